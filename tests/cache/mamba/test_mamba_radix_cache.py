"""MambaRadixCache: worked examples E10 and E11, and each Mamba departure from the
reference (docs/semantics.md, departure 12), with SGLang's semantics."""

from __future__ import annotations

import pytest
import torch

from prefixcache.cache import (
    IntegrityError,
    InvalidInputError,
    LockError,
    RadixKey,
    TokenToKVPoolAllocator,
)
from prefixcache.cache.inspection import walk
from prefixcache.cache.mamba.mamba_radix_cache import MambaRadixCache
from prefixcache.cache.mamba.mamba_tree import LRUList, MambaTreeNode
from prefixcache.cache.pools.mamba_pool import MambaPool


def t(*slots: int) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.int64)


def r(lo: int, hi: int) -> list[int]:
    return list(range(lo, hi + 1))


class Pools:
    """A real KV allocator and Mamba pool with every slot handed out, reporting frees.

    Track slots are 101..120 (100 working slots come first), as in the spec's examples.
    """

    def __init__(self, size: int = 128, page_size: int = 1) -> None:
        self.allocator = TokenToKVPoolAllocator(size, page_size=page_size)
        self.all = self.allocator.alloc(self.allocator.available_size())
        self.pool = MambaPool(max_reqs=100, max_track_slots=20)
        while self.pool.alloc_track_slot() is not None:
            pass
        self._kv: set[int] = set()
        self._states: set[int] = set()

    def freed(self) -> list[int]:
        """KV slots freed since the previous call, sorted."""
        now = set(self.all[~self.allocator.is_allocated(self.all)].tolist())
        new, self._kv = sorted(now - self._kv), now
        return new

    def states_freed(self) -> list[int]:
        """Track slots freed since the previous call, sorted."""
        now = {s for s in range(101, 121) if not self.pool.is_track_slot_allocated(s)}
        new, self._states = sorted(now - self._states), now
        return new

    def cache(self, page_size: int = 1, **kwargs: object) -> MambaRadixCache:
        return MambaRadixCache(page_size, self.allocator, self.pool, **kwargs)  # type: ignore[arg-type]


def mamba_sizes(cache: MambaRadixCache) -> tuple[int, int]:
    return cache.mamba_evictable_size(), cache.mamba_protected_size()


def nodes(cache: MambaRadixCache) -> list[MambaTreeNode]:
    return [n for n, _ in walk(cache.root_node) if n.key_len]


