"""Sessions are bounded per client before the global cap.

One anonymous client opening 10,000 sessions used to lock every other client out of
OpenSession and Session streams. ``max_sessions_per_client`` caps one client's open
sessions first; a client is a tenant's token, else its peer's address, else (unix
socket, loopback: all peers look alike) its client_name. Against real servers.
"""

from __future__ import annotations

import grpc
import pytest
from harness import SMALL_POOL, pb, running, stub_for

from prefixcache.server.access.tenants import ANYONE, Caller, client_identity, peer_host
from prefixcache.server.config import ModelConfig, TenantConfig

MODELS = (ModelConfig(name="m", page_size=1, pool=SMALL_POOL),)
CAP = 5


def _open(stub, name: str = "", metadata=None) -> str:
    return stub.OpenSession(pb.OpenSessionRequest(client_name=name), metadata=metadata,
                            timeout=10).session_id


def _refused(stub, name: str = "", metadata=None) -> str:
    with pytest.raises(grpc.RpcError) as err:
        _open(stub, name, metadata)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "server.max_sessions_per_client" in err.value.details()
    return err.value.details()


def test_a_local_client_at_its_cap_leaves_room_for_the_others(tmp_path) -> None:
    with running(tmp_path, MODELS, max_sessions=4 * CAP, max_sessions_per_client=CAP) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            hog = [_open(stub, "hog") for _ in range(CAP)]
            assert "'hog'" in _refused(stub, "hog")
            victims = [_open(stub, "victim") for _ in range(CAP)]  # not locked out
            # Session streams of the same socket count too, under their own identity.
            stream = stub.Session(iter([pb.SessionRequest(
                seq=1, stats=pb.StatsRequest(model="m"))]))
            assert [r.seq for r in stream] == [1]
            # A closed session makes room for its client again.
            stub.CloseSession(pb.CloseSessionRequest(session_id=hog.pop()))
            hog.append(_open(stub, "hog"))
            assert srv.service.sessions.count_of("local:hog") == CAP
            for sid in hog + victims:
                stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
            assert len(srv.service.sessions) == 0
            assert srv.service.sessions.count_of("local:hog") == 0


def test_a_tenant_is_one_client_whatever_names_it_sends(tmp_path) -> None:
    """A client_name is self-asserted: under a tenant's token, changing it opens
    nothing more; another tenant still opens its sessions."""
    tenants = (TenantConfig("acme", "tok-acme", namespaces=("acme/",)),
               TenantConfig("beta", "tok-beta", namespaces=("beta/",)))
    with running(tmp_path, MODELS, token="t0k", tenants=tenants, max_sessions=4 * CAP,
                 max_sessions_per_client=CAP) as srv:
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
    assert peer_host("ipv4:10.0.0.7:51234") == "10.0.0.7"
    assert peer_host("ipv6:%5Bfe80::1%5D:443") == "fe80::1"
    assert peer_host("ipv6:[2001:db8::2]:9") == "2001:db8::2"
    assert peer_host("unix:/tmp/pc.sock") is None and peer_host("") is None
    # A remote peer is its address, whatever name it sends and whichever port.
    assert client_identity(ANYONE, "ipv4:10.0.0.7:1", "x") == \
        client_identity(ANYONE, "ipv4:10.0.0.7:2", "y") == "host:10.0.0.7"
    # A tenant is its token, from anywhere.
    assert client_identity(tenant, "ipv4:10.0.0.7:1", "x") == \
        client_identity(tenant, "unix:", "y") == "tenant:acme"
    # Local peers look alike: their names tell them apart.
    assert client_identity(ANYONE, "unix:/tmp/pc.sock", "w1") == "local:w1"
    assert client_identity(ANYONE, "ipv4:127.0.0.1:5", "w2") == "local:w2"
    assert client_identity(ANYONE, "ipv6:%5B::1%5D:5", "w3") == "local:w3"


def test_the_settings_are_checked(tmp_path) -> None:
    from prefixcache.server.config import ConfigError, load_config

    for bad in ("max_sessions_per_client: -1", "evict_interval: 0", "evict_interval: .nan"):
        path = tmp_path / "c.yaml"
        path.write_text(f"server:\n  {bad}\nmodels:\n  - name: m\n    pool: {{size: 64}}\n")
        with pytest.raises(ConfigError, match=bad.split(":")[0]):
            load_config(path)
