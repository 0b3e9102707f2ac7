"""Sessions are bounded per client before the global cap, and a client is what it
cannot choose: not its client_name.

``max_sessions_per_client`` caps one client's open sessions first. A client is a
tenant's token; on the unix socket the uid and pid its connection came from (read
through the relay, unix_peers.py); on TCP its address, or on loopback the uid owning
its socket (loopback_peers.py). A client that draws a new client_name per session opens
no more than one with a fixed name. Against real servers: a unix-socket one and a TCP
one, with the other clients in processes of their own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import pytest
from harness import SMALL_POOL, SOURCE_PATH, pb, running, stub_for

from prefixcache.server.access.tenants import ANYONE, Caller, client_identity, peer_address
from prefixcache.server.config import ModelConfig, TenantConfig

MODELS = (ModelConfig(name="m", page_size=1, pool=SMALL_POOL),)
CAP = 5

# Another client, in a process of its own: opens sessions under a new name each, until
# refused; prints how many it opened and the refusal.
OTHER = """
import json, sys, grpc
from prefixcache.v1 import prefix_cache_pb2 as pb, prefix_cache_pb2_grpc as pb_grpc
stub = pb_grpc.PrefixCacheStub(grpc.insecure_channel(sys.argv[1]))
opened = 0
for i in range(int(sys.argv[2])):
    try:
        stub.OpenSession(pb.OpenSessionRequest(client_name=f"other-{i}"), timeout=10)
    except grpc.RpcError as exc:
        print(json.dumps([opened, exc.code().name, exc.details()]))
        break
    opened += 1
else:
    print(json.dumps([opened, "OK", ""]))
