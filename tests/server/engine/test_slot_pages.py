"""Slot checks per page: where a session's slots are whole pages or runs, the
ownership checks count pages per run or per page instead of sorting every slot. These
compare that fast path with the per-slot one on random slot sets (runs, whole pages in
any order, scattered slots, repeats, foreign slots, out of range): the same answers,
the same refusals, the same page counts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.cache import InvalidInputError, RadixKey
from prefixcache.server.config import ModelConfig, PoolConfig
from prefixcache.server.engine.slot_checks import check_distinct, page_blocks, slot_runs
from prefixcache.server.errors import PreconditionError
from prefixcache.server.service import CacheService

PAGE_SIZES = st.sampled_from([2, 3, 4, 16])


def _by_sort(slots: np.ndarray, ps: int) -> dict[int, int]:
    pages, counts = np.unique(slots // ps, return_counts=True)
    return dict(zip(pages.tolist(), counts.tolist(), strict=True))


@st.composite
def slot_sets(draw: st.DrawFn) -> tuple[np.ndarray, int, bool]:
    """Slots from pieces (whole pages, partial runs, single slots, repeats, descending
    runs), with whether they are whole-page blocks on distinct pages (the fast shape)."""
    ps = draw(PAGE_SIZES)
    pages = draw(st.lists(st.integers(0, 60), min_size=1, max_size=12))
    out: list[int] = []
    fast_shape = len(set(pages)) == len(pages)
    for i, page in enumerate(pages):
        shape = draw(st.sampled_from(["whole", "head", "tail", "one", "repeat", "down"]))
        base = list(range(page * ps, (page + 1) * ps))
        if shape == "whole":
            piece = base
        elif shape == "head":
            piece = base[: draw(st.integers(1, ps))]
        elif shape == "tail":
            piece = base[draw(st.integers(0, ps - 1)) :]
        elif shape == "one":
            piece = [draw(st.sampled_from(base))]
        elif shape == "repeat":
            piece = [base[0], base[0]]
        else:
            piece = base[::-1]
        # Only a page's first and last piece of a whole allocation may be partial.
        if (
            shape in ("repeat", "down")
            or (shape in ("head", "one") and i < len(pages) - 1)
            or (shape in ("tail", "one") and i > 0)
        ):
            fast_shape = False
        out += piece
    return np.array(out, dtype=np.int64), ps, fast_shape


@settings(max_examples=400, deadline=None)
@given(slot_sets())
def test_page_blocks_agree_with_a_sort(case: tuple[np.ndarray, int, bool]) -> None:
    slots, ps, fast_shape = case
    blocks = page_blocks(slots, ps)
    if fast_shape:  # whole pages in any order: the fast path must take them
        assert blocks is not None
    if blocks is None:
        return
    pages, counts = blocks
    assert len(set(slots.tolist())) == len(slots), "a repeat passed as distinct"
    assert len(set(pages.tolist())) == len(pages)
    assert dict(zip(pages.tolist(), counts.tolist(), strict=True)) == _by_sort(slots, ps)


@settings(max_examples=300, deadline=None)
@given(slot_sets())
def test_check_distinct_per_page_refuses_alike(case: tuple[np.ndarray, int, bool]) -> None:
    slots, ps, _ = case

    def outcome(page_size: int) -> str:
        try:
            check_distinct(slots, page_size)
        except InvalidInputError as e:
            return str(e)
        return "ok"

    assert outcome(ps) == outcome(1)


# ------------------------------------------------------------------ on an engine

POOL = PoolConfig(size=256, k_heads=1, k_head_dim=2)


def _engine(ps: int, sizes: list[int], drop: list[bool]):
    """A session A holding slots on many runs of pages (B's allocations between, some of
    both freed again, so the free list is fragmented), and B."""
    svc = CacheService([ModelConfig(name="m", page_size=ps, pool=POOL)])
    engine = svc.engine("m")
    a, b = svc.open_session(10.0), svc.open_session(10.0)
    for size, gone in zip(sizes, drop, strict=False):
        mine = engine.alloc(a, size)[0]
        theirs = engine.alloc(b, size)[0]
        if gone:
            engine.free(b, theirs)
        elif size > 1:
            engine.free(a, mine[: size // 2])
    return svc, engine, a, b


@st.composite
def engine_cases(draw: st.DrawFn):
    ps = draw(st.sampled_from([2, 4, 16]))
    sizes = draw(st.lists(st.integers(1, 12), min_size=1, max_size=6))
    drop = draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes)))
    arrange = draw(st.sampled_from(["as_held", "pages_shuffled", "scattered", "runs"]))
    spoil = draw(st.sampled_from(["none", "none", "repeat", "foreign", "free", "range", "zero"]))
    seed = draw(st.integers(0, 2**32 - 1))
    return ps, sizes, drop, arrange, spoil, seed


def _pick(engine, a, b, arrange: str, spoil: str, rng: np.random.Generator) -> np.ndarray:
    ps = engine.page_size
    held = np.flatnonzero(engine._owner == a.tag)
    if arrange == "pages_shuffled":
        pages = np.unique(held // ps)
        rng.shuffle(pages)
        slots = np.concatenate([held[held // ps == p] for p in pages])
    elif arrange == "scattered":
        slots = rng.permutation(held)[: max(1, len(held) * 2 // 3)]
    elif arrange == "runs":
        cut = sorted(rng.integers(0, len(held) + 1, size=2).tolist())
        slots = held[cut[0] : cut[1]] if cut[1] > cut[0] else held[:1]
    else:
        slots = held
    slots = slots.astype(np.int64).copy()
    spot = int(rng.integers(0, len(slots)))
    if spoil == "repeat" and len(slots) > 1:
        slots[spot] = slots[(spot + 1) % len(slots)]
    elif spoil == "foreign" and (engine._owner == b.tag).any():
        slots[spot] = int(rng.choice(np.flatnonzero(engine._owner == b.tag)))
    elif spoil == "free":
        slots[spot] = int(np.flatnonzero(engine._owner == 0)[-1])
    elif spoil == "range":
        slots[spot] = engine.num_rows + int(rng.integers(0, 5))
    elif spoil == "zero":
        slots[spot] = 0
    return slots


def _per_slot_refusal(engine, tag: int, checked: np.ndarray, owned: np.ndarray) -> type | None:
    """What the per-slot rules refuse: range over ``checked``, then ownership and
    repeats over ``owned``."""
    if len(checked) and (checked.min() < 1 or checked.max() >= engine.num_rows):
        return InvalidInputError
    if not (engine._owner[owned] == tag).all():
        return PreconditionError
    if len(set(owned.tolist())) != len(owned):
        return InvalidInputError
    return None


def _snapshot(engine, a) -> tuple:
    return (
        engine._owner.tobytes(),
        engine._page_held.tobytes(),
        dict(a.pages),
        dict(a.slots),
        engine.session_slots,
        engine.sizes(),
    )


@settings(max_examples=150, deadline=None)
@given(engine_cases(), st.sampled_from(["free", "insert"]))
def test_engine_refuses_and_counts_as_the_per_slot_path(case, op: str) -> None:
    ps, sizes, drop, arrange, spoil, seed = case
    svc, engine, a, b = _engine(ps, sizes, drop)
    slots = _pick(engine, a, b, arrange, spoil, np.random.default_rng(seed))
    if op == "free":
        expected = _per_slot_refusal(engine, a.tag, slots, slots)
    else:  # an insert checks the range of all, ownership and repeats of the aligned head
        head = slots[: len(slots) - len(slots) % ps]
        expected = _per_slot_refusal(engine, a.tag, slots, head)
    before = _snapshot(engine, a)
    tag = a.tag
    reference = engine._page_held.copy()
    # What the per-slot path leaves: one less held slot per slot that leaves A.
    leaving = slots if op == "free" else slots[: len(slots) - len(slots) % ps]
    if expected is None:
        np.subtract.at(reference, leaving // ps, 1)
    key = RadixKey(list(range(1, len(slots) + 1)))
    if expected is not None:
        with pytest.raises(expected):
            engine.free(a, slots) if op == "free" else engine.insert(key, slots, a)
        assert _snapshot(engine, a) == before
    else:
        if op == "free":
            engine.free(a, slots)
        else:
            engine.insert(key, slots, a)
        assert np.array_equal(engine._page_held, reference)
        still = np.flatnonzero(engine._owner == tag)
        assert a.pages.get("m", 0) == len(np.unique(still // ps))
    svc.check_integrity()  # page counts against the owner array, slot by slot


@settings(max_examples=150, deadline=None)
@given(engine_cases(), st.sampled_from([1, -1]))
def test_page_counts_per_run_equal_per_slot(case, sign: int) -> None:
    """``_count_pages`` given the runs (a slice per run), given none (per page), and
    ``np.unique`` over every slot leave the same counts and the same session charge."""
    ps, sizes, drop, arrange, _, seed = case
    _svc, engine, a, b = _engine(ps, sizes, drop)
    slots = _pick(engine, a, b, arrange, "none", np.random.default_rng(seed))
    runs = slot_runs(slots)
    start = (engine._page_held.copy(), dict(a.pages))
    results = []
    for given_runs in (runs, None, "sort"):
        engine._page_held[:] = start[0]
        a.pages.clear()
        a.pages.update(start[1])
        if given_runs == "sort":  # the per-slot reference
            pages, counts = np.unique(slots // ps, return_counts=True)
            before = engine._page_held[pages].copy()
            engine._page_held[pages] += sign * counts.astype(engine._page_held.dtype)
            change = int(np.count_nonzero(engine._page_held[pages])) - int(np.count_nonzero(before))
            charge = a.pages.get("m", 0) + change
        else:
            engine._count_pages(a, slots, sign, given_runs)
            charge = a.pages.get("m", 0)
        results.append((engine._page_held.tobytes(), charge))
    assert results[0] == results[2] and results[1] == results[2]
