"""Tests for the token-slot allocators: exact slot values, validation and stateful models."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from prefixcache.cache import SWATokenToKVPoolAllocator, TokenToKVPoolAllocator
from prefixcache.cache.errors import DoubleFreeError, InvalidInputError, SlotIndexError


def snapshot(alloc: TokenToKVPoolAllocator) -> tuple[int, int, list[bool]]:
    """Observable state: available size, allocated count and the per-row flags."""
    rows = torch.arange(alloc.size + alloc.page_size)
    return alloc.available_size(), alloc.num_allocated(), alloc.is_allocated(rows).tolist()




def test_alloc_returns_lowest_slots_from_one() -> None:
    """size=8 ps=1: alloc(3) hands out [1, 2, 3]; slot 0 is never handed out."""
    a = TokenToKVPoolAllocator(8)
    out = a.alloc(3)
    assert out is not None
    assert out.dtype == torch.int64 and out.device.type == "cpu"
    assert out.tolist() == [1, 2, 3]
    assert a.available_size() == 5 and a.num_allocated() == 3


def test_alloc_whole_pool_then_none() -> None:
    """All usable slots 1..size can be handed out; one more returns None, unchanged."""
    a = TokenToKVPoolAllocator(8)
    out = a.alloc(8)
    assert out is not None and out.tolist() == list(range(1, 9))
    before = snapshot(a)
    assert a.alloc(1) is None
    assert snapshot(a) == before


def test_alloc_too_many_returns_none_and_keeps_state() -> None:
    """A request larger than what is available returns None and changes nothing."""
    a = TokenToKVPoolAllocator(8)
    a.alloc(5)
    before = snapshot(a)
    assert a.alloc(4) is None
    assert snapshot(a) == before


def test_alloc_zero_returns_empty_int64() -> None:
    """alloc(0) returns an empty int64 tensor and allocates nothing."""
    a = TokenToKVPoolAllocator(8)
    out = a.alloc(0)
    assert out is not None and out.numel() == 0 and out.dtype == torch.int64
    assert a.available_size() == 8


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_alloc_rejects_bad_sizes(bad: object) -> None:
    """alloc rejects negative or non-int sizes with InvalidInputError."""
    a = TokenToKVPoolAllocator(8)
    with pytest.raises(InvalidInputError):
        a.alloc(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("size", "page_size"), [(0, 1), (3, 4), (8, 0), (-5, 1)])
def test_constructor_rejects_pools_without_a_page(size: int, page_size: int) -> None:
    """A pool must have page_size >= 1 and at least one usable page."""
    with pytest.raises(InvalidInputError):
        TokenToKVPoolAllocator(size, page_size=page_size)


def test_freed_slots_are_not_reused_until_needed() -> None:
    """Freed slots wait in the release list; fresh slots are handed out first."""
    a = TokenToKVPoolAllocator(8)
    first = a.alloc(3)
    assert first is not None
    a.free(first)
    assert a.available_size() == 8
    second = a.alloc(3)
    assert second is not None and second.tolist() == [4, 5, 6]


def test_release_merge_is_sorted() -> None:
    """With need_sort, merged free slots come back in ascending order."""
    a = TokenToKVPoolAllocator(8)
    a.alloc(8)
    a.free(torch.tensor([7, 2]))
    a.free(torch.tensor([5]))
    out = a.alloc(3)
    assert out is not None and out.tolist() == [2, 5, 7]


def test_release_merge_unsorted_keeps_free_order() -> None:
    """Without need_sort, merged slots keep the order they were freed in."""
    a = TokenToKVPoolAllocator(8, need_sort=False)
    a.alloc(8)
    a.free(torch.tensor([7, 2]))
    a.free(torch.tensor([5]))
    out = a.alloc(3)
    assert out is not None and out.tolist() == [7, 2, 5]


def test_unsorted_free_list_spanning_a_gap() -> None:
    """Without need_sort, pages [3, 7, 5] are handed out as such, never as the run 3..5."""
    a = TokenToKVPoolAllocator(8, need_sort=False)
    a.alloc(8)
    for slot in (3, 7, 5):
        a.free([slot])
    out = a.alloc(3)
    assert out is not None and out.tolist() == [3, 7, 5]
    assert a.is_allocated([4, 6]).tolist() == [True, True]
    assert a.num_allocated() == 8


def test_free_accepts_lists_other_int_dtypes_and_2d() -> None:
    """free takes a list, an int32 tensor or a 2-D tensor, flattening them."""
    a = TokenToKVPoolAllocator(16)
    a.alloc(8)
    a.free([1, 2])
    a.free(torch.tensor([3, 4], dtype=torch.int32))
    a.free(torch.tensor([[5, 6], [7, 8]]))
    assert a.num_allocated() == 0 and a.available_size() == 16


def test_free_empty_is_noop() -> None:
    """Freeing an empty tensor or list changes nothing."""
    a = TokenToKVPoolAllocator(8)
    a.alloc(2)
    before = snapshot(a)
    a.free(torch.tensor([], dtype=torch.int64))
    a.free([])
    assert snapshot(a) == before


@pytest.mark.parametrize("bad", [torch.tensor([1.0]), torch.tensor([True]), ["a"]])
def test_free_rejects_non_integer_indices(bad: object) -> None:
    """Float, bool or non-numeric indices raise InvalidInputError."""
    a = TokenToKVPoolAllocator(8)
    a.alloc(2)
    with pytest.raises(InvalidInputError):
        a.free(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, 9, -1, 100])
def test_free_out_of_range_raises_and_changes_nothing(bad: int) -> None:
    """Slot 0, negative or past-the-end slots raise SlotIndexError with state untouched."""
    a = TokenToKVPoolAllocator(8)
    a.alloc(4)
    before = snapshot(a)
    with pytest.raises(SlotIndexError):
        a.free(torch.tensor([1, bad]))
    assert snapshot(a) == before


def test_double_free_raises_and_changes_nothing() -> None:
    """Freeing a slot twice raises DoubleFreeError and leaves the state as it was."""
    a = TokenToKVPoolAllocator(8)
    a.alloc(4)
    a.free(torch.tensor([2]))
    before = snapshot(a)
    with pytest.raises(DoubleFreeError):
        a.free(torch.tensor([1, 2]))
    assert snapshot(a) == before
    assert a.is_allocated([1, 2]).tolist() == [True, False]


def test_free_never_allocated_slot_raises() -> None:
    """Freeing an in-range slot that was never handed out raises DoubleFreeError."""
    a = TokenToKVPoolAllocator(8)
    a.alloc(2)
    with pytest.raises(DoubleFreeError):
        a.free([5])


@pytest.mark.parametrize("order", [[3, 1, 3], [1, 1], [2, 3, 1, 2]])
def test_repeat_within_one_free_raises(order: list[int]) -> None:
    """The same slot twice in one call raises DoubleFreeError, nothing freed."""
    a = TokenToKVPoolAllocator(8)
    a.alloc(4)
    before = snapshot(a)
    with pytest.raises(DoubleFreeError):
        a.free(torch.tensor(order))
    assert snapshot(a) == before


def test_clear_frees_everything() -> None:
    """clear() returns every slot and resets the free list order."""
    a = TokenToKVPoolAllocator(8)
    a.alloc(5)
    a.free_group_begin()
    a.clear()
    assert a.available_size() == 8 and a.num_allocated() == 0
    out = a.alloc(2)
    assert out is not None and out.tolist() == [1, 2]
    with pytest.raises(InvalidInputError):
        a.free_group_end()  # clear() also closed the group


def test_is_allocated_range() -> None:
    """is_allocated answers for rows 0..size+page_size-1 and rejects anything else."""
    a = TokenToKVPoolAllocator(8)
    a.alloc(2)
    assert a.is_allocated(torch.tensor([0, 1, 2, 3, 8])).tolist() == [
        False,
        True,
        True,
        False,
        False,
    ]
    with pytest.raises(SlotIndexError):
        a.is_allocated([9])
    with pytest.raises(SlotIndexError):
        a.is_allocated([-1])


def test_returned_tensor_is_private_copy() -> None:
    """Mutating a returned or freed tensor afterwards does not corrupt the allocator."""
    a = TokenToKVPoolAllocator(8)
    out = a.alloc(3)
    assert out is not None
    a.free(out)
    out.fill_(1)
    merged = a.alloc(8)
    assert merged is not None and sorted(merged.tolist()) == list(range(1, 9))




def test_free_group_defers_pages_until_end() -> None:
    """Frees inside a group mark slots free at once but add capacity only at the end."""
    a = TokenToKVPoolAllocator(8)
    a.alloc(6)
    a.free_group_begin()
    a.free([1, 2])
    a.free([5])
    assert a.is_allocated([1, 2, 5]).tolist() == [False, False, False]
    assert a.num_allocated() == 3 and a.available_size() == 2
    a.free_group_end()
    assert a.available_size() == 5


def test_free_group_catches_double_free_across_calls() -> None:
    """A slot freed earlier in the same group cannot be freed again."""
    a = TokenToKVPoolAllocator(8)
    a.alloc(4)
    a.free_group_begin()
    a.free([2])
    with pytest.raises(DoubleFreeError):
        a.free([2, 3])
    assert a.is_allocated([3]).tolist() == [True]
    a.free_group_end()
    assert a.available_size() == 5


def test_free_group_nests_and_end_without_begin_raises() -> None:
    """Nested groups release at the outermost end; an unmatched end raises."""
    a = TokenToKVPoolAllocator(8)
    a.alloc(4)
    a.free_group_begin()
    a.free_group_begin()
    a.free([1])
    a.free_group_end()
    assert a.available_size() == 4
    a.free_group_end()
    assert a.available_size() == 5
    with pytest.raises(InvalidInputError):
        a.free_group_end()




def test_paged_alloc_takes_whole_pages() -> None:
    """size=64 ps=16: pages 1..4; alloc(20) returns slots 16..35 and uses 2 pages."""
    a = TokenToKVPoolAllocator(64, page_size=16)
    assert a.available_size() == 64
    out = a.alloc(20)
    assert out is not None and out.tolist() == list(range(16, 36))
    assert a.available_size() == 32 and a.num_allocated() == 20
    # The tail of page 2 (slots 36..47) is reserved, not handed out.
    assert a.is_allocated(torch.arange(36, 48)).any().item() is False
    nxt = a.alloc(1)
    assert nxt is not None and nxt.tolist() == [48]


def test_paged_pool_size_not_multiple_of_page() -> None:
    """size=70 ps=16 has 4 pages; the highest usable slot is 79 < size + page_size."""
    a = TokenToKVPoolAllocator(70, page_size=16)
    assert a.available_size() == 64
    out = a.alloc(64)
    assert out is not None and out.tolist() == list(range(16, 80))
    assert int(out.max()) < 70 + 16
    assert a.alloc(1) is None


def test_partial_page_free_keeps_page() -> None:
    """Freeing some slots of a page keeps it in use until its last live slot is freed."""
    a = TokenToKVPoolAllocator(64, page_size=16)
    a.alloc(20)  # pages 1 and 2
    a.free(torch.arange(16, 24))
    assert a.available_size() == 32
    assert a.is_allocated(torch.arange(24, 32)).all().item() is True
    a.free(torch.arange(24, 32))
    assert a.available_size() == 48  # page 1 back
    a.free(torch.arange(32, 36))
    assert a.available_size() == 64  # page 2 back, its reserved tail included
    assert a.num_allocated() == 0


def test_partial_page_free_slot_not_handed_out_raises() -> None:
    """A reserved tail slot of a partly handed-out page cannot be freed."""
    a = TokenToKVPoolAllocator(64, page_size=16)
    a.alloc(20)
    before = snapshot(a)
    with pytest.raises(DoubleFreeError):
        a.free([35, 36])
    assert snapshot(a) == before


@pytest.mark.parametrize("bad", [0, 5, 15, 80, 1000])
def test_paged_free_page_zero_or_past_end_raises(bad: int) -> None:
    """Slots in reserved page 0 or past the last page raise SlotIndexError."""
    a = TokenToKVPoolAllocator(64, page_size=16)
    a.alloc(16)
    before = snapshot(a)
    with pytest.raises(SlotIndexError):
        a.free([16, bad])
    assert snapshot(a) == before


def test_paged_free_whole_request_unordered() -> None:
    """Freeing a request's slots in shuffled order returns all its pages."""
    a = TokenToKVPoolAllocator(64, page_size=4)
    out = a.alloc(10)
    assert out is not None
    a.free(out[torch.randperm(10, generator=torch.Generator().manual_seed(0))])
    assert a.available_size() == 64 and a.num_allocated() == 0


