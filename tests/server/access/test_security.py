"""Transport security, bearer tokens and listener safety, against a real gRPC server.

Every test starts a real ``PrefixCacheServer`` (in-process, on its own event loop) and
talks to it through real gRPC channels; certificates come from the ``openssl`` CLI.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server.certs import PKI, make_pki
from server.harness import ServerThread, make_config, pb, pb_grpc, running, stub_for, toks

from prefixcache.server.app import PrefixCacheServer
from prefixcache.server.config import Config, ConfigError

TIMEOUT = 10.0
# A peer that cannot complete a handshake is reported as soon as the connection fails;
# the deadline only bounds a hang.
FAIL_TIMEOUT = 5.0


def _code(call: object) -> grpc.StatusCode:
    """The status code of a failed call (``call`` raises grpc.RpcError)."""
    with pytest.raises(grpc.RpcError) as info:
        call()  # type: ignore[operator]
    return info.value.code()


def _start_error(config: Config) -> ConfigError:
    """Start a server that must refuse; return its ConfigError (stop it if it started)."""
    loop = asyncio.new_event_loop()
    server = PrefixCacheServer(config)
    try:
        with pytest.raises(ConfigError) as info:
            loop.run_until_complete(server.start())
        return info.value
    finally:
        loop.run_until_complete(server.stop(0))
        loop.close()


# ------------------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _tls_stub(
    address: str,
    root: Path,
    client: tuple[bytes, bytes] | None = None,
) -> tuple[grpc.Channel, pb_grpc.PrefixCacheStub]:
    key, chain = client if client else (None, None)
    creds = grpc.ssl_channel_credentials(
        root.read_bytes(), private_key=key, certificate_chain=chain
    )
    channel = grpc.secure_channel(address, creds)
    return channel, pb_grpc.PrefixCacheStub(channel)


@pytest.fixture(scope="module")
def tls_server(pki: PKI, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    with running(
        tmp_path_factory.mktemp("tls"),
        listen="127.0.0.1:0",
        tls_cert=str(pki.server.cert),
        tls_key=str(pki.server.key),
    ) as thread:
        yield thread


@pytest.fixture(scope="module")
def mtls_server(pki: PKI, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    with running(
        tmp_path_factory.mktemp("mtls"),
        listen="127.0.0.1:0",
        tls_cert=str(pki.server.cert),
        tls_key=str(pki.server.key),
        tls_client_ca=str(pki.ca.cert),
    ) as thread:
        yield thread


def test_tls_server_binds_a_real_port(tls_server: ServerThread) -> None:
    """listen 127.0.0.1:0 reports the port it actually bound."""
    host, _, port = tls_server.address.rpartition(":")
    assert host == "127.0.0.1"
    assert 0 < int(port) <= 65535


def test_tls_client_trusting_the_ca_is_served(tls_server: ServerThread, pki: PKI) -> None:
    channel, stub = _tls_stub(tls_server.address, pki.ca.cert)
    with channel:
        reply = stub.ListModels(pb.ListModelsRequest(), timeout=TIMEOUT)
    assert [m.name for m in reply.models] == ["m"]


def test_tls_by_host_name_matches_the_certificate(tls_server: ServerThread, pki: PKI) -> None:
    """The server certificate's SAN covers `localhost` as well as 127.0.0.1."""
    port = tls_server.address.rpartition(":")[2]
    channel, stub = _tls_stub(f"localhost:{port}", pki.ca.cert)
    with channel:
        assert stub.ListModels(pb.ListModelsRequest(), timeout=TIMEOUT).models


def test_tls_port_refuses_clear_text(tls_server: ServerThread) -> None:
    channel, stub = stub_for(tls_server.address)
    with channel:
        code = _code(lambda: stub.ListModels(pb.ListModelsRequest(), timeout=FAIL_TIMEOUT))
    assert code is grpc.StatusCode.UNAVAILABLE


def test_tls_client_with_another_root_rejects_the_server(
    tls_server: ServerThread, pki: PKI
) -> None:
    """A client that does not trust the server's CA never sends its request."""
    channel, stub = _tls_stub(tls_server.address, pki.other_ca.cert)
    with channel:
        code = _code(lambda: stub.ListModels(pb.ListModelsRequest(), timeout=FAIL_TIMEOUT))
    assert code is grpc.StatusCode.UNAVAILABLE


