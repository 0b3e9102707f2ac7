"""In-process Mooncake trace replay through our RadixCache and the plain yardstick tree."""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import inspect
import io
import json
import os
import pickle
import platform
import pstats
import resource
import sys
import time
import traceback
import warnings
from array import array
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Run as `python bench/replay.py`, sys.path[0] is bench/, where trace.py would
# shadow the stdlib `trace` module; import our modules as `bench.*` instead.
_REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == _REPO / "bench":
    sys.path[0] = str(_REPO)
sys.path += [p for p in map(str, (_REPO, _REPO / "server", _REPO / "client")) if p not in sys.path]

# torch warns at import when numpy is absent; nothing here uses numpy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402

from bench.trace import DEFAULT_TRACE, load_expanded  # noqa: E402
from bench.yardstick import PlainRadixCache  # noqa: E402

OPS = ("key", "match", "lock", "evict", "alloc", "cat", "insert", "free_dup", "unlock")


@dataclass
class OpStats:
    calls: int
    mean_us: float
    p50_us: float
    p99_us: float

    @staticmethod
    def of(ns: array) -> OpStats:
        s = sorted(ns) or [0]
        return OpStats(
            len(ns),
            sum(s) / len(s) / 1e3,
            s[len(s) // 2] / 1e3,
            s[min(len(s) - 1, len(s) * 99 // 100)] / 1e3,
        )


@dataclass
class RunResult:
    impl: str
    budget: int
    page_size: int
    requests: int
    failed: int
    errors: int
    tokens: int
    hit_tokens: int
    hit_ratio: float
    loop_s: float
    prep_s: float
    wall_s: float
    req_per_s: float
    evicted_tokens: int
    peak_rss_mb: float
    peak_rss_delta_mb: float
    integrity: str
    ops: dict[str, OpStats] = field(default_factory=dict)
    prefix_lens: array | None = field(default=None, repr=False)
    # The loop's CPU time (process time, key preparation excluded): other tenants of
    # a busy machine inflate it far less than the wall-clock loop time.
    cpu_s: float = 0.0

    @property
    def cpu_us_per_req(self) -> float:
        return self.cpu_s / self.requests * 1e6 if self.requests else 0.0


@dataclass
class Impl:
    """How to build one implementation; `prepare` (untimed) turns the pre-built array
    into the impl's input form, `wrap` (timed as op "key") makes its key type."""

    name: str
    make_cache: Callable[[Any, int], Any]
    prepare: Callable[[array], Any]
    wrap: Callable[[Any], Any]


def _default_allocator(budget: int, page_size: int) -> Any:
    from prefixcache.cache import TokenToKVPoolAllocator

    return TokenToKVPoolAllocator(size=budget, device="cpu", page_size=page_size)


def yardstick_impl() -> Impl:
    return Impl(
        "yardstick",
        lambda alloc, ps: PlainRadixCache(ps, alloc),
        lambda arr: arr.tolist(),
        lambda x: x,
    )


# What the caller holds its token ids in, for `ours` (the pre-built array('I') is
# "packed"); converting to it is untimed, like the yardstick's tolist().
KEY_TYPES: dict[str, Callable[[array], Any]] = {
    "packed": lambda arr: arr,
    "list": lambda arr: arr.tolist(),
    "array_q": lambda arr: array("q", arr),
    "numpy": lambda arr: _numpy_int64(arr),
}


def _numpy_int64(arr: array) -> Any:
    import numpy as np

    return np.frombuffer(arr, dtype=np.uint32).astype(np.int64)


def ours_impl(eager_hashes: bool = False, key_type: str = "packed") -> Impl:
    """Our RadixCache; ``key_type`` names what the caller holds (KEY_TYPES)."""
    from prefixcache.cache import RadixCache, RadixKey

    kw = {"eager_page_hashes": True} if eager_hashes else {}
    name = "ours+hashes" if eager_hashes else "ours"
    if key_type != "packed":
        name += f"/{key_type}"
    return Impl(
        name,
        lambda alloc, ps: RadixCache(page_size=ps, token_to_kv_pool_allocator=alloc, **kw),
        KEY_TYPES[key_type],
        RadixKey,
    )


def supports_eager_hashes() -> bool:
    from prefixcache.cache import RadixCache

    # RadixCache defines __new__(*args, **kwargs), which hides __init__ from
    # inspect.signature(RadixCache).
    return "eager_page_hashes" in inspect.signature(RadixCache.__init__).parameters


def _status_kb(field_name: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            return next((int(ln.split()[1]) for ln in fh if ln.startswith(field_name + ":")), None)
    except OSError:
        return None


def _reset_peak_rss() -> bool:
    # Writing 5 to clear_refs resets VmHWM, so a run reports its own peak even
    # when it shares the process with earlier runs (e.g. under --no-fork).
    try:
        Path("/proc/self/clear_refs").write_text("5", encoding="ascii")
        return True
    except OSError:
        return False


def replay(
    impl: Impl,
    keys: list[array],
    budget: int,
    page_size: int,
    make_allocator: Callable[[int, int], Any] = _default_allocator,
    profile_top: int = 0,
) -> RunResult:
    """Run the caller protocol for every key, sequentially, and collect timings.

    With `profile_top`, cProfile the loop and print its top entries by own time.
    """
    profile = cProfile.Profile() if profile_top else None
    gc.collect()
    peak_reset = _reset_peak_rss()
    rss0 = _status_kb("VmRSS") or 0
    t_wall = time.perf_counter()
    alloc = make_allocator(budget, page_size)
    capacity = alloc.available_size()
    cache = impl.make_cache(alloc, page_size)
    prepare, wrap = impl.prepare, impl.wrap
    times = {op: array("q") for op in OPS}
    t_key, t_match, t_lock, t_evict, t_alloc, t_cat, t_insert, t_free, t_unlock = (
        times[op].append for op in OPS
    )
    prefix_lens = array("q")
    clock = time.perf_counter_ns
    failed = hit = evicted = prep_ns = prep_cpu = errors = 0
    cpu = time.process_time_ns
    first_error: str | None = None
    if profile is not None:
        profile.enable()
    start, cpu_start = clock(), cpu()
    for i, arr in enumerate(keys):
        try:
            c0, t0 = cpu(), clock()
            raw = key = None  # free the last input untimed, as tolist() is untimed
            raw = prepare(arr)
            t1 = clock()
            prep_ns += t1 - t0
            prep_cpu += cpu() - c0
            key = wrap(raw)
            t2 = clock()
            m = cache.match_prefix(key)
            t3 = clock()
            node = m.last_node
            cache.inc_lock_ref(node)
            t4 = clock()
            t_key(t2 - t1)
            t_match(t3 - t2)
            t_lock(t4 - t3)
            matched = m.prefix_len
            prefix_lens.append(matched)
            hit += matched
            need = len(arr) - matched
            if need > 0:
                short = need - alloc.available_size()
                if short > 0:
                    # Exactly the shortfall is asked for; whole-leaf eviction may free more.
                    t5 = clock()
                    evicted += cache.evict(short).full_evicted
                    t_evict(clock() - t5)
                t5 = clock()
                new = alloc.alloc(need)
                t6 = clock()
                t_alloc(t6 - t5)
                if new is None:
                    failed += 1
                    cache.dec_lock_ref(node)
                    continue
                value = torch.cat((m.indices, new))
                t5 = clock()
                t_cat(t5 - t6)
            else:
                value, new = m.indices, m.indices[:0]
            t5 = clock()
            dup = cache.insert(key, value).prefix_len - matched
            t6 = clock()
            t_insert(t6 - t5)
            if dup > 0:
                # The radix cache keeps its own slots for the part already present;
                # the caller frees the incoming duplicates (as cache_finished_req does).
                alloc.free(new[:dup])
                t_free(clock() - t6)
                t6 = clock()
            cache.dec_lock_ref(node)
            t_unlock(clock() - t6)
        except Exception as exc:  # a library error must not hide the rest of the run
            errors += 1
            if len(prefix_lens) == i:
                prefix_lens.append(-1)
            if first_error is None:
                first_error = f"request {i}: {type(exc).__name__}: {exc}"

    loop_ns = clock() - start - prep_ns
    loop_cpu = cpu() - cpu_start - prep_cpu
    if profile is not None:
        profile.disable()
        buf = io.StringIO()
        pstats.Stats(profile, stream=buf).sort_stats("tottime").print_stats(profile_top)
        print(f"profile {impl.name} budget {budget:,}:\n{buf.getvalue()}", file=sys.stderr)
    # Read before check_integrity (its scans are not the cache's cost); without a VmHWM
    # reset, fall back to the process's lifetime peak (KiB on Linux).
    peak = (_status_kb("VmHWM") if peak_reset else None) or resource.getrusage(
        resource.RUSAGE_SELF
    ).ru_maxrss
    integrity = _integrity(cache, alloc, capacity)
    if errors:
        integrity = f"{errors} request(s) raised, first {first_error}; {integrity}"
    wall, tokens = time.perf_counter() - t_wall, sum(len(k) for k in keys)
    return RunResult(
        impl=impl.name,
        budget=budget,
        page_size=page_size,
        requests=len(keys),
        failed=failed,
        errors=errors,
        tokens=tokens,
        hit_tokens=hit,
        hit_ratio=hit / tokens if tokens else 0.0,
        loop_s=loop_ns / 1e9,
        prep_s=prep_ns / 1e9,
        wall_s=wall,
        req_per_s=len(keys) / (loop_ns / 1e9) if loop_ns else 0.0,
        evicted_tokens=evicted,
        peak_rss_mb=peak / 1024,
        peak_rss_delta_mb=(peak - rss0) / 1024,
        integrity=integrity,
        ops={op: OpStats.of(ns) for op, ns in times.items()},
        prefix_lens=prefix_lens,
        cpu_s=loop_cpu / 1e9,
    )


def _integrity(cache: Any, alloc: Any, capacity: int) -> str:
    """check_integrity() plus slot conservation: every slot is free or in the tree."""
    try:
        cache.check_integrity()
    except Exception as exc:  # report, don't abort the other runs
        return f"check_integrity: {type(exc).__name__}: {exc}"
    leaked = capacity - alloc.available_size() - cache.total_size()
    return f"{leaked} slots neither free nor cached" if leaked else "ok"


def first_divergence(a: RunResult, b: RunResult) -> str | None:
    """Describe the first request whose matched length differs between two runs."""
    if a.prefix_lens is None or b.prefix_lens is None:
        return None
    for i, (x, y) in enumerate(zip(a.prefix_lens, b.prefix_lens, strict=False)):
        if x != y:
            return (
                f"{b.impl} vs {a.impl} (budget {a.budget:,}): request {i} matched {y} "
                f"tokens, expected {x}; totals {b.hit_tokens:,} vs {a.hit_tokens:,}"
            )
    return None


HEADER = (
    "| impl | budget | page | requests (failed/raised) | token hit | req/s | vs yardstick "
    "| CPU µs/req | vs yardstick (CPU) "
    "| match p50 / p99 µs | insert p50 / p99 µs | alloc p50 / p99 µs "
    "| evict calls, mean µs | peak RSS MiB (Δ run) | loop s | wall s | integrity |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|---|---:|---:|---|"
)


def table_row(r: RunResult, yard: RunResult | None) -> str:
    o = r.ops
    ratio = f"{r.req_per_s / yard.req_per_s:.2f}x" if yard and yard.req_per_s else "-"
    cpu_ratio = (
        f"{yard.cpu_us_per_req / r.cpu_us_per_req:.2f}x" if yard and r.cpu_us_per_req else "-"
    )
    pq = lambda s: f"{s.p50_us:,.1f} / {s.p99_us:,.1f}"  # noqa: E731
    ev = o["evict"]
    return (
        f"| {r.impl} | {r.budget:,} | {r.page_size} | {r.requests:,} ({r.failed}/{r.errors}) "
        f"| {r.hit_ratio:.4f} | {r.req_per_s:,.0f} | {ratio} | {r.cpu_us_per_req:,.0f} "
        f"| {cpu_ratio} | {pq(o['match'])} "
        f"| {pq(o['insert'])} | {pq(o['alloc'])} | {ev.calls:,}, {ev.mean_us:,.0f} "
        f"| {r.peak_rss_mb:,.0f} ({r.peak_rss_delta_mb:+,.0f}) | {r.loop_s:.1f} "
        f"| {r.wall_s:.1f} | {r.integrity} |"
    )


def _in_child(fn: Callable[[], RunResult]) -> RunResult:
    """Run `fn` in a forked child: each run then starts from the same heap (just the
    keys), so RSS deltas compare; heap kept from an earlier run would skew them."""
    sys.stdout.flush()
    sys.stderr.flush()
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into the parent's code
        os.close(rfd)
        code, data = 0, b""
        try:
            data = pickle.dumps(fn())
        except BaseException:
            traceback.print_exc()
            code = 1
        with os.fdopen(wfd, "wb") as fh:
            fh.write(data)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as fh:
        data = fh.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        raise RuntimeError(f"replay child failed (wait status {status})")
    return pickle.loads(data)


def print_tables(trace: Path, results: list[RunResult], notes: list[str]) -> None:
    print(
        f"\n{trace.name}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, Python "
        f"{platform.python_version()}, torch {torch.__version__} ({torch.get_num_threads()} "
        f"thread), {os.cpu_count()} CPUs\n"
    )
    print(HEADER)
    for r in results:
        yard = next((y for y in results if y.impl == "yardstick" and y.budget == r.budget), None)
        print(table_row(r, yard if r.impl != "yardstick" else None))
    print("\nmean µs per call (evict: per evict call; free_dup: only when insert found more)\n")
    print("| impl | budget | " + " | ".join(OPS) + " |")
    print("|---|---:|" + "---:|" * len(OPS))
    for r in results:
        means = " | ".join(f"{r.ops[op].mean_us:,.1f}" for op in OPS)
        print(f"| {r.impl} | {r.budget:,} | {means} |")
    for note in notes:
        print(f"\nHIT RATIO MISMATCH: {note}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    add = ap.add_argument
    add("--trace", type=Path, default=DEFAULT_TRACE)
    add("--budget", type=int, action="append", help="tokens; repeatable (default 1M and 10M)")
    add("--page-size", type=int, default=16)
    add("--limit", type=int, help="replay only the first N requests")
    add("--impl", choices=("ours", "yardstick", "both"), default="both")
    add(
        "--keys",
        default=",".join(KEY_TYPES),
        help="comma-separated key types for `ours` rows, from "
        f"{', '.join(KEY_TYPES)} (default: all); `packed` is the plain `ours` row",
    )
    add(
        "--hash-pages",
        action="store_true",
        help="add an 'ours+hashes' row if RadixCache accepts eager_page_hashes",
    )
    add(
        "--profile",
        type=int,
        metavar="TOP",
        default=0,
        help="cProfile each run and print the TOP entries by own time (slows runs)",
    )
    add(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: tiny tensor ops on a busy 2-core VM "
        "run up to ~8x slower with a 2-thread pool)",
    )
    add("--no-fork", action="store_true", help="run in this process (RSS deltas then skew)")
    add("--json", type=Path, metavar="OUT", help="write all results as JSON")
    args = ap.parse_args(argv)
    budgets = args.budget or [1_000_000, 10_000_000]
    torch.set_num_threads(args.torch_threads)
    if not args.trace.exists():
        ap.error(f"trace not found: {args.trace}")
    trace = load_expanded(args.trace, args.page_size, args.limit)
    print(
        f"{args.trace.name}: {len(trace.keys):,} requests, {trace.total_tokens:,} tokens; "
        f"key build {trace.build_s:.1f} s (not timed)",
        file=sys.stderr,
    )
    impls = [yardstick_impl()] if args.impl in ("yardstick", "both") else []
    key_types = [k.strip() for k in args.keys.split(",") if k.strip()]
    if bad := [k for k in key_types if k not in KEY_TYPES]:
        ap.error(f"--keys: unknown {bad}; choose from {', '.join(KEY_TYPES)}")
    if args.impl in ("ours", "both"):
        impls += [ours_impl(key_type=k) for k in key_types]
        if args.hash_pages and supports_eager_hashes():
            impls.append(ours_impl(eager_hashes=True))
        elif args.hash_pages:
            print("RadixCache has no eager_page_hashes keyword; no hashes row", file=sys.stderr)
    fork = hasattr(os, "fork") and not args.no_fork

    results: list[RunResult] = []
    notes: list[str] = []
    for budget in budgets:
        yard: RunResult | None = None
        for impl in impls:
            job = functools.partial(
                replay, impl, trace.keys, budget, args.page_size, profile_top=args.profile
            )
            r = _in_child(job) if fork else job()
            print(
                f"{impl.name} {budget:,}: {r.req_per_s:,.0f} req/s, "
                f"{r.cpu_us_per_req:,.0f} CPU µs/req, hit {r.hit_ratio:.4f}, "
                f"{r.wall_s:.1f} s",
                file=sys.stderr,
            )
            if impl.name == "yardstick":
                yard = r
            elif yard is not None and (note := first_divergence(yard, r)):
                notes.append(note)
            results.append(r)
            gc.collect()
    print_tables(args.trace, results, notes)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        runs = [{k: v for k, v in asdict(r).items() if k != "prefix_lens"} for r in results]
        args.json.write_text(
            json.dumps(
                {
                    "trace": str(args.trace),
                    "key_build_s": trace.build_s,
                    "runs": runs,
                    "mismatches": notes,
                },
                indent=2,
            )
        )
    return 1 if notes else 0


if __name__ == "__main__":
    sys.exit(main())
