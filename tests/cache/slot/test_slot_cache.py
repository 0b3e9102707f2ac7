"""Unit tests of SlotPrefixCache: entries, staleness, pins and capacity eviction
(copy_kv and the integrity check: test_slot_cache_kv.py)."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from slot_helpers import make, make_stale, snapshot, take

from prefixcache.cache.errors import (
    InvalidInputError,
    LockError,
    SlotIndexError,
    TokenRangeError,
)
from prefixcache.cache.key import RadixKey
from prefixcache.cache.pools.slot_allocator import SlotAllocator, StaleSlotError
from prefixcache.cache.slot.slot_cache import MISS, SlotMatch, SlotNode, SlotPrefixCache


def test_find_returns_the_slot_holding_the_longest_prefix_without_splitting() -> None:
    """A match may end inside a node: the node's slot holds that shorter prefix too."""
    alloc, cache = make()
    slot, version = take(alloc)
    r = cache.insert([1, 2, 3, 4], slot, version)
    assert (r.prefix_len, r.evicted, r.node.depth) == (0, 0, 4)
    assert cache.find([1, 2, 3, 9]) == SlotMatch(3, slot, version)
    assert cache.find([1, 2, 3, 4, 5]) == (4, slot, version)
    assert cache.find([2]) == MISS == (0, None, None)
    assert cache.find([]) == MISS
    assert cache.num_nodes() == 1 and cache.total_size() == 4
    cache.check_integrity()


def test_insert_reports_the_cached_prefix_and_splits_at_the_key_end() -> None:
    alloc, cache = make()
    a, b = take(alloc), take(alloc)
    cache.insert([1, 2, 3, 4], *a)
    r = cache.insert([1, 2, 7], *b)
    assert r.prefix_len == 2 and r.node.depth == 3
    assert cache.num_nodes() == 3 and cache.total_size() == 5
    r = cache.insert([1, 2], *b)
    assert r.prefix_len == 2 and r.node.depth == 2 and r.node.key_len == 2
    assert cache.insert([], *b) == (0, None, 0)
    cache.check_integrity()


def test_namespaces_and_token_widths_never_share_entries() -> None:
    """None, "" and "a" are three namespaces; tuple tokens never alias their packed ints."""
    alloc, cache = make(slots=6)
    cache.insert([1, 2, 3], *take(alloc), extra_key="a")
    assert cache.find([1, 2, 3]) == MISS
    assert cache.find([1, 2, 3], extra_key="") == MISS
    assert cache.find(RadixKey([1, 2, 3], "a")).prefix_len == 3
    assert cache.find(RadixKey([1, 2, 3], "a"), extra_key="a").prefix_len == 3
    cache.insert([0, 1, 0, 1], *take(alloc))
    assert cache.find([(0, 1), (0, 1)]) == MISS
    pair = take(alloc)
    cache.insert([(0, 1), (0, 1)], *pair)
    assert cache.find([(0, 1), (0, 2)]) == (1, *pair)
    cache.check_integrity()


def test_tokens_may_be_a_tensor_or_an_array() -> None:
    from array import array

    alloc, cache = make()
    a = take(alloc)
    cache.insert(torch.tensor([5, 6, 7]), *a)
    assert cache.find(array("l", [5, 6, 8])) == (2, *a)
    assert cache.find(RadixKey.from_bytes(bytes([5, 0, 0, 0]))) == (1, *a)


@pytest.mark.parametrize("extra_key", [1, b"a", ("a",)])
def test_a_non_string_extra_key_is_refused(extra_key: object) -> None:
    _, cache = make()
    with pytest.raises(InvalidInputError):
        cache.find([1], extra_key=extra_key)  # type: ignore[arg-type]


def test_a_radix_key_and_a_different_extra_key_are_refused() -> None:
    _, cache = make()
    with pytest.raises(InvalidInputError):
        cache.find(RadixKey([1], "a"), extra_key="b")