def test_paged_release_merge_sorted_pages() -> None:
    """Paged frees are merged back as sorted whole pages."""
    a = TokenToKVPoolAllocator(64, page_size=16)
    a.alloc(64)
    a.free(torch.arange(64, 80))
    a.free(torch.arange(16, 32))
    out = a.alloc(17)
    assert out is not None and out.tolist() == [*range(16, 32), 64]


def test_paged_non_power_of_two_page_size() -> None:
    """Page sizes that are not powers of two map slot s to page s // ps."""
    a = TokenToKVPoolAllocator(30, page_size=3)
    out = a.alloc(7)
    assert out is not None and out.tolist() == list(range(3, 10))
    a.free(torch.tensor([9, 3, 4, 5]))
    assert a.available_size() == 27  # pages 1 (slots 3..5) and 3 (slot 9) are back
    a.free([6, 7, 8])
    assert a.available_size() == 30


def test_large_pool_merge_paths() -> None:
    """Both merge strategies (sort and bucket) return all pages sorted."""
    a = TokenToKVPoolAllocator(16 * 400, page_size=16)
    out = a.alloc(16 * 400)
    assert out is not None
    a.free(out[-16:])  # one page: sorted merge
    again = a.alloc(16)
    assert again is not None and again.tolist() == out[-16:].tolist()
    a.free(torch.cat([out[:-16].flip(0), again]))  # everything: bucket merge
    every = a.alloc(16 * 400)
    assert every is not None and every.tolist() == list(range(16, 16 * 401))