def test_mtls_refuses_a_client_without_a_certificate(mtls_server: ServerThread, pki: PKI) -> None:
    channel, stub = _tls_stub(mtls_server.address, pki.ca.cert)
    with channel:
        code = _code(lambda: stub.ListModels(pb.ListModelsRequest(), timeout=FAIL_TIMEOUT))
    assert code is grpc.StatusCode.UNAVAILABLE


def test_mtls_refuses_a_certificate_from_another_ca(mtls_server: ServerThread, pki: PKI) -> None:
    channel, stub = _tls_stub(mtls_server.address, pki.ca.cert, pki.other_client.read())
    with channel:
        code = _code(lambda: stub.ListModels(pb.ListModelsRequest(), timeout=FAIL_TIMEOUT))
    assert code is grpc.StatusCode.UNAVAILABLE


def test_mtls_serves_a_client_with_a_certificate(mtls_server: ServerThread, pki: PKI) -> None:
    channel, stub = _tls_stub(mtls_server.address, pki.ca.cert, pki.client.read())
    with channel:
        reply = stub.ListModels(pb.ListModelsRequest(), timeout=TIMEOUT)
    assert [m.name for m in reply.models] == ["m"]


def test_tls_with_token_through_call_credentials(pki: PKI, tmp_path: Path) -> None:
    """The production setup: TLS plus a bearer token sent as gRPC call credentials."""
    with running(
        tmp_path,
        listen="127.0.0.1:0",
        tls_cert=str(pki.server.cert),
        tls_key=str(pki.server.key),
        token="t0k",
    ) as thread:
        tls = grpc.ssl_channel_credentials(pki.ca.cert.read_bytes())
        good = grpc.composite_channel_credentials(tls, grpc.access_token_call_credentials("t0k"))
        with grpc.secure_channel(thread.address, good) as channel:
            stub = pb_grpc.PrefixCacheStub(channel)
            assert stub.Stats(pb.StatsRequest(), timeout=TIMEOUT).models
        with grpc.secure_channel(thread.address, tls) as channel:
            stub = pb_grpc.PrefixCacheStub(channel)
            code = _code(lambda: stub.Stats(pb.StatsRequest(), timeout=TIMEOUT))
        assert code is grpc.StatusCode.UNAUTHENTICATED


# ---------------------------------------------------------------------- tokens


def _bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    with running(tmp_path_factory.mktemp("auth"), token="t0k", admin_token="adm") as thread:
        yield thread


@pytest.fixture
def auth_stub(auth_server: ServerThread) -> Iterator[pb_grpc.PrefixCacheStub]:
    channel, stub = stub_for(auth_server.address)
    with channel:
        yield stub


def test_call_without_token_is_unauthenticated(auth_stub: pb_grpc.PrefixCacheStub) -> None:
    code = _code(lambda: auth_stub.ListModels(pb.ListModelsRequest(), timeout=TIMEOUT))
    assert code is grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    "metadata",
    [
        _bearer("wrong"),
        _bearer("t0k0"),
        _bearer(""),
        [("authorization", "t0k")],
        [("authorization", "Basic t0k")],
        [("x-token", "t0k")],
    ],
    ids=["wrong", "longer", "empty", "no-scheme", "basic", "other-key"],
)
def test_call_with_wrong_token_is_unauthenticated(
    auth_stub: pb_grpc.PrefixCacheStub, metadata: list[tuple[str, str]]
) -> None:
    code = _code(
        lambda: auth_stub.ListModels(pb.ListModelsRequest(), timeout=TIMEOUT, metadata=metadata)
    )
    assert code is grpc.StatusCode.UNAUTHENTICATED


def test_call_with_token_is_served(auth_stub: pb_grpc.PrefixCacheStub) -> None:
    reply = auth_stub.ListModels(pb.ListModelsRequest(), timeout=TIMEOUT, metadata=_bearer("t0k"))
    assert [m.name for m in reply.models] == ["m"]


def test_admin_token_also_passes_as_plain_token(auth_stub: pb_grpc.PrefixCacheStub) -> None:
    reply = auth_stub.Stats(pb.StatsRequest(), timeout=TIMEOUT, metadata=_bearer("adm"))
    assert [m.model for m in reply.models] == ["m"]


