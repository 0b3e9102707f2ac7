"""SlotPrefixCache.copy_kv (a cached prefix's K and V into another slot) and its
integrity check against corrupted bookkeeping."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from slot_helpers import make, make_stale, snapshot, take

from prefixcache.cache.errors import IntegrityError, InvalidInputError
from prefixcache.cache.inspection import walk
from prefixcache.cache.slot.slot_cache import MISS, SlotPrefixCache


def kv(slots: int = 4, positions: int = 8, layers: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V whose every element is distinct, so any misplaced copy shows."""
    k = torch.arange(slots * positions * layers * 2, dtype=torch.float32)
    k = k.reshape(slots, positions, layers, 2)
    return k, -k[..., :1].clone() - 1


@pytest.mark.parametrize("pair", [True, False])
def test_copy_kv_copies_the_cached_prefix_into_the_target(pair: bool) -> None:
    """Positions [0, prefix) of every layer move; no other element changes."""
    alloc, cache = make()
    a, t = take(alloc), take(alloc)
    cache.insert([1, 2, 3, 4], *a)
    k, v = kv()
    before_k, before_v = k.clone(), v.clone()
    match = cache.copy_kv([1, 2, 3, 9], t[0], (k, v) if pair else k)
    assert match == (3, *a)
    assert torch.equal(k[t[0], :3], before_k[a[0], :3])
    moved = torch.zeros(k.shape[:3], dtype=torch.bool)
    moved[t[0], :3] = True
    assert torch.equal(k[~moved], before_k[~moved])
    if pair:
        assert torch.equal(v[t[0], :3], before_v[a[0], :3])
        assert torch.equal(v[~moved], before_v[~moved])
    else:
        assert torch.equal(v, before_v)


def test_copy_kv_refreshes_the_source_path_in_the_lru_order() -> None:
    alloc, cache = make(capacity=4, slots=8)
    a = take(alloc)
    cache.insert([1, 2], *a)
    cache.insert([3, 4], *take(alloc))
    cache.copy_kv([1, 2], take(alloc)[0], kv(slots=8))
    cache.insert([5, 6], *take(alloc))
    assert cache.find([3, 4]) == MISS and cache.find([1, 2]) == (2, *a)


def test_copy_kv_copies_only_the_layers_asked() -> None:
    alloc, cache = make()
    a, t = take(alloc), take(alloc)
    cache.insert([1, 2], *a)
    k, v = kv()
    before = k.clone()
    cache.copy_kv([1, 2], t[0], [k, v], n_layers=2)
    assert torch.equal(k[t[0], :2, :2], before[a[0], :2, :2])
    assert torch.equal(k[t[0], :, 2], before[t[0], :, 2])


def test_copy_kv_copies_nothing_on_a_miss_or_from_the_target_itself() -> None:
    alloc, cache = make()
    a = take(alloc)
    cache.insert([1, 2], *a)
    k, v = kv()
    before = k.clone()
    assert cache.copy_kv([7], take(alloc)[0], (k, v)) == MISS
    assert cache.copy_kv([1, 2, 3], a[0], (k, v)) == (2, *a)  # already there
    assert torch.equal(k, before)


def test_copy_kv_skips_a_stale_source() -> None:
    alloc, cache = make()
    a = take(alloc)
    cache.insert([1, 2], *a)
    make_stale(alloc, a[0])
    t = take(alloc)
    k, v = kv()
    before = k.clone()
    assert cache.copy_kv([1, 2], t[0], (k, v)) == MISS
    assert torch.equal(k, before)


@pytest.mark.parametrize("case", ["free", "indexed", "short", "layers", "layout", "slot"])
def test_copy_kv_refusals_change_nothing(case: str) -> None:
    alloc, cache = make()
    a, t = take(alloc), take(alloc)
    cache.insert([1, 2, 3, 4], *a)
    cache.insert([8], *t)
    free = alloc.alloc()
    alloc.free(free)
    k, v = kv()
    target, tensors, layers = take(alloc)[0], (k, v), None
    if case == "free":
        target = free
    elif case == "indexed":
        target = t[0]  # its current KV is cached under [8]
    elif case == "short":
        k, v = kv(positions=3)
        tensors = (k, v)
    elif case == "layers":
        layers = 4
    elif case == "layout":
        tensors = (k, v[:2])
    elif case == "slot":
        target = 4
    before, before_k = snapshot(cache), k.clone()
    with pytest.raises(InvalidInputError):
        cache.copy_kv([1, 2, 3, 4], target, tensors, layers)
    assert snapshot(cache) == before and torch.equal(k, before_k)


def _corrupt_counter(cache: SlotPrefixCache) -> None:
    cache._evictable += 1


def _corrupt_tips(cache: SlotPrefixCache) -> None:
    cache._tips.clear()


def _corrupt_lock(cache: SlotPrefixCache) -> None:
    next(iter(cache._leaves._live.values()))[2].lock_ref = 1


def _corrupt_entry(cache: SlotPrefixCache) -> None:
    node = next(n for n, _ in walk(cache.root_node) if n.key_len == 2)
    node.version = 9  # never handed out, and it breaks the chain of its pair


def _corrupt_depth(cache: SlotPrefixCache) -> None:
    next(n for n, _ in walk(cache.root_node) if n.key_len).depth += 1


@pytest.mark.parametrize(
    "corrupt", [_corrupt_counter, _corrupt_tips, _corrupt_lock, _corrupt_entry, _corrupt_depth]
)
def test_check_integrity_reports_corrupted_bookkeeping(corrupt: Any) -> None:
    alloc, cache = make()
    cache.insert([1, 2, 3], *take(alloc))
    cache.insert([1, 2, 4], *take(alloc))
    cache.check_integrity()
    corrupt(cache)
    with pytest.raises(IntegrityError):
        cache.check_integrity()