def test_swa_alloc_maps_full_to_swa() -> None:
    """SWA alloc returns full slots and maps each to a distinct SWA slot."""
    a = SWATokenToKVPoolAllocator(16, 8)
    out = a.alloc(3)
    assert out is not None and out.tolist() == [1, 2, 3]
    assert a.translate_loc_from_full_to_swa(out).tolist() == [1, 2, 3]
    assert a.full_to_swa_index_mapping.shape == (17,)
    assert a.available_size() == 5
    assert (a.full_available_size(), a.swa_available_size()) == (13, 5)
    assert a.num_allocated() == 3
    assert a.is_swa_mapped([1, 4]).tolist() == [True, False]


def test_swa_alloc_all_or_nothing_when_swa_short() -> None:
    """If the SWA pool is short, nothing is allocated on either side."""
    a = SWATokenToKVPoolAllocator(16, 4)
    a.alloc(3)
    full_before = snapshot(a.full_attn_allocator)
    swa_before = snapshot(a.swa_attn_allocator)
    assert a.alloc(2) is None
    assert snapshot(a.full_attn_allocator) == full_before
    assert snapshot(a.swa_attn_allocator) == swa_before


def test_swa_alloc_all_or_nothing_when_full_short() -> None:
    """If the full pool is short, nothing is allocated on either side."""
    a = SWATokenToKVPoolAllocator(4, 16)
    a.alloc(3)
    swa_before = snapshot(a.swa_attn_allocator)
    assert a.alloc(2) is None
    assert snapshot(a.swa_attn_allocator) == swa_before
    assert a.alloc(0) is not None


