"""RadixCache: worked examples E1-E4 and the departures from the reference that concern
full attention (docs/semantics.md), each asserted."""

from __future__ import annotations

import pytest
import torch

from prefixcache.cache import (
    ChunkCache,
    InvalidInputError,
    LockError,
    RadixCache,
    RadixKey,
    TokenRangeError,
    TokenToKVPoolAllocator,
)


def t(*slots: int) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.int64)


class Slots:
    """A real allocator with every slot handed out, so tests can name slots and see frees."""

    def __init__(self, size: int = 128, page_size: int = 1) -> None:
        self.allocator = TokenToKVPoolAllocator(size, page_size=page_size)
        self.all = self.allocator.alloc(self.allocator.available_size())
        self._seen: set[int] = set()

    def freed(self) -> list[int]:
        """Slots freed since the previous call, sorted."""
        now = set(self.all[~self.allocator.is_allocated(self.all)].tolist())
        new, self._seen = sorted(now - self._seen), now
        return new


def sizes(cache: RadixCache) -> tuple[int, int, int]:
    return cache.evictable_size(), cache.protected_size(), cache.total_size()


def test_e1_basic_insert_match_lock_evict() -> None:
    """E1: insert/match/lock/evict with SGLang-meaning sizes (evictable never negative)."""
    slots = Slots()
    cache = RadixCache(token_to_kv_pool_allocator=slots.allocator)
    assert cache.insert(RadixKey([1, 2, 3]), t(11, 12, 13)).prefix_len == 0
    assert cache.insert(RadixKey([1, 2, 3, 4, 5]), t(21, 22, 23, 24, 25)).prefix_len == 3
    assert slots.freed() == []  # duplicates stay the caller's in plain mode
    slots.allocator.free(t(21, 22, 23))
    slots.freed()
    match = cache.match_prefix(RadixKey([1, 2, 3, 4, 5, 6]))
    assert (match.prefix_len, match.indices.tolist()) == (5, [11, 12, 13, 24, 25])
    assert sizes(cache) == (5, 0, 5)
    cache.inc_lock_ref(match.last_node)
    assert sizes(cache) == (0, 5, 5)
    assert cache.evict(100).full_evicted == 0
    cache.dec_lock_ref(match.last_node)
    assert sizes(cache) == (5, 0, 5)
    assert cache.evict(2).full_evicted == 2
    assert slots.freed() == [24, 25]
    assert sizes(cache) == (3, 0, 3)
    assert cache.evict(100).full_evicted == 3
    assert slots.freed() == [11, 12, 13]
    assert sizes(cache) == (0, 0, 0)
    cache.check_integrity()


def test_e2_paging_aligns_match_and_insert() -> None:
    """E2, departure 3: inserts are page-aligned, so no stranded tails or overshoot."""
    slots = Slots(page_size=2)
    cache = RadixCache(page_size=2, token_to_kv_pool_allocator=slots.allocator)
    assert cache.insert(RadixKey([1, 2, 3, 4, 5]), t(11, 12, 13, 14, 15)).prefix_len == 0
    assert cache.total_size() == 4  # the unaligned tail [5] is not cached
    match = cache.match_prefix(RadixKey([1, 2, 3, 4, 5]))
    assert (match.prefix_len, match.indices.tolist()) == (4, [11, 12, 13, 14])
    assert cache.match_prefix(RadixKey([1])).last_node is cache.root_node
    assert cache.insert(RadixKey([1, 2, 3, 4, 5, 6]), t(21, 22, 23, 24, 25, 26)).prefix_len == 4
    assert len(match.last_node.children) == 1  # one [5,6] leaf, no stray [5] sibling
    assert cache.insert(RadixKey([1, 2, 3, 4, 5]), t(31, 32, 33, 34, 35)).prefix_len == 4
    assert cache.insert(RadixKey([7, 8, 9]), t(41, 42, 43)).prefix_len == 0
    assert cache.insert(RadixKey([7, 8, 9]), t(51, 52, 53)).prefix_len == 2
    assert cache.match_prefix(RadixKey([7, 8, 9, 10])).indices.tolist() == [41, 42]
    split = cache.match_prefix(RadixKey([1, 2, 3, 9]))
    assert (split.prefix_len, split.indices.tolist()) == (2, [11, 12])
    assert slots.freed() == []
    cache.check_integrity()


