"""A free the allocator refuses leaves every cache kind consistent.

The tree only holds slots that the allocator handed out, unless the caller broke that
(freed slots it had given to the tree, or cleared the allocator without a reset). Then
eviction's free is refused. The nodes already taken out of the tree stay out, every
other node's slots are still freed, ``on_node_evict`` still fires once for each node
that went, and the refusal is raised; ``check_integrity()`` passes afterwards.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from prefixcache.cache import (
    DoubleFreeError,
    InvalidInputError,
    RadixCache,
    RadixKey,
    SWATokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from prefixcache.cache.mamba.mamba_radix_cache import MambaRadixCache
from prefixcache.cache.pools.mamba_pool import MambaPool


class Gone(list[int]):
    """Records ``on_node_evict`` calls; a node reported twice fails the test."""

    def __call__(self, node_id: int) -> None:
        assert node_id not in self, f"on_node_evict({node_id}) twice"
        self.append(node_id)


def _fill(
    cache: RadixCache, alloc: TokenToKVPoolAllocator | SWATokenToKVPoolAllocator
) -> list[int]:
    """Three leaves, the middle one holding slots the caller then frees behind the tree."""
    ids, slots = [], []
    for key in ([1, 2], [3, 4], [5, 6]):
        value = alloc.alloc(2)
        assert value is not None
        ids.append(cache.insert(RadixKey(key), value).last_node.id)
        slots.append(value)
    alloc.free(slots[1])
    return ids


def test_radix_evict_survives_a_refused_free() -> None:
    alloc = TokenToKVPoolAllocator(32)
    gone = Gone()
    cache = RadixCache(1, None, alloc, gone)
    ids = _fill(cache, alloc)
    with pytest.raises(DoubleFreeError):
        cache.evict(6)
    assert sorted(gone) == sorted(ids)
    assert alloc.num_allocated() == 0, "the other leaves' slots leaked"
    assert cache.total_size() == cache.evictable_size() == 0
    cache.check_integrity()
    assert cache.evict(1).full_evicted == 0


def test_radix_evict_of_one_refused_leaf() -> None:
    """A refusal in the last node an evict takes: the others earlier in it still go."""
    alloc = TokenToKVPoolAllocator(32)
    gone = Gone()
    cache = RadixCache(1, None, alloc, gone)
    ids = _fill(cache, alloc)
    with pytest.raises(DoubleFreeError):
        cache.evict(3)  # LRU: [1, 2] then the refused [3, 4]
    assert sorted(gone) == sorted(ids[:2]) and alloc.num_allocated() == 2
    assert cache.total_size() == 2
    cache.check_integrity()
    assert cache.match_prefix(RadixKey([5, 6])).prefix_len == 2


def test_swa_evict_survives_refused_frees() -> None:
    alloc = SWATokenToKVPoolAllocator(32, 32)
    gone = Gone()
    cache = RadixCache(1, 2, alloc, gone)
    ids = _fill(cache, alloc)
    with pytest.raises(DoubleFreeError):
        cache.evict(6)
    assert sorted(gone) == sorted(ids) and alloc.num_allocated() == 0
    assert cache.total_size() == cache.swa_evictable_size() == 0
    cache.check_integrity()

    # Phase 2: an inner node's SWA KV freed behind the tree. It still becomes a
    # tombstone, and the other node's window is freed.
    inner = alloc.alloc(2)
    leaf = alloc.alloc(2)
    other = alloc.alloc(2)
    cache.insert(RadixKey([1, 2]), inner)
    cache.insert(RadixKey([1, 2, 3, 4]), torch.cat([inner, leaf]), prev_prefix_len=2)
    last = cache.insert(RadixKey([7, 8]), other).last_node
    alloc.free_swa(inner)
    cache.inc_lock_ref(cache.match_prefix(RadixKey([1, 2, 3, 4])).last_node)
    with pytest.raises(DoubleFreeError):
        cache.evict(0, 6)
    assert last.id in gone and not bool(alloc.is_allocated(other).any())
    assert cache.swa_evictable_size() == 0
    cache.check_integrity()


def test_mamba_evict_survives_refused_frees() -> None:
    alloc = TokenToKVPoolAllocator(32)
    pool = MambaPool(max_reqs=1, max_track_slots=8)
    gone = Gone()
    cache = MambaRadixCache(1, alloc, pool, gone)
    ids = []
    states = []
    for key in ([1, 2], [3, 4], [5, 6]):
        states.append(pool.alloc_track_slot())
        ids.append(cache.insert(RadixKey(key), alloc.alloc(2), mamba_value=states[-1]).last_node.id)
    pool.free_track_slot(states[0])  # a state freed behind the tree
    alloc.free(cache.match_prefix(RadixKey([3, 4])).indices)  # and KV
    with pytest.raises(DoubleFreeError):
        cache.evict(6)
    assert sorted(gone) == sorted(ids)
    assert alloc.num_allocated() == 0 and pool.num_allocated_track_slots() == 0
    assert cache.total_size() == cache.mamba_total_size() == 0
    cache.check_integrity()


@pytest.mark.parametrize(
    "make",
    [
        lambda a: RadixCache(1, None, a),
        lambda a: RadixCache(1, 4, SWATokenToKVPoolAllocator(32, 32)),
        lambda a: MambaRadixCache(1, a, MambaPool(max_reqs=1, max_track_slots=2)),
    ],
    ids=["radix", "swa", "mamba"],
)
def test_insert_without_slots_is_refused_when_an_allocator_is_attached(
    make: Callable[[TokenToKVPoolAllocator], RadixCache],
) -> None:
    """value=None stores the token ids as slots: fine without a pool, never with one."""
    alloc = TokenToKVPoolAllocator(32)
    cache = make(alloc)
    kwargs = (
        {"mamba_value": cache.mamba_pool.alloc_track_slot()}
        if isinstance(cache, MambaRadixCache)
        else {}
    )
    with pytest.raises(InvalidInputError, match="value"):
        cache.insert(RadixKey([1, 2, 3]), **kwargs)
    assert cache.total_size() == 0 and not cache.root_node.children
    cache.check_integrity()