def test_swa_free_releases_both_sides() -> None:
    """free releases the full slots and their SWA slots and clears the mapping."""
    a = SWATokenToKVPoolAllocator(16, 8)
    out = a.alloc(4)
    assert out is not None
    a.free(out[:2])
    assert (a.full_available_size(), a.swa_available_size()) == (14, 6)
    assert a.translate_loc_from_full_to_swa(out).tolist() == [0, 0, 3, 4]


def test_swa_free_swa_then_free() -> None:
    """free_swa releases only window slots; a later free releases just the full slots."""
    a = SWATokenToKVPoolAllocator(16, 8)
    out = a.alloc(4)
    assert out is not None
    a.free_swa(out[:3])
    assert (a.full_available_size(), a.swa_available_size()) == (12, 7)
    assert a.is_swa_mapped(out).tolist() == [False, False, False, True]
    assert a.is_allocated(out).all().item() is True
    a.free(out)
    assert (a.full_available_size(), a.swa_available_size()) == (16, 8)
    assert a.swa_attn_allocator.num_allocated() == 0


def test_swa_free_swa_twice_raises() -> None:
    """free_swa of a full slot whose SWA slot is already freed raises, nothing changes."""
    a = SWATokenToKVPoolAllocator(16, 8)
    out = a.alloc(4)
    assert out is not None
    a.free_swa(out[:1])
    before = (snapshot(a.full_attn_allocator), snapshot(a.swa_attn_allocator))
    with pytest.raises(DoubleFreeError):
        a.free_swa(out[:2])
    assert (snapshot(a.full_attn_allocator), snapshot(a.swa_attn_allocator)) == before
    assert a.is_swa_mapped(out[1:2]).tolist() == [True]


