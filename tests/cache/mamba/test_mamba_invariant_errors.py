"""Invariant breaks in the Mamba tree raise IntegrityError, not a bare assert (which
``python -O`` strips, leaving the lists or counters silently corrupt)."""

from __future__ import annotations

import pytest
import torch

from prefixcache.cache import (
    IntegrityError,
    InvalidInputError,
    MambaPool,
    MambaRadixCache,
    RadixKey,
    TokenToKVPoolAllocator,
)
from prefixcache.cache.mamba.mamba_tree import LRUList, MambaTreeNode


def _cache() -> tuple[MambaRadixCache, TokenToKVPoolAllocator, MambaPool]:
    alloc = TokenToKVPoolAllocator(64)
    pool = MambaPool(max_reqs=2, max_track_slots=4)
    return MambaRadixCache(1, alloc, pool), alloc, pool


def test_the_lru_list_refuses_a_double_link_and_a_missing_node() -> None:
    cache, alloc, pool = _cache()
    cache.insert(RadixKey([1, 2]), alloc.alloc(2), mamba_value=pool.alloc_track_slot())
    node = cache.match_prefix(RadixKey([1, 2])).last_node
    with pytest.raises(IntegrityError, match="already in the list"):
        cache.mamba_lru_list.push_mru(node)
    with pytest.raises(IntegrityError, match="not in the list"):
        LRUList("mamba_prev", "mamba_next").remove(MambaTreeNode())
    cache.check_integrity()


def test_taking_a_locked_state_and_a_stateless_leaf_are_refused() -> None:
    cache, alloc, pool = _cache()
    cache.insert(RadixKey([1, 2]), alloc.alloc(2), mamba_value=pool.alloc_track_slot())
    node = cache.match_prefix(RadixKey([1, 2])).last_node
    cache.inc_lock_ref(node)
    with pytest.raises(IntegrityError, match="cannot be taken"):
        cache._take_state(node)
    with pytest.raises(InvalidInputError, match="mamba_value"):
        cache._add_leaf(node, b"\x05\x00\x00\x00", torch.tensor([9]))
    cache.dec_lock_ref(node)
    cache.check_integrity()
