"""The allocator's run-based fast paths against plain models of the same semantics.

``free_parts`` must check, raise and free exactly as ``free`` of the joined parts; the
free list's span merge must hand out pages in the order a sorted (or free-order) merge
of the released pages gives; a run that wraps around int64 must still be refused.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.cache import (
    CacheError,
    DoubleFreeError,
    RadixCache,
    RadixKey,
    SlotIndexError,
    TokenToKVPoolAllocator,
)

CONFIGS = st.sampled_from([(1, True), (4, True), (16, True), (4, False), (16, False)])


def _state(alloc: TokenToKVPoolAllocator) -> tuple[int, int, list[bool]]:
    rows = np.arange(alloc.num_rows)
    return alloc.available_size(), alloc.num_allocated(), alloc.is_allocated(rows).tolist()


def _drain(alloc: TokenToKVPoolAllocator) -> list[int]:
    """Every slot the allocator can still hand out, in the order it hands them out."""
    out = alloc.alloc(alloc.available_size())
    return [] if out is None else out.tolist()


def _error(fn: object, *args: object) -> type[Exception] | None:
    try:
        fn(*args)  # type: ignore[operator]
    except CacheError as exc:
        return type(exc)
    return None


@st.composite
def _scenario(draw: st.DrawFn) -> tuple[int, bool, list[tuple[bool, int]], list[list[int]]]:
    page, need_sort = draw(CONFIGS)
    steps = draw(st.lists(st.tuples(st.booleans(), st.integers(1, 3 * page + 5)), max_size=25))
    # Parts built later from held slots: (held block, start, length, shuffle) or a raw slot.
    part = st.one_of(
        st.tuples(st.integers(0, 50), st.integers(0, 60), st.integers(1, 60), st.booleans()),
        st.integers(-3, 200 + 2 * page),
    )
    parts = draw(st.lists(st.lists(part, min_size=1, max_size=3), min_size=1, max_size=4))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))

    def build(held: list[list[int]]) -> list[list[int]]:
        out = []
        for spec in parts:
            slots: list[int] = []
            for item in spec:
                if isinstance(item, int) or not held:
                    slots.append(item if isinstance(item, int) else 1)
                    continue
                block = held[item[0] % len(held)]
                chunk = block[item[1] % len(block) :][: item[2]]
                slots += rng.permutation(chunk).tolist() if item[3] else chunk
            out.append(slots)
        return out

    return page, need_sort, steps, build  # type: ignore[return-value]


@settings(max_examples=150, deadline=None)
@given(_scenario())
def test_free_parts_is_free_of_the_joined_parts(scenario: tuple) -> None:
    page, need_sort, steps, build = scenario
    a, b = (TokenToKVPoolAllocator(200, "cpu", page, need_sort) for _ in range(2))
    held: list[list[int]] = []
    for take, n in steps:
        if take or not held:
            got_a, got_b = a.alloc(n), b.alloc(n)
            assert (got_a is None) == (got_b is None)
            if got_a is not None:
                held.append(got_a.tolist())
        else:
            block = held.pop(n % len(held))
            a.free(block)
            b.free(block)
    parts = build(held)
    want = _error(b.free, torch.tensor([s for p in parts for s in p], dtype=torch.int64))
    got = _error(a.free_parts, [torch.tensor(p, dtype=torch.int64) for p in parts])
    assert got is want
    assert _state(a) == _state(b)
    assert _drain(a) == _drain(b)


class _ReferencePool:
    """Plain-Python free list: pages handed out front first; a page freed once all its
    handed-out slots are; released pages join at the next shortfall, sorted (need_sort)
    or in the order the frees emptied them (each free ordered by first slot given)."""

    def __init__(self, size: int, page: int, need_sort: bool) -> None:
        self.page, self.need_sort = page, need_sort
        self.free_pages = list(range(1, size // page + 1))
        self.released: list[int] = []
        self.handed: dict[int, set[int]] = {}  # page -> its live slots

    def alloc(self, n: int) -> list[int] | None:
        num = -(-n // self.page)
        if num > len(self.free_pages):
            if num > len(self.free_pages) + len(self.released):
                return None
            merged = self.free_pages + self.released
            self.free_pages, self.released = sorted(merged) if self.need_sort else merged, []
        pages, self.free_pages = self.free_pages[:num], self.free_pages[num:]
        slots = [p * self.page + k for p in pages for k in range(self.page)][:n]
        for s in slots:
            self.handed.setdefault(s // self.page, set()).add(s)
        return slots

    def free(self, slots: list[int]) -> None:
        for s in slots:
            self.handed[s // self.page].discard(s)
        for s in slots:
            p = s // self.page
            if p in self.handed and not self.handed[p]:
                del self.handed[p]
                self.released.append(p)


@settings(max_examples=120, deadline=None)
@given(CONFIGS, st.lists(st.tuples(st.booleans(), st.integers(1, 60), st.booleans()), max_size=40))
def test_pages_come_back_in_reference_order(
    config: tuple[int, bool], steps: list[tuple[bool, int, bool]]
) -> None:
    page, need_sort = config
    alloc, ref = (
        TokenToKVPoolAllocator(256, "cpu", page, need_sort),
        _ReferencePool(256, page, need_sort),
    )
    held: list[list[int]] = []
    for take, n, split in steps:
        if take or not held:
            want = ref.alloc(n)
            got = alloc.alloc(n)
            assert (None if got is None else got.tolist()) == want
            if want:
                held.append(want)
        else:
            block = held.pop(n % len(held))
            if split and len(block) > 1:  # two frees: pages may empty only at the second
                cut = n % (len(block) - 1) + 1
                block, rest = (block[:cut], block[cut:]) if n % 2 else (block[cut:], block[:cut])
                held.append(rest)
            alloc.free(torch.tensor(block[::-1] if n % 3 == 0 else block))
            ref.free(block[::-1] if n % 3 == 0 else block)
        assert alloc.available_size() == (len(ref.free_pages) + len(ref.released)) * page


def test_released_spans_merge_sorted() -> None:
    """Spans released high then low come back lowest first."""
    alloc = TokenToKVPoolAllocator(32, "cpu", 4)
    blocks = [alloc.alloc(8) for _ in range(4)]  # pages 1-2, 3-4, 5-6, 7-8: the pool
    alloc.free(blocks[2])
    alloc.free(blocks[0])
    out = alloc.alloc(12)
    assert out is not None and out.tolist() == [*range(4, 12), *range(20, 24)]


@pytest.mark.parametrize("bad", [[4, 4, 6, 7], [4, 6, 6, 7], [7, 5, 6, 4, 4]])
def test_ends_one_run_apart_but_not_a_run(bad: list[int]) -> None:
    """Ends n - 1 apart prove nothing without the ascending check: a repeat is refused."""
    alloc = TokenToKVPoolAllocator(32, "cpu", 4)
    alloc.alloc(12)
    before = _state(alloc)
    with pytest.raises(DoubleFreeError):
        alloc.free(torch.tensor(bad))
    with pytest.raises(DoubleFreeError):
        alloc.free_parts([torch.tensor([8, 9]), torch.tensor(bad)])
    assert _state(alloc) == before


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("bad", [[2**63 - 1, -(2**63)], [2**63 - 2, 2**63 - 1, -(2**63)]])
def test_a_run_wrapping_around_int64_is_refused(page: int, bad: list[int]) -> None:
    """Slots that differ by 1 across the int64 wrap are not one run: a run built from
    them would pass the range check, and the free be accepted without freeing
    anything."""
    alloc = TokenToKVPoolAllocator(64, "cpu", page)
    alloc.alloc(5)
    before = _state(alloc)
    with pytest.raises(SlotIndexError):
        alloc.free(np.array(bad, dtype=np.int64))
    with pytest.raises(SlotIndexError):
        alloc.free_parts([np.array(bad, dtype=np.int64), np.array([page], dtype=np.int64)])
    assert _state(alloc) == before


def test_paged_evict_of_several_leaves_with_one_refused() -> None:
    """The multi-node free (free_parts) refuses as a whole, then the retry frees the rest."""
    alloc = TokenToKVPoolAllocator(64, "cpu", 4)
    cache = RadixCache(4, None, alloc)
    values = []
    for first in (10, 20, 30):
        value = alloc.alloc(8)
        assert value is not None
        cache.insert(RadixKey(list(range(first, first + 8))), value)
        values.append(value)
    alloc.free(values[1][4:])  # behind the tree's back
    with pytest.raises(DoubleFreeError):
        cache.evict(24)
    assert alloc.num_allocated() == 4 and alloc.is_allocated(values[1][:4]).all()
    cache.check_integrity()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(1, 90)), min_size=1, max_size=60))
def test_paged_tree_on_a_plain_allocator_conserves_slots(reqs: list[tuple[int, int]]) -> None:
    """Evictions of many leaves at once go through free_parts; no slot leaks or repeats."""
    alloc = TokenToKVPoolAllocator(160, "cpu", 4)
    cache = RadixCache(4, None, alloc)
    for prefix, n in reqs:
        key = RadixKey([prefix] * 8 + list(range(1000 * prefix, 1000 * prefix + n)))
        m = cache.match_prefix(key)
        cache.inc_lock_ref(m.last_node)
        need = len(key) - m.prefix_len
        if need > alloc.available_size():
            cache.evict(need - alloc.available_size())
        new = alloc.alloc(need)
        if new is not None:
            found = cache.insert(key, torch.cat((m.indices, new))).prefix_len
            aligned = len(key) // 4 * 4
            # The caller keeps (and frees) what the tree did not take: the part already
            # cached and the unaligned tail.
            alloc.free(torch.cat((new[: found - m.prefix_len], new[aligned - m.prefix_len :])))
        cache.dec_lock_ref(m.last_node)
        cache.check_integrity()
        assert alloc.num_allocated() == cache.total_size()
