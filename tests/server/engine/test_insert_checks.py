"""The insert's slot checks: the one-pass path for slots in a few runs and the
one-check-at-a-time path for scattered slots accept and refuse the same inserts, refuse
with the same errors in the same order, and leave the cache unchanged on a refusal."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.cache import InvalidInputError, RadixKey
from prefixcache.server.config import ModelConfig, PoolConfig
from prefixcache.server.engine.slot_checks import MAX_RUNS, runs_fit, slot_runs
from prefixcache.server.errors import PreconditionError
from prefixcache.server.service import CacheService

POOL = PoolConfig(size=400, k_heads=1, k_head_dim=2)


def service() -> CacheService:
    return CacheService([ModelConfig(name="m", page_size=1, pool=POOL)])


def scattered(svc: CacheService, n: int) -> tuple[object, np.ndarray]:
    """A session holding ``n`` slots in ``n`` runs (another session holds the gaps)."""
    engine = svc.engine("m")
    mine, other = svc.open_session(10.0), svc.open_session(10.0)
    held = []
    for _ in range(n):
        held.append(engine.alloc(mine, 1)[0])
        engine.alloc(other, 1)
    slots = np.concatenate(held)
    assert slot_runs(slots) is None or len(slot_runs(slots)) == n
    return mine, slots


def state(svc: CacheService) -> tuple:
    engine = svc.engine("m")
    return (engine.sizes(), engine.session_slots, engine._owner.copy().tobytes())


@pytest.mark.parametrize("runs", [1, MAX_RUNS - 1, MAX_RUNS, 3 * MAX_RUNS])
def test_accepted_whatever_the_number_of_runs(runs: int) -> None:
    svc = service()
    session, slots = scattered(svc, runs)
    engine = svc.engine("m")
    key = RadixKey(list(range(1, runs + 1)))
    out = engine.insert(key, slots, session)
    assert out.prefix_len == 0 and len(out.freed) == 0
    assert not (engine._owner[slots] != 0).any() and engine.session_slots == runs
    svc.check_integrity()
    # The same tokens again, with the tree's slots: nothing is the session's.
    again = engine.insert(key, engine.cache.peek_prefix(key).numpy(), session)
    assert again.prefix_len == runs
    svc.check_integrity()


@pytest.mark.parametrize("runs", [4, 3 * MAX_RUNS])
@pytest.mark.parametrize(
    ("spoil", "error", "text"),
    [
        ("out_of_range", InvalidInputError, "outside model"),
        ("negative", InvalidInputError, "outside model"),
        ("twice", InvalidInputError, "named twice"),
        ("not_held", PreconditionError, "not held by this session"),
        ("other_session", PreconditionError, "not held by this session"),
        ("range_and_twice", InvalidInputError, "outside model"),
    ],
)
def test_refused_alike_and_nothing_changes(runs: int, spoil: str, error: type, text: str) -> None:
    svc = service()
    session, slots = scattered(svc, runs)
    engine = svc.engine("m")
    # A cached prefix first, so the slots start with the tree's own.
    first = svc.open_session(10.0)
    prefix = engine.match(RadixKey([9, 9, 9]), first, allocate=True).allocated
    engine.insert(RadixKey([9, 9, 9]), prefix, first)
    slots = np.concatenate([prefix, slots]).astype(np.int64)
    tokens = [9, 9, 9, *range(1, runs + 1)]
    free_slot = int(np.flatnonzero(engine._owner == 0)[-1])
    if spoil == "out_of_range":
        slots[-1] = engine.num_rows
    elif spoil == "negative":
        slots[5] = -3
    elif spoil == "twice":
        slots[-1] = slots[-2]
    elif spoil == "not_held":
        slots[4] = free_slot
    elif spoil == "other_session":
        slots[4] = int(np.flatnonzero((engine._owner != 0) & (engine._owner != session.tag))[0])
    elif spoil == "range_and_twice":
        slots[-1], slots[4] = slots[-2], engine.num_rows + 7
    before = state(svc)
    with pytest.raises(error, match=text):
        engine.insert(RadixKey(tokens), slots, session)
    assert state(svc) == before
    svc.check_integrity()


def test_a_slot_that_differs_from_the_trees_is_refused() -> None:
    svc = service()
    engine = svc.engine("m")
    a = svc.open_session(10.0)
    cached = engine.match(RadixKey([1, 2, 3, 4]), a, allocate=True).allocated
    engine.insert(RadixKey([1, 2, 3, 4]), cached, a)
    mine = engine.alloc(a, 2)[0]
    wrong = np.array([cached[0], cached[1], mine[0], cached[3], mine[1]], dtype=np.int64)
    before = state(svc)
    with pytest.raises(PreconditionError, match="not held by this session"):
        engine.insert(RadixKey([1, 2, 3, 4, 5]), wrong, a)
    wrong = np.array([cached[0], cached[2], cached[1], mine[0], mine[1]], dtype=np.int64)
    with pytest.raises(PreconditionError, match="the cache holds that token"):
        engine.insert(RadixKey([1, 2, 3, 4, 5]), wrong, a)
    assert state(svc) == before


def test_runs_helpers() -> None:
    assert slot_runs(np.zeros(0, np.int64)) == []
    assert slot_runs(np.array([5, 6, 7, 2, 3, 9])) == [(5, 8), (2, 4), (9, 10)]
    assert len(slot_runs(np.arange(0, 2 * MAX_RUNS, 2))) == MAX_RUNS
    assert slot_runs(np.arange(0, 2 * MAX_RUNS + 2, 2)) is None
    assert runs_fit([(5, 8), (2, 4)], 1, 9)
    assert not runs_fit([(5, 8), (2, 6)], 1, 9)  # 5 is in both
    assert not runs_fit([(5, 8)], 6, 9) and not runs_fit([(5, 10)], 1, 9)


def _runs_by_loop(slots: list[int]) -> list[tuple[int, int]] | None:
    runs: list[list[int]] = []
    for s in slots:
        if runs and s == runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([s, s + 1])
    return None if len(runs) > MAX_RUNS else [(a, b) for a, b in runs]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(-(2**63), 2**63 - 2000),
            st.integers(1, 50),
            st.sampled_from(["up", "down", "same"]),
        ),
        max_size=40,
    )
)
def test_slot_runs_agrees_with_a_loop(pieces: list[tuple[int, int, str]]) -> None:
    """The one-compare shortcut for a single run finds exactly the runs a loop finds,
    for ascending, descending and repeated slots, near the int64 ends too."""
    slots: list[int] = []
    for start, length, shape in pieces:
        run = list(range(start, start + length))
        slots += run[::-1] if shape == "down" else [start] * length if shape == "same" else run
    assert slot_runs(np.array(slots, dtype=np.int64)) == _runs_by_loop(slots)