def test_unauthenticated_call_does_not_touch_the_cache(
    auth_server: ServerThread,
    auth_stub: pb_grpc.PrefixCacheStub,
) -> None:
    before = auth_stub.Stats(pb.StatsRequest(), timeout=TIMEOUT, metadata=_bearer("t0k"))
    code = _code(
        lambda: auth_stub.Match(
            pb.MatchRequest(model="m", token_ids=toks([1, 2, 3])), timeout=TIMEOUT
        )
    )
    assert code is grpc.StatusCode.UNAUTHENTICATED
    after = auth_stub.Stats(pb.StatsRequest(), timeout=TIMEOUT, metadata=_bearer("t0k"))
    assert after.models[0].match_tokens_total == before.models[0].match_tokens_total


def test_session_stream_without_token_is_unauthenticated(
    auth_stub: pb_grpc.PrefixCacheStub,
) -> None:
    requests = iter([pb.SessionRequest(seq=1, stats=pb.StatsRequest())])
    code = _code(lambda: list(auth_stub.Session(requests, timeout=TIMEOUT)))
    assert code is grpc.StatusCode.UNAUTHENTICATED


def test_session_stream_with_token_is_served(auth_stub: pb_grpc.PrefixCacheStub) -> None:
    requests = iter([pb.SessionRequest(seq=7, stats=pb.StatsRequest())])
    replies = list(auth_stub.Session(requests, timeout=TIMEOUT, metadata=_bearer("t0k")))
    assert [r.seq for r in replies] == [7]
    assert replies[0].WhichOneof("result") == "stats"


@pytest.mark.parametrize("metadata", [None, _bearer("wrong")], ids=["none", "wrong"])
def test_subscription_without_token_is_unauthenticated(
    auth_stub: pb_grpc.PrefixCacheStub, metadata: list[tuple[str, str]] | None
) -> None:
    """A subscription streams the cache's contents: refused like any other call."""
    call = auth_stub.Subscribe(pb.SubscribeRequest(model="m"), timeout=TIMEOUT, metadata=metadata)
    assert _code(lambda: next(call)) is grpc.StatusCode.UNAUTHENTICATED


def test_subscription_with_token_is_served(auth_stub: pb_grpc.PrefixCacheStub) -> None:
    call = auth_stub.Subscribe(
        pb.SubscribeRequest(model="m"), timeout=TIMEOUT, metadata=_bearer("t0k")
    )
    assert next(call).snapshot_begin.reason == pb.SNAPSHOT_REASON_NEW
    call.cancel()


def test_reset_with_plain_token_is_permission_denied(auth_stub: pb_grpc.PrefixCacheStub) -> None:
    code = _code(
        lambda: auth_stub.Reset(
            pb.ResetRequest(model="m"), timeout=TIMEOUT, metadata=_bearer("t0k")
        )
    )
    assert code is grpc.StatusCode.PERMISSION_DENIED


def test_reset_without_token_is_unauthenticated(auth_stub: pb_grpc.PrefixCacheStub) -> None:
    code = _code(lambda: auth_stub.Reset(pb.ResetRequest(model="m"), timeout=TIMEOUT))
    assert code is grpc.StatusCode.UNAUTHENTICATED


def test_reset_with_admin_token_is_served(auth_stub: pb_grpc.PrefixCacheStub) -> None:
    reply = auth_stub.Reset(pb.ResetRequest(model="m"), timeout=TIMEOUT, metadata=_bearer("adm"))
    assert reply.dropped_locks == 0


