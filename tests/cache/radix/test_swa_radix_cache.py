"""SWARadixCache: worked examples E5-E9 and the sliding-window departures from the reference
(docs/semantics.md, departure 11), with SGLang's semantics."""

from __future__ import annotations

import pytest
import torch

from prefixcache.cache import (
    InvalidInputError,
    LockError,
    RadixCache,
    RadixKey,
    SWATokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from prefixcache.cache.inspection import walk
from prefixcache.cache.radix.swa_radix_cache import SWARadixCache


def t(*slots: int) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.int64)


def r(lo: int, hi: int) -> list[int]:
    return list(range(lo, hi + 1))


class SwaSlots:
    """A real SWA allocator with every slot handed out, reporting full and SWA frees."""

    def __init__(self, size: int = 128) -> None:
        self.allocator = SWATokenToKVPoolAllocator(size, size)
        self.all = self.allocator.alloc(self.allocator.available_size())
        self._full: set[int] = set()
        self._swa: set[int] = set()

    def freed(self) -> list[int]:
        """Full slots freed since the previous call, sorted."""
        now = set(self.all[~self.allocator.is_allocated(self.all)].tolist())
        new, self._full = sorted(now - self._full), now
        return new

    def swa_freed(self) -> list[int]:
        """Full slots whose SWA KV was freed since the previous call, sorted."""
        now = set(self.all[~self.allocator.is_swa_mapped(self.all)].tolist())
        new, self._swa = sorted(now - self._swa), now
        return new


def swa_cache(window: int, slots: SwaSlots, **kwargs: object) -> SWARadixCache:
    cache = RadixCache(
        sliding_window_size=window, token_to_kv_pool_allocator=slots.allocator, **kwargs
    )
    assert isinstance(cache, SWARadixCache)
    return cache


def test_e5_window_rule_locks_and_eviction() -> None:
    """E5 (W=4): tombstones, the window rule on match, boundary locks, full cascade."""
    slots = SwaSlots()
    evicted: list[int] = []
    cache = swa_cache(4, slots, on_node_evict=evicted.append)
    cache.insert(RadixKey(r(1, 4)), t(*r(11, 14)))
    assert cache.insert(RadixKey(r(1, 8)), t(*r(21, 28))).prefix_len == 4
    assert slots.freed() == r(21, 24)  # SWA insert frees its own duplicates
    slots.swa_freed()

    result = cache.evict(0, 1)
    assert (result.full_evicted, result.swa_evicted) == (0, 4)
    assert slots.swa_freed() == r(11, 14) and slots.freed() == [] and evicted == []
    cache.check_integrity()

    match = cache.match_prefix(RadixKey(r(1, 9)))
    assert match.indices.tolist() == r(11, 14) + r(25, 28)
    assert cache.match_prefix(RadixKey(r(1, 6))).prefix_len == 0  # only 2 live tokens
    assert cache.match_prefix(RadixKey(r(1, 4))).prefix_len == 0

    match = cache.match_prefix(RadixKey(r(1, 9)))
    boundary = cache.inc_lock_ref(match.last_node)
    assert boundary is not None and match.last_node.parent.swa_boundary_id == boundary
    assert (cache.swa_protected_size(), cache.protected_size()) == (4, 8)
    assert cache.evict(0, 100).swa_evicted == 0
    cache.check_integrity()
    cache.dec_lock_ref(match.last_node, boundary)
    assert (cache.swa_protected_size(), cache.swa_evictable_size()) == (0, 4)

    result = cache.evict(0, 100)  # the cascade takes the orphaned tombstones too
    assert (result.full_evicted, result.swa_evicted) == (8, 4)
    assert slots.freed() == r(11, 14) + r(25, 28)
    assert cache.total_size() == 0 and len(evicted) == 3
    cache.check_integrity()


def make_tombstone_then_leaf(cache: SWARadixCache) -> None:
    """Tree [1..4](tombstone) -> [5,6]=[25,26]."""
    cache.insert(RadixKey(r(1, 4)), t(*r(11, 14)))
    cache.insert(RadixKey(r(1, 6)), t(*r(21, 26)))
    assert cache.evict(0, 1).swa_evicted == 4


