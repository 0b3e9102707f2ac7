"""``tier.write: on_evict`` (write-back): a page goes to the store when eviction takes it,
not when it is cached; another node then hits it with byte-identical KV. A real master
and two ``prefixcache serve`` processes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from tier_harness import Node, tier_config, two_nodes

from prefixcache.client import PrefixCacheClient

MODEL = "m"
PAGE = 4
ROW = (2, 8)  # k_heads, k_head_dim (tier_config's model: 2 layers, 256 slots)
POOL = 256
PUT = r'prefixcache_tier_put_pages_total\{model="m"\}'


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Node, Node]]:
    def config(address: str) -> dict[str, Any]:
        # Nothing here is about deadlines: room for a loaded machine.
        made = tier_config(address, timeout=5.0)
        made["server"]["tier"]["write"] = "on_evict"
        return made

    with two_nodes(tmp_path_factory.mktemp("write_back"), config) as (_, a, b):
        yield a, b


def _cache(node: Node, tokens: list[int], seed: int) -> list[torch.Tensor]:
    """Cache ``tokens`` on ``node``, KV written through the client; returns the KV."""
    gen = torch.Generator().manual_seed(seed)
    kv = [torch.randn(len(tokens), *ROW, generator=gen).half() for _ in range(4)]
    with PrefixCacheClient(node.address, timeout=10) as client, client.session() as s:
        slots = client.alloc(MODEL, len(tokens), session=s).slots
        client.write_kv(MODEL, slots, kv[:2], kv[2:], session=s)
        client.insert(MODEL, tokens, slots, session=s)
    return kv


def _read(node: Node, tokens: list[int]) -> tuple[int, list[torch.Tensor]]:
    with PrefixCacheClient(node.address, timeout=10) as client, client.session() as s:
        reply = client.match(MODEL, tokens, session=s, lock=True)
        if not reply.prefix_len:
            return 0, []
        data = client.read_kv(MODEL, reply.slots, session=s)
        return reply.prefix_len, [*data.k, *data.v]


def _tokens(seed: int, n: int = 24) -> list[int]:
    return np.random.default_rng(seed).integers(1, 30000, n).tolist()


def _same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) and all(
        g.shape == w.shape and g.view(torch.int16).equal(w.view(torch.int16))
        for g, w in zip(got, want, strict=True)
    )


def test_pages_reach_the_store_when_evicted_and_b_hits_them(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    tokens = _tokens(1)
    kv = _cache(a, tokens, seed=1)
    time.sleep(0.5)  # a write-through put would be done by now
    assert a.metric(PUT) == 0
    assert _read(b, tokens)[0] == 0  # not in the store yet: a miss on B
    assert _read(a, tokens)[0] == len(tokens)  # A still holds it
    with PrefixCacheClient(a.address, timeout=10) as client:
        assert client.evict(MODEL, POOL).evicted_tokens >= len(tokens)
    a.wait(PUT, len(tokens) // PAGE)
    hit, got = _read(b, tokens)
    assert hit == len(tokens)
    assert _same(got, kv)


def test_eviction_under_allocation_pressure_writes_back_too(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    tokens = _tokens(2, 32)
    kv = _cache(a, tokens, seed=2)
    before = a.metric(PUT)
    with PrefixCacheClient(a.address, timeout=10) as client, client.session() as s:
        client.alloc(MODEL, POOL, session=s)  # the whole pool: every cached node goes
    a.wait(PUT, before + len(tokens) // PAGE)
    hit, got = _read(b, tokens)
    assert hit == len(tokens)
    assert _same(got, kv)
    assert a.metric(r"prefixcache_tier_put_dropped_pages_total\{.*\}") == 0
    assert a.metric(r"prefixcache_tier_errors_total\{.*\}") == 0


def test_a_node_longer_than_the_staging_buffer_writes_its_leading_pages(
    nodes: tuple[Node, Node],
) -> None:
    a, b = nodes
    staging_pages = POOL // 4 // PAGE  # staging.py: a quarter of the pool
    tokens = _tokens(3, (staging_pages + 4) * PAGE)
    kv = _cache(a, tokens, seed=3)
    before = a.metric(PUT)
    with PrefixCacheClient(a.address, timeout=10) as client:
        client.evict(MODEL, POOL)
    a.wait(PUT, before + staging_pages)
    dropped = r'prefixcache_tier_put_dropped_pages_total\{.*reason="staging_full"\}'
    assert a.metric(dropped) == 4
    hit, got = _read(b, tokens)
    assert hit == staging_pages * PAGE  # the leading run the store holds
    assert _same(got, [t[:hit] for t in kv])
