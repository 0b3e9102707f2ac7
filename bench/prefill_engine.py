"""A prefill's engine work, no gRPC: Match(lock, allocate) then Insert(matched +
allocated slots, release the lock) of each trace prompt, as the service's handlers
call them (``CacheService`` in this process, one session).

The pool evicts once full, so allocations come back as many runs of scattered pages,
which is what the slot-ownership checks see on a busy server. Prints µs per prefill
(and per Match / Insert) of this thread's CPU time, so that other processes on a
shared machine count less than they would in wall-clock time; ``--json`` writes the
same numbers.

    python bench/prefill_engine.py --limit 600 --page-size 16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == _REPO / "bench":
    sys.path[0] = str(_REPO)  # bench/trace.py would shadow the stdlib `trace`
sys.path += [p for p in map(str, (_REPO, _REPO / "server", _REPO / "client")) if p not in sys.path]

import numpy as np  # noqa: E402

from bench.trace import DEFAULT_TRACE, load_expanded  # noqa: E402
from prefixcache.cache import RadixKey  # noqa: E402
from prefixcache.server.config import ModelConfig, PoolConfig  # noqa: E402
from prefixcache.server.service import CacheService  # noqa: E402


def replay(keys: list, budget: int, page_size: int) -> dict[str, float]:
    pool = PoolConfig(size=budget, k_heads=1, k_head_dim=2)
    svc = CacheService([ModelConfig(name="m", page_size=page_size, pool=pool)])
    engine = svc.engine("m")
    session = svc.open_session(3600.0)
    match_ns = insert_ns = 0
    for tokens in keys:
        key = RadixKey(tokens)
        t0 = time.thread_time_ns()
        out = engine.match(key, session, lock=True, allocate=True)
        t1 = time.thread_time_ns()
        slots = np.concatenate([out.indices[: out.prefix_len], out.allocated])
        t2 = time.thread_time_ns()
        engine.insert(key, slots, session, release_lock_id=out.lock_id)
        t3 = time.thread_time_ns()
        match_ns += t1 - t0
        insert_ns += t3 - t2
    svc.check_integrity()
    n = max(len(keys), 1)
    return {
        "requests": len(keys),
        "prefill_us": (match_ns + insert_ns) / n / 1e3,
        "match_us": match_ns / n / 1e3,
        "insert_us": insert_ns / n / 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--limit", type=int, default=600)
    parser.add_argument("--budget", type=int, default=1_000_000, help="pool size in tokens")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--json", type=Path, help="write the numbers here")
    args = parser.parse_args()
    trace = load_expanded(args.trace, args.page_size, args.limit)
    out = replay(trace.keys, args.budget, args.page_size)
    out["mean_tokens"] = trace.total_tokens / max(len(trace.keys), 1)
    print(
        f"{out['requests']} prefills of {out['mean_tokens']:,.0f} tokens (mean), page "
        f"{args.page_size}: {out['prefill_us']:,.1f} µs each (Match {out['match_us']:,.1f}, "
        f"Insert {out['insert_us']:,.1f})"
    )
    if args.json:
        args.json.write_text(json.dumps(out))


if __name__ == "__main__":
    main()