def test_a_slot_that_moved_on_is_never_returned_as_usable() -> None:
    """Once the slot is reallocated its entries are stale: find skips them."""
    alloc, cache = make()
    slot, version = take(alloc)
    cache.insert([1, 2, 3], slot, version)
    alloc.free(slot)
    assert cache.find([1, 2, 3]) == (3, slot, version)  # freed, KV still intact
    make_stale(alloc, slot)
    assert cache.find([1, 2, 3]) == MISS
    assert cache.total_size() == 3  # stale entries stay until evicted or refreshed
    cache.check_integrity()


def test_find_takes_the_deepest_usable_node_past_stale_ones() -> None:
    """A stale ancestor does not hide a deeper node whose slot holds the path."""
    alloc, cache = make()
    a, b = take(alloc), take(alloc)
    cache.insert([1, 2, 3, 4], *a)
    cache.insert([1, 2], *b)  # [1, 2] now names b; [3, 4] keeps a
    make_stale(alloc, b[0])
    assert cache.find([1, 2, 3, 4]) == (4, *a)
    assert cache.find([1, 2, 9]) == MISS
    make_stale(alloc, a[0])
    assert cache.find([1, 2, 3, 4]) == MISS


def test_insert_refreshes_stale_ancestors_to_the_new_slot() -> None:
    """Seed 004's "the slot holds the whole path": every node on it takes the new entry."""
    alloc, cache = make()
    a, b = take(alloc), take(alloc)
    cache.insert([1, 2, 3], *a)
    make_stale(alloc, a[0])
    assert cache.insert([1, 2, 3, 4, 5], *b).prefix_len == 3
    assert cache.find([1, 2, 3]) == (3, *b)
    assert cache.find([1, 2, 9]) == (2, *b)


def test_insert_moves_live_ancestors_to_the_newest_holder() -> None:
    alloc, cache = make()
    a, b = take(alloc), take(alloc)
    cache.insert([1, 2, 3], *a)
    cache.insert([1, 2, 3, 4], *b)
    assert cache.find([1, 2, 3]) == (3, *b)
    make_stale(alloc, b[0])
    assert cache.find([1, 2, 3]) == MISS  # the older holder is no longer named


def test_a_shorter_key_for_the_same_slot_writes_its_whole_path() -> None:
    """Re-inserting a prefix of what a slot holds re-labels the path down to its end."""
    alloc, cache = make()
    a, b = take(alloc), take(alloc)
    cache.insert([1, 2, 3, 4], *a)
    cache.insert([1, 2, 5], *b)  # [1, 2] -> b, [3, 4] keeps a
    cache.insert([1], *a)
    make_stale(alloc, b[0])
    assert cache.find([1, 2, 5]) == (2, *a)
    cache.check_integrity()


def test_growing_a_sequence_in_its_slot_extends_the_entry() -> None:
    alloc, cache = make()
    a = take(alloc)
    cache.insert([1, 2], *a)
    assert cache.insert([1, 2, 3, 4], *a).prefix_len == 2
    assert cache.find([1, 2, 3, 4]) == (4, *a)
    cache.check_integrity()


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (([1, 2], 0, 2), StaleSlotError),  # a version from the future
        (([1, 2], 1, 0), StaleSlotError),  # slot 1 never allocated: version 0
        (([1, 2], 9, 1), SlotIndexError),
        (([1, 2], -1, 1), SlotIndexError),
        (([1, 2], 0, -1), InvalidInputError),
        (([1, 2], 0, True), InvalidInputError),
        (([-1], 0, 1), TokenRangeError),
        (([2**32], 0, 1), TokenRangeError),
        (("ab", 0, 1), InvalidInputError),
        ((None, 0, 1), InvalidInputError),
        (([1, (2, 3)], 0, 1), InvalidInputError),
        (([7] * 9, 0, 1), InvalidInputError),  # longer than max_seq_len
        (([5, 6], 0, 1), InvalidInputError),  # slot 0 v1 holds [1, 2, 3]
        (([1, 2, 4], 0, 1), InvalidInputError),
    ],
)
def test_bad_inserts_raise_and_change_nothing(
    args: tuple[Any, ...], error: type[Exception]
) -> None:
    alloc, cache = make(max_seq_len=8)
    cache.insert([1, 2, 3], *take(alloc))
    before = snapshot(cache)
    with pytest.raises(error):
        cache.insert(*args)
    assert snapshot(cache) == before
    cache.check_integrity()


