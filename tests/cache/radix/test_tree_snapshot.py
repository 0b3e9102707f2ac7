"""tree_snapshot: a radix tree taken, encoded, decoded and rebuilt over a fresh allocator
matches what it was; a pruned image keeps exactly the prefixes it was cut to; a
damaged snapshot is refused and leaves the cache empty."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.cache import RadixCache, RadixKey, TokenToKVPoolAllocator
from prefixcache.cache.index.change_log import ChangeLog
from prefixcache.cache.radix.tree_snapshot import (
    SnapshotError,
    TreeImage,
    decode,
    encode,
    prune,
    restore,
    take,
)


def _cache(
    page_size: int, listener: ChangeLog | None = None, rows: int = 256
) -> tuple[RadixCache, TokenToKVPoolAllocator]:
    alloc = TokenToKVPoolAllocator(rows, "cpu", page_size)
    return RadixCache(page_size, None, alloc, listener=listener), alloc


def _put(cache: RadixCache, alloc: TokenToKVPoolAllocator, key: RadixKey) -> None:
    have = cache.match_prefix(key)
    slots = alloc.alloc(len(key) - have.prefix_len)
    value = torch.cat([have.indices, slots])
    done = cache.insert(key, value)
    alloc.free(value[have.prefix_len : done.prefix_len])  # already cached: the caller's
    aligned = len(key) - len(key) % cache.page_size
    if aligned < len(key):
        alloc.free(value[aligned:])  # the unaligned tail is not cached either


def _fill(cache: RadixCache, alloc: TokenToKVPoolAllocator) -> list[RadixKey]:
    keys = [
        RadixKey(list(range(1, 17))),
        RadixKey([*range(1, 9), *range(50, 58)]),
        RadixKey(list(range(1, 13)), extra_key="tenant"),
        RadixKey([(1, 2), (3, 4), (5, 6), (7, 8)]),
        RadixKey(list(range(90, 98))),
    ]
    for key in keys:
        _put(cache, alloc, key)
    cache.match_prefix(keys[0][:4])  # a split that stays, and a touch
    return keys


def _same_tree(
    fresh: RadixCache,
    fresh_alloc: TokenToKVPoolAllocator,
    cache: RadixCache,
    alloc: TokenToKVPoolAllocator,
    keys: list[RadixKey],
) -> None:
    fresh.check_integrity()
    assert fresh.total_size() == cache.total_size() and fresh.protected_size() == 0
    assert fresh_alloc.num_allocated() == alloc.num_allocated()
    assert fresh_alloc.available_size() == alloc.available_size()
    for key in keys:
        assert torch.equal(fresh.match_prefix(key).indices, cache.match_prefix(key).indices)


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_tree_comes_back_with_the_same_slots(page_size: int) -> None:
    cache, alloc = _cache(page_size)
    keys = _fill(cache, alloc)
    image = decode(encode(take(cache)))
    assert image.tokens == cache.total_size() == alloc.num_allocated()
    fresh, fresh_alloc = _cache(page_size)
    nodes = restore(fresh, fresh_alloc, image)
    assert len(nodes) == image.nodes and sum(n.key_len for n in nodes) == image.tokens
    _same_tree(fresh, fresh_alloc, cache, alloc, keys)
    # The slots left are the free ones: a new allocation never hands out a tree slot.
    new = fresh_alloc.alloc(fresh_alloc.available_size())
    assert new is not None and not fresh_alloc.is_allocated(torch.tensor([0])).any()
    tree = torch.cat([fresh.match_prefix(k).indices for k in keys])
    assert not np.isin(new.numpy(), tree.numpy()).any()


def test_whole_pages_are_kept_as_page_numbers() -> None:
    cache, alloc = _cache(4)
    _fill(cache, alloc)
    paged = encode(take(cache))
    cache1, alloc1 = _cache(1)
    _fill(cache1, alloc1)
    assert b'"paged": true' in paged and b'"paged": false' in encode(take(cache1))
    # Slots that are not whole aligned pages are kept as they are.
    odd, odd_alloc = _cache(4)
    slots = odd_alloc.alloc(8)
    odd.insert(RadixKey(list(range(1, 9))), slots.flip(0))
    data = encode(take(odd))
    assert b'"paged": false' in data
    fresh, fresh_alloc = _cache(4)
    restore(fresh, fresh_alloc, decode(data))
    assert torch.equal(fresh.match_prefix(RadixKey(list(range(1, 9)))).indices, slots.flip(0))


def test_lru_order_survives() -> None:
    cache, alloc = _cache(1)
    old, new = RadixKey([1, 2, 3]), RadixKey([7, 8, 9])
    for key in (old, new):
        cache.insert(key, alloc.alloc(3))
    cache.match_prefix(old)  # old is now the most recent
    fresh, fresh_alloc = _cache(1)
    restore(fresh, fresh_alloc, decode(encode(take(cache))))
    fresh.evict(3)
    assert fresh.match_prefix(old).prefix_len == 3 and fresh.match_prefix(new).prefix_len == 0
    # New touches rank after every restored one.
    fresh.insert(new, fresh_alloc.alloc(3))
    fresh.evict(3)
    assert fresh.match_prefix(new).prefix_len == 3


def test_a_listener_hears_of_every_restored_page() -> None:
    cache, alloc = _cache(4, ChangeLog())
    keys = _fill(cache, alloc)
    log = ChangeLog()
    fresh, fresh_alloc = _cache(4, log)
    restore(fresh, fresh_alloc, decode(encode(take(cache))))
    fresh.check_integrity()  # page hashes chain from the parents
    stored = {
        (r.extra_key, r.token_width, r.parent_hash, r.page_hashes)
        for r in log.since(-1)
        if type(r).__name__ == "PagesStored"
    }
    assert stored == {
        (r.extra_key, r.token_width, r.parent_hash, r.page_hashes)
        for r in cache.listener.snapshot().pages
    }
    for key in keys:
        assert fresh.match_prefix(key).prefix_len == cache.match_prefix(key).prefix_len


def test_prune_keeps_what_it_is_cut_to() -> None:
    cache, alloc = _cache(4)
    keys = _fill(cache, alloc)
    image = decode(encode(take(cache)))
    # The first node cut to one page: its children go; a node cut to 0 goes whole.
    keep = image.key_lens.copy()
    first = int(np.flatnonzero(image.parent == -1)[0])
    keep[first] = 4
    pruned = prune(image, keep)
    assert pruned.tokens < image.tokens
    below = np.flatnonzero(image.parent == first)
    assert pruned.nodes == image.nodes - len(below) - sum(
        1 for i in range(image.nodes) if image.parent[i] in below
    )
    fresh, fresh_alloc = _cache(4)
    restore(fresh, fresh_alloc, pruned)
    fresh.check_integrity()
    assert fresh_alloc.num_allocated() == pruned.tokens
    for key in keys:  # every hit is a prefix of what it was, with the same slots
        got, was = fresh.match_prefix(key).indices, cache.match_prefix(key).indices
        assert torch.equal(got, was[: len(got)])
    assert prune(image, image.key_lens) is image
    empty = prune(image, np.zeros(image.nodes, dtype=np.int64))
    assert empty.nodes == 0 and empty.namespaces == []


KEYS = st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=24), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(KEYS, st.sampled_from([1, 2, 4]), st.integers(0, 40), st.data())
def test_any_tree_comes_back_and_any_cut_is_a_prefix(
    keys: list[list[int]], page_size: int, evict: int, data: st.DataObject
) -> None:
    cache, alloc = _cache(page_size, rows=512)
    radix = [RadixKey(k) for k in keys]
    for key in radix:
        _put(cache, alloc, key)
    cache.evict(evict)
    image = decode(encode(take(cache)))
    fresh, fresh_alloc = _cache(page_size, rows=512)
    restore(fresh, fresh_alloc, image)
    _same_tree(fresh, fresh_alloc, cache, alloc, radix)
    keep = np.asarray(
        [data.draw(st.integers(0, int(n))) for n in image.key_lens.tolist()], dtype=np.int64
    )
    cut, cut_alloc = _cache(page_size, rows=512)
    restore(cut, cut_alloc, prune(image, keep))
    cut.check_integrity()
    for key in radix:
        got, was = cut.match_prefix(key).indices, cache.match_prefix(key).indices
        assert torch.equal(got, was[: len(got)])


def _corrupt(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1 :]


def _with(image: TreeImage, **fields: object) -> TreeImage:
    values = {f: getattr(image, f) for f in TreeImage.__slots__}
    values.update(fields)
    return TreeImage(**values)  # type: ignore[arg-type]


def test_damaged_snapshots_are_refused_and_leave_the_cache_empty() -> None:
    cache, alloc = _cache(1)
    _fill(cache, alloc)
    data = encode(take(cache))
    image = decode(data)
    with pytest.raises(SnapshotError):
        decode(data[:-8])  # torn
    with pytest.raises(SnapshotError):
        decode(b"garbage" + data)
    # Two nodes claiming one slot, and a slot outside the pool: decoded, not restored.
    for slots in (np.r_[image.slots[:-1], image.slots[0]], np.r_[image.slots[:-1], 10**6]):
        fresh, fresh_alloc = _cache(1)
        with pytest.raises(SnapshotError):
            restore(fresh, fresh_alloc, _with(image, slots=slots))
        assert fresh.total_size() == 0 and fresh_alloc.num_allocated() == 0
        fresh.check_integrity()
    # Two siblings with one first page.
    top = np.flatnonzero(image.parent == -1)[:2]
    keys = bytearray(image.keys)
    ends = np.cumsum(image.key_lens * 4)  # namespace 0 (width 1) comes first
    a, b = (int(ends[i - 1]) if i else 0 for i in top)
    assert image.namespace[top[0]] == image.namespace[top[1]] == 0
    keys[b : b + 4] = keys[a : a + 4]
    fresh, fresh_alloc = _cache(1)
    with pytest.raises(SnapshotError, match="same page"):
        restore(fresh, fresh_alloc, _with(image, keys=bytes(keys)))
    assert fresh.total_size() == 0 and fresh_alloc.num_allocated() == 0
    fresh.check_integrity()


def test_another_page_size_is_refused() -> None:
    cache, alloc = _cache(1)
    _fill(cache, alloc)
    fresh, fresh_alloc = _cache(4)
    with pytest.raises(SnapshotError, match="page size"):
        restore(fresh, fresh_alloc, decode(encode(take(cache))))
