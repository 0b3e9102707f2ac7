"""Lookup outcomes in the cache layer: page ids, the evicted-page record, the
distinct-page sketch and the classification of a lookup, on real caches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.cache import RadixCache, RadixKey, TokenToKVPoolAllocator
from prefixcache.cache.index.hyperloglog import HyperLogLog
from prefixcache.cache.index.page_ids import (
    EvictedPages,
    EvictionRecorder,
    PrefixIds,
    namespace_salt,
)
from prefixcache.cache.radix.lookup_outcomes import classify


def _cache(page_size: int = 2, size: int = 64) -> tuple[RadixCache, EvictedPages, PrefixIds]:
    allocator = TokenToKVPoolAllocator(size, "cpu", page_size)
    cache = RadixCache(page_size, None, allocator)
    record, ids = EvictedPages(1024), PrefixIds()
    cache.eviction_observer = EvictionRecorder(record, ids).observe
    return cache, record, ids


def _insert(cache: RadixCache, tokens: list[int], extra_key: str | None = None) -> None:
    slots = cache.token_to_kv_pool_allocator.alloc(len(tokens))
    result = cache.insert(RadixKey(tokens, extra_key), slots)
    cache.token_to_kv_pool_allocator.free(slots[: result.prefix_len])


def _lookup(cache, record, ids, tokens, extra_key=None) -> list[tuple[str, int, int]]:
    key = RadixKey(tokens, extra_key)
    hit = cache.match_prefix(key).prefix_len
    return classify(cache, key, hit, record, ids).ranges


def test_page_ids_name_prefixes() -> None:
    ids = PrefixIds()
    words = np.arange(1, 33, dtype="<u4").tobytes()
    whole = ids.pages(words, 4, 7)
    assert len(whole) == 8 and len(set(whole.tolist())) == 8
    assert (ids.pages(words[:40], 4, 7) == whole[:2]).all()  # a prefix's pages: the same
    assert (ids.pages(words, 4, 7, first=3) == whole[3:]).all()
    assert (ids.pages(words, 4, 8) != whole).all()  # another namespace
    other = np.arange(2, 34, dtype="<u4").tobytes()  # another prefix, same page
    assert ids.pages(other, 4, 7)[-1] != whole[-1]
    zeros = np.zeros(8, dtype="<u4").tobytes()  # leading zeros count
    assert ids.pages(zeros, 4, 7)[1] != ids.pages(zeros[:16], 4, 7)[0]
    assert namespace_salt(None, 1) != namespace_salt("", 1) != namespace_salt("", 2)


def test_outcomes_of_a_lookup() -> None:
    cache, record, ids = _cache()
    _insert(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    _insert(cache, [1, 2, 3, 4, 9, 9], "lora")
    assert _lookup(cache, record, ids, [1, 2, 3, 4, 5, 6, 7]) == [
        ("hit", 0, 6),
        ("below_page", 6, 7),
    ]
    # Beyond the hit in its own namespace, another namespace has two more tokens.
    assert _lookup(cache, record, ids, [1, 2, 3, 4, 9, 9, 5, 5]) == [
        ("hit", 0, 4),
        ("miss_namespace", 4, 6),
        ("miss_cold", 6, 8),
    ]
    cache.evict(100)  # everything goes: the record has every page
    assert len(record) == 4 + 3
    assert _lookup(cache, record, ids, [1, 2, 3, 4, 5, 6, 7, 8, 1, 1]) == [
        ("miss_evicted", 0, 8),
        ("miss_cold", 8, 10),
    ]
    assert _lookup(cache, record, ids, [1, 2, 3, 4, 9, 9], "lora") == [("miss_evicted", 0, 6)]
    assert _lookup(cache, record, ids, [1, 2, 3, 4, 9, 9], "other") == [("miss_cold", 0, 6)]
    # Cached again up to a point: a hit, then the evicted rest, then cold.
    _insert(cache, [1, 2, 3, 4])
    assert _lookup(cache, record, ids, [1, 2, 3, 4, 5, 6, 7, 8, 1, 1, 3]) == [
        ("hit", 0, 4),
        ("miss_evicted", 4, 8),
        ("miss_cold", 8, 10),
        ("below_page", 10, 11),
    ]


def test_blocks_of_pages() -> None:
    """Fed and asked in blocks of 4 pages: an evicted range ends at a block's end."""
    allocator = TokenToKVPoolAllocator(64, "cpu", 1)
    cache = RadixCache(1, None, allocator)
    record, ids = EvictedPages(), PrefixIds()
    cache.eviction_observer = EvictionRecorder(record, ids, block=4).observe
    _insert(cache, list(range(1, 11)))  # 10 tokens: blocks end at 4 and 8
    cache.evict(100)
    assert len(record) == 2
    key = RadixKey([*range(1, 11), 50, 51])
    out = classify(cache, key, 0, record, ids, block=4)
    assert out.ranges == [("miss_evicted", 0, 8), ("miss_cold", 8, 12)]
    assert len(out.page_ids) == 3
    _insert(cache, [1, 2, 3, 4, 5, 6])  # a hit inside the second block
    key = RadixKey(list(range(1, 11)))
    assert classify(cache, key, 6, record, ids, block=4).ranges == [
        ("hit", 0, 6),
        ("miss_evicted", 6, 8),
        ("miss_cold", 8, 10),
    ]