def test_e6_insert_revives_a_tombstone() -> None:
    """E6: fresh SWA KV for a tombstone replaces its stale full KV."""
    slots = SwaSlots()
    cache = swa_cache(2, slots)
    make_tombstone_then_leaf(cache)
    slots.freed(), slots.swa_freed()
    result = cache.insert(RadixKey(r(1, 7)), t(*r(31, 37)))
    assert result.prefix_len == 6
    assert slots.freed() == [*r(11, 14), 35, 36]
    assert cache.match_prefix(RadixKey(r(1, 7))).indices.tolist() == [*r(31, 34), 25, 26, 37]
    assert result.last_node.key_len == 1
    cache.check_integrity()


def test_e6_swa_evicted_prefix_enters_as_tombstone() -> None:
    """E6: with swa_evicted_seqlen=3 the first 3 tokens become a tombstone above the rest."""
    slots = SwaSlots()
    cache = swa_cache(2, slots)
    slots.allocator.free_swa(t(1, 2, 3))  # the runtime already dropped their SWA KV
    cache.insert(RadixKey(r(1, 6)), t(*r(1, 6)), swa_evicted_seqlen=3)
    assert cache.match_prefix(RadixKey(r(1, 6))).prefix_len == 6
    assert cache.match_prefix(RadixKey(r(1, 4))).prefix_len == 0
    cache.check_integrity()


def test_b2_tail_without_swa_is_not_stored() -> None:
    """B2 fix: when the whole tail's SWA KV is gone the tail is freed, not cached live."""
    slots = SwaSlots()
    cache = swa_cache(2, slots)
    slots.allocator.free_swa(t(91, 92))
    slots.swa_freed()
    assert cache.insert(RadixKey([9, 9]), t(91, 92), swa_evicted_seqlen=2).prefix_len == 0
    assert cache.total_size() == 0 and slots.freed() == [91, 92]
    cache.check_integrity()


def test_b3_partly_swa_evicted_tombstone_is_split_and_revived() -> None:
    """B3 fix: the fresh part of a tombstone is revived by splitting it (SGLang branch 2)."""
    slots = SwaSlots()
    cache = swa_cache(2, slots)
    make_tombstone_then_leaf(cache)
    slots.allocator.free_swa(t(31, 32))
    slots.freed(), slots.swa_freed()
    cache.insert(RadixKey(r(1, 6)), t(*r(31, 36)), swa_evicted_seqlen=2)
    assert slots.freed() == [13, 14, 31, 32, 35, 36]
    assert cache.match_prefix(RadixKey(r(1, 6))).indices.tolist() == [11, 12, 33, 34, 25, 26]
    assert cache.match_prefix(RadixKey(r(1, 4))).prefix_len == 4  # [3,4] is live again
    cache.check_integrity()


def test_b4_only_slots_past_prev_prefix_len_are_freed() -> None:
    """B4 fix: slots below prev_prefix_len belong to the tree and are never freed."""
    slots = SwaSlots()
    cache = swa_cache(2, slots)
    cache.insert(RadixKey(r(1, 4)), t(*r(11, 14)))
    slots.freed()
    result = cache.insert(RadixKey(r(1, 6)), t(11, 12, 33, 34, 35, 36), prev_prefix_len=2)
    assert result.prefix_len == 4 and slots.freed() == [33, 34]
    cache.check_integrity()


def test_e7_split_is_followed_on_insert() -> None:
    """E7 / B1 fix: a key diverging inside a node continues from the upper half."""
    slots = SwaSlots()
    cache = swa_cache(2, slots)
    cache.insert(RadixKey([1, 2, 3, 4]), t(11, 12, 13, 14))
    cache.insert(RadixKey([1, 2, 5, 6]), t(21, 22, 23, 24))
    assert slots.freed() == [21, 22]
    assert cache.match_prefix(RadixKey([1, 2, 5, 6])).indices.tolist() == [11, 12, 23, 24]
    assert cache.match_prefix(RadixKey(r(1, 6))).indices.tolist() == [11, 12, 13, 14]
    cache.check_integrity()