def test_e10_split_match_lock_evict_adopt() -> None:
    """E10, departure 12: exact mamba_exist, no slot shared by a split, slot units."""
    pools = Pools()
    cache = pools.cache()
    assert not cache.insert(RadixKey(r(1, 4)), t(11, 12, 13, 14), mamba_value=101).mamba_exist
    ins = cache.insert(RadixKey(r(1, 6)), t(21, 22, 23, 24, 25, 26), mamba_value=102)
    assert (ins.prefix_len, ins.mamba_exist) == (4, False)  # [1..4] had state, [1..6] did not
    assert ins.last_node.mamba_value.tolist() == [102]
    assert mamba_sizes(cache) == (2, 0)

    miss = cache.match_prefix(RadixKey([1, 2]))  # splits [1..4]; [1,2] has no state
    assert (miss.prefix_len, miss.last_node, miss.mamba_branching_seqlen) == (0, cache.root_node, 2)
    by_first = {n.key.token_ids[0]: n for n in nodes(cache)}
    upper, lower = by_first[1], by_first[3]
    assert upper.mamba_value is None and lower.mamba_value.tolist() == [101]
    assert mamba_sizes(cache) == (2, 0)

    leaf = cache.match_prefix(RadixKey(r(1, 6)))
    assert (leaf.prefix_len, leaf.indices.tolist()) == (6, [11, 12, 13, 14, 25, 26])
    cache.inc_lock_ref(leaf.last_node)
    assert mamba_sizes(cache) == (1, 1)
    res = cache.evict(100, 100)  # leaf locked: phase 2 tombstones [3,4] only
    assert (res.full_evicted, res.mamba_evicted) == (0, 1)
    assert pools.states_freed() == [101] and pools.freed() == []
    assert lower.mamba_value is None and not lower.evicted

    hit = cache.match_prefix(RadixKey(r(1, 4)))  # the KV is there, no state to resume
    assert (hit.prefix_len, hit.mamba_branching_seqlen) == (0, 4)
    adopt = cache.insert(RadixKey(r(1, 4)), t(31, 32, 33, 34), mamba_value=103)
    assert (adopt.prefix_len, adopt.mamba_exist, adopt.last_node) == (4, False, lower)
    assert lower.mamba_value.tolist() == [103]

    cache.dec_lock_ref(leaf.last_node)
    res = cache.evict(0, 1)  # [5,6] is least recently used: the whole leaf goes
    assert (res.full_evicted, res.mamba_evicted) == (2, 1)
    assert pools.states_freed() == [102] and pools.freed() == [25, 26]
    again = cache.match_prefix(RadixKey(r(1, 6)))
    assert (again.prefix_len, again.indices.tolist(), again.mamba_branching_seqlen) == (
        4,
        [11, 12, 13, 14],
        None,
    )
    res = cache.evict(100)
    assert (res.full_evicted, res.mamba_evicted) == (4, 1)
    assert pools.freed() == [11, 12, 13, 14] and pools.states_freed() == [103]
    assert cache.total_size() == 0 and mamba_sizes(cache) == (0, 0)
    cache.check_integrity()


def test_e11_split_never_leaks_a_mamba_lock() -> None:
    """E11 / M2: the upper part of a split gets no Mamba lock, so nothing stays protected."""
    pools = Pools()
    cache = pools.cache()
    node = cache.insert(RadixKey(r(1, 4)), t(11, 12, 13, 14), mamba_value=101).last_node
    cache.inc_lock_ref(node)
    cache.match_prefix(RadixKey([1, 2]))
    upper = node.parent
    assert (upper.lock_ref, upper.mamba_lock_ref, upper.mamba_value) == (1, 0, None)
    assert (node.lock_ref, node.mamba_lock_ref) == (1, 1)
    cache.dec_lock_ref(node)
    assert mamba_sizes(cache) == (1, 0)
    res = cache.evict(0, 10)
    assert (res.full_evicted, res.mamba_evicted) == (4, 1)
    assert pools.states_freed() == [101] and pools.freed() == [11, 12, 13, 14]
    assert mamba_sizes(cache) == (0, 0) and cache.total_size() == 0
    cache.check_integrity()


def test_split_keeps_the_state_on_the_lower_part() -> None:
    """M1: a split never hands one slot to both halves; the upper part is a tombstone."""
    pools = Pools()
    cache = pools.cache()
    node = cache.insert(RadixKey(r(1, 4)), t(11, 12, 13, 14), mamba_value=101).last_node
    cache.insert(RadixKey([1, 2, 9, 9]), t(21, 22, 23, 24), mamba_value=102)
    upper = node.parent
    assert upper.key.token_ids == [1, 2] and upper.mamba_value is None
    assert node.key.token_ids == [3, 4] and node.mamba_value.tolist() == [101]
    states = [n.mamba_value.tolist() for n in nodes(cache) if n.mamba_value is not None]
    assert sorted(states) == [[101], [102]]
    assert mamba_sizes(cache) == (2, 0)
    cache.check_integrity()


