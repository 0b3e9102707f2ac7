"""Write-back staging (staging.py) over a real KVPool: a staged page's object bytes are
those a write-through put of the same page reads from the pool; a full buffer copies
nothing."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from prefixcache.cache.pools.kv_pool import KVPool
from prefixcache.server.tier.layout import PageLayout
from prefixcache.server.tier.staging import Staging

PS = 4


def _object(ptrs: list[int], sizes: list[int]) -> bytes:
    return b"".join(ctypes.string_at(p, s) for p, s in zip(ptrs, sizes, strict=True))


def test_staged_pages_hold_the_bytes_a_put_from_the_pool_would_store() -> None:
    pool = KVPool(64, PS, torch.bfloat16, 2, 2, 8)
    for b in [*pool.k_buffer, *pool.v_buffer]:
        b.copy_(torch.randn(b.shape))
    layout = PageLayout(pool, PS)
    staging = Staging(layout, 3)
    slots = np.array([8, 9, 10, 11, 20, 21, 22, 23], dtype=np.int64)
    want = [_object(p, s) for p, s in zip(*layout.parts(slots), strict=True)]
    taken = staging.copy(slots)
    assert taken == [0, 1]
    assert [_object(p, s) for p, s in zip(*staging.parts(taken), strict=True)] == want
    assert staging.copy(slots) is None  # one page free, two asked: nothing copied
    staging.release([0])
    staging.release([1])
    # Free pages out of order: staged through the scattered path, the same bytes.
    page = np.array([40, 41, 42, 43], dtype=np.int64)
    taken2 = staging.copy(np.concatenate([page, slots[:4]]))
    assert len(taken2) == 2
    assert taken2 != list(range(taken2[0], taken2[0] + 2))
    got = [_object(p, s) for p, s in zip(*staging.parts(taken2), strict=True)]
    assert got == [_object(p, s) for p, s in zip(*layout.parts(page), strict=True)] + want[:1]
    assert sum(size for _, size in staging.regions()) == 3 * layout.page_bytes