def test_e8_allocator_without_free_swa_is_refused() -> None:
    """E8 fix: SWA mode without free_swa would double free, so construction fails."""
    with pytest.raises(InvalidInputError, match="free_swa"):
        RadixCache(sliding_window_size=2, token_to_kv_pool_allocator=TokenToKVPoolAllocator(8))


def test_e9_boundary_moves_up_on_split_and_double_unlock_raises() -> None:
    """E9: splitting the boundary node moves the boundary up; a second unlock raises."""
    slots = SwaSlots()
    cache = swa_cache(3, slots)
    leaf = cache.insert(RadixKey(r(1, 6)), t(*r(11, 16))).last_node
    boundary = cache.inc_lock_ref(leaf)
    assert leaf.swa_boundary_id == boundary
    upper = cache.match_prefix(RadixKey(r(1, 3))).last_node
    assert upper.swa_boundary_id == boundary and leaf.swa_boundary_id is None
    cache.dec_lock_ref(leaf, boundary)
    assert (cache.swa_protected_size(), cache.protected_size()) == (0, 0)
    with pytest.raises(LockError):
        cache.dec_lock_ref(leaf, boundary)
    cache.check_integrity()


def test_unlock_with_a_foreign_boundary_changes_nothing() -> None:
    """A boundary id that is not on the node's path is refused before anything changes."""
    cache = swa_cache(2, SwaSlots())
    leaf = cache.insert(RadixKey(r(1, 4)), t(*r(11, 14))).last_node
    boundary = cache.inc_lock_ref(leaf)
    with pytest.raises(LockError):
        cache.dec_lock_ref(leaf, boundary + 100)
    assert cache.swa_protected_size() == 4
    cache.dec_lock_ref(leaf, boundary)
    cache.check_integrity()


def test_locked_tombstone_is_not_revived() -> None:
    """A full-locked tombstone keeps its slots; the incoming ones are freed instead."""
    slots = SwaSlots()
    cache = swa_cache(2, slots)
    make_tombstone_then_leaf(cache)
    leaf = cache.match_prefix(RadixKey(r(1, 6))).last_node
    boundary = cache.inc_lock_ref(leaf)
    slots.freed(), slots.swa_freed()
    cache.insert(RadixKey(r(1, 7)), t(*r(31, 37)))
    assert slots.freed() == r(31, 36)
    cache.dec_lock_ref(leaf, boundary)
    cache.check_integrity()


def test_short_path_locks_swa_to_the_root() -> None:
    """A path shorter than the window returns no boundary and SWA-locks everything."""
    cache = swa_cache(10, SwaSlots())
    leaf = cache.insert(RadixKey(r(1, 4)), t(*r(11, 14))).last_node
    assert cache.inc_lock_ref(leaf) is None
    assert cache.swa_protected_size() == 4
    cache.dec_lock_ref(leaf)
    assert cache.swa_evictable_size() == 4
    cache.check_integrity()


def test_match_refreshes_recency() -> None:
    """Departure 11: a match makes its path recent, so the other sequence goes first."""
    slots = SwaSlots()
    cache = swa_cache(2, slots)
    cache.insert(RadixKey([1, 2]), t(11, 12))
    cache.insert(RadixKey([3, 4]), t(13, 14))
    cache.match_prefix(RadixKey([1, 2]))
    cache.evict(1)
    assert slots.freed() == [13, 14]


def test_sliding_window_must_be_positive() -> None:
    """A zero window is a configuration error."""
    with pytest.raises(InvalidInputError):
        RadixCache(sliding_window_size=0)


def _tree_swa_tokens(cache: SWARadixCache) -> int:
    return sum(n.key_len for n, _ in walk(cache.root_node) if n.key_len and not n.swa_tombstone)