def test_mamba_sizes_count_state_slots() -> None:
    """M3: Mamba sizes and mamba_evicted count slots, whatever the token lengths."""
    pools = Pools()
    cache = pools.cache()
    a = cache.insert(RadixKey(r(1, 8)), t(*r(11, 18)), mamba_value=101).last_node
    cache.insert(RadixKey([9, 9, 9]), t(21, 22, 23), mamba_value=102)
    assert mamba_sizes(cache) == (2, 0) and cache.mamba_total_size() == 2
    cache.inc_lock_ref(a)
    assert mamba_sizes(cache) == (1, 1) and cache.protected_size() == 8
    cache.dec_lock_ref(a)
    res = cache.evict(1)  # phase 1 alone: the older leaf, 8 tokens, and its slot
    assert (res.full_evicted, res.mamba_evicted) == (8, 1)
    res = cache.evict(0, 1)
    assert (res.full_evicted, res.mamba_evicted) == (3, 1)
    assert mamba_sizes(cache) == (0, 0)
    cache.check_integrity()


def test_mamba_exist_means_the_final_node_already_had_state() -> None:
    """Departure 12: mamba_exist is about the key's end only, and then the slot is not taken."""
    pools = Pools()
    cache = pools.cache()
    cache.insert(RadixKey(r(1, 4)), t(11, 12, 13, 14), mamba_value=101)
    assert not cache.insert(RadixKey(r(1, 6)), t(*r(21, 26)), mamba_value=102).mamba_exist
    again = cache.insert(RadixKey(r(1, 6)), t(*r(31, 36)), mamba_value=103)
    assert (again.prefix_len, again.mamba_exist) == (6, True)
    assert again.last_node.mamba_value.tolist() == [102]  # 103 stays the caller's
    assert cache.insert(RadixKey(r(1, 4)), t(*r(41, 44)), mamba_value=104).mamba_exist
    assert cache.insert(RadixKey([]), t(), mamba_value=105).mamba_exist  # the root's state
    assert cache.mamba_total_size() == 2
    assert pools.states_freed() == [] and pools.freed() == []  # insert frees nothing
    cache.check_integrity()


def test_mamba_phase_deletes_leaves_instead_of_tombstoning_them() -> None:
    """Departure 12: phase 2 takes a leaf whole (with the tombstones above it), never
    leaving a tombstone leaf; on_node_evict hears of each deleted node, not tombstones."""
    pools = Pools()
    gone: list[int] = []
    cache = pools.cache(on_node_evict=gone.append)
    cache.insert(RadixKey(r(1, 4)), t(11, 12, 13, 14), mamba_value=101)
    leaf = cache.insert(RadixKey(r(1, 6)), t(*r(21, 26)), mamba_value=102).last_node
    cache.insert(RadixKey([1, 2, 7, 7]), t(31, 32, 33, 34), mamba_value=103)
    cache.match_prefix(RadixKey(r(1, 6)))
    cache.match_prefix(RadixKey([1, 2, 7, 7]))  # [3..6] path is now the older one
    res = cache.evict(0, 1)  # LRU state: [3,4] (inner): tombstoned, no callback
    assert (res.full_evicted, res.mamba_evicted, gone) == (0, 1, [])
    assert pools.states_freed() == [101]
    res = cache.evict(0, 1)  # next: leaf [5,6]; it goes with tombstone [3,4]
    assert (res.full_evicted, res.mamba_evicted) == (4, 1)
    assert pools.freed() == [13, 14, 25, 26] and pools.states_freed() == [102]
    assert gone == [leaf.id, leaf.parent.id] and leaf.evicted
    assert all(n.mamba_value is not None or n.children for n in nodes(cache))
    cache.check_integrity()