def test_a_full_hit_feeds_no_page_ids() -> None:
    cache, record, ids = _cache()
    _insert(cache, [1, 2, 3, 4])
    key = RadixKey([1, 2, 3, 4, 5])
    assert classify(cache, key, 4, record, ids).page_ids is None
    key = RadixKey([1, 2, 3, 4, 5, 6])
    assert len(classify(cache, key, 4, record, ids).page_ids) == 1


def test_namespaces_filter() -> None:
    cache, record, ids = _cache()
    _insert(cache, [1, 2, 3, 4], "tenant-b/x")
    key = RadixKey([1, 2, 3, 4], "tenant-a/x")
    assert classify(cache, key, 0, record, ids).ranges == [("miss_namespace", 0, 4)]
    mine = classify(
        cache, key, 0, record, ids, namespaces=lambda ek: (ek or "").startswith("tenant-a/")
    )
    assert mine.ranges == [("miss_cold", 0, 4)] and mine.namespace is None


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 8), st.lists(st.lists(st.integers(0, 20), max_size=12), max_size=40))
def test_evicted_pages_is_a_bounded_ring(capacity: int, batches: list[list[int]]) -> None:
    """Against a plain list model: the last ``capacity`` distinct ids added, oldest out
    first; an id added again while held keeps its place."""
    record, model = EvictedPages(capacity), []
    for batch in batches:
        record.add(batch)
        for page_id in batch:
            if page_id not in model:
                model.append(page_id)
        del model[:-capacity]
        assert len(record) == len(model)
        assert all(page_id in record for page_id in model)
        assert not any(page_id in record for page_id in range(21) if page_id not in model)


def test_evicted_pages_refuses_a_bad_capacity() -> None:
    with pytest.raises(ValueError):
        EvictedPages(0)


