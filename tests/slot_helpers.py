"""Small builders shared by the SlotPrefixCache unit tests."""

from __future__ import annotations

from typing import Any

from prefixcache.cache.inspection import walk
from prefixcache.cache.pools.slot_allocator import SlotAllocator
from prefixcache.cache.slot.slot_cache import SlotPrefixCache


def make(
    capacity: int = 100, slots: int = 4, **kwargs: Any
) -> tuple[SlotAllocator, SlotPrefixCache]:
    alloc = SlotAllocator(slots)
    return alloc, SlotPrefixCache(alloc, capacity, **kwargs)


def take(alloc: SlotAllocator) -> tuple[int, int]:
    slot = alloc.alloc()
    assert slot is not None
    return slot, alloc.version(slot)


def make_stale(alloc: SlotAllocator, slot: int) -> None:
    """Give ``slot`` a new owner, so KV written under its old version is gone."""
    if not alloc.is_free(slot):
        alloc.free(slot)
    assert alloc.occupy(slot, alloc.version(slot)) is not None


def snapshot(cache: SlotPrefixCache) -> Any:
    """Everything a refused call must leave alone, the allocator included."""
    nodes = sorted(
        (
            n.id,
            n.key_bytes,
            n.slot,
            n.version,
            n.depth,
            n.lock_ref,
            n.own_lock_ref,
            n.last_access_time,
            n.hit_count,
            n.parent.id,
        )
        for n, _ in walk(cache.root_node)
    )
    alloc = cache.allocator
    return (
        cache.total_size(),
        cache.evictable_size(),
        cache.protected_size(),
        cache.num_nodes(),
        cache.num_pins(),
        nodes,
        sorted(cache._tips),
        cache._leaves.node_ids(),
        list(alloc._free),
        [alloc.version(s) for s in range(alloc.max_slots)],
    )