def test_an_empty_key_is_a_no_op_whatever_the_slot_holds() -> None:
    """An empty key packs as width 1; it must not clash with a width-2 entry."""
    alloc, cache = make()
    a = take(alloc)
    cache.insert([(0, 1)], *a)
    before = snapshot(cache)
    assert cache.insert([], *a) == (0, None, 0)
    assert snapshot(cache) == before


def test_the_same_slot_version_in_another_namespace_is_a_contradiction() -> None:
    alloc, cache = make()
    a = take(alloc)
    cache.insert([1, 2, 3], *a)
    with pytest.raises(InvalidInputError):
        cache.insert([1, 2, 3], *a, extra_key="a")


def test_pin_by_tokens_pins_exactly_the_usable_prefix() -> None:
    """The node is split so the pin covers find's answer and no more."""
    alloc, cache = make()
    a = take(alloc)
    cache.insert([1, 2, 3, 4], *a)
    node = cache.pin([1, 2, 9])
    assert isinstance(node, SlotNode)
    assert (node.depth, node.slot, node.version) == (2, *a)
    assert cache.protected_size() == 2 and cache.evictable_size() == 2
    assert cache.num_pins() == 1 and cache.num_nodes() == 2
    assert cache.pin([5]) is None and cache.num_pins() == 1
    cache.check_integrity()
    cache.release(node)
    assert cache.protected_size() == 0 and cache.num_pins() == 0
    cache.check_integrity()


def test_pins_on_a_handle_add_up_and_must_balance() -> None:
    alloc, cache = make()
    node = cache.insert([1, 2, 3], *take(alloc)).node
    assert cache.pin(node) is node and cache.pin(node) is node
    assert node.own_lock_ref == 2 and cache.num_pins() == 2
    cache.release(node)
    cache.release(node)
    before = snapshot(cache)
    with pytest.raises(LockError):
        cache.release(node)
    assert snapshot(cache) == before


def test_a_split_keeps_a_pinned_handle_where_it_ends() -> None:
    alloc, cache = make()
    node = cache.insert([1, 2, 3, 4], *take(alloc)).node
    cache.pin(node)
    cache.insert([1, 2, 5], *take(alloc))
    assert node.depth == 4 and node.key_len == 2 and node.parent.lock_ref == 1
    assert cache.protected_size() == 4
    cache.release(node)
    cache.check_integrity()


def test_release_and_pin_refuse_evicted_foreign_and_pre_reset_nodes() -> None:
    alloc, cache = make()
    _, other = make()
    node = cache.insert([1, 2], *take(alloc)).node
    foreign = other.insert([1, 2], *take(other.allocator)).node
    for bad in (foreign, cache.root_node):
        with pytest.raises(LockError):
            cache.pin(bad)
    with pytest.raises(InvalidInputError):
        cache.release([1, 2])  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        cache.pin(node, extra_key="a")
    cache.evict(10)
    before = snapshot(cache)
    for call in (cache.pin, cache.release):
        with pytest.raises(LockError):
            call(node)
    assert snapshot(cache) == before
    node = cache.insert([1, 2], *take(alloc)).node
    cache.pin(node)
    cache.reset()
    with pytest.raises(LockError):
        cache.release(node)
    assert cache.total_size() == cache.num_nodes() == cache.num_pins() == 0
    cache.check_integrity()


def test_capacity_evicts_the_least_recently_used_leaf() -> None:
    """Capacity counts tokens; a find refreshes the nodes that served it."""
    alloc, cache = make(capacity=6, slots=8)
    for tokens in ([1, 2], [3, 4], [5, 6]):
        cache.insert(tokens, *take(alloc))
    cache.find([1, 2])
    r = cache.insert([7, 8], *take(alloc))
    assert r.evicted == 2 and cache.total_size() == 6
    assert cache.find([3, 4]) == MISS
    assert all(cache.find(t).prefix_len == 2 for t in ([1, 2], [5, 6], [7, 8]))
    cache.check_integrity()


