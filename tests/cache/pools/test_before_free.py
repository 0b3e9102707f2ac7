"""``before_free``: a RadixCache shows each node it evicts, with its slots, before the
slots go back to the allocator (a write-back tier copies their rows out there)."""

from __future__ import annotations

import torch

from prefixcache.cache import RadixCache, RadixKey, TokenToKVPoolAllocator
from prefixcache.cache.hashing import hash_pages
from prefixcache.cache.key import TOKEN_BYTES


def _cache(page_size: int = 2, size: int = 32) -> RadixCache:
    allocator = TokenToKVPoolAllocator(size, "cpu", page_size)
    return RadixCache(page_size, None, allocator, eager_page_hashes=True)


def _insert(cache: RadixCache, tokens: list[int], extra_key: str | None = None) -> torch.Tensor:
    slots = cache.token_to_kv_pool_allocator.alloc(len(tokens))
    cache.insert(RadixKey(tokens, extra_key), slots)
    return slots


def test_before_free_sees_each_evicted_node_with_its_slots_still_allocated() -> None:
    cache = _cache()
    allocator = cache.token_to_kv_pool_allocator
    tokens = [5, 6, 7, 8]
    slots = _insert(cache, tokens, "t")
    seen = []

    def hook(node, node_slots) -> None:
        # Still in the tree, its slots not yet free: their rows still hold its KV.
        seen.append(
            (
                node.require_namespace().extra_key,
                list(node.hash_values),
                node_slots.tolist(),
                bool(allocator.is_allocated(node_slots).all()),
                node.evicted,
            )
        )

    cache.before_free = hook
    free_before = allocator.available_size()
    assert cache.evict(4).full_evicted == 4
    packed = RadixKey(tokens).packed()[0]
    assert seen == [("t", hash_pages(packed, 2 * TOKEN_BYTES, None), slots.tolist(), True, False)]
    assert allocator.available_size() == free_before + 4  # then freed
    cache.check_integrity()


def test_a_failing_before_free_never_leaves_an_eviction_half_done() -> None:
    cache = _cache()
    allocator = cache.token_to_kv_pool_allocator
    _insert(cache, [1, 2, 3, 4])
    _insert(cache, [9, 9])

    def broken(node, node_slots) -> None:
        raise RuntimeError("hook bug")

    cache.before_free = broken
    free_before = allocator.available_size()
    assert cache.evict(6).full_evicted == 6
    assert cache.before_free_errors == 2
    assert allocator.available_size() == free_before + 6
    assert cache.evictable_size() == 0
    cache.check_integrity()
