"""A node's slots are the tree's own copy, and a match's slots are the caller's: neither
shares memory with the other side, whichever way they are copied (numpy or torch)."""

from __future__ import annotations

import torch

from prefixcache.cache import RadixCache, RadixKey, TokenToKVPoolAllocator
from prefixcache.cache.slot_values import empty_slots, joined_slots, owned_slots


def _cache() -> tuple[RadixCache, TokenToKVPoolAllocator]:
    alloc = TokenToKVPoolAllocator(size=256, page_size=4)
    return RadixCache(page_size=4, token_to_kv_pool_allocator=alloc), alloc


def test_caller_tensor_changed_after_insert_leaves_tree_alone() -> None:
    cache, alloc = _cache()
    slots = alloc.alloc(12)
    kept = slots.clone()
    cache.insert(RadixKey(list(range(12))), slots)
    slots.fill_(0)
    assert torch.equal(cache.match_prefix(RadixKey(list(range(12)))).indices, kept)
    # A split (a match ending inside the node) copies both parts again.
    assert torch.equal(cache.match_prefix(RadixKey([*range(8), 99, 99, 99, 99])).indices, kept[:8])
    assert torch.equal(cache.match_prefix(RadixKey(list(range(12)))).indices, kept)
    cache.check_integrity()


def test_match_result_is_the_callers_to_change() -> None:
    cache, alloc = _cache()
    slots = alloc.alloc(8)
    cache.insert(RadixKey(list(range(8))), slots)
    cache.insert(RadixKey([*range(8), 20, 21, 22, 23]), torch.cat((slots, alloc.alloc(4))))
    first = cache.match_prefix(RadixKey([*range(8), 20, 21, 22, 23]))
    expected = first.indices.clone()
    first.indices.fill_(-1)
    again = cache.match_prefix(RadixKey([*range(8), 20, 21, 22, 23]))
    assert torch.equal(again.indices, expected)
    cache.check_integrity()


def test_helpers_keep_torch_semantics_for_every_dtype() -> None:
    for dtype in (torch.int64, torch.int32):
        value = torch.arange(10, dtype=dtype)
        part = owned_slots(value, 2, 7)
        assert part.dtype == dtype and torch.equal(part, value[2:7])
        value[3] = 100
        assert int(part[1]) == 3  # a copy, not a view
        joined = joined_slots([value[:2], value[5:]], torch.device("cpu"))
        assert joined.dtype == dtype and torch.equal(joined, torch.cat([value[:2], value[5:]]))
        value[0] = 50
        assert int(joined[0]) == 0
    mixed = joined_slots([torch.arange(2, dtype=torch.int32), torch.arange(2)], torch.device("cpu"))
    assert mixed.dtype == torch.int64  # promoted, as torch.cat does
    empty = empty_slots(torch.device("cpu"))
    assert empty.dtype == torch.int64 and empty.shape == (0,)
    assert joined_slots([], torch.device("cpu")).shape == (0,)
