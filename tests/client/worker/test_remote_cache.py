"""RemoteRadixCache runs serving code written for the in-process RadixCache unchanged.

One scripted scenario (prefills that hit, miss, split and share; a prefill that loses
a race; locks; eviction; errors) runs against RadixCache + TokenToKVPoolAllocator and
against RemoteRadixCache + RemoteAllocator, and both must tell the same story.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import ServerThread, running

from prefixcache.cache import (
    BasePrefixCache,
    DoubleFreeError,
    InvalidInputError,
    LockError,
    RadixCache,
    RadixKey,
    TokenToKVPoolAllocator,
)
from prefixcache.client import PrefixCacheClient, RemoteAllocator, RemoteRadixCache
from prefixcache.server.config import MambaConfig, ModelConfig, PoolConfig

PAGE, POOL = 4, 64
MODELS = (
    ModelConfig(name="r", page_size=PAGE, pool=PoolConfig(size=POOL, k_heads=1, k_head_dim=4)),
    ModelConfig(
        name="h",
        kind="mamba",
        page_size=2,
        mamba=MambaConfig(state_slots=4),
        pool=PoolConfig(size=16, k_heads=1, k_head_dim=4),
    ),
)


def scenario(cache: Any, allocator: Any) -> list[tuple[Any, ...]]:
    """Serving code as written for the in-process cache; returns what it observed."""
    trace: list[tuple[Any, ...]] = []

    def sizes() -> tuple[int, ...]:
        return (
            cache.evictable_size(),
            cache.protected_size(),
            cache.total_size(),
            allocator.available_size(),
        )

    def prefill(tokens: list[int], lora: str | None = None, keep_lock: bool = False) -> Any:
        key = RadixKey(tokens, extra_key=lora)
        hit = cache.match_prefix(key)
        cache.inc_lock_ref(hit.last_node)
        need = len(tokens) - hit.prefix_len
        if allocator.available_size() < need:
            evicted = cache.evict(need - allocator.available_size())
            trace.append(("pressure", evicted.full_evicted))
        new = allocator.alloc(need)
        slots = torch.cat([hit.indices, new])
        done = cache.insert(key, slots)
        allocator.free(slots[hit.prefix_len : done.prefix_len])
        allocator.free(slots[len(tokens) // PAGE * PAGE :])
        if keep_lock:
            cache.inc_lock_ref(done.last_node)
        cache.dec_lock_ref(hit.last_node)
        trace.append(
            ("prefill", hit.prefix_len, len(hit.indices), len(new), done.prefix_len, *sizes())
        )
        return done

    trace.append(("start", *sizes()))
    prefill(list(range(10)))  # 8 cached, the tail of 2 freed
    prefill([*range(10), 50, 51, 52, 53, 54])  # hits 8
    prefill([*range(4), 60, 61, 62, 63])  # splits the first node
    prefill(list(range(10)), lora="adapter")  # its own namespace: a miss
    pinned = prefill([70, 71, 72, 73, 74, 75, 76, 77], keep_lock=True)

    # A prefill that loses a race: someone caches the same tokens between our match
    # and our insert, so the insert finds them all and our new slots are duplicates.
    key = RadixKey([80, 81, 82, 83, 84, 85])
    hit = cache.match_prefix(key)
    mine = torch.cat([hit.indices, allocator.alloc(len(key) - hit.prefix_len)])
    prefill([80, 81, 82, 83, 84, 85])
    done = cache.insert(key, mine)
    # (Sizes are compared only after the caller's frees: the service returns the
    # duplicates to the pool during the insert, in-process the caller's free does.)
    trace.append(("race", hit.prefix_len, done.prefix_len))
    allocator.free(mine[hit.prefix_len : done.prefix_len])
    allocator.free(mine[4:])
    trace.append(("race freed", *sizes()))

    # Pressure: fill the pool; eviction takes the oldest unlocked leaves first.
    for base in (100, 120, 140, 160):
        prefill(list(range(base, base + 12)))
    trace.append(("full", *sizes()))
    hit = cache.match_prefix(RadixKey([*range(10), 50, 51, 52, 53]))
    trace.append(("old entry", hit.prefix_len))
    hit = cache.match_prefix(RadixKey([70, 71, 72, 73, 74, 75, 76, 77]))
    trace.append(("pinned survives", hit.prefix_len))

    # Errors mirror the in-process cache.
    recent = cache.match_prefix(RadixKey(list(range(160, 172))))
    trace.append(("recent", recent.prefix_len))
    with pytest.raises(LockError):
        cache.dec_lock_ref(recent.last_node)  # never locked
    cache.dec_lock_ref(hit.last_node)  # the pinned node, by the handle a match gave
    with pytest.raises(LockError):
        cache.dec_lock_ref(pinned.last_node)
    trace.append(("unpinned", *sizes()))
    spare = allocator.alloc(3)
    allocator.free(spare)
    with pytest.raises(DoubleFreeError):
        allocator.free(spare)
    assert allocator.alloc(10 * POOL) is None
    with pytest.raises(InvalidInputError):
        cache.evict(-1)
    trace.append(("after errors", *sizes()))

    evicted = cache.evict(5)
    trace.append(("evict 5", evicted.full_evicted, *sizes()))
    gone = cache.match_prefix(RadixKey(list(range(100, 112))))
    trace.append(("evicted?", gone.prefix_len))
    evicted = cache.evict(10**6)
    trace.append(("evict all", evicted.full_evicted, *sizes()))
    with pytest.raises(LockError):
        cache.inc_lock_ref(pinned.last_node)  # evicted
    return trace


def in_process() -> tuple[RadixCache, TokenToKVPoolAllocator]:
    allocator = TokenToKVPoolAllocator(POOL, "cpu", PAGE)
    return RadixCache(page_size=PAGE, token_to_kv_pool_allocator=allocator), allocator


@pytest.fixture(scope="module")
def remote_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    with running(tmp_path_factory.mktemp("remote"), MODELS) as srv:
        yield srv


def test_the_same_scenario_tells_the_same_story(remote_server: ServerThread) -> None:
    local, local_allocator = in_process()
    expected = scenario(local, local_allocator)
    local.check_integrity()
    with RemoteRadixCache(remote_server.address, "r") as cache:
        assert isinstance(cache, BasePrefixCache)
        allocator = cache.token_to_kv_pool_allocator
        assert isinstance(allocator, RemoteAllocator)
        assert (cache.page_size, allocator.page_size, allocator.size) == (PAGE, PAGE, POOL)
        got = scenario(cache, allocator)
        cache.check_integrity()
        assert cache.stats().session_slots == 0
    assert got == expected
    assert ("old entry", 0) in got and ("pinned survives", 8) in got
    assert any(step[0] == "pressure" for step in got)
    race = next(step for step in got if step[0] == "race")
    assert race[1:3] == (0, 4)  # the insert found every aligned token cached already
    remote_server.check_integrity()


def test_insert_needs_slots_and_keys_may_be_plain_token_lists(remote_server: ServerThread) -> None:
    client = PrefixCacheClient(remote_server.address)
    with RemoteRadixCache(client, "r", ttl=5, device="cpu") as cache:
        allocator = cache.token_to_kv_pool_allocator
        with pytest.raises(InvalidInputError):
            cache.insert(RadixKey([1, 2, 3, 4]))
        slots = allocator.alloc(6)
        with pytest.raises(InvalidInputError):
            cache.insert(RadixKey([1, 2, 3, 4, 5, 6]), slots[:3])  # fewer than a page
        done = cache.insert([1, 2, 3, 4, 5, 6], slots[:4])  # value shorter than the key
        assert done.prefix_len == 0
        hit = cache.match_prefix([1, 2, 3, 4, 5, 6])
        assert hit.prefix_len == 4 and torch.equal(hit.indices, slots[:4])
        assert hit.indices.dtype == torch.int64
        assert cache.match_prefix([9]).last_node is cache.root_node
        cache.inc_lock_ref(cache.root_node)  # no-ops, as in-process
        cache.dec_lock_ref(cache.root_node)
        cache.inc_lock_ref(None)
        allocator.free_group_begin()
        allocator.free(slots[4:5])
        allocator.free(slots[5:])
        assert cache.stats().session_slots == 2  # held back until the group ends
        allocator.free_group_end()
        assert cache.stats().session_slots == 0
        with pytest.raises(InvalidInputError):
            allocator.free_group_end()
        assert cache.swa_evictable_size() == cache.swa_protected_size() == 0
        cache.reset()
        assert cache.total_size() == 0
    assert not client._closed  # the cache leaves a client it was given open
    client.close()


def test_only_radix_models_and_known_models(remote_server: ServerThread, tmp_path: Path) -> None:
    from prefixcache.client import InvalidArgument, NotFound

    with pytest.raises(InvalidArgument):
        RemoteRadixCache(remote_server.address, "h")
    with pytest.raises(NotFound):
        RemoteRadixCache(remote_server.address, "nope")


def test_fail_open_cache_misses_when_the_server_is_gone(tmp_path: Path) -> None:
    with running(tmp_path, MODELS[:1]) as srv:
        client = PrefixCacheClient(srv.address, fail_open=True, retries=0)
        cache = RemoteRadixCache(client, "r", ttl=5)
        slots = cache.token_to_kv_pool_allocator.alloc(4)
        cache.insert(RadixKey([1, 2, 3, 4]), slots)
        assert cache.match_prefix(RadixKey([1, 2, 3, 4])).prefix_len == 4
    hit = cache.match_prefix(RadixKey([1, 2, 3, 4]))
    assert (hit.prefix_len, len(hit.indices), hit.last_node) == (0, 0, cache.root_node)
    done = cache.insert(RadixKey([1, 2, 3, 4]), slots)
    assert (done.prefix_len, done.last_node) == (0, cache.root_node)
    assert client.fail_open_count == 2
    cache.close()
    client.close()