def test_e3_namespaces_are_disjoint() -> None:
    """E3: None, "", "a", "b" are four namespaces; tuple tokens match as opaque tokens."""
    cache = RadixCache()
    cache.insert(RadixKey([1, 2, 3], "a"), t(1, 2, 3))
    assert cache.match_prefix(RadixKey([1, 2, 3])).prefix_len == 0
    assert cache.match_prefix(RadixKey([1, 2, 3], "a")).prefix_len == 3
    assert cache.match_prefix(RadixKey([1, 2, 3], "")).prefix_len == 0
    assert cache.insert(RadixKey([1, 2, 3], "b"), t(4, 5, 6)).prefix_len == 0
    assert cache.insert(RadixKey([1, 2, 3]), t(7, 8, 9)).prefix_len == 0
    assert len(cache.root_node.children) == 3
    assert cache.insert(RadixKey([1, 2, 9], "a"), t(1, 2, 10)).prefix_len == 2
    cache.insert(RadixKey([(1, 2), (2, 3), (3, 4)]), t(21, 22, 23))
    assert cache.match_prefix(RadixKey([(1, 2), (2, 3), (3, 5)])).prefix_len == 2
    cache.check_integrity()


def test_tuple_and_int_keys_never_alias() -> None:
    """Departure 4: a bigram key and the flat ints it packs to live in different subtrees."""
    cache = RadixCache()
    cache.insert(RadixKey([(5, 7), (8, 9)]), t(1, 2))
    assert cache.match_prefix(RadixKey([5, 7, 8, 9])).prefix_len == 0
    assert cache.match_prefix(RadixKey([(5, 7), (8, 9)])).prefix_len == 2


def test_extra_key_must_be_a_string() -> None:
    """Departure 4: a non-str extra_key is refused instead of aliasing token child keys."""
    with pytest.raises(InvalidInputError):
        RadixKey([7], extra_key=5)  # type: ignore[arg-type]


def test_e4_lru_order_overshoot_and_cascade() -> None:
    """E4, departure 6: whole-leaf LRU eviction, overshoot, locked paths kept, parent cascade."""
    slots = Slots()
    evicted_ids: list[int] = []
    cache = RadixCache(token_to_kv_pool_allocator=slots.allocator, on_node_evict=evicted_ids.append)
    cache.insert(RadixKey([1, 2]), t(11, 12))
    cache.insert(RadixKey([3, 4]), t(13, 14))
    cache.insert(RadixKey([5, 6]), t(15, 16))
    cache.match_prefix(RadixKey([1, 2]))
    assert cache.evict(2).full_evicted == 2 and slots.freed() == [13, 14]
    assert cache.evict(3).full_evicted == 4 and slots.freed() == [11, 12, 15, 16]
    assert len(evicted_ids) == 3

    cache.insert(RadixKey([1, 2, 3]), t(21, 22, 23))
    cache.insert(RadixKey([1, 2, 4]), t(31, 32, 34))
    slots.allocator.free(t(31, 32))
    slots.freed()
    locked = cache.match_prefix(RadixKey([1, 2, 3])).last_node
    cache.inc_lock_ref(locked)
    assert cache.evict(100).full_evicted == 1 and slots.freed() == [34]
    cache.dec_lock_ref(locked)
    assert cache.evict(1).full_evicted == 1 and slots.freed() == [23]
    assert cache.match_prefix(RadixKey([1, 2])).prefix_len == 2

    cache.insert(RadixKey([1, 2, 4]), t(41, 42, 44))
    cache.insert(RadixKey([1, 2, 5]), t(51, 52, 55))
    slots.allocator.free(t(41, 42, 51, 52))
    slots.freed()
    evicted_ids.clear()
    assert cache.evict(3).full_evicted == 4
    assert slots.freed() == [21, 22, 44, 55]
    assert len(evicted_ids) == 3
    assert cache.total_size() == 0
    cache.check_integrity()


