"""Sustained load against a real ``prefixcache serve``: errors, latency, and RSS over time.

A fresh ``prefixcache serve`` process (unix socket, one radix model whose pool is small
enough that eviction runs all the time, and one small model of every other kind) and
``--workers`` client processes (spawn), each with a ``PrefixCacheClient`` session,
replaying its slice of the Mooncake conversation trace in a loop until ``--duration``
is up. Per request:

1. ``match(lock=True, allocate=True)``;
2. ``insert(matched + allocated slots, release_lock_id=match's lock, lock=True)``;
3. every ``--side-every`` requests, while that lock is held: one request on the next
   of the ``swa``, ``mamba``, ``slot`` and ``chunk`` models (see load_mixed.py: state
   and slot pressure, in-place slot reuse, and inserts that name the radix lock as
   ``release_lock_id``, which must be refused);
4. two decode steps: ``alloc(k)`` twice, then one ``free`` of both;
5. ``unlock`` of the insert's lock.

Every ``--reopen-every`` requests a worker makes one more locking, allocating match and
then closes its session without inserting or unlocking (the service must release that
lock and free those slots), and opens a new session. The parent samples the server's
VmRSS every second. At the end it prints throughput, p50/p99 per operation, errors,
RSS at the end of warm-up vs. at the end, and the final Stats of every model (locks,
session slots and sessions must all be 0 once the workers have gone).

    python bench/load.py --duration 600 --workers 8 --json bench/out/load.json

The exit status is 1 when any call failed, nothing completed, the service still holds
locks, slots or sessions after the workers exit, the service did not exit 0 on SIGTERM,
or (with ``--max-rss-growth``) RSS grew more than allowed after warm-up. With
``--check-integrity`` the service runs its integrity check after every call that can
change a cache, so corruption fails the call that caused it (INTERNAL, an error here).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == _REPO / "bench":
    sys.path[0] = str(_REPO)  # bench/trace.py would shadow the stdlib `trace`
sys.path += [p for p in map(str, (_REPO, _REPO / "server", _REPO / "client")) if p not in sys.path]

from bench.grpc_servers import MODEL, ServerProcess  # noqa: E402
from bench.load_mixed import final_stats, held_after, start_service  # noqa: E402
from bench.load_workers import OPS, START_TIMEOUT_S, WorkerResult, WorkerSpec, worker  # noqa: E402
from bench.trace import DEFAULT_TRACE, load_expanded  # noqa: E402

# ---------------------------------------------------------------- parent side


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class RssSampler(threading.Thread):
    """VmRSS of ``pid`` every ``interval`` seconds, as (seconds since start, KiB)."""

    def __init__(self, pid: int, interval: float = 1.0) -> None:
        super().__init__(daemon=True, name="rss-sampler")
        self.pid = pid
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        self.t0 = time.monotonic()
        self._stop_event = threading.Event()

    def run(self) -> None:
        while True:
            try:
                self.samples.append((time.monotonic() - self.t0, _rss_kib(self.pid)))
            except OSError:
                return
            if self._stop_event.wait(self.interval):
                return

    def stop(self) -> None:
        self._stop_event.set()
        self.join(5)


@dataclass
class Latency:
    count: int
    p50_us: float
    p99_us: float
    max_us: float

    @staticmethod
    def of(ns: list[int]) -> Latency:
        s = sorted(ns) or [0]
        return Latency(
            len(ns), s[len(s) // 2] / 1e3, s[min(len(s) - 1, len(s) * 99 // 100)] / 1e3, s[-1] / 1e3
        )


@dataclass
class Report:
    workers: int
    duration_s: float
    budget: int
    page_size: int
    trace_requests: int
    max_key_tokens: int
    requests: int
    reopens: int
    req_per_s: float
    rpc_per_s: float
    errors: dict[str, int]
    first_errors: list[str]
    latency: dict[str, Latency]
    hit_ratio: float
    warmup_s: float
    rss_start_kib: int
    rss_warm_kib: int
    rss_end_kib: int
    rss_max_after_warm_kib: int
    rss_growth_pct: float
    rss_timeline: list[tuple[float, int]]
    stats: dict[str, Any]
    counts: dict[str, int] = field(default_factory=dict)
    server_exit: int | None = None


def _median_rss(samples: list[tuple[float, int]], lo: float, hi: float) -> int:
    window = [kib for t, kib in samples if lo <= t <= hi]
    return int(statistics.median(window)) if window else 0


def run(args: argparse.Namespace) -> Report:
    trace = load_expanded(args.trace, args.page_size, args.limit)
    # Every worker may hold a locked request plus its allocation at once: cut keys so
    # that n workers can never exhaust the pool with locked slots (a RESOURCE_EXHAUSTED
    # here would be the load's fault, not the service's).
    cap = args.budget // (3 * args.workers)
    cap -= cap % args.page_size
    n_requests = len(trace.keys)
    print(
        f"{args.trace.name}: {n_requests:,} requests; keys cut to {cap:,} tokens; pool "
        f"{args.budget:,} tokens, page {args.page_size}; {args.workers} workers for "
        f"{args.duration:g} s",
        file=sys.stderr,
    )
    with tempfile.TemporaryDirectory(prefix="pc-load-") as tmpdir:
        tmp = Path(tmpdir)
        tokens_path = tmp / "tokens.bin"
        spans: list[tuple[int, int]] = []
        with open(tokens_path, "wb") as fh:
            offset = 0
            for key in trace.keys:
                data = key[:cap].tobytes()
                if not data:
                    continue
                fh.write(data)
                spans.append((offset, offset + len(data)))
                offset += len(data)
        del trace
        server = start_service(tmp, args)
        sampler = RssSampler(server.proc.pid)
        sampler.start()
        try:
            results, t_run = _run_workers(args, server, tokens_path, spans)
            stats = final_stats(server.target)
        except BaseException:
            sampler.stop()
            server.stop()
            raise
        sampler.stop()
        code = server.stop()
        if code != 0:
            print(f"server exited {code}; its log:\n{server.log_tail()}", file=sys.stderr)
    shift = t_run - sampler.t0  # sample times from the start of the load, not of the sampler
    samples = [(round(t - shift, 2), kib) for t, kib in sampler.samples]
    run_samples = [(t, kib) for t, kib in samples if 0 <= t <= args.duration]
    warm = args.warmup if args.warmup is not None else max(5.0, 0.2 * args.duration)
    rss_warm = _median_rss(run_samples, warm - 5, warm)
    rss_end = _median_rss(run_samples, args.duration - 5, args.duration)
    after = [kib for t, kib in run_samples if t >= warm]
    errors: dict[str, int] = {}
    counts: dict[str, int] = {}
    for r in results:
        for k, v in r.errors.items():
            errors[k] = errors.get(k, 0) + v
        for k, v in r.counts.items():
            counts[k] = counts.get(k, 0) + v
    requests = sum(r.requests for r in results)
    reopens = sum(r.reopens for r in results)
    wall = max(r.t_end for r in results) - min(r.t_start for r in results)
    latency = {op: Latency.of([x for r in results for x in r.ns[op]]) for op in OPS}
    rpcs = sum(lat.count for lat in latency.values())
    query = sum(r.query_tokens for r in results)
    return Report(
        workers=args.workers,
        duration_s=wall,
        budget=args.budget,
        page_size=args.page_size,
        trace_requests=len(spans),
        max_key_tokens=cap,
        requests=requests,
        reopens=reopens,
        req_per_s=requests / wall if wall > 0 else 0.0,
        rpc_per_s=rpcs / wall if wall > 0 else 0.0,
        errors=errors,
        first_errors=[e for r in results for e in r.first_errors][:10],
        latency=latency,
        hit_ratio=sum(r.hit_tokens for r in results) / query if query else 0.0,
        warmup_s=warm,
        rss_start_kib=run_samples[0][1] if run_samples else 0,
        rss_warm_kib=rss_warm,
        rss_end_kib=rss_end,
        rss_max_after_warm_kib=max(after, default=0),
        rss_growth_pct=(rss_end - rss_warm) / rss_warm * 100 if rss_warm else 0.0,
        rss_timeline=samples,
        stats=stats,
        counts=counts,
        server_exit=code,
    )


def _run_workers(
    args: argparse.Namespace, server: ServerProcess, tokens_path: Path, spans: list[tuple[int, int]]
) -> tuple[list[WorkerResult], float]:
    ctx = mp.get_context("spawn")
    n = args.workers
    barrier = ctx.Barrier(n + 1)
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=worker,
            daemon=True,
            args=(
                WorkerSpec(
                    server.target,
                    str(tokens_path),
                    spans[i::n] or spans,
                    i,
                    args.duration,
                    args.reopen_every,
                    args.decode_tokens,
                    args.side_every,
                ),
                barrier,
                out,
            ),
        )
        for i in range(n)
    ]
    for p in procs:
        p.start()
    t_run = 0.0
    try:
        barrier.wait(START_TIMEOUT_S)
        t_run = time.monotonic()
    except threading.BrokenBarrierError:
        pass  # a worker failed; its traceback comes through the queue
    results: list[WorkerResult] = []
    try:
        for _ in procs:
            results.append(out.get(timeout=args.duration + START_TIMEOUT_S))
    except queue.Empty:
        pass
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    failures = [r.failure for r in results if r.failure]
    if failures or len(results) != n:
        raise RuntimeError(
            f"{n - len(results)} of {n} workers sent nothing back; failures:\n"
            + "\n".join(failures)
            + f"\nserver log:\n{server.log_tail()}"
        )
    return results, t_run


def _mib(kib: int) -> str:
    return f"{kib / 1024:,.1f}"


def print_report(rep: Report) -> None:
    print(
        f"\n{rep.workers} workers, {rep.duration_s:,.0f} s; pool {rep.budget:,} tokens, page "
        f"{rep.page_size}; {rep.trace_requests:,} trace requests cut to {rep.max_key_tokens:,} "
        f"tokens; Python {platform.python_version()}, {os.cpu_count()} CPUs\n"
    )
    errs = sum(rep.errors.values())
    print("| requests | req/s | RPC/s | errors | session reopens | token hit | evicted tokens |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {rep.requests:,} | {rep.req_per_s:,.1f} | {rep.rpc_per_s:,.0f} | {errs} | "
        f"{rep.reopens:,} | {rep.hit_ratio:.3f} | {rep.stats.get('evicted_tokens', 0):,} |"
    )
    print("\n| op | calls | p50 µs | p99 µs | max µs |")
    print("|---|---:|---:|---:|---:|")
    for op, lat in rep.latency.items():
        print(
            f"| {op} | {lat.count:,} | {lat.p50_us:,.0f} | {lat.p99_us:,.0f} | {lat.max_us:,.0f} |"
        )
    print(
        f"\n| server RSS MiB: start | end of warm-up ({rep.warmup_s:.0f} s) | max after "
        "warm-up | end | growth after warm-up |"
    )
    print("|---:|---:|---:|---:|---:|")
    print(
        f"| {_mib(rep.rss_start_kib)} | {_mib(rep.rss_warm_kib)} | "
        f"{_mib(rep.rss_max_after_warm_kib)} | {_mib(rep.rss_end_kib)} | "
        f"{rep.rss_growth_pct:+.2f}% |"
    )
    s = rep.stats
    print(
        f"\nafter the workers exit: locks {s['locks']}, session slots {s['session_slots']}, "
        f"sessions {s['sessions']}, protected tokens {s['protected_tokens']}, free slots "
        f"{s['free_slots']:,} + cached {s['cached_tokens']:,} of {s['pool_size']:,}; "
        f"server exit code {rep.server_exit}"
    )
    for name, m in s["models"].items():
        if name != MODEL:
            print(
                f"{name}: {m['match_tokens']:,} tokens matched, hit {m['hit_ratio']:.3f}, "
                f"{m['evicted_tokens']:,} evicted; after: locks {m['locks']}, session "
                f"slots {m['session_slots']}, state slots {m['session_state_slots']}, "
                f"protected {m['protected_tokens']}, free slots {m['free_slots']:,}"
            )
    if rep.counts:
        print(f"expected outcomes: {rep.counts}")
    step = max(1, len(rep.rss_timeline) // 10)
    points = ", ".join(f"{t:.0f}s {_mib(kib)}" for t, kib in rep.rss_timeline[::step])
    print(f"RSS MiB over time: {points}")
    if rep.errors:
        print(f"\nerrors: {rep.errors}\nfirst: {rep.first_errors}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = ap.add_argument
    add("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    add("--workers", type=int, default=8, help="client processes (default 8)")
    add("--budget", type=int, default=200_000, help="KV pool size in tokens (default 200,000)")
    add("--page-size", type=int, default=16)
    add("--trace", type=Path, default=DEFAULT_TRACE)
    add("--limit", type=int, default=3000, help="use the first N trace requests (default 3000)")
    add(
        "--reopen-every",
        type=int,
        default=200,
        help="close and reopen the session every N requests (default 200)",
    )
    add("--decode-tokens", type=int, default=8, help="base size of each decode alloc")
    add(
        "--side-every",
        type=int,
        default=1,
        metavar="N",
        help="one request on the swa, mamba, slot and chunk models (in turn) every N "
        "radix requests (default 1; 0: the radix model only)",
    )
    add(
        "--check-integrity",
        action="store_true",
        help="run the service in invariant mode (integrity check after every change)",
    )
    add("--warmup", type=float, help="seconds (default: 20%% of --duration, at least 5)")
    add(
        "--max-rss-growth",
        type=float,
        metavar="PCT",
        help="fail when RSS grows more than PCT %% after warm-up",
    )
    add("--json", type=Path, metavar="OUT", help="write the report as JSON")
    args = ap.parse_args(argv)
    if args.workers < 1 or args.duration <= 0 or args.reopen_every < 2 or args.side_every < 0:
        ap.error("need --workers >= 1, --duration > 0, --reopen-every >= 2, --side-every >= 0")
    if not args.trace.exists():
        ap.error(f"trace not found: {args.trace}")
    os.environ["OMP_NUM_THREADS"] = "1"  # the spawned workers and the server inherit it
    rep = run(args)
    print_report(rep)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(asdict(rep), indent=1))
    s = rep.stats
    bad = (
        rep.errors
        or rep.requests == 0
        or held_after(s)
        or s["sessions"]
        or rep.server_exit != 0
        or (args.max_rss_growth is not None and rep.rss_growth_pct > args.max_rss_growth)
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