def test_swa_free_swa_unallocated_raises() -> None:
    """free_swa of a full slot that is not allocated raises DoubleFreeError."""
    a = SWATokenToKVPoolAllocator(16, 8)
    a.alloc(2)
    with pytest.raises(DoubleFreeError):
        a.free_swa([5])
    with pytest.raises(SlotIndexError):
        a.free_swa([0])


def test_swa_double_free_raises_and_changes_nothing() -> None:
    """Freeing a full slot twice raises DoubleFreeError before any change on either side."""
    a = SWATokenToKVPoolAllocator(16, 8)
    out = a.alloc(3)
    assert out is not None
    a.free(out[:1])
    before = (snapshot(a.full_attn_allocator), snapshot(a.swa_attn_allocator))
    mapping = a.full_to_swa_index_mapping.clone()
    with pytest.raises(DoubleFreeError):
        a.free(out)
    assert (snapshot(a.full_attn_allocator), snapshot(a.swa_attn_allocator)) == before
    assert torch.equal(a.full_to_swa_index_mapping, mapping)


def test_swa_paged_and_groups_and_clear() -> None:
    """Paged SWA pools allocate pages on both sides; groups and clear reach both."""
    a = SWATokenToKVPoolAllocator(64, 32, page_size=16)
    out = a.alloc(20)
    assert out is not None and out.tolist() == list(range(16, 36))
    assert a.translate_loc_from_full_to_swa(out).tolist() == list(range(16, 36))
    assert a.available_size() == 0
    assert a.alloc(1) is None
    a.free_group_begin()
    a.free(out)
    assert a.available_size() == 0
    a.free_group_end()
    assert (a.full_available_size(), a.swa_available_size()) == (64, 32)
    with pytest.raises(InvalidInputError):
        a.free_group_end()
    a.alloc(5)
    a.clear()
    assert a.num_allocated() == 0 and a.available_size() == 32
    assert int(a.full_to_swa_index_mapping.abs().sum()) == 0


def test_swa_translate_out_of_range_raises() -> None:
    """translate_loc_from_full_to_swa rejects rows outside the full buffer."""
    a = SWATokenToKVPoolAllocator(16, 8)
    with pytest.raises(SlotIndexError):
        a.translate_loc_from_full_to_swa([17])
    assert a.translate_loc_from_full_to_swa([]).numel() == 0