def test_unlocking_a_tombstone_never_leaves_an_unlocked_tombstone_leaf() -> None:
    """DirectMachine, page 1, shrunk to five steps.

    ``insert([0])`` returns node A; ``insert([0, 0])`` hangs B under it; an SWA-only
    eviction tombstones A (the older inner node); the caller locks A (an insert's
    ``last_node``, now a tombstone); the next SWA eviction deletes the leaf B and stops
    at the locked A. Unlocking A then leaves an unlocked tombstone *leaf*, which
    ``check_integrity`` rejects ("tombstone ... is an unlocked leaf"; SGLang's invariant
    is that a leaf is never a tombstone): it holds full KV no match can ever return.
    """
    alloc = SWATokenToKVPoolAllocator(16, 16)
    cache = RadixCache(sliding_window_size=3, token_to_kv_pool_allocator=alloc)
    a = cache.insert(RadixKey([0]), alloc.alloc(1)).last_node
    cache.insert(RadixKey([0, 0]), alloc.alloc(2))  # [0] | [0]; the duplicate is freed
    assert cache.evict(0, 1).swa_evicted == 1
    assert a.swa_tombstone
    cache.inc_lock_ref(a)
    assert cache.evict(0, 1).full_evicted == 1  # B goes; A is locked
    cache.check_integrity()
    cache.dec_lock_ref(a)
    cache.check_integrity()  # raised: "tombstone ... is an unlocked leaf"
    assert cache.swa_evictable_size() + cache.swa_protected_size() == _tree_swa_tokens(cache)
    assert alloc.num_allocated() == cache.total_size()


def test_unlocking_a_stale_tombstoned_match_handle() -> None:
    """The same defect reached through a match handle that was tombstoned after the
    match, and a full (phase-1) eviction of its child while it is locked."""
    alloc = SWATokenToKVPoolAllocator(16, 16)
    cache = RadixCache(sliding_window_size=1, token_to_kv_pool_allocator=alloc)
    cache.insert(RadixKey([1, 2, 3, 4]), alloc.alloc(4))
    handle = cache.match_prefix(RadixKey([1, 2])).last_node  # splits [1,2] | [3,4]
    cache.match_prefix(RadixKey([1, 2, 3, 4]))  # touch: the parent ranks older
    assert cache.evict(0, 1).swa_evicted == 2
    assert handle.swa_tombstone  # the inner node [1,2] was tombstoned
    cache.inc_lock_ref(handle)
    assert cache.evict(100).full_evicted == 2  # [3,4] goes; [1,2] is locked
    cache.check_integrity()
    cache.dec_lock_ref(handle)
    cache.check_integrity()
    assert alloc.num_allocated() == cache.total_size()


def test_unaligned_swa_evicted_seqlen_is_refused_without_change() -> None:
    """Found while building the machine's ``swa_evicted_seqlen`` choices.

    With ``s`` inside a page the cache used to round ``s`` up and store ``[0, page)`` as a
    tombstone although the caller had freed the SWA KV before ``s`` only: the tombstone
    kept live SWA slots (``check_integrity``: "a tombstone's slot still holds SWA KV")
    and the SWA pool held a slot neither the tree nor the caller accounted for. Insert
    now refuses such a value before changing anything (the docstring's choice), which
    the machines also check.
    """
    alloc = SWATokenToKVPoolAllocator(16, 16, page_size=2)
    cache = RadixCache(page_size=2, sliding_window_size=2, token_to_kv_pool_allocator=alloc)
    kv = alloc.alloc(6)
    alloc.free_swa(kv[:1])  # the request's SWA KV before position 1 is gone
    with pytest.raises(InvalidInputError):
        cache.insert(RadixKey([1, 2, 3, 4, 5, 6]), kv, swa_evicted_seqlen=1)
    assert cache.total_size() == 0
    assert alloc.num_allocated() == 6
    assert alloc.is_swa_mapped(kv).tolist() == [False] + [True] * 5
    cache.check_integrity()
    # the caller frees the rest of that page's SWA KV and retries with the page end
    alloc.free_swa(kv[1:2])
    assert cache.insert(RadixKey([1, 2, 3, 4, 5, 6]), kv, swa_evicted_seqlen=2).prefix_len == 0
    cache.check_integrity()
    live = _tree_swa_tokens(cache)
    assert (live, cache.total_size()) == (4, 6)
    assert cache.swa_evictable_size() + cache.swa_protected_size() == live
    assert alloc.swa_attn_allocator.num_allocated() == live
