"""SWATokenToKVPoolAllocator: paired full and window slots, free_swa, all-or-nothing."""

from __future__ import annotations

import pytest
import torch

from prefixcache.cache import SWATokenToKVPoolAllocator
from prefixcache.cache.errors import DoubleFreeError, InvalidInputError, SlotIndexError


def snapshot(alloc: SWATokenToKVPoolAllocator) -> tuple[int, int, list[bool]]:
    """Observable state: available size, allocated count and the per-row flags."""
    rows = torch.arange(alloc.size + alloc.page_size)
    return alloc.available_size(), alloc.num_allocated(), alloc.is_allocated(rows).tolist()


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
