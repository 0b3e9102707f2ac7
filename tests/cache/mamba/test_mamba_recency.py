"""Which Mamba state eviction takes: SGLang's recency policy.

An insert refreshes each node it walks into, top-down, as it reaches it, so a node it
splits ranks newer than the shared prefix above it; a match refreshes the answered
path in the full-KV list but only the answered node's state in the Mamba list
(SGLang as of 2026-07, ``_match_post_processor``). Touching the insert's whole path
again at the end would rank the shared prefix's state newest, and state pressure would
then delete the deeper leaf, KV included: these tests fail on that order.
"""

from __future__ import annotations

from prefixcache.cache import RadixKey, TokenToKVPoolAllocator
from prefixcache.cache.mamba.mamba_radix_cache import MambaRadixCache
from prefixcache.cache.pools.mamba_pool import MambaPool


def _sglang_unittest_tree() -> tuple[MambaRadixCache, TokenToKVPoolAllocator, MambaPool]:
    """The four inserts and two evictions of SGLang's test_mamba_radix_cache_1."""
    alloc = TokenToKVPoolAllocator(128)
    pool = MambaPool(max_reqs=4, max_track_slots=8)
    cache = MambaRadixCache(1, alloc, pool)
    for tokens in ([1, 2, 3], [1, 2, 3, 4, 5, 6, 7], [10, 11, 12], [1, 2, 3, 4, 5, 60, 70]):
        cache.insert(
            RadixKey(tokens), alloc.alloc(len(tokens)), mamba_value=pool.alloc_track_slot()
        )
    cache.evict(1)  # the LRU leaf, [10, 11, 12]
    cache.evict(0, 1)  # the LRU state: the shared prefix [1, 2, 3] becomes a tombstone
    cache.check_integrity()
    return cache, alloc, pool


def test_state_pressure_tombstones_the_shared_prefix_not_the_deeper_leaf() -> None:
    """The issue's repro: the split node [6, 7] keeps its state and its KV."""
    cache, _, pool = _sglang_unittest_tree()
    assert cache.match_prefix(RadixKey([1, 2, 3, 4, 5, 6, 7])).prefix_len == 7
    assert pool.num_allocated_track_slots() == 2


def test_sglang_mamba_radix_cache_unittest_sequence() -> None:
    """The rest of SGLang's test, with its expectations."""
    cache, _, _ = _sglang_unittest_tree()
    assert cache.match_prefix(RadixKey([1, 2, 3, 4, 5])).prefix_len == 0
    m = cache.match_prefix(RadixKey([1, 2, 3, 4, 5, 60, 70]))
    assert (m.prefix_len, m.last_node.key_len) == (7, 2)
    m = cache.match_prefix(RadixKey([1, 2, 3, 4, 5, 6, 7]))
    assert (m.prefix_len, m.last_node.key_len) == (7, 2)
    cache.evict(0, 1)  # now [60, 70] is the LRU state: its leaf goes
    m = cache.match_prefix(RadixKey([1, 2, 3, 4, 5, 60, 70]))
    assert (m.prefix_len, m.last_node) == (0, cache.root_node)
    cache.check_integrity()


def _order(cache: MambaRadixCache) -> list[list[int]]:
    """Each node with state, most recent first, as its tokens."""
    return [list(n.key.token_ids) for n in cache.mamba_lru_list]


def test_insert_refreshes_walked_states_top_down_and_match_the_answered_path() -> None:
    alloc = TokenToKVPoolAllocator(64)
    pool = MambaPool(max_reqs=1, max_track_slots=8)
    cache = MambaRadixCache(1, alloc, pool)

    def insert(tokens: list[int]) -> bool:
        return cache.insert(
            RadixKey(tokens), alloc.alloc(len(tokens)), mamba_value=pool.alloc_track_slot()
        ).mamba_exist

    insert([1]), insert([1, 2, 3]), insert([9])
    assert _order(cache) == [[9], [2, 3], [1]]
    insert([1, 2])  # walks [1], splits [2, 3] (which keeps its state), adopts at [2]
    assert _order(cache) == [[2], [3], [1], [9]]
    insert([1, 2, 3, 4])  # walks [1], [2], [3] in that order, then the new leaf
    assert _order(cache) == [[4], [3], [2], [1], [9]]
    assert insert([1, 2])  # walks [1], [2]: the existing state at the end is newest
    assert _order(cache) == [[2], [1], [4], [3], [9]]
    cache.match_prefix(RadixKey([9]))
    assert _order(cache) == [[9], [2], [1], [4], [3]]
    cache.match_prefix(RadixKey([1, 2, 3, 4]))  # the answered state only
    assert _order(cache) == [[4], [9], [2], [1], [3]]
    cache.match_prefix(RadixKey([1, 5]))  # answers [1] only
    assert _order(cache) == [[1], [4], [9], [2], [3]]
    cache.check_integrity()


def _full_order(cache: MambaRadixCache) -> list[list[int]]:
    return [list(n.key.token_ids) for n in cache.full_lru_list]


def test_mamba_lru_match_refreshes_only_used_node() -> None:
    """SGLang 2026-07 (``_match_post_processor``): a match refreshes the whole matched
    path in the full-KV LRU, but only the matched node in the Mamba-state LRU. So under
    state pressure the ancestors' states go before an unrelated, older state, while the
    path's KV stays the most recent."""
    alloc = TokenToKVPoolAllocator(64)
    pool = MambaPool(max_reqs=1, max_track_slots=8)
    cache = MambaRadixCache(1, alloc, pool)
    for tokens in ([1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [9]):
        cache.insert(
            RadixKey(tokens), alloc.alloc(len(tokens)), mamba_value=pool.alloc_track_slot()
        )
    assert _order(cache) == [[9], [5, 6], [3, 4], [1, 2]]
    m = cache.match_prefix(RadixKey([1, 2, 3, 4, 5, 6, 7]))
    assert m.prefix_len == 6
    # Full list: the whole path, deeper newer. Mamba list: [5, 6] alone moves up.
    assert _full_order(cache)[:3] == [[5, 6], [3, 4], [1, 2]]
    assert _order(cache) == [[5, 6], [9], [3, 4], [1, 2]]
    cache.check_integrity()
    # State pressure takes the path's unused states first: [1, 2], then [3, 4].
    assert cache.evict(0, 2).mamba_evicted == 2
    assert cache.match_prefix(RadixKey([9])).prefix_len == 1
    assert cache.match_prefix(RadixKey([1, 2, 3, 4, 5, 6])).prefix_len == 6
    assert cache.match_prefix(RadixKey([1, 2, 3, 4])).prefix_len == 0  # tombstones now
    cache.check_integrity()