def test_match_stops_at_the_deepest_node_with_state() -> None:
    """Departure 12: a hit always ends where a state exists; branching seqlen says how far
    the KV went, rounded down to mamba_cache_chunk_size."""
    pools = Pools()
    cache = pools.cache(mamba_cache_chunk_size=4)
    cache.insert(RadixKey(r(1, 3)), t(11, 12, 13), mamba_value=101)
    cache.insert(RadixKey(r(1, 10)), t(*r(11, 20)), mamba_value=102)
    cache.evict(0, 1)  # [1..3] is older: tombstoned
    m = cache.match_prefix(RadixKey(r(1, 12)))
    assert (m.prefix_len, m.indices.tolist(), m.mamba_branching_seqlen) == (10, r(11, 20), None)
    m = cache.match_prefix(RadixKey([*r(1, 7), 99]))  # splits [4..10] at 7: no state there
    assert (m.prefix_len, m.last_node, m.mamba_branching_seqlen) == (0, cache.root_node, 4)
    cache.insert(RadixKey(r(1, 3)), t(11, 12, 13), mamba_value=103)
    m = cache.match_prefix(RadixKey([*r(1, 7), 99]))
    assert (m.prefix_len, m.mamba_branching_seqlen) == (3, 4)
    m = cache.match_prefix(RadixKey([*r(1, 5), 99]))  # walks 5: rounds to 4 > 3
    assert (m.prefix_len, m.mamba_branching_seqlen) == (3, 4)
    m = cache.match_prefix(RadixKey([1, 2, 3, 99]))
    assert (m.prefix_len, m.mamba_branching_seqlen) == (3, None)
    cache.check_integrity()


def test_lock_covers_full_kv_to_the_root_but_state_on_the_node_only() -> None:
    """inc_lock_ref: full KV of the path is protected; ancestors' states stay evictable."""
    pools = Pools()
    cache = pools.cache()
    top = cache.insert(RadixKey([1, 2]), t(11, 12), mamba_value=101).last_node
    leaf = cache.insert(RadixKey(r(1, 4)), t(11, 12, 13, 14), mamba_value=102).last_node
    cache.inc_lock_ref(leaf)
    assert (top.lock_ref, top.mamba_lock_ref, leaf.lock_ref, leaf.mamba_lock_ref) == (1, 0, 1, 1)
    assert cache.protected_size() == 4 and mamba_sizes(cache) == (1, 1)
    res = cache.evict(100, 100)
    assert (res.full_evicted, res.mamba_evicted) == (0, 1)
    assert pools.states_freed() == [101] and top.mamba_value is None
    assert cache.match_prefix(RadixKey(r(1, 4))).prefix_len == 4
    cache.dec_lock_ref(leaf)
    assert (top.lock_ref, leaf.lock_ref, leaf.mamba_lock_ref) == (0, 0, 0)
    cache.check_integrity()


def test_unbalanced_unlocks_raise_and_change_nothing() -> None:
    """Departure 8: double unlock, unlock of an unlocked or evicted node raise LockError."""
    pools = Pools()
    cache = pools.cache()
    leaf = cache.insert(RadixKey(r(1, 4)), t(11, 12, 13, 14), mamba_value=101).last_node
    with pytest.raises(LockError):
        cache.dec_lock_ref(leaf)
    cache.inc_lock_ref(leaf)
    cache.dec_lock_ref(leaf)
    with pytest.raises(LockError):
        cache.dec_lock_ref(leaf)
    assert mamba_sizes(cache) == (1, 0) and cache.evictable_size() == 4
    cache.evict(4)
    for call in (cache.inc_lock_ref, cache.dec_lock_ref):
        with pytest.raises(LockError):
            call(leaf)
    other = Pools().cache()
    node = other.insert(RadixKey([5]), t(5), mamba_value=101).last_node
    with pytest.raises(LockError):
        cache.inc_lock_ref(node)
    assert cache.inc_lock_ref(None) is None and cache.inc_lock_ref(cache.root_node) is None
    cache.check_integrity()


def test_tombstone_gaining_state_while_locked_unlocks_cleanly() -> None:
    """A locked tombstone that adopts a state takes a Mamba lock per own lock."""
    pools = Pools()
    cache = pools.cache()
    cache.insert(RadixKey(r(1, 4)), t(11, 12, 13, 14), mamba_value=101)
    cache.match_prefix(RadixKey([1, 2]))
    upper = next(n for n in nodes(cache) if n.mamba_value is None)
    cache.inc_lock_ref(upper)
    cache.inc_lock_ref(upper)
    assert upper.mamba_lock_ref == 0
    assert not cache.insert(RadixKey([1, 2]), t(11, 12), mamba_value=102).mamba_exist
    assert upper.mamba_lock_ref == 2 and mamba_sizes(cache) == (1, 1)
    assert cache.evict(0, 5).mamba_evicted == 1 and pools.states_freed() == [101]
    cache.dec_lock_ref(upper)
    cache.dec_lock_ref(upper)
    assert mamba_sizes(cache) == (1, 0) and upper.mamba_lock_ref == 0
    cache.check_integrity()