@pytest.mark.parametrize("n", [1, 50, 3000, 200000])
def test_hyperloglog_estimates(n: int) -> None:
    sketch = HyperLogLog()
    ids = PrefixIds().pages(np.arange(n, dtype="<u4").tobytes(), 1, 1)
    sketch.add(ids)
    sketch.add(ids[: n // 2])  # seen again: not counted twice
    assert sketch.estimate() == pytest.approx(n, rel=0.05, abs=1)


def test_eviction_record_matches_lookup_ids_on_every_tree_kind() -> None:
    """The ids the eviction path records are those a lookup computes, on SWA too."""
    from prefixcache.cache import SWARadixCache, SWATokenToKVPoolAllocator

    allocator = SWATokenToKVPoolAllocator(64, 64, "cpu", 2)
    cache = SWARadixCache(2, 4, allocator)
    record, ids = EvictedPages(), PrefixIds()
    cache.eviction_observer = EvictionRecorder(record, ids).observe
    tokens = [5, 6, 7, 8, 9, 10]
    slots = allocator.alloc(len(tokens))
    cache.insert(RadixKey(tokens), torch.as_tensor(slots))
    cache.evict(100)
    key = RadixKey(tokens)
    assert classify(cache, key, 0, record, ids).ranges == [("miss_evicted", 0, 6)]


def test_namespaces_looked_into_are_bounded() -> None:
    """A model with many namespaces: a miss looks into the oldest MAX_EXAMINED only."""
    from prefixcache.cache.radix.lookup_outcomes import MAX_EXAMINED

    cache, record, ids = _cache(page_size=1, size=4096)
    for i in range(MAX_EXAMINED + 5):
        _insert(cache, [i + 100, 7], f"ns{i}")
    _insert(cache, [1, 2, 3], "late")  # created after the first MAX_EXAMINED
    _insert(cache, [5, 6], "ns3")
    key = RadixKey([5, 6, 9])
    assert classify(cache, key, 0, record, ids).ranges == [
        ("miss_namespace", 0, 2),
        ("miss_cold", 2, 3),
    ]
    assert classify(cache, RadixKey([1, 2, 3]), 0, record, ids).ranges == [("miss_cold", 0, 3)]


_NS = st.sampled_from([None, "a", "b"])
_TOKENS = st.lists(st.integers(1, 3), max_size=9)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("insert"), _NS, _TOKENS),
            st.tuples(st.just("evict"), st.integers(1, 12), st.none()),
            st.tuples(st.just("lookup"), _NS, _TOKENS),
        ),
        max_size=30,
    )
)
def test_classification_against_a_model(ops: list) -> None:
    """Every lookup's ranges against a brute-force model of the tree's history: hit
    (cached now), then miss_namespace (cached now under another namespace), then
    miss_evicted (cached at some point, not now), then miss_cold, then below_page."""
    page = 2
    cache, record, ids = _cache(page_size=page, size=256)
    ever: set = set()
    for op, arg, tokens in ops:
        if op == "evict":
            cache.evict(arg)
            continue
        ns, tokens = arg, tokens or []
        end = len(tokens) - len(tokens) % page
        if op == "insert":
            _insert(cache, tokens, ns)
            ever.update((ns, tuple(tokens[:k])) for k in range(page, end + 1, page))
            continue

        def cached(name, k, tokens=tokens) -> bool:
            return len(cache.peek_prefix(RadixKey(tokens[:k], name))) >= k

        expected, pos = [], 0
        for k in range(page, end + 1, page):
            if cached(ns, k):
                outcome = "hit"
            elif any(cached(other, k) for other in (None, "a", "b") if other != ns):
                outcome = "miss_namespace"
            elif (ns, tuple(tokens[:k])) in ever:
                outcome = "miss_evicted"
            else:
                outcome = "miss_cold"
            expected.append((outcome, k - page, k))
            pos = k
        if pos < len(tokens):
            expected.append(("below_page", pos, len(tokens)))
        merged: list = []
        for outcome, a, b in expected:
            if merged and merged[-1][0] == outcome:
                merged[-1] = (outcome, merged[-1][1], b)
            else:
                merged.append((outcome, a, b))
        key = RadixKey(tokens, ns)
        hit = cache.match_prefix(key).prefix_len
        assert classify(cache, key, hit, record, ids).ranges == merged
        cache.check_integrity()


def test_a_failing_record_never_breaks_an_eviction() -> None:
    """The recorder runs inside the eviction: a failure there is counted, never raised
    (the tree would be left half evicted)."""
    cache, record, ids = _cache()
    recorder = EvictionRecorder(record, ids)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug in the record")

    record.add = broken  # type: ignore[method-assign]
    cache.eviction_observer = recorder.observe
    _insert(cache, [1, 2, 3, 4])
    _insert(cache, [5, 6])
    assert cache.evict(100).full_evicted == 6
    assert recorder.errors == 2
    cache.check_integrity()