"""


def _open(stub, name: str = "", metadata=None) -> str:
    return stub.OpenSession(
        pb.OpenSessionRequest(client_name=name), metadata=metadata, timeout=10
    ).session_id


def _refused(stub, name: str = "", metadata=None) -> str:
    with pytest.raises(grpc.RpcError) as err:
        _open(stub, name, metadata)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "server.max_sessions_per_client" in err.value.details()
    return err.value.details()


def _other(address: str, tries: int) -> tuple[int, str, str]:
    """Run OTHER; what it printed."""
    done = subprocess.run(
        [sys.executable, "-c", OTHER, address, str(tries)],
        env={**os.environ, "PYTHONPATH": SOURCE_PATH},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    opened, code, details = json.loads(done.stdout)
    return opened, code, details


def _rotating_names_are_one_client(srv, stub, who: str) -> None:
    """This process, a new name per session, is capped; the sessions it was refused
    were never opened."""
    mine = [_open(stub, f"worker-{i}") for i in range(CAP)]
    details = _refused(stub, "worker-new")
    assert who in details, details
    assert _refused(stub, "")
    assert len(srv.service.sessions) == CAP
    # A closed session makes room for its client again.
    stub.CloseSession(pb.CloseSessionRequest(session_id=mine.pop()))
    mine.append(_open(stub, "yet-another-name"))
    assert len(srv.service.sessions) == CAP


def test_rotating_names_on_the_unix_socket_are_one_process(tmp_path) -> None:
    with running(tmp_path, MODELS, max_sessions=4 * CAP, max_sessions_per_client=CAP) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            _rotating_names_are_one_client(srv, stub, f"uid={os.geteuid()},pid={os.getpid()}")
            # Another process is another client: not locked out, and capped in turn.
            opened, code, details = _other(srv.address, 2 * CAP)
            assert (opened, code) == (CAP, "RESOURCE_EXHAUSTED"), details
            assert f"pid={os.getpid()}" not in details
            # Session streams of this process count against it too.
            stream = stub.Session(
                iter([pb.SessionRequest(seq=1, stats=pb.StatsRequest(model="m"))])
            )
            with pytest.raises(grpc.RpcError) as err:
                list(stream)
            assert "server.max_sessions_per_client" in err.value.details()
            assert len(srv.service.sessions) == 2 * CAP
        srv.check_integrity()


def test_rotating_names_on_loopback_tcp_are_one_user(tmp_path) -> None:
    with running(
        tmp_path,
        MODELS,
        listen="127.0.0.1:0",
        insecure=True,
        max_sessions=4 * CAP,
        max_sessions_per_client=CAP,
    ) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            _rotating_names_are_one_client(srv, stub, f"uid={os.geteuid()}")
            # Another process of the same user, over another connection: the same client.
            opened, code, details = _other(srv.address, 2 * CAP)
            assert (opened, code) == (0, "RESOURCE_EXHAUSTED"), details
            assert len(srv.service.sessions) == CAP


def test_without_peer_credentials_names_tell_local_clients_apart(tmp_path) -> None:
    with running(
        tmp_path, MODELS, max_sessions=4 * CAP, max_sessions_per_client=CAP, peer_credentials=False
    ) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            for _ in range(CAP):
                _open(stub, "hog")
            assert "'hog'" in _refused(stub, "hog")
            for _ in range(CAP):
                _open(stub, "victim")
            assert srv.service.sessions.count_of("local:hog") == CAP


def test_a_tenant_is_one_client_whatever_names_it_sends(tmp_path) -> None:
    """Under a tenant's token, changing names opens nothing more; another tenant still
    opens its sessions, from the same process."""
    tenants = (
        TenantConfig("acme", "tok-acme", namespaces=("acme/",)),
        TenantConfig("beta", "tok-beta", namespaces=("beta/",)),
    )
    with running(
        tmp_path,
        MODELS,
        token="t0k",
        tenants=tenants,
        max_sessions=4 * CAP,
        max_sessions_per_client=CAP,
    ) as srv:
        channel, stub = stub_for(srv.address)
        acme = (("authorization", "Bearer tok-acme"),)
        beta = (("authorization", "Bearer tok-beta"),)
        with channel:
            for i in range(CAP):
                _open(stub, f"worker-{i}", acme)
            assert "tenant 'acme'" in _refused(stub, "worker-new", acme)
            assert "tenant 'acme'" in _refused(stub, "", acme)
            for i in range(CAP):
                _open(stub, f"worker-{i}", beta)
            assert len(srv.service.sessions) == 2 * CAP


def test_the_global_cap_still_holds(tmp_path) -> None:
    with running(tmp_path, MODELS, max_sessions=3, max_sessions_per_client=CAP) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            for name in ("a", "b", "c"):
                _open(stub, name)
            with pytest.raises(grpc.RpcError) as err:
                _open(stub, "d")
            assert "server.max_sessions" in err.value.details()
            assert "per_client" not in err.value.details()


def test_client_identity() -> None:
    tenant = Caller(tenant="acme", namespaces=("acme/",))
    assert peer_address("ipv4:10.0.0.7:51234") == ("10.0.0.7", 51234)
    assert peer_address("ipv6:%5Bfe80::1%5D:443") == ("fe80::1", 443)
    assert peer_address("ipv6:[2001:db8::2]:9") == ("2001:db8::2", 9)
    assert peer_address("unix:/tmp/pc.sock") is None and peer_address("") is None
    # A remote peer is its address, whatever name it sends and whichever port.
    assert (
        client_identity(ANYONE, "ipv4:10.0.0.7:1", "x")
        == client_identity(ANYONE, "ipv4:10.0.0.7:2", "y")
        == "host:10.0.0.7"
    )
    # A tenant is its token, from anywhere.
    assert (
        client_identity(tenant, "ipv4:10.0.0.7:1", "x")
        == client_identity(tenant, "unix:", "y")
        == "tenant:acme"
    )
    # A unix peer named like a relay's, but not under a relay's directory of this
    # process, is no credential: a socket served without the relay tells it by name.
    assert client_identity(ANYONE, "unix:/tmp/x/0.1.2", "w1") == "local:w1"
    assert client_identity(ANYONE, "unix:", "w2") == "local:w2"
    # A loopback peer the kernel does not know (no such connection) is its address.
    assert client_identity(ANYONE, "ipv4:127.0.0.1:1", "w3") == "host:127.0.0.1"


def test_the_settings_are_checked(tmp_path) -> None:
    from prefixcache.server.config import ConfigError, load_config

    for bad in (
        "max_sessions_per_client: -1",
        "evict_interval: 0",
        "evict_interval: .nan",
        "peer_credentials: maybe",
    ):
        path = tmp_path / "c.yaml"
        path.write_text(f"server:\n  {bad}\nmodels:\n  - name: m\n    pool: {{size: 64}}\n")
        with pytest.raises(ConfigError, match=bad.split(":")[0]):
            load_config(path)