def test_unlocking_a_childless_tombstone_deletes_it() -> None:
    """A tombstone whose children were evicted while it was locked goes at unlock."""
    pools = Pools()
    gone: list[int] = []
    cache = pools.cache(on_node_evict=gone.append)
    cache.insert(RadixKey(r(1, 4)), t(11, 12, 13, 14), mamba_value=101)
    cache.match_prefix(RadixKey([1, 2]))
    upper = next(n for n in nodes(cache) if n.mamba_value is None)
    cache.inc_lock_ref(upper)
    assert cache.evict(100).full_evicted == 2  # the leaf [3,4]; [1,2] stays locked
    assert pools.freed() == [13, 14] and upper.children == {}
    cache.check_integrity()  # a locked tombstone leaf is allowed
    cache.dec_lock_ref(upper)
    assert pools.freed() == [11, 12] and gone[-1] == upper.id and upper.evicted
    assert cache.total_size() == 0 and cache.root_node.children == {}
    cache.check_integrity()


def test_lru_order_child_more_recent_than_parent() -> None:
    """Match and insert touch the whole path in the full list, each child ahead of its
    parent; a match touches only the answered node in the Mamba list (SGLang 2026-07)."""
    pools = Pools()
    cache = pools.cache()
    a = cache.insert(RadixKey([1, 2]), t(11, 12), mamba_value=101).last_node
    b = cache.insert(RadixKey([1, 2, 3]), t(11, 12, 13), mamba_value=102).last_node
    c = cache.insert(RadixKey([5]), t(15), mamba_value=103).last_node
    assert list(cache.full_lru_list) == [c, b, a]
    cache.match_prefix(RadixKey([1, 2, 3]))
    assert list(cache.full_lru_list) == [b, a, c]
    assert list(cache.mamba_lru_list) == [b, c, a]
    cache.match_prefix(RadixKey([1, 2]))
    assert list(cache.full_lru_list) == [a, b, c]
    assert list(cache.mamba_lru_list) == [a, b, c]
    res = cache.evict(1)  # the LRU unlocked *leaf* is c, though b is older than a
    assert pools.freed() == [15] and res.full_evicted == 1
    res = cache.evict(0, 1)  # the LRU state is b's (a leaf: deleted)
    assert pools.states_freed() == [102, 103] and pools.freed() == [13]
    cache.check_integrity()


def test_full_eviction_takes_parents_left_behind_in_lru_order() -> None:
    """A parent that becomes a leaf during evict is taken before newer leaves."""
    pools = Pools()
    cache = pools.cache()
    cache.insert(RadixKey([1]), t(11), mamba_value=101)
    cache.insert(RadixKey([1, 2]), t(11, 12), mamba_value=102)
    cache.insert(RadixKey([3]), t(13), mamba_value=103)
    cache.match_prefix(RadixKey([3]))  # order, oldest first: [1], [1,2], [3]
    cache.evict(2)
    assert pools.freed() == [11, 12] and pools.states_freed() == [101, 102]
    assert cache.total_size() == 1
    cache.check_integrity()


