"""The cache library on a CUDA device: slots, matches and KV all live on the GPU."""

from __future__ import annotations

import pytest
import torch

from prefixcache.cache import (
    KVPool,
    RadixCache,
    RadixKey,
    SWATokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)

pytestmark = pytest.mark.gpu


def test_radix_cache_over_a_cuda_pool_round_trips_kv() -> None:
    """Slots come back on the GPU, KV written by slot reads back through a later hit."""
    page = 16
    allocator = TokenToKVPoolAllocator(4096, device="cuda", page_size=page)
    pool = KVPool(
        4096,
        page_size=page,
        dtype=torch.bfloat16,
        layer_num=2,
        k_head_num=4,
        k_head_dim=64,
        v_head_num=2,
        v_head_dim=32,
        device="cuda",
    )
    cache = RadixCache(page_size=page, token_to_kv_pool_allocator=allocator)
    prompt = list(range(200))
    slots = allocator.alloc(len(prompt))
    assert slots.device.type == "cuda"
    k = torch.randn(len(prompt), 4, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(len(prompt), 2, 32, device="cuda", dtype=torch.bfloat16)
    pool.set_kv_buffer(1, slots, k, v)
    cache.insert(RadixKey(prompt), slots)
    allocator.free(slots[192:])  # the unaligned tail stays the caller's

    hit = cache.match_prefix(RadixKey([*prompt[:150], 7, 7]))
    assert hit.prefix_len == 144 and hit.indices.device.type == "cuda"
    cache.inc_lock_ref(hit.last_node)
    k_rows, v_rows = pool.read_kv(1, hit.indices)
    assert torch.equal(k_rows, k[:144]) and torch.equal(v_rows, v[:144])
    cache.dec_lock_ref(hit.last_node)
    cache.check_integrity()
    assert cache.evict(10_000).full_evicted == 192
    assert allocator.available_size() == 4096
    cache.check_integrity()


def test_swa_cache_over_cuda_allocators() -> None:
    """SWA tombstoning and window matches work with GPU-resident slots."""
    allocator = SWATokenToKVPoolAllocator(256, 256, device="cuda")
    cache = RadixCache(sliding_window_size=4, token_to_kv_pool_allocator=allocator)
    cache.insert(RadixKey(list(range(8))), allocator.alloc(8))
    cache.insert(
        RadixKey(list(range(16))),
        torch.cat([cache.match_prefix(RadixKey(list(range(8)))).indices, allocator.alloc(8)]),
        prev_prefix_len=8,
    )
    assert cache.evict(0, 1).swa_evicted == 8
    assert cache.match_prefix(RadixKey(list(range(16)))).prefix_len == 16
    assert cache.match_prefix(RadixKey(list(range(10)))).prefix_len == 0
    cache.check_integrity()