def test_empty_and_short_keys() -> None:
    """Departure 1: empty or sub-page keys match nothing (last_node = root) and insert nothing."""
    cache = RadixCache(page_size=4)
    assert cache.insert(RadixKey([]), t()).prefix_len == 0
    assert cache.insert(RadixKey([1, 2, 3]), t(1, 2, 3)).prefix_len == 0
    assert cache.total_size() == 0
    for key in (RadixKey([]), RadixKey([1, 2, 3])):
        match = cache.match_prefix(key)
        assert (match.prefix_len, match.last_node, match.indices.numel()) == (0, cache.root_node, 0)


def test_match_splits_only_at_pages_and_split_persists() -> None:
    """Departure 2: a match ending inside a node splits it there, at a page multiple, for good."""
    cache = RadixCache(page_size=2)
    cache.insert(RadixKey([1, 2, 3, 4, 5, 6]), t(1, 2, 3, 4, 5, 6))
    match = cache.match_prefix(RadixKey([1, 2, 3, 4, 9, 9]))
    assert match.prefix_len == 4 and match.last_node.key_len == 4
    assert [c.key_len for c in match.last_node.children.values()] == [2]
    assert cache.match_prefix(RadixKey([1, 2, 3, 9])).prefix_len == 2
    cache.check_integrity()


def test_split_keeps_node_id_on_the_deeper_part() -> None:
    """A handle to a sequence end stays valid across splits above it."""
    cache = RadixCache()
    end = cache.insert(RadixKey([1, 2, 3, 4]), t(1, 2, 3, 4)).last_node
    upper = cache.match_prefix(RadixKey([1, 2])).last_node
    assert upper is not end and end.parent is upper
    assert cache.match_prefix(RadixKey([1, 2, 3, 4])).last_node is end


def test_unbalanced_unlock_raises_and_changes_nothing() -> None:
    """Departure 8: double unlock, unlock of a never-locked node and of an evicted node raise."""
    cache = RadixCache()
    leaf = cache.insert(RadixKey([1, 2, 3, 4]), t(1, 2, 3, 4)).last_node
    upper = cache.match_prefix(RadixKey([1, 2])).last_node
    cache.inc_lock_ref(leaf)
    before = sizes(cache)
    with pytest.raises(LockError):
        cache.dec_lock_ref(upper)  # locked only through its child
    assert sizes(cache) == before
    cache.dec_lock_ref(leaf)
    with pytest.raises(LockError):
        cache.dec_lock_ref(leaf)
    assert sizes(cache) == (4, 0, 4)
    cache.evict(100)
    with pytest.raises(LockError):
        cache.dec_lock_ref(leaf)
    with pytest.raises(LockError):
        cache.inc_lock_ref(leaf)
    cache.check_integrity()


def test_nodes_of_another_cache_or_a_reset_tree_are_refused() -> None:
    """A lock on a node this cache does not hold raises instead of corrupting counters."""
    first, second = RadixCache(), RadixCache()
    node = first.insert(RadixKey([1, 2]), t(1, 2)).last_node
    with pytest.raises(LockError):
        second.inc_lock_ref(node)
    first.reset()
    with pytest.raises(LockError):
        first.inc_lock_ref(node)
    assert sizes(first) == sizes(second) == (0, 0, 0)