def test_paged_keys_and_unaligned_state_are_refused() -> None:
    """Departure 3: inserts align to pages; a state for an unaligned key belongs to no node."""
    pools = Pools(page_size=2)
    cache = pools.cache(page_size=2)
    with pytest.raises(InvalidInputError, match="whole pages"):
        cache.insert(RadixKey(r(1, 5)), t(*r(11, 15)), mamba_value=101)
    assert cache.total_size() == 0
    assert cache.insert(RadixKey(r(1, 4)), t(*r(11, 14)), mamba_value=101).prefix_len == 0
    m = cache.match_prefix(RadixKey(r(1, 5)))
    assert (m.prefix_len, m.indices.tolist()) == (4, r(11, 14))
    m = cache.match_prefix(RadixKey([1, 2, 3, 9]))  # splits at the page boundary
    assert (m.prefix_len, m.mamba_branching_seqlen) == (0, 2)
    cache.check_integrity()


def test_namespaces_and_token_widths_are_separate_subtrees() -> None:
    """Departure 4: extra_key and token width isolate namespaces, as in RadixCache."""
    pools = Pools()
    cache = pools.cache()
    cache.insert(RadixKey([1, 2, 3], "a"), t(11, 12, 13), mamba_value=101)
    assert cache.match_prefix(RadixKey([1, 2, 3])).prefix_len == 0
    assert cache.match_prefix(RadixKey([1, 2, 3], "")).prefix_len == 0
    assert cache.match_prefix(RadixKey([1, 2, 3], "a")).prefix_len == 3
    cache.insert(RadixKey([(1, 2), (3, 4)]), t(21, 22), mamba_value=102)
    assert cache.match_prefix(RadixKey([1, 2, 3, 4])).prefix_len == 0
    assert cache.match_prefix(RadixKey([(1, 2), (3, 4)])).prefix_len == 2
    assert len(cache.root_node.children) == 2
    cache.evict(100)
    assert cache.root_node.children == {}  # empty namespaces are dropped
    cache.check_integrity()


@pytest.mark.parametrize(
    "bad",
    [
        dict(mamba_value=7),  # a working slot, not a track slot
        dict(mamba_value=101),  # already held by the tree
        dict(mamba_value=t(102, 103)),
        dict(mamba_value=1.5),
        dict(mamba_value=None),  # new tokens need a state
    ],
)
def test_bad_insert_changes_nothing(bad: dict[str, object]) -> None:
    """Bad input raises InvalidInputError before any split or store."""
    pools = Pools()
    cache = pools.cache()
    cache.insert(RadixKey(r(1, 4)), t(11, 12, 13, 14), mamba_value=101)
    before = [(n.id, n.key_len, n.mamba_value is None) for n in nodes(cache)]
    with pytest.raises(InvalidInputError):
        cache.insert(RadixKey([1, 2, 7]), t(21, 22, 23), **bad)
    assert [(n.id, n.key_len, n.mamba_value is None) for n in nodes(cache)] == before
    assert mamba_sizes(cache) == (1, 0) and cache.total_size() == 4
    cache.check_integrity()


def test_insert_without_state_of_a_cached_key_and_bad_arguments() -> None:
    """mamba_value=None is fine when every token is cached; bad counts and policy raise."""
    cache = MambaRadixCache()
    cache.insert(RadixKey([1, 2, 3]), mamba_value=5)  # value=None: slots are the tokens
    res = cache.insert(RadixKey([1, 2, 3]))
    assert (res.prefix_len, res.mamba_exist) == (3, True)
    res = cache.insert(RadixKey([1, 2]))  # splits: the end has no state
    assert (res.prefix_len, res.mamba_exist, res.last_node.mamba_value) == (2, False, None)
    for args in ((-1,), (1, -1), (1.5,)):
        with pytest.raises(InvalidInputError):
            cache.evict(*args)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        MambaRadixCache(eviction_policy="lfu")
    with pytest.raises(InvalidInputError):
        MambaRadixCache(mamba_pool=object())
    assert cache.evict(100, swa_num_tokens=3).full_evicted == 3
    cache.check_integrity()