def test_health_check_needs_no_token(auth_server: ServerThread) -> None:
    """Kubernetes probes cannot send tokens, so health stays open."""
    with grpc.insecure_channel(auth_server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "prefixcache.v1.PrefixCache", "prefixcache.v1.PrefixCache/m"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service


def test_token_without_admin_token_disables_reset(tmp_path: Path) -> None:
    with running(tmp_path, token="t0k") as thread:
        channel, stub = stub_for(thread.address)
        with channel:
            assert stub.Stats(pb.StatsRequest(), timeout=TIMEOUT, metadata=_bearer("t0k"))
            code = _code(
                lambda: stub.Reset(
                    pb.ResetRequest(model="m"), timeout=TIMEOUT, metadata=_bearer("t0k")
                )
            )
    assert code is grpc.StatusCode.PERMISSION_DENIED


def test_without_tokens_reset_is_open(tmp_path: Path) -> None:
    with running(tmp_path) as thread:
        channel, stub = stub_for(thread.address)
        with channel:
            session = stub.OpenSession(pb.OpenSessionRequest(), timeout=TIMEOUT).session_id
            held = stub.Alloc(
                pb.AllocRequest(model="m", num_slots=4, session_id=session), timeout=TIMEOUT
            ).slot_indices
            stub.Insert(
                pb.InsertRequest(
                    model="m", token_ids=toks([5, 6, 7, 8]), slot_indices=held, session_id=session
                ),
                timeout=TIMEOUT,
            )
            reply = stub.Reset(pb.ResetRequest(model="m"), timeout=TIMEOUT)
    assert reply.dropped_tokens == 4


# ----------------------------------------------------------------- unix socket


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_unix_socket_is_owner_only_by_default(tmp_path: Path) -> None:
    path = tmp_path / "pc.sock"
    mask = _umask()
    with running(tmp_path, listen=f"unix:{path}") as thread:
        assert thread.address == f"unix:{path}"
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert _umask() == mask, "start left the process umask changed"
    assert not path.exists(), "stop left the socket file behind"


def test_unix_socket_mode_is_configurable(tmp_path: Path) -> None:
    path = tmp_path / "pc.sock"
    with running(tmp_path, listen=f"unix:{path}", socket_mode=0o660):
        assert os.stat(path).st_mode & 0o777 == 0o660


def test_second_server_on_a_live_socket_refuses_to_start(tmp_path: Path) -> None:
    with running(tmp_path) as first:
        error = _start_error(make_config(tmp_path))
        assert "another server is listening" in str(error)
        # The refusal left the first server's socket alone.
        channel, stub = stub_for(first.address)
        with channel:
            assert stub.ListModels(pb.ListModelsRequest(), timeout=TIMEOUT).models


def test_stale_socket_file_is_replaced(tmp_path: Path) -> None:
    """A socket file whose server died (nobody accepts on it) is removed and rebound."""
    path = tmp_path / "pc.sock"
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(path))
    dead.listen()
    dead.close()  # like a killed server: the file stays, connections are refused
    assert path.is_socket()
    with running(tmp_path, listen=f"unix:{path}") as thread:
        channel, stub = stub_for(thread.address)
        with channel:
            assert stub.ListModels(pb.ListModelsRequest(), timeout=TIMEOUT).models
        assert os.stat(path).st_mode & 0o777 == 0o600


def test_listen_path_that_is_not_a_socket_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "pc.sock"
    path.write_text("precious")
    error = _start_error(make_config(tmp_path, listen=f"unix:{path}"))
    assert "not a socket" in str(error)
    assert path.read_text() == "precious"


# ------------------------------------------------------------------------ TCP


def test_tcp_without_tls_needs_insecure(tmp_path: Path) -> None:
    error = _start_error(make_config(tmp_path, listen="127.0.0.1:0"))
    assert "insecure" in str(error)


def test_tcp_with_insecure_serves_clear_text(tmp_path: Path) -> None:
    with running(tmp_path, listen="127.0.0.1:0", insecure=True) as thread:
        assert thread.address.startswith("127.0.0.1:")
        assert not thread.address.endswith(":0")
        channel, stub = stub_for(thread.address)
        with channel:
            assert stub.ListModels(pb.ListModelsRequest(), timeout=TIMEOUT).models


# --------------------------------------------------------------- message size


def test_oversized_message_is_resource_exhausted(tmp_path: Path) -> None:
    with running(tmp_path, max_message_bytes=4096) as thread:
        channel, stub = stub_for(thread.address)
        with channel:
            big = pb.MatchRequest(model="m", token_ids=toks(range(2048)))  # 8 KiB of ids
            assert big.ByteSize() > 8192
            code = _code(lambda: stub.Match(big, timeout=TIMEOUT))
            assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
            # The server is still up, and the refused request never reached the cache.
            stats = stub.Stats(pb.StatsRequest(model="m"), timeout=TIMEOUT)
            assert stats.models[0].match_tokens_total == 0
            small = stub.Match(
                pb.MatchRequest(model="m", token_ids=toks(range(16))), timeout=TIMEOUT
            )
            assert small.prefix_len == 0
            stats = stub.Stats(pb.StatsRequest(model="m"), timeout=TIMEOUT)
            assert stats.models[0].match_tokens_total == 16
