"""Tests for the token-slot allocators: exact slot values and validation."""

from __future__ import annotations

import pytest
import torch

from prefixcache.cache import TokenToKVPoolAllocator
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


@pytest.mark.parametrize("page_size", [1, 4])
def test_ready_size_is_what_parts_take_as_one(page_size: int) -> None:
    """Within ready_size, allocations in parts take the slots one allocation would; past
    it a part merges the freed pages in and the order changes (Step relies on this)."""

    def run(sizes: list[int]) -> list[int]:
        a = TokenToKVPoolAllocator(12 * page_size, page_size=page_size)
        held = a.alloc(10 * page_size)
        assert held is not None
        a.free(held[: 2 * page_size])
        assert a.ready_size() == 2 * page_size and a.available_size() == 4 * page_size
        return [s for n in sizes for s in a.alloc(n).tolist()]  # type: ignore[union-attr]

    ready = 2 * page_size
    assert run([ready]) == run([page_size, page_size])
    assert run([ready + page_size]) != run([page_size, page_size, page_size])


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