def test_reset_forgets_everything() -> None:
    """reset() empties the tree and both lists; old handles then refuse locks."""
    pools = Pools()
    cache = pools.cache()
    node = cache.insert(RadixKey([1, 2]), t(11, 12), mamba_value=101).last_node
    cache.reset()
    assert (cache.total_size(), cache.mamba_total_size()) == (0, 0)
    assert len(cache.full_lru_list) == len(cache.mamba_lru_list) == 0
    with pytest.raises(LockError):
        cache.inc_lock_ref(node)
    cache.check_integrity()


def test_check_integrity_reports_corruption() -> None:
    """check_integrity catches a Mamba lock above the full lock, bad sizes, broken lists."""
    pools = Pools()
    cache = pools.cache()
    node = cache.insert(RadixKey([1, 2]), t(11, 12), mamba_value=101).last_node
    node.mamba_lock_ref = 1
    with pytest.raises(IntegrityError, match="mamba_lock_ref"):
        cache.check_integrity()
    node.mamba_lock_ref = 0
    cache._mamba_evictable += 1
    with pytest.raises(IntegrityError, match="Mamba sizes"):
        cache.check_integrity()
    cache._mamba_evictable -= 1
    cache.mamba_lru_list.remove(node)
    with pytest.raises(IntegrityError, match="Mamba LRU list"):
        cache.check_integrity()
    cache.mamba_lru_list.push_mru(node)
    pools.pool.free_track_slot(101)
    with pytest.raises(IntegrityError, match="free in the Mamba pool"):
        cache.check_integrity()


def test_lru_list_operations_and_order_check() -> None:
    """The list links nodes in O(1), skips ancestors it lacks, and checks its order."""
    root = MambaTreeNode()
    a = MambaTreeNode(None, b"", None, root)
    b = MambaTreeNode(None, b"", None, a)
    for n, (length, time) in zip((a, b), ((1, 1), (1, 2)), strict=True):
        n.key_len, n.last_access_time = length, time
    lru = LRUList("mamba_prev", "mamba_next")
    lru.push_mru(a)
    lru.push_mru(b)
    assert list(lru) == [b, a] and len(lru) == 2 and a in lru
    assert lru.lru(lambda n: True) is a and lru.lru(lambda n: True, newer_than=a) is b
    assert lru.check({a.id: a, b.id: b}, "x") == []
    lru.touch_node_and_parents_mru(b)
    assert list(lru) == [b, a]
    lru.remove(b)
    assert b not in lru and lru.lru(lambda n: n is b) is None
    lru.touch_node_and_parents_mru(b)  # b is not a member: only a moves
    assert list(lru) == [a]
    assert "lacks nodes" in " ".join(lru.check({a.id: a, b.id: b}, "x"))


def test_pretty_print_shows_locks_and_states(capsys: pytest.CaptureFixture[str]) -> None:
    cache = MambaRadixCache()
    cache.insert(RadixKey([1, 2, 3, 4]), mamba_value=5)
    cache.inc_lock_ref(cache.insert(RadixKey([1, 2, 7, 7]), mamba_value=6).last_node)
    cache.pretty_print()
    out = capsys.readouterr().out
    assert "states=2 state_evictable=1" in out
    assert "lock=1 mamba_lock=0 tombstone [1, 2]" in out
    assert "lock=1 mamba_lock=1 state=6 [7, 7]" in out


def test_mamba_phase_never_revisits_a_tombstone_left_behind() -> None:
    """Deleting a leaf in the Mamba phase leaves its tombstone parent, older than the
    next candidate, alone instead of taking it (a case the long property run found)."""
    pools = Pools()
    cache = pools.cache()
    cache.insert(RadixKey(r(1, 4)), t(11, 12, 13, 14), mamba_value=101)
    cache.insert(RadixKey([1, 2, 7, 7]), t(11, 12, 23, 24), mamba_value=102)
    # LRU order: [3,4] (101), then tombstone [1,2], then [7,7] (102).
    res = cache.evict(0, 2)
    assert (res.full_evicted, res.mamba_evicted) == (6, 2)
    assert pools.states_freed() == [101, 102] and pools.freed() == [11, 12, 13, 14, 23, 24]
    cache.check_integrity()
