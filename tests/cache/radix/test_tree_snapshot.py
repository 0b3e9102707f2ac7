"""tree_snapshot: a radix tree taken, encoded, decoded and rebuilt over a fresh allocator
matches what it was; a damaged snapshot is refused and leaves the cache empty."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefixcache.cache import RadixCache, RadixKey, TokenToKVPoolAllocator
from prefixcache.cache.radix.tree_snapshot import SnapshotError, decode, encode, restore, take


def _cache(page_size: int) -> tuple[RadixCache, TokenToKVPoolAllocator]:
    alloc = TokenToKVPoolAllocator(256, "cpu", page_size)
    return RadixCache(page_size, None, alloc), alloc


def _fill(cache: RadixCache, alloc: TokenToKVPoolAllocator) -> list[RadixKey]:
    keys = [RadixKey(list(range(1, 17))), RadixKey([*range(1, 9), *range(50, 58)]),
            RadixKey(list(range(1, 13)), extra_key="tenant"),
            RadixKey([(1, 2), (3, 4), (5, 6), (7, 8)]), RadixKey(list(range(90, 98)))]
    for key in keys:
        have = cache.match_prefix(key)
        slots = alloc.alloc(len(key) - have.prefix_len)
        value = torch.cat([have.indices, slots])
        done = cache.insert(key, value)
        alloc.free(value[have.prefix_len:done.prefix_len])  # already cached: the caller's
    cache.match_prefix(keys[0][:4])  # a split that stays, and a touch
    return keys


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_tree_comes_back_with_the_same_slots(page_size: int) -> None:
    cache, alloc = _cache(page_size)
    keys = _fill(cache, alloc)
    image = decode(encode(take(cache)))
    assert image.tokens == cache.total_size() == alloc.num_allocated()
    fresh, fresh_alloc = _cache(page_size)
    assert restore(fresh, fresh_alloc, image) == image.tokens
    fresh.check_integrity()
    assert fresh.total_size() == cache.total_size() and fresh.protected_size() == 0
    assert fresh_alloc.num_allocated() == alloc.num_allocated()
    assert fresh_alloc.available_size() == alloc.available_size()
    for key in keys:
        assert torch.equal(fresh.match_prefix(key).indices, cache.match_prefix(key).indices)
    # The slots left are the free ones: a new allocation never hands out a tree slot.
    new = fresh_alloc.alloc(fresh_alloc.available_size())
    assert new is not None and not fresh_alloc.is_allocated(torch.tensor([0])).any()
    tree = torch.cat([fresh.match_prefix(k).indices for k in keys])
    assert not np.isin(new.numpy(), tree.numpy()).any()


def test_lru_order_survives() -> None:
    cache, alloc = _cache(1)
    old, new = RadixKey([1, 2, 3]), RadixKey([7, 8, 9])
    for key in (old, new):
        cache.insert(key, alloc.alloc(3))
    cache.match_prefix(old)  # old is now the most recent
    fresh, fresh_alloc = _cache(1)
    restore(fresh, fresh_alloc, take(cache))
    fresh.evict(3)
    assert fresh.match_prefix(old).prefix_len == 3 and fresh.match_prefix(new).prefix_len == 0


def _corrupt(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1:]


def test_damaged_snapshots_are_refused_and_leave_the_cache_empty() -> None:
    cache, alloc = _cache(1)
    _fill(cache, alloc)
    image = take(cache)
    data = encode(image)
    with pytest.raises(SnapshotError):
        decode(data[:-8])  # torn
    with pytest.raises(SnapshotError):
        decode(b"garbage" + data)
    # Two nodes claiming one slot, and a slot outside the pool: decoded, not restored.
    for slots in (np.r_[image.slots[:-1], image.slots[0]], np.r_[image.slots[:-1], 10**6]):
        bad = decode(data)
        bad = type(bad)(bad.page_size, bad.namespaces, bad.parent, bad.namespace,
                        bad.key_lens, bad.ticks, bad.keys, slots)
        fresh, fresh_alloc = _cache(1)
        with pytest.raises(SnapshotError):
            restore(fresh, fresh_alloc, bad)
        assert fresh.total_size() == 0 and fresh_alloc.num_allocated() == 0
        fresh.check_integrity()
    # Two siblings with one first page: fewer tokens rebuilt than slots claimed.
    twin = decode(data)
    top = np.flatnonzero(twin.parent == -1)[:2]
    keys = bytearray(twin.keys)
    ends = np.cumsum(twin.key_lens * 4)  # namespace 0 (width 1) comes first
    a, b = (int(ends[i - 1]) if i else 0 for i in top)
    assert twin.namespace[top[0]] == twin.namespace[top[1]] == 0
    keys[b:b + 4] = keys[a:a + 4]
    twin = type(twin)(twin.page_size, twin.namespaces, twin.parent, twin.namespace,
                      twin.key_lens, twin.ticks, bytes(keys), twin.slots)
    fresh, fresh_alloc = _cache(1)
    with pytest.raises(SnapshotError):
        restore(fresh, fresh_alloc, twin)
    assert fresh.total_size() == 0 and fresh_alloc.num_allocated() == 0


def test_another_page_size_is_refused() -> None:
    cache, alloc = _cache(1)
    _fill(cache, alloc)
    fresh, fresh_alloc = _cache(4)
    with pytest.raises(SnapshotError, match="page size"):
        restore(fresh, fresh_alloc, take(cache))
