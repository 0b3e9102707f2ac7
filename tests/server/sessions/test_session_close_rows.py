"""Closing a session frees what it holds by looking where it was given slots, not at the
whole pool (no per-call work proportional to the pool), and frees exactly
what a pool scan would find, whatever the session did before."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.cache import RadixKey
from prefixcache.server.config import ModelConfig, PoolConfig
from prefixcache.server.engine.slots import MAX_TRACKED_RUNS
from prefixcache.server.service import CacheService

POOL = PoolConfig(size=512, k_heads=1, k_head_dim=2)

# (who, what, amount): who 0 is the session closed at the end, 1 another session.
OPS = st.lists(
    st.tuples(st.integers(0, 1), st.sampled_from(["alloc", "free", "insert"]), st.integers(1, 24)),
    max_size=30,
)


def _service(page_size: int, pool: PoolConfig = POOL) -> CacheService:
    return CacheService([ModelConfig(name="m", page_size=page_size, pool=pool)])


@settings(max_examples=60, deadline=None)
@given(page_size=st.sampled_from([1, 4]), ops=OPS)
def test_close_frees_exactly_the_held_rows(page_size: int, ops: list[tuple[int, str, int]]) -> None:
    svc = _service(page_size)
    engine = svc.engine("m")
    sessions = [svc.open_session(10.0), svc.open_session(10.0)]
    held: list[list[int]] = [[], []]
    next_token = 1
    for who, what, amount in ops:
        session, mine = sessions[who], held[who]
        if what == "alloc":
            if engine.allocator.available_size() + engine.cache.evictable_size() < amount + 8:
                continue
            mine += engine.alloc(session, amount)[0].tolist()
        elif what == "free" and mine:
            gone, held[who] = mine[:amount], mine[amount:]
            engine.free(session, np.array(gone, dtype=np.int64))
        elif what == "insert" and len(mine) >= page_size:
            n = min(amount, len(mine)) // page_size * page_size
            taken, held[who] = mine[:n], mine[n:]
            key = RadixKey(list(range(next_token, next_token + n)))
            next_token += n
            engine.insert(key, np.array(taken, dtype=np.int64), session)
        svc.check_integrity()
    before = np.flatnonzero(engine._owner == sessions[0].tag)
    assert sorted(before.tolist()) == sorted(held[0])
    free_before = engine.allocator.available_size()
    _, freed = svc.close_session(sessions[0])
    assert freed == len(held[0])
    assert not (engine._owner == sessions[0].tag).any()
    assert sessions[0].tag not in engine._alloc_runs
    assert engine.allocator.available_size() >= free_before  # pages came back (or will)
    svc.check_integrity()


def test_what_is_followed_stays_bounded() -> None:
    """Slots handed on (here to the tree) end the record; past MAX_TRACKED_RUNS runs a
    session is no longer followed, and its close scans the pool instead."""
    svc = _service(1, PoolConfig(size=4 * MAX_TRACKED_RUNS, k_heads=1, k_head_dim=2))
    engine = svc.engine("m")
    session, other = svc.open_session(10.0), svc.open_session(10.0)
    slots, _ = engine.alloc(session, 8)
    assert engine._alloc_runs[session.tag] is not None
    engine.insert(RadixKey(list(range(1, 9))), slots, session)
    assert session.tag not in engine._alloc_runs  # it holds nothing: nothing to follow

    for _ in range(MAX_TRACKED_RUNS + 1):  # interleaved: every allocation its own run
        engine.alloc(session, 1)
        engine.alloc(other, 1)
    assert engine._alloc_runs[session.tag] is None
    _, freed = svc.close_session(session)
    assert freed == MAX_TRACKED_RUNS + 1
    svc.check_integrity()
    assert not (engine._owner == session.tag).any()