def test_root_and_none_locks_are_no_ops() -> None:
    """Locking the root (a miss) or None does nothing, as in the reference."""
    cache = RadixCache()
    miss = cache.match_prefix(RadixKey([1]))
    assert cache.inc_lock_ref(miss.last_node) is None
    cache.dec_lock_ref(miss.last_node)
    assert cache.inc_lock_ref(None) is None
    cache.dec_lock_ref(None)
    cache.check_integrity()


def test_nested_locks_balance() -> None:
    """Two locks on one path keep it protected until both are released."""
    cache = RadixCache()
    a = cache.insert(RadixKey([1, 2, 3]), t(1, 2, 3)).last_node
    b = cache.insert(RadixKey([1, 2, 3, 4]), t(1, 2, 3, 4)).last_node
    cache.inc_lock_ref(a)
    cache.inc_lock_ref(b)
    cache.dec_lock_ref(a)
    assert sizes(cache) == (0, 4, 4)
    cache.dec_lock_ref(b)
    assert sizes(cache) == (4, 0, 4)
    cache.check_integrity()


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (t(1, 2), InvalidInputError),  # shorter than the key
        (torch.tensor([1.0, 2.0, 3.0]), InvalidInputError),
        (torch.tensor([[1, 2, 3]]), InvalidInputError),
    ],
)
def test_bad_insert_values_change_nothing(value: torch.Tensor, error: type) -> None:
    """Malformed values raise before the tree changes."""
    cache = RadixCache()
    cache.insert(RadixKey([9, 9]), t(1, 2))
    with pytest.raises(error):
        cache.insert(RadixKey([1, 2, 3]), value)
    assert sizes(cache) == (2, 0, 2)
    cache.check_integrity()


def test_out_of_range_tokens_are_refused() -> None:
    """Token ids outside uint32 raise TokenRangeError (an OverflowError too)."""
    cache = RadixCache()
    for bad in ([-1], [2**32]):
        with pytest.raises(TokenRangeError):
            cache.insert(RadixKey(bad), t(1))
        with pytest.raises(OverflowError):
            cache.match_prefix(RadixKey(bad))
    assert cache.total_size() == 0


def test_negative_evict_is_refused() -> None:
    """Evicting a negative amount is a caller error."""
    with pytest.raises(InvalidInputError):
        RadixCache().evict(-1)


def test_value_none_stores_token_ids() -> None:
    """value=None stores the token ids themselves (handy for tests, as in the reference)."""
    cache = RadixCache()
    cache.insert(RadixKey([5, 6, 7]))
    assert cache.match_prefix(RadixKey([5, 6, 7])).indices.tolist() == [5, 6, 7]
    with pytest.raises(InvalidInputError):
        cache.insert(RadixKey([(1, 2)]))


def test_hit_count_and_last_access_time() -> None:
    """Matches count hits on the path; every touch moves the logical clock forward."""
    cache = RadixCache()
    leaf = cache.insert(RadixKey([1, 2]), t(1, 2)).last_node
    created = leaf.last_access_time
    cache.match_prefix(RadixKey([1, 2]))
    cache.match_prefix(RadixKey([1, 2, 3]))
    assert leaf.hit_count == 2 and leaf.last_access_time > created


def test_lfu_policy_keeps_the_frequently_hit_leaf() -> None:
    """eviction_policy="lfu" evicts the least-hit leaf even if it was used last."""
    cache = RadixCache(eviction_policy="lfu")
    cache.insert(RadixKey([1]), t(1))
    cache.insert(RadixKey([2]), t(2))
    for _ in range(3):
        cache.match_prefix(RadixKey([1]))
    cache.match_prefix(RadixKey([2]))
    cache.evict(1)
    assert cache.match_prefix(RadixKey([1])).prefix_len == 1
    assert cache.match_prefix(RadixKey([2])).prefix_len == 0


