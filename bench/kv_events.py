"""What KV events cost the request path: Match/Insert latency with the publisher off, on
with no subscriber, on with a subscriber that never reads, and on with one that reads.

For each configuration a fresh ``prefixcache serve`` process hosts one model; one client
replays a Mooncake trace as a worker does (Match with allocation, then Insert of the
matched and allocated slots), one request at a time over a unix socket, and times each
call on the client side. The pool is smaller than the trace, so eviction under pressure
publishes removals as well as stores. Configurations run interleaved, ``--rounds`` times
each, so drift on a shared machine hits them alike. The never-reading subscriber is a
SUB socket in this process that subscribes and then never calls recv (with a receive
queue of 10 batches, so a short run fills it): its queues fill, and from then on ZMQ
drops that subscriber's copy of each batch (not counted) instead of waiting for it.

    python bench/kv_events.py --limit 1500 --rounds 3 --json bench/out/kv_events.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == _REPO / "bench":
    sys.path[0] = str(_REPO)  # bench/trace.py would shadow the stdlib `trace`
sys.path += [p for p in map(str, (_REPO, _REPO / "server", _REPO / "client")) if p not in sys.path]

import grpc  # noqa: E402
import zmq  # noqa: E402

from bench.trace import DEFAULT_TRACE, load_expanded  # noqa: E402
from prefixcache.v1 import prefix_cache_pb2 as pb  # noqa: E402
from prefixcache.v1 import prefix_cache_pb2_grpc as pb_grpc  # noqa: E402

CONFIGS = ("off", "no_subscriber", "stuck_subscriber", "reading_subscriber")
_SERVE = "import sys; from prefixcache.server.cli import main; sys.exit(main())"
_READER = """
import sys, zmq
ctx = zmq.Context(); sub = ctx.socket(zmq.SUB); sub.connect(sys.argv[1])
sub.setsockopt(zmq.SUBSCRIBE, b"")
print("ready", flush=True)
while True:
    sub.recv_multipart()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config_yaml(args: argparse.Namespace, events: bool, port: int) -> str:
    page_size, pool = args.page_size, args.pool
    kv = (
        (
            f"  kv_events:\n    enable_kv_cache_events: true\n"
            f"    endpoint: tcp://*:{port}\n    hwm: {args.hwm}\n"
            f"    buffer_steps: {args.buffer_steps}\n"
        )
        if events
        else ""
    )
    return (
        f"server:\n{kv}models:\n  - name: bench\n    page_size: {page_size}\n"
        f"    pool: {{size: {pool}, layers: 1, k_heads: 1, k_head_dim: 8}}\n"
    )


def _wait_serving(proc: subprocess.Popen[bytes], target: str) -> None:
    deadline = time.monotonic() + 60
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.PrefixCacheStub(channel)
        while True:
            try:
                stub.ListModels(pb.ListModelsRequest(), timeout=1)
                return
            except grpc.RpcError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("prefixcache serve did not start") from None
                time.sleep(0.1)


def _metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("prefixcache_kv_event") and "_created" not in line:
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = float(value)
    return out


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_one(config: str, keys: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    events_on = config != "off"
    port, metrics_port = _free_port(), _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "pc.yaml").write_text(_config_yaml(args, events_on, port))
        target = f"unix:{tmp}/pc.sock"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(_REPO / "server"), str(_REPO / "client")]),
            "OMP_NUM_THREADS": "1",
        }
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _SERVE,
                "serve",
                "--config",
                f"{tmp}/pc.yaml",
                "--listen",
                target,
                "--metrics-port",
                str(metrics_port),
                "--shm-dir",
                "off",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        ctx = zmq.Context()
        stuck = reader = None
        try:
            _wait_serving(proc, target)
            if config == "stuck_subscriber":
                stuck = ctx.socket(zmq.SUB)
                stuck.setsockopt(zmq.LINGER, 0)
                # Small queues on its side, so the run reaches the drop regime (with the
                # defaults, ~1,000 batches would queue in the subscriber first).
                stuck.setsockopt(zmq.RCVHWM, 10)
                stuck.setsockopt(zmq.RCVBUF, 65536)
                stuck.connect(f"tcp://127.0.0.1:{port}")
                stuck.setsockopt(zmq.SUBSCRIBE, b"")  # and never a recv
            elif config == "reading_subscriber":
                reader = subprocess.Popen(
                    [sys.executable, "-c", _READER, f"tcp://127.0.0.1:{port}"],
                    stdout=subprocess.PIPE,
                    env=env,
                )
                assert reader.stdout is not None
                reader.stdout.readline()
            time.sleep(0.3)
            result = _replay(target, keys)
            result["config"] = config
            if events_on:
                result["events"] = _metrics(metrics_port)
            return result
        finally:
            if stuck is not None:
                stuck.close()
            if reader is not None:
                reader.kill()
                reader.wait()
            proc.terminate()
            proc.wait(30)
            ctx.term()


