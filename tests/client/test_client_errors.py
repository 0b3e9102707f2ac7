"""Each typed exception, provoked for real against a running server."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from certs import PKI, make_pki
from harness import ServerThread, running

from prefixcache.client import (
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    PrefixCacheClient,
    PrefixCacheError,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from prefixcache.client.errors import error_for


def test_invalid_argument_not_found_failed_precondition_resource_exhausted(
    client: PrefixCacheClient,
) -> None:
    with pytest.raises(InvalidArgument) as bad:
        client.match("m", b"\x00" * 5)  # not whole uint32 words
    assert bad.value.code is grpc.StatusCode.INVALID_ARGUMENT and "bytes" in bad.value.details
    assert isinstance(bad.value, ValueError)
    with pytest.raises(InvalidArgument):
        client.match("m", [1000])  # outside the model's vocabulary
    with pytest.raises(NotFound) as missing:
        client.stats("nope")
    assert "nope" in str(missing.value) and isinstance(missing.value, LookupError)
    with pytest.raises(NotFound):
        client.keep_alive("f" * 32)
    with client.session() as s:
        got = s.alloc("m", 2)
        s.free("m", got.slots)
        with pytest.raises(FailedPrecondition):
            s.free("m", got.slots)  # a double free
        with pytest.raises(FailedPrecondition):
            client.lock("m", 1)  # a lock needs a session
        before = client.stats()
        with pytest.raises(ResourceExhausted):
            s.alloc("m", 10**6)
        assert client.stats() == before


def test_a_message_over_the_size_limit_is_resource_exhausted(server: ServerThread) -> None:
    with PrefixCacheClient(server.address, max_message_bytes=1024) as small:
        assert small.match("m", list(range(10))).prefix_len == 0
        with pytest.raises(ResourceExhausted):
            small.match("m", list(range(900)))


def test_a_server_bug_is_internal(server: ServerThread, client: PrefixCacheClient) -> None:
    engine = server.service.engine("p")

    def broken(*args: object) -> None:
        raise RuntimeError("injected bug")

    server.run(setattr, engine, "evict", broken)
    try:
        with pytest.raises(Internal):
            client.evict("p", 1)
    finally:
        server.run(delattr, engine, "evict")


def test_a_slow_server_is_deadline_exceeded(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    """The server's event loop is stuck until the test lets it go; a 0.1 s deadline runs
    out meanwhile, and the client raises while the loop is still stuck."""
    release = threading.Event()
    server.loop.call_soon_threadsafe(release.wait, 30)
    try:
        with pytest.raises(DeadlineExceeded) as err:
            client.stats(timeout=0.1)
        assert not release.is_set()  # raised by the deadline, not after the server
    finally:
        release.set()
    assert isinstance(err.value, TimeoutError)
    assert client.stats().models


def test_draining_is_unavailable_and_reads_are_retried(server: ServerThread) -> None:
    patient = PrefixCacheClient(server.address, retries=6, backoff=0.02)
    impatient = PrefixCacheClient(server.address, retries=0)
    session = patient.session()
    server.run(setattr, server.service, "draining", True)
    try:
        with pytest.raises(Unavailable):
            impatient.stats()
        with pytest.raises(Unavailable):
            session.alloc("m", 1)  # not idempotent: never retried
        timer = threading.Timer(0.1, server.run, (setattr, server.service, "draining", False))
        timer.start()
        start = time.monotonic()
        assert patient.stats().models  # retried until the drain was called off
        assert time.monotonic() - start >= 0.05
        timer.join()
    finally:
        server.run(setattr, server.service, "draining", False)
        session.close()
        patient.close()
        impatient.close()


def test_a_stopped_server_is_unavailable(tmp_path: Path) -> None:
    with running(tmp_path) as srv:
        client = PrefixCacheClient(srv.address, retries=1, backoff=0.01)
        assert client.list_models().models
    with pytest.raises(Unavailable) as err:
        client.list_models()
    assert isinstance(err.value, ConnectionError)
    client.close()
    with (
        PrefixCacheClient(str(tmp_path / "never.sock"), retries=0) as nobody,
        pytest.raises(Unavailable),
    ):
        nobody.stats()


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    with running(tmp_path_factory.mktemp("auth"), token="t0k", admin_token="adm") as srv:
        yield srv


def test_tokens_unauthenticated_and_permission_denied(auth_server: ServerThread) -> None:
    address = auth_server.address
    with PrefixCacheClient(address) as anonymous, pytest.raises(Unauthenticated):
        anonymous.list_models()
    with PrefixCacheClient(address, token="wrong") as wrong, pytest.raises(Unauthenticated):
        wrong.stats()
    with PrefixCacheClient(address, token="t0k") as worker:
        assert worker.list_models().models
        with worker.session() as s:
            m = s.match("m", [1, 2], allocate=True)
            s.insert("m", [1, 2], m.allocated)
        with pytest.raises(PermissionDenied):
            worker.reset("m")
    with PrefixCacheClient(address, token="adm") as admin:
        assert admin.reset("m").dropped_tokens == 2


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_tls_mutual_tls_and_a_token(pki: PKI, tmp_path: Path) -> None:
    with running(
        tmp_path,
        listen="127.0.0.1:0",
        tls_cert=str(pki.server.cert),
        tls_key=str(pki.server.key),
        tls_client_ca=str(pki.ca.cert),
        token="t0k",
    ) as srv:
        port = srv.address.rpartition(":")[2]
        with PrefixCacheClient(
            f"localhost:{port}",
            root_certificates=pki.ca.cert,
            private_key=pki.client.key,
            certificate_chain=pki.client.cert,
            token="t0k",
        ) as good:
            assert [m.name for m in good.list_models().models] == ["m"]
        with (
            PrefixCacheClient(
                srv.address,
                root_certificates=pki.ca.cert.read_bytes(),
                private_key=pki.client.key.read_bytes(),
                certificate_chain=pki.client.cert.read_bytes(),
                token="nope",
            ) as wrong,
            pytest.raises(Unauthenticated),
        ):
            wrong.stats()
        with (
            PrefixCacheClient(
                srv.address, root_certificates=pki.ca.cert, token="t0k", retries=0, timeout=3
            ) as no_cert,
            pytest.raises(Unavailable),
        ):
            no_cert.stats()  # mutual TLS: no client certificate, no handshake
        with (
            PrefixCacheClient(srv.address, retries=0, timeout=3) as clear,
            pytest.raises(Unavailable),
        ):
            clear.stats()
    with pytest.raises(InvalidArgument):
        PrefixCacheClient("localhost:1", private_key=pki.client.key)


def test_codes_without_a_class_of_their_own() -> None:
    err = error_for(grpc.StatusCode.UNIMPLEMENTED, "no such method")
    assert type(err) is PrefixCacheError and err.code is grpc.StatusCode.UNIMPLEMENTED
    assert str(err) == "UNIMPLEMENTED: no such method"
    assert type(error_for(5, "x")) is NotFound  # the int value, as the Session stream sends
    assert type(error_for(999)) is PrefixCacheError
