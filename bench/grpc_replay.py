"""Mooncake trace replay over gRPC against the real service, next to two baselines.

For each (mode, workers) configuration, in one invocation:

1. ``service``: a fresh ``prefixcache serve`` process; each worker opens a session,
   then per request sends Match(lock, allocate) and Insert(matched + allocated
   slots, release the match's lock): exactly the two RPCs of a prefill.
2. ``floor``: the same client loop against ``floor_server.py``, the service's gRPC
   interface and protobuf messages with handlers that do no cache work.
3. ``echo``: the workers replay the trace's request shapes against a bare ``grpc.aio``
   echo server (``echo_server.py``, raw bytes), two calls per request with the request
   and response sizes of the service's Match and Insert.

The requests are cut into ``--rounds`` consecutive slices, and each slice runs on the
service, then the floor, then the echo, so the three share the machine's slow and fast
patches; the service keeps its cache from one slice to the next.

Mode ``unary`` uses the unary RPCs; ``stream`` one Session stream (echo: one bidi
stream) per worker, one operation in flight. Workers are separate client processes
(spawn, ``grpc.aio`` channel, closed loop). A latency is the client-side time of one
call, from handing over the built message to having the reply; building the messages
(and the Insert's slot list) counts in requests/s only. It prints a markdown table with
requests/s, p50/p99 per RPC, the echo's for the same shape, the ratios, and the hit ratio
from the Stats RPC, then where the CPU went.

    python bench/grpc_replay.py --limit 3000 --workers 1 --workers 8 --json bench/out/grpc.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Run as `python bench/grpc_replay.py`, sys.path[0] is bench/, where trace.py would
# shadow the stdlib `trace` module; import our modules as `bench.*` instead.
_REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == _REPO / "bench":
    sys.path[0] = str(_REPO)
sys.path += [p for p in map(str, (_REPO, _REPO / "server", _REPO / "client")) if p not in sys.path]

import grpc  # noqa: E402

from bench.grpc_servers import (  # noqa: E402
    ServerProcess,
    handler_times,
    service_stats,
    start_echo,
    start_floor,
    start_service,
)
from bench.grpc_workers import BARRIER_TIMEOUT_S, WorkerResult, WorkerSpec, worker  # noqa: E402
from bench.trace import DEFAULT_TRACE, load_expanded  # noqa: E402

MODES = ("unary", "stream")


# ---------------------------------------------------------------- parent side


@dataclass
class Latency:
    p50_us: float
    p99_us: float
    mean_us: float

    @staticmethod
    def of(ns: list[int]) -> Latency:
        s = sorted(ns) or [0]
        return Latency(
            s[len(s) // 2] / 1e3,
            s[min(len(s) - 1, len(s) * 99 // 100)] / 1e3,
            sum(s) / len(s) / 1e3,
        )


@dataclass
class Run:
    """One side (service or echo) of one configuration."""

    kind: str
    mode: str
    workers: int
    requests: int
    errors: dict[str, int]
    wall_s: float
    req_per_s: float
    match: Latency
    insert: Latency
    prefill: Latency  # Match + Insert of one request
    client_cpu_us_per_req: float
    server_cpu_us_per_req: float
    stats: dict[str, Any] = field(default_factory=dict)
    handler_us: dict[str, float] = field(default_factory=dict)


@dataclass
class Round:
    """One side's workers over one slice of the requests, and the server CPU it cost."""

    results: list[WorkerResult]
    server_cpu_s: float


def run_round(
    kind: str,
    mode: str,
    n: int,
    server: ServerProcess,
    tokens_path: Path,
    spans: list[tuple[int, int]],
) -> Round:
    ctx = mp.get_context("spawn")
    barriers = (ctx.Barrier(n + 1), ctx.Barrier(n + 1))
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=worker,
            daemon=True,
            args=(
                WorkerSpec(kind, mode, server.target, str(tokens_path), spans[i::n], i),
                barriers,
                out,
            ),
        )
        for i in range(n)
    ]
    for p in procs:
        p.start()
    results: list[WorkerResult] = []
    cpu0 = cpu1 = 0.0
    try:
        barriers[0].wait(BARRIER_TIMEOUT_S)
        cpu0 = server.cpu_s()
        barriers[1].wait(BARRIER_TIMEOUT_S)
        cpu1 = server.cpu_s()
    except threading.BrokenBarrierError:
        pass  # a worker failed; its traceback comes through the queue
    try:
        for _ in procs:
            results.append(out.get(timeout=BARRIER_TIMEOUT_S))
    except queue.Empty:
        pass
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    failures = [r.failure for r in results if r.failure]
    if failures or len(results) != n:
        raise RuntimeError(
            f"{kind}/{mode}/{n} workers failed:\n"
            + "\n".join(failures)
            + (f"\n{server.name} log:\n{server.log_tail()}" if failures else "")
        )
    return Round(results, cpu1 - cpu0)


