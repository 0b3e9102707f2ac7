"""The /metrics endpoint: loopback by default, an optional bearer
token, and a bounded cost for connections that send nothing.

It used to bind 0.0.0.0 with no token, and prometheus_client's server started a thread
per connection: 1000 idle connections made 1010 threads.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from harness import running
from prometheus_client import CollectorRegistry, Counter

from prefixcache.server.config import ServerConfig, load_config
from prefixcache.server.metrics_http import MetricsHttpServer

IDLE = 200


def get(port: int, token: str | None = None, path: str = "/metrics") -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def listening_on(port: int) -> set[str]:
    """The local addresses of the sockets listening on ``port`` (from /proc/net/tcp)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # LISTEN
                found.add(addr)
    return found


def test_the_endpoint_binds_loopback_by_default(tmp_path: Path) -> None:
    assert ServerConfig().metrics_host == "127.0.0.1"
    assert load_config(env={}).server.metrics_host == "127.0.0.1"
    with running(tmp_path, metrics_port=0) as srv:
        port = srv.server.metrics_port
        assert port is not None and get(port)[0] == 200
        if Path("/proc/net/tcp").exists():
            assert listening_on(port) == {"0100007F"}  # 127.0.0.1, nothing else


def test_a_token_guards_the_scrape(tmp_path: Path) -> None:
    token_file = tmp_path / "metrics-token"
    token_file.write_text("s3cret\n")
    config = load_config(env={"PREFIXCACHE_METRICS_TOKEN_FILE": str(token_file)})
    assert config.server.metrics_token == "s3cret"
    with running(tmp_path, metrics_port=0, metrics_token="s3cret") as srv:
        port = srv.server.metrics_port
        assert port is not None
        status, _ = get(port)
        assert status == 401
        assert get(port, "wrong")[0] == 401
        status, text = get(port, "s3cret")
        assert status == 200 and "prefixcache_sessions" in text


def test_idle_connections_cost_no_threads_and_never_lock_out_a_scrape(tmp_path: Path) -> None:
    with running(tmp_path, metrics_port=0) as srv:
        port = srv.server.metrics_port
        assert port is not None
        get(port)  # the endpoint's own thread is up
        threads = threading.active_count()
        httpd = srv.server.metrics._httpd
        assert httpd is not None
        # No idle connection is closed by its timeout during the test, only to make room.
        httpd.idle_timeout = 600.0
        idle = []
        try:
            for _ in range(IDLE):
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=30))
            time.sleep(0.5)
            # A thread per connection before: +200 here.
            assert threading.active_count() - threads <= 1, threading.active_count()
            assert httpd.open_connections <= httpd.max_connections
            status, text = get(port)  # the idle ones make room for it
            assert status == 200 and "prefixcache_sessions" in text
            # Room was made by closing the connection that had waited longest (each of
            # the 200 closed the oldest before it), not by waiting for one to time out:
            # the newest max_connections - 1 are still open, the one before them is closed.
            kept = httpd.max_connections - 1
            assert idle[-kept - 1].recv(1) == b""
            for conn in idle[-kept:]:
                conn.setblocking(False)
                with pytest.raises(BlockingIOError):
                    conn.recv(1)
        finally:
            for conn in idle:
                conn.close()


def test_a_connection_that_sends_nothing_is_closed_after_the_idle_timeout() -> None:
    registry = CollectorRegistry()
    Counter("probe", "A counter.", registry=registry).inc()
    httpd = MetricsHttpServer(registry, "127.0.0.1", 0, idle_timeout=0.3, max_connections=2)
    port = httpd.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as quiet:
            t0 = time.monotonic()
            assert quiet.recv(1) == b""  # closed by the server, not the 30 s of the socket
            assert time.monotonic() - t0 > 0.2  # and not before its idle timeout
        # Keep-alive: two requests on one connection, then the idle timeout ends it.
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            for _ in range(2):
                conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                reply = _read_reply(conn)
                assert reply.startswith(b"HTTP/1.1 200 ") and b"probe_total 1.0" in reply
            assert conn.recv(1) == b""
        status, _ = get(port, path="/other")
        assert status == 404
    finally:
        httpd.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def _read_reply(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(
            line.split(b":")[1]
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
    )
    while len(body) < length:
        body += conn.recv(65536)
    return head + b"\r\n\r\n" + body


def test_bad_requests_and_a_broken_collector_get_an_answer_not_a_dead_endpoint() -> None:
    class Broken:
        def collect(self):  # type: ignore[no-untyped-def]
            raise RuntimeError("a collector's bug")

    registry = CollectorRegistry()
    httpd = MetricsHttpServer(registry, "127.0.0.1", 0)
    port = httpd.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(b"POST /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _read_reply(conn).startswith(b"HTTP/1.1 405 ")
            conn.sendall(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            head = conn.recv(65536)
            assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n")
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(b"nonsense\r\n\r\n")
            assert _read_reply(conn).startswith(b"HTTP/1.1 400 ")
        broken = Broken()
        registry.register(broken)  # type: ignore[arg-type]
        assert get(port)[0] == 500
        registry.unregister(broken)  # type: ignore[arg-type]
        assert get(port)[0] == 200
    finally:
        httpd.close()
