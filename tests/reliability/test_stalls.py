"""Stalls on either side of the socket, with real processes:

- a server whose stderr is a pipe nobody reads keeps answering (it froze after 223 log
  lines: every log call blocked the event loop on the full pipe);
- a server stopped (SIGSTOP) for longer than a lease keeps its live clients' sessions
  (the reaper used to run before their queued KeepAlives and expire them all);
- a Session stream client frozen with SIGSTOP has its slots and locks released within
  its TTL, by the stream's lease or by gRPC keepalive.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from harness import SOURCE_PATH, pb, running, serve_process, stub_for, wait_serving

# One client opens 1500 sessions to fill the log pipe: above max_sessions_per_client's
# default, which is not under test here.
CONFIG = (
    "server:\n  session_ttl_min: 0.5\n  log_queue_lines: 100\n"
    "  max_sessions_per_client: 0\n"
    "models:\n  - name: m\n    page_size: 1\n"
    "    pool: {size: 1024, layers: 1, k_heads: 1, k_head_dim: 4}\n"
)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": SOURCE_PATH, "OMP_NUM_THREADS": "1"}


def _health(channel: grpc.Channel) -> int:
    return (
        health_pb2_grpc.HealthStub(channel)
        .Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        .status
    )


@pytest.mark.slow
def test_an_unread_stderr_pipe_does_not_stall_the_service(tmp_path: Path) -> None:
    (tmp_path / "pc.yaml").write_text(CONFIG)
    address = f"unix:{tmp_path / 'pc.sock'}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prefixcache.server.cli",
            "serve",
            "--config",
            str(tmp_path / "pc.yaml"),
            "--listen",
            address,
            "--metrics-port",
            "0",
            "--metrics-host",
            "127.0.0.1",
        ],
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        port = None
        assert proc.stderr is not None
        for raw in proc.stderr:  # read up to the "serving" line, and never again
            if match := re.search(rb" serving .*metrics_port=(\d+)", raw):
                port = int(match[1])
                break
        assert port, "no serving line"
        wait_serving(proc, address)
        channel, stub = stub_for(address)
        with channel:
            name = "a-worker-with-a-name-long-enough-to-fill-the-pipe-sooner"
            for _ in range(1500):  # one "session opened" line each: ~250 KB of log
                stub.OpenSession(pb.OpenSessionRequest(client_name=name), timeout=5)
            assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
            assert stub.Stats(pb.StatsRequest(), timeout=5).sessions == 1500
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        dropped = re.search(r"^prefixcache_log_records_dropped_total (\S+)$", text, re.M)
        assert dropped and float(dropped[1]) > 500, dropped  # pipe ~64 KiB + queue 100
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_a_stopped_server_keeps_its_live_clients_sessions(tmp_path: Path) -> None:
    with serve_process(tmp_path, CONFIG) as (proc, address):
        channel, stub = stub_for(address)
        with channel:
            live = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=1.0)).session_id
            stub.Alloc(pb.AllocRequest(model="m", num_slots=3, session_id=live))
            dead = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=1.0)).session_id
            stop = threading.Event()
            failures: list[grpc.StatusCode] = []

            def keep_alive() -> None:  # a live client: renews every ttl / 4
                while not stop.wait(0.25):
                    try:
                        stub.KeepAlive(pb.KeepAliveRequest(session_id=live), timeout=20)
                    except grpc.RpcError as exc:
                        failures.append(exc.code())

            keeper = threading.Thread(target=keep_alive)
            keeper.start()
            try:
                time.sleep(0.5)
                proc.send_signal(signal.SIGSTOP)
                time.sleep(3.0)  # three leases
                proc.send_signal(signal.SIGCONT)
                time.sleep(2.0)  # the dead client's lease runs out meanwhile
            finally:
                proc.send_signal(signal.SIGCONT)
                stop.set()
                keeper.join()
            assert failures == []
            assert stub.Stats(pb.StatsRequest(model="m"), timeout=5).models[0].session_slots == 3
            with pytest.raises(grpc.RpcError) as err:
                stub.KeepAlive(pb.KeepAliveRequest(session_id=dead), timeout=5)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            stub.CloseSession(pb.CloseSessionRequest(session_id=live), timeout=5)


# A worker on a Session stream: allocates 4 slots and locks a cached prefix, then talks
# every 0.2 s, as long as it is not frozen.
STREAM_CLIENT = """
import queue, sys, time
import grpc
from prefixcache.v1 import prefix_cache_pb2 as pb, prefix_cache_pb2_grpc as pb_grpc
stub = pb_grpc.PrefixCacheStub(grpc.insecure_channel(sys.argv[1]))
requests = queue.Queue()
replies = stub.Session(iter(requests.get, None))
tokens = bytes(range(8))  # two tokens, cached by the test
requests.put(pb.SessionRequest(seq=1, alloc=pb.AllocRequest(model="m", num_slots=4)))
requests.put(pb.SessionRequest(seq=2, match=pb.MatchRequest(model="m", token_ids=tokens,
                                                            lock=True)))
assert next(replies).seq == 1 and next(replies).match.lock_id
print("ready", flush=True)
seq = 2
while True:
    seq += 1
    requests.put(pb.SessionRequest(seq=seq, stats=pb.StatsRequest(model="m")))
    next(replies)
    time.sleep(0.2)
"""


@pytest.fixture
def stream_client(tmp_path: Path) -> Iterator:
    script = tmp_path / "client.py"
    script.write_text(STREAM_CLIENT)
    procs: list[subprocess.Popen[str]] = []

    def start(address: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, str(script), address], env=_env(), stdout=subprocess.PIPE, text=True
        )
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def _holdings(stub) -> tuple[int, int]:
    m = stub.Stats(pb.StatsRequest(model="m"), timeout=5).models[0]
    return m.session_slots, m.locks


@pytest.mark.parametrize("how", ["stream_ttl", "keepalive"])
def test_a_frozen_stream_client_loses_its_holdings_within_its_ttl(
    tmp_path: Path, stream_client, how: str
) -> None:
    """By the stream's own lease (it sends nothing), or by gRPC keepalive (its process
    answers no pings), whichever is shorter."""
    ttl = 1.5
    limits = (
        {"stream_ttl": ttl, "keepalive_time": 60.0}
        if how == "stream_ttl"
        else {"stream_ttl": 300.0, "keepalive_time": ttl / 2, "keepalive_timeout": ttl / 2}
    )
    with running(tmp_path, **limits) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
            m = stub.Match(
                pb.MatchRequest(model="m", token_ids=bytes(range(8)), session_id=sid, allocate=True)
            )
            stub.Insert(
                pb.InsertRequest(
                    model="m",
                    token_ids=bytes(range(8)),
                    session_id=sid,
                    slot_indices=m.allocated_slots,
                )
            )
            client = stream_client(srv.address)
            time.sleep(2 * ttl)  # a live client keeps its stream past the TTL
            assert _holdings(stub) == (4, 1)
            client.send_signal(signal.SIGSTOP)
            # Released by the limit under test: the other one (60 s of keepalive_time,
            # or a 300 s stream TTL) is past this deadline.
            deadline = time.monotonic() + 30
            while _holdings(stub) != (0, 0):
                assert time.monotonic() < deadline, f"still held: {_holdings(stub)}"
                time.sleep(0.05)
            srv.check_integrity()
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