def summarize(kind: str, mode: str, n: int, rounds: list[Round]) -> Run:
    """One Run of every round of one side: counts and CPU summed, latencies pooled."""
    results = [r for rnd in rounds for r in rnd.results]
    requests = sum(r.requests for r in results)
    wall = sum(
        max(r.t_end for r in rnd.results) - min(r.t_start for r in rnd.results) for rnd in rounds
    )
    errors: dict[str, int] = {}
    for r in results:
        for k, v in r.errors.items():
            errors[k] = errors.get(k, 0) + v
    match = [x for r in results for x in r.match_ns]
    insert = [x for r in results for x in r.insert_ns]
    prefill = [a + b for r in results for a, b in zip(r.match_ns, r.insert_ns, strict=True)]
    per_req = 1e6 / max(requests, 1)
    return Run(
        kind,
        mode,
        n,
        requests,
        errors,
        wall,
        requests / wall if wall > 0 else 0.0,
        Latency.of(match),
        Latency.of(insert),
        Latency.of(prefill),
        sum(r.cpu_s for r in results) * per_req,
        sum(rnd.server_cpu_s for rnd in rounds) * per_req,
    )


def _slices(spans: list[tuple[int, int]], rounds: int) -> list[list[tuple[int, int]]]:
    """``spans`` cut into ``rounds`` consecutive slices (trace order is kept)."""
    k = max(1, min(rounds, len(spans)))
    return [spans[len(spans) * i // k : len(spans) * (i + 1) // k] for i in range(k)]


def _fmt(x: float) -> str:
    return f"{x:,.0f}"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def print_tables(triples: list[tuple[Run, Run, Run]]) -> None:
    print(
        "\n| mode | workers | requests (errors) | req/s | echo req/s | Match p50 / p99 µs "
        "| echo p50 / p99 µs | Match ÷ echo | Insert p50 / p99 µs | echo p50 / p99 µs "
        "| Insert ÷ echo | prefill p50 µs (echo) | prefill ÷ echo | token hit |"
    )
    print("|---|---:|---:|---:|---:|---|---|---:|---|---|---:|---|---:|---:|")
    for svc, _, echo in triples:
        errs = sum(svc.errors.values())
        print(
            f"| {svc.mode} | {svc.workers} | {svc.requests:,} ({errs}) | "
            f"{_fmt(svc.req_per_s)} | {_fmt(echo.req_per_s)} | "
            f"{_fmt(svc.match.p50_us)} / {_fmt(svc.match.p99_us)} | "
            f"{_fmt(echo.match.p50_us)} / {_fmt(echo.match.p99_us)} | "
            f"**{_ratio(svc.match.p50_us, echo.match.p50_us)}** | "
            f"{_fmt(svc.insert.p50_us)} / {_fmt(svc.insert.p99_us)} | "
            f"{_fmt(echo.insert.p50_us)} / {_fmt(echo.insert.p99_us)} | "
            f"**{_ratio(svc.insert.p50_us, echo.insert.p50_us)}** | "
            f"{_fmt(svc.prefill.p50_us)} ({_fmt(echo.prefill.p50_us)}) | "
            f"**{_ratio(svc.prefill.p50_us, echo.prefill.p50_us)}** | "
            f"{svc.stats.get('hit_ratio', 0.0):.4f} |"
        )
    print(
        "\nServer CPU per request (µs; user+system; a request is two RPCs) of the service, "
        "the protobuf floor (the same interface, no cache) and the raw-bytes echo, and the "
        "service's own handler time (server-side mean µs per call, from /metrics):\n"
    )
    print(
        "| mode | workers | server CPU: service / floor / echo | **service ÷ echo** "
        "| floor ÷ echo | service ÷ floor | client CPU: service / echo "
        "| handler Match / Insert | evicted tokens | leftover locks / slots |"
    )
    print("|---|---:|---|---:|---:|---:|---|---|---:|---|")
    for svc, floor, echo in triples:
        prefix = "Session/" if svc.mode == "stream" else ""
        match_key, insert_key = (
            (f"{prefix}match", f"{prefix}insert") if prefix else ("Match", "Insert")
        )
        h = svc.handler_us
        cpu = svc.server_cpu_us_per_req, floor.server_cpu_us_per_req, echo.server_cpu_us_per_req
        print(
            f"| {svc.mode} | {svc.workers} | {' / '.join(map(_fmt, cpu))} | "
            f"**{_ratio(cpu[0], cpu[2])}** | {_ratio(cpu[1], cpu[2])} | "
            f"{_ratio(cpu[0], cpu[1])} | {_fmt(svc.client_cpu_us_per_req)} / "
            f"{_fmt(echo.client_cpu_us_per_req)} | "
            f"{h.get(match_key, 0.0):,.0f} / {h.get(insert_key, 0.0):,.0f} | "
            f"{svc.stats.get('evicted_tokens', 0):,} | "
            f"{svc.stats.get('locks', '?')} / {svc.stats.get('session_slots', '?')} |"
        )
    for run in (r for triple in triples for r in triple):
        if run.errors:
            print(f"\n{run.kind} {run.mode}/{run.workers}: errors {run.errors}")


def run_config(
    mode: str,
    n: int,
    servers: dict[str, ServerProcess],
    args: argparse.Namespace,
    tmp: Path,
    tokens_path: Path,
    spans: list[tuple[int, int]],
) -> tuple[Run, Run, Run]:
    """The service, the floor and the echo over the same requests, interleaved round by
    round (the service keeps its cache across rounds), so that a slow patch of a shared
    machine falls on all three rather than on one."""
    service, port = start_service(
        tmp, args.budget, args.page_size, f"{mode}{n}", args.change_log_capacity
    )
    sides = {"service": service, "floor": servers["floor"], "echo": servers["echo"]}
    rounds: dict[str, list[Round]] = {kind: [] for kind in sides}
    try:
        for chunk in _slices(spans, args.rounds):
            for kind, server in sides.items():
                rounds[kind].append(run_round(kind, mode, n, server, tokens_path, chunk))
        s, f, e = (summarize(kind, mode, n, rounds[kind]) for kind in sides)
        s.stats = service_stats(service.target)
        s.handler_us = handler_times(port)
    finally:
        service.stop()
    print(
        f"{mode} x{n}: service {s.req_per_s:,.0f} req/s, floor {f.req_per_s:,.0f}, echo "
        f"{e.req_per_s:,.0f}; server CPU per prefill {s.server_cpu_us_per_req:,.0f} / "
        f"{f.server_cpu_us_per_req:,.0f} / {e.server_cpu_us_per_req:,.0f} µs "
        f"({_ratio(s.server_cpu_us_per_req, e.server_cpu_us_per_req)}x the echo's), hit "
        f"{s.stats['hit_ratio']:.4f}",
        file=sys.stderr,
    )
    return s, f, e


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = ap.add_argument
    add("--trace", type=Path, default=DEFAULT_TRACE)
    add("--limit", type=int, default=3000, help="replay the first N requests (default 3000)")
    add(
        "--workers",
        type=int,
        action="append",
        help="concurrent client processes; repeatable (default 1 and 8)",
    )
    add("--modes", default="unary,stream", help="comma-separated: unary, stream")
    add(
        "--rounds",
        type=int,
        default=3,
        help="slices of the requests, each run on service, floor and echo in turn (default 3)",
    )
    add("--budget", type=int, default=1_000_000, help="KV pool size in tokens (default 1M)")
    add("--page-size", type=int, default=16)
    add(
        "--change-log-capacity",
        type=int,
        metavar="N",
        help="server.change_log_capacity for the service (0: no change log, so no page "
        "hashes at insert); default: the server's default",
    )
    add("--json", type=Path, metavar="OUT", help="write every run as JSON")
    args = ap.parse_args(argv)
    workers = args.workers or [1, 8]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if bad := [m for m in modes if m not in MODES]:
        ap.error(f"--modes: unknown {bad}; choose from {', '.join(MODES)}")
    if not args.trace.exists():
        ap.error(f"trace not found: {args.trace}")
    if min(workers) < 1 or args.rounds < 1:
        ap.error("--workers and --rounds must be >= 1")
    os.environ["OMP_NUM_THREADS"] = "1"  # the spawned workers inherit it

    t_all = time.monotonic()
    trace = load_expanded(args.trace, args.page_size, args.limit)
    total = trace.total_tokens
    print(
        f"{args.trace.name}: {len(trace.keys):,} requests, {total:,} tokens "
        f"(mean {total / max(len(trace.keys), 1):,.0f}); pool {args.budget:,} tokens, "
        f"page {args.page_size}",
        file=sys.stderr,
    )
    triples: list[tuple[Run, Run, Run]] = []
    with tempfile.TemporaryDirectory(prefix="pc-grpc-bench-") as tmpdir:
        tmp = Path(tmpdir)
        tokens_path = tmp / "tokens.bin"
        spans: list[tuple[int, int]] = []
        with open(tokens_path, "wb") as fh:
            offset = 0
            for key in trace.keys:
                data = key.tobytes()
                fh.write(data)
                spans.append((offset, offset + len(data)))
                offset += len(data)
        del trace
        servers = {"echo": start_echo(tmp)}
        try:
            servers["floor"] = start_floor(tmp)
            for mode in modes:
                for n in workers:
                    triples.append(run_config(mode, n, servers, args, tmp, tokens_path, spans))
        finally:
            for server in servers.values():
                server.stop()
    print(
        f"\n{args.trace.name}, first {len(spans):,} requests in {args.rounds} rounds, pool "
        f"{args.budget:,} tokens, page {args.page_size}; grpcio {grpc.__version__}, Python "
        f"{platform.python_version()}, {os.cpu_count()} CPUs; total "
        f"{time.monotonic() - t_all:.0f} s"
    )
    print_tables(triples)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "trace": str(args.trace),
                    "limit": args.limit,
                    "budget": args.budget,
                    "page_size": args.page_size,
                    "rounds": args.rounds,
                    "grpcio": grpc.__version__,
                    "runs": [
                        {"service": asdict(s), "floor": asdict(f), "echo": asdict(e)}
                        for s, f, e in triples
                    ],
                },
                indent=2,
            )
        )
    failed = any(run.requests == 0 for triple in triples for run in triple)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