def test_lfu_ranks_a_leaf_with_the_hit_of_its_last_match() -> None:
    """A match counts its hit before it ranks the leaf anew, so a leaf hit once ranks
    above a newer one never hit."""
    cache = RadixCache(eviction_policy="lfu")
    cache.insert(RadixKey([1]), t(1))
    cache.match_prefix(RadixKey([1]))
    cache.insert(RadixKey([2]), t(2))
    cache.evict(1)
    assert cache.match_prefix(RadixKey([1])).prefix_len == 1
    assert cache.match_prefix(RadixKey([2])).prefix_len == 0


def test_unknown_policy_is_refused() -> None:
    """An unknown eviction policy name is a clear error."""
    with pytest.raises(InvalidInputError, match="lru"):
        RadixCache(eviction_policy="random")


def test_evict_does_not_rescan_when_nothing_is_evictable() -> None:
    """With everything locked evict returns 0 and leaves the tree whole."""
    cache = RadixCache()
    nodes = [cache.insert(RadixKey([i, i + 1]), t(i, i + 1)).last_node for i in range(0, 20, 2)]
    for node in nodes:
        cache.inc_lock_ref(node)
    assert cache.evict(5).full_evicted == 0
    assert sizes(cache) == (0, 20, 20)
    for node in nodes:
        cache.dec_lock_ref(node)
    assert cache.evict(5).full_evicted == 6
    cache.check_integrity()


def test_pretty_print_shows_namespaces(capsys: pytest.CaptureFixture[str]) -> None:
    """pretty_print lists each namespace and node."""
    cache = RadixCache()
    cache.insert(RadixKey([1, 2, 3], "lora-a"), t(1, 2, 3))
    cache.pretty_print()
    out = capsys.readouterr().out
    assert "lora-a" in out and "len=3" in out


def test_chunk_cache_is_a_no_op() -> None:
    """ChunkCache: misses on the allocator's device, does nothing, sizes all 0."""
    allocator = TokenToKVPoolAllocator(16)
    cache = ChunkCache(allocator)
    match = cache.match_prefix(RadixKey([1, 2, 3]))
    assert (match.prefix_len, match.last_node, match.indices.device.type) == (0, None, "cpu")
    assert cache.insert(RadixKey([1]), t(1)).prefix_len == 0
    assert cache.evict(10).full_evicted == 0
    assert cache.inc_lock_ref(None) is None
    assert (cache.evictable_size(), cache.protected_size(), cache.total_size()) == (0, 0, 0)
    assert allocator.available_size() == 16


@pytest.mark.parametrize("extra_key", [None, "a"])
def test_lock_of_a_miss_survives_its_namespace_emptying(extra_key: str | None) -> None:
    """WorkerMachine, page 1 (shrunk): a worker locks the last_node of a miss, the
    namespace's last node is evicted, and the balancing unlock must not fail.

    A miss inside an existing namespace returns that namespace's (empty-key) root as
    ``last_node``. Locking it is a no-op, so nothing keeps the namespace root alive;
    when its last leaf is evicted the root is detached and marked evicted, and the
    worker's ``dec_lock_ref(last_node)`` raised ``LockError("node ... has been
    evicted")`` for a perfectly balanced lock/unlock pair. (A miss in SWA mode returns
    the cache root, which never goes away.)
    """
    alloc = TokenToKVPoolAllocator(8)
    cache = RadixCache(token_to_kv_pool_allocator=alloc)
    cache.insert(RadixKey([0], extra_key), alloc.alloc(1))
    miss = cache.match_prefix(RadixKey([1], extra_key))
    assert miss.prefix_len == 0
    cache.inc_lock_ref(miss.last_node)
    assert cache.evict(1).full_evicted == 1  # the namespace is empty now
    cache.dec_lock_ref(miss.last_node)  # balances the lock above: must not raise
    cache.check_integrity()
    # and the same handle stays usable once the namespace exists again
    cache.insert(RadixKey([2], extra_key), alloc.alloc(1))
    cache.inc_lock_ref(miss.last_node)
    cache.dec_lock_ref(miss.last_node)
    cache.check_integrity()