def _replay(target: str, keys: list[Any]) -> dict[str, Any]:
    match_s: list[float] = []
    insert_s: list[float] = []
    hit = total = 0
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.PrefixCacheStub(channel)
        session = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=600)).session_id
        start = time.perf_counter()
        for key in keys:
            packed = key.tobytes()
            t0 = time.perf_counter()
            m = stub.Match(
                pb.MatchRequest(model="bench", token_ids=packed, session_id=session, allocate=True)
            )
            t1 = time.perf_counter()
            stub.Insert(
                pb.InsertRequest(
                    model="bench",
                    token_ids=packed,
                    session_id=session,
                    slot_indices=m.slot_indices + m.allocated_slots,
                )
            )
            t2 = time.perf_counter()
            match_s.append(t1 - t0)
            insert_s.append(t2 - t1)
            hit += m.prefix_len
            total += len(key)
        wall = time.perf_counter() - start
    return {
        "requests": len(keys),
        "requests_per_s": len(keys) / wall,
        "match_p50_us": _pct(match_s, 0.5) * 1e6,
        "match_p99_us": _pct(match_s, 0.99) * 1e6,
        "insert_p50_us": _pct(insert_s, 0.5) * 1e6,
        "insert_p99_us": _pct(insert_s, 0.99) * 1e6,
        "hit_ratio": hit / max(total, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--limit", type=int, default=1500, help="requests replayed per run")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pool", type=int, default=400_000, help="pool size in tokens")
    ap.add_argument("--rounds", type=int, default=3, help="runs per configuration")
    ap.add_argument(
        "--hwm",
        type=int,
        default=1000,
        help="server.kv_events.hwm (default 1000, as the Helm chart sets)",
    )
    ap.add_argument(
        "--buffer-steps",
        type=int,
        default=1000,
        help="server.kv_events.buffer_steps (default 1000, as the chart)",
    )
    ap.add_argument(
        "--config",
        action="append",
        choices=CONFIGS,
        help="run only these (repeatable); default all",
    )
    ap.add_argument("--json", type=Path, help="write every run as JSON")
    args = ap.parse_args()
    keys = load_expanded(args.trace, args.page_size, args.limit).keys
    configs = args.config or list(CONFIGS)
    runs = []
    for round_ in range(args.rounds):
        for config in configs:
            result = run_one(config, keys, args)
            result["round"] = round_
            runs.append(result)
            print(
                f"round {round_} {config:18s} match p99 {result['match_p99_us']:8.0f} us",
                file=sys.stderr,
            )
    print(
        f"\n{len(keys)} requests, page {args.page_size}, pool {args.pool} tokens, "
        f"hwm {args.hwm}, {args.rounds} rounds (median of the rounds)\n"
    )
    print(
        "| config | req/s | Match p50 µs | Match p99 µs | Insert p50 µs | Insert p99 µs "
        "| batches sent |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for config in configs:
        mine = [r for r in runs if r["config"] == config]

        def med(field: str, mine: list[dict[str, Any]] = mine) -> float:
            return statistics.median(r[field] for r in mine)

        ev = [r.get("events", {}) for r in mine]
        sent = statistics.median(
            e.get("prefixcache_kv_event_batches_published_total", 0) for e in ev
        )
        print(
            f"| {config} | {med('requests_per_s'):.0f} | {med('match_p50_us'):.0f} | "
            f"{med('match_p99_us'):.0f} | {med('insert_p50_us'):.0f} | "
            f"{med('insert_p99_us'):.0f} | {sent:.0f} |"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