PAGE_CONFIGS = [(1, 40), (4, 70), (16, 100)]
STATEFUL = settings(
    max_examples=30,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class _PoolModel:
    """Reference model of one paged pool: allocated slots plus pages held by a group."""

    def __init__(self, size: int, page_size: int) -> None:
        self.size, self.ps = size, page_size
        self.num_pages = size // page_size
        self.allocated: set[int] = set()
        self.page_users: set[int] = set()  # pages handed out and not yet released
        self.group_pending: set[int] = set()
        self.group_depth = 0

    def available(self) -> int:
        return (self.num_pages - len(self.page_users) - len(self.group_pending)) * self.ps

    def can_alloc(self, n: int) -> bool:
        return -(-n // self.ps) * self.ps <= self.available()

    def take(self, slots: list[int]) -> None:
        """Checks a successful allocation's shape against the model and records it."""
        n, ps = len(slots), self.ps
        assert len(set(slots)) == n
        assert not set(slots) & self.allocated
        assert all(ps <= s < (self.num_pages + 1) * ps for s in slots)
        pages = [s // ps for s in slots[::ps]]
        assert not set(pages) & (self.page_users | self.group_pending)
        # Each page contributes its first slots, in order: page*ps + 0, 1, ...
        expect = [p * ps + k for p in pages for k in range(ps)][:n]
        assert slots == expect
        self.allocated |= set(slots)
        self.page_users |= set(pages)

    def release(self, slots: list[int]) -> None:
        self.allocated -= set(slots)
        live_pages = {s // self.ps for s in self.allocated}
        emptied = self.page_users - live_pages
        self.page_users -= emptied
        if self.group_depth:
            self.group_pending |= emptied

    def end_group(self) -> None:
        self.group_depth -= 1
        if self.group_depth == 0:
            self.group_pending.clear()

    def expected_error(self, slots: list[int]) -> type[Exception] | None:
        if any(not self.ps <= s < (self.num_pages + 1) * self.ps for s in slots):
            return SlotIndexError
        if len(set(slots)) != len(slots) or not set(slots) <= self.allocated:
            return DoubleFreeError
        return None


def _check_pool(alloc: TokenToKVPoolAllocator, model: _PoolModel) -> None:
    rows = alloc.size + alloc.page_size
    flags = alloc.is_allocated(torch.arange(rows)).tolist()
    assert {i for i, f in enumerate(flags) if f} == model.allocated
    assert not flags[0]
    assert alloc.available_size() == model.available()
    assert alloc.num_allocated() == len(model.allocated)


def _make_allocator_machine(
    page_size: int, size: int, alternate: bool = False
) -> type[RuleBasedStateMachine]:
    class AllocatorMachine(RuleBasedStateMachine):
        """TokenToKVPoolAllocator against a set-of-slots model."""

        def __init__(self) -> None:
            super().__init__()
            self.alloc = TokenToKVPoolAllocator(size, page_size=page_size, need_sort=not alternate)
            # The alternate run covers an unsorted free list.
            self.model = _PoolModel(size, page_size)

        @rule(n=st.integers(0, size // 2))
        def allocate(self, n: int) -> None:
            out = self.alloc.alloc(n)
            if not self.model.can_alloc(n):
                assert out is None
                return
            assert out is not None and out.dtype == torch.int64
            self.model.take(out.tolist())

        @precondition(lambda self: bool(self.model.allocated))
        @rule(data=st.data())
        def free_some(self, data: st.DataObject) -> None:
            pool = sorted(self.model.allocated)
            chosen = data.draw(st.lists(st.sampled_from(pool), min_size=1, unique=True))
            if data.draw(st.booleans()):
                chosen = data.draw(st.permutations(chosen))
            self.alloc.free(torch.tensor(chosen))
            self.model.release(chosen)

        @rule(data=st.data())
        def invalid_free(self, data: st.DataObject) -> None:
            candidates = st.integers(-2, size + 2 * page_size)
            if self.model.allocated:
                candidates = candidates | st.sampled_from(sorted(self.model.allocated))
            chosen = data.draw(st.lists(candidates, min_size=1, max_size=6))
            expected = self.model.expected_error(chosen)
            if expected is None:
                chosen = chosen + chosen[:1]  # force a repeat
                expected = self.model.expected_error(chosen)
            before = snapshot(self.alloc)
            with pytest.raises(expected):
                self.alloc.free(chosen)
            assert snapshot(self.alloc) == before

        @rule()
        def group_begin(self) -> None:
            self.alloc.free_group_begin()
            self.model.group_depth += 1

        @precondition(lambda self: self.model.group_depth > 0)
        @rule()
        def group_end(self) -> None:
            self.alloc.free_group_end()
            self.model.end_group()

        @invariant()
        def matches_model(self) -> None:
            _check_pool(self.alloc, self.model)

    return AllocatorMachine


def _make_swa_machine(page_size: int, size: int) -> type[RuleBasedStateMachine]:
    size_swa = size // 2 + page_size

    class SWAMachine(RuleBasedStateMachine):
        """SWATokenToKVPoolAllocator against two slot-set models and a mapping dict."""

        def __init__(self) -> None:
            super().__init__()
            self.alloc = SWATokenToKVPoolAllocator(size, size_swa, page_size=page_size)
            self.full = _PoolModel(size, page_size)
            self.swa = _PoolModel(size_swa, page_size)
            self.mapping: dict[int, int] = {}

        def _state(self) -> tuple[object, ...]:
            return (
                snapshot(self.alloc.full_attn_allocator),
                snapshot(self.alloc.swa_attn_allocator),
                self.alloc.full_to_swa_index_mapping.tolist(),
            )

        @rule(n=st.integers(0, size // 3))
        def allocate(self, n: int) -> None:
            out = self.alloc.alloc(n)
            if not (self.full.can_alloc(n) and self.swa.can_alloc(n)):
                assert out is None
                return
            assert out is not None
            full = out.tolist()
            swa = self.alloc.translate_loc_from_full_to_swa(out).tolist()
            self.full.take(full)
            self.swa.take(swa)
            self.mapping.update(zip(full, swa, strict=True))

        @precondition(lambda self: bool(self.full.allocated))
        @rule(data=st.data())
        def free_some(self, data: st.DataObject) -> None:
            pool = sorted(self.full.allocated)
            chosen = data.draw(st.lists(st.sampled_from(pool), min_size=1, unique=True))
            self.alloc.free(chosen)
            self.full.release(chosen)
            self.swa.release([self.mapping.pop(s) for s in chosen if s in self.mapping])

        @precondition(lambda self: bool(self.mapping))
        @rule(data=st.data())
        def free_swa_some(self, data: st.DataObject) -> None:
            pool = sorted(self.mapping)
            chosen = data.draw(st.lists(st.sampled_from(pool), min_size=1, unique=True))
            self.alloc.free_swa(torch.tensor(chosen))
            self.swa.release([self.mapping.pop(s) for s in chosen])

        @rule(data=st.data(), swa_only=st.booleans())
        def invalid_free(self, data: st.DataObject, swa_only: bool) -> None:
            candidates = st.integers(-1, size + 2 * page_size)
            chosen = data.draw(st.lists(candidates, min_size=1, max_size=5))
            expected = self.full.expected_error(chosen)
            if swa_only and expected is None and any(s not in self.mapping for s in chosen):
                expected = DoubleFreeError
            if expected is None:
                chosen = chosen + chosen[:1]
                expected = self.full.expected_error(chosen)
            before = self._state()
            with pytest.raises(expected):
                if swa_only:
                    self.alloc.free_swa(chosen)
                else:
                    self.alloc.free(chosen)
            assert self._state() == before

        @rule()
        def group_begin(self) -> None:
            self.alloc.free_group_begin()
            self.full.group_depth += 1
            self.swa.group_depth += 1

        @precondition(lambda self: self.full.group_depth > 0)
        @rule()
        def group_end(self) -> None:
            self.alloc.free_group_end()
            self.full.end_group()
            self.swa.end_group()

        @invariant()
        def matches_model(self) -> None:
            _check_pool(self.alloc.full_attn_allocator, self.full)
            _check_pool(self.alloc.swa_attn_allocator, self.swa)
            expect = [0] * (size + page_size)
            for full, swa in self.mapping.items():
                expect[full] = swa
            assert self.alloc.full_to_swa_index_mapping.tolist() == expect
            assert set(self.mapping.values()) == self.swa.allocated
            assert self.alloc.available_size() == min(self.full.available(), self.swa.available())

    return SWAMachine


for _ps, _size in PAGE_CONFIGS:
    _machine = _make_allocator_machine(_ps, _size)
    _machine.TestCase.settings = STATEFUL
    globals()[f"TestAllocatorStateful_ps{_ps}"] = _machine.TestCase
    _alt = _make_allocator_machine(_ps, _size, alternate=True)
    _alt.TestCase.settings = STATEFUL
    globals()[f"TestAllocatorStatefulUnsorted_ps{_ps}"] = _alt.TestCase
    _swa = _make_swa_machine(_ps, _size)
    _swa.TestCase.settings = STATEFUL
    globals()[f"TestSWAAllocatorStateful_ps{_ps}"] = _swa.TestCase