def test_a_stale_node_is_not_refreshed_by_finds_through_it() -> None:
    """Only the nodes that served a find are touched, so stale ones age out first."""
    for stale in (False, True):
        alloc, cache = make(slots=8)
        a = take(alloc)
        cache.insert([1, 2, 3, 4], *a)
        cache.insert([1, 2], *take(alloc))  # splits: [1, 2] | [3, 4]
        cache.insert([9], *take(alloc))  # newer than [3, 4]
        if stale:
            make_stale(alloc, a[0])
        cache.find([1, 2, 3, 4])
        cache.evict(1)
        gone = [9] if not stale else [1, 2, 3, 4]
        assert cache.find(gone).prefix_len == (0 if not stale else 2)


def test_eviction_never_takes_a_pinned_node_or_one_with_pinned_descendants() -> None:
    alloc, cache = make(slots=8)
    cache.insert([1, 2, 3], *take(alloc))
    deep = cache.insert([1, 2, 4, 5], *take(alloc)).node
    cache.pin(deep)
    assert cache.evict(100) == 1  # only the unpinned leaf [3]
    assert cache.find([1, 2, 4, 5]).prefix_len == 4 and cache.total_size() == 4
    cache.release(deep)
    assert cache.evict(1) == 2  # a whole leaf, [4, 5]
    assert cache.evict(100) == 2 and cache.total_size() == 0
    assert cache.root_node.children == {}  # the empty namespace is dropped
    cache.check_integrity()


def test_an_insert_with_no_room_beside_pinned_tokens_is_evicted_at_once() -> None:
    """The tree never exceeds capacity: the new, unpinned tokens go again (LRU last)."""
    alloc, cache = make(capacity=4, slots=8)
    node = cache.insert([1, 2, 3, 4], *take(alloc)).node
    cache.pin(node)
    before = cache.find([1, 2, 3, 4])
    r = cache.insert([5, 6], *take(alloc))
    assert r == (0, None, 2) and cache.total_size() == 4
    r = cache.insert([1, 2, 3, 4, 7], *take(alloc))  # cut to capacity: relabels [1..4]
    assert r.node is node and r.evicted == 0 and cache.find([1, 2, 3, 4]) != before
    cache.release(node)
    assert cache.total_size() == 4
    cache.check_integrity()


def test_a_key_longer_than_the_capacity_is_cached_up_to_it() -> None:
    alloc, cache = make(capacity=3)
    a = take(alloc)
    r = cache.insert([1, 2, 3, 4, 5], *a)
    assert r.node.depth == 3 and cache.total_size() == 3
    assert cache.find([1, 2, 3, 4, 5]) == (3, *a)


def test_node_ids_keying_the_lru_queue_are_never_reused() -> None:
    """The reference keyed LRU by id(node), which a new node may reuse once one is freed."""
    alloc, cache = make(capacity=4, slots=2)
    seen: set[int] = set()
    for i in range(200):
        node = cache.insert([i, i + 1, i + 2], *take(alloc)).node
        assert node.id not in seen
        seen.add(node.id)
        alloc.free(node.slot)
        del node
        gc.collect(0)
    assert len(cache._leaves) == cache.num_nodes() == 1
    cache.check_integrity()


def test_policies_are_chosen_by_name() -> None:
    alloc, cache = make(capacity=4, slots=8, eviction_policy="fifo")
    for tokens in ([1, 2], [3, 4]):
        cache.insert(tokens, *take(alloc))
    cache.find([1, 2])
    cache.insert([5, 6], *take(alloc))
    assert cache.find([1, 2]) == MISS  # oldest, despite the hit
    with pytest.raises(InvalidInputError):
        make(eviction_policy="nope")


@pytest.mark.parametrize("kwargs", [dict(capacity=0), dict(capacity=1, max_seq_len=0)])
def test_constructor_checks_its_sizes(kwargs: dict[str, int]) -> None:
    with pytest.raises(InvalidInputError):
        SlotPrefixCache(SlotAllocator(1), **kwargs)
