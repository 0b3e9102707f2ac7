"""A model with many layers: a page is one store object of a part per K and V buffer of
every layer (64 for 32 layers), and Mooncake's TCP transport queues about 2048 parts per
peer, rejecting the rest (TRANSFER_FAIL). A lookup that fetches more pages than that
allows, here 80 pages of 64 parts (5120), still gets every page, byte for byte: the
backend cuts its calls (mooncake_backend.py, MAX_CALL_PARTS). So do the puts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tier_harness import Node, tier_config, two_nodes

from prefixcache.client import PrefixCacheClient
from prefixcache.server.tier.backend import Parts
from prefixcache.server.tier.mooncake_backend import (
    MAX_CALL_PARTS,
    MAX_QUEUED_PARTS,
    PartBudget,
    chunked,
    part_chunks,
)

PAGE = 4
LAYERS = 32
ROW = (1, 8)  # k_heads, k_head_dim: 16 bytes a row, 64 a part, 4 KiB a page
PAGES = 80
TOKENS = PAGES * PAGE
MODEL = {
    "name": "m",
    "page_size": PAGE,
    "pool": {
        "size": 4 * TOKENS,
        "layers": LAYERS,
        "k_heads": ROW[0],
        "k_head_dim": ROW[1],
        "dtype": "float16",
    },
}


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[tuple[Node, Node]]:
    with two_nodes(
        tmp_path, lambda address: tier_config(address, timeout=10.0, models=[MODEL])
    ) as (_, a, b):
        yield a, b


@pytest.mark.slow
def test_a_fetch_of_more_parts_than_mooncake_queues_arrives_whole(nodes: tuple[Node, Node]) -> None:
    assert PAGES * 2 * LAYERS > 2 * MAX_QUEUED_PARTS  # past what one call could carry
    a, b = nodes
    tokens = np.random.default_rng(5).integers(1, 30000, TOKENS).tolist()
    gen = torch.Generator().manual_seed(5)
    kv = [torch.randn(TOKENS, *ROW, generator=gen).half() for _ in range(2 * LAYERS)]
    with PrefixCacheClient(a.address, timeout=30) as client, client.session() as s:
        slots = client.alloc("m", TOKENS, session=s).slots
        client.write_kv("m", slots, kv[:LAYERS], kv[LAYERS:], session=s)
        client.insert("m", tokens, slots, session=s)
    a.wait(r"prefixcache_tier_put_pages_total\{.*\}", PAGES)
    assert a.metric(r"prefixcache_tier_put_failed_pages_total\{.*\}") == 0
    with PrefixCacheClient(b.address, timeout=30) as client, client.session() as s:
        reply = client.match("m", tokens, session=s, lock=True)
        errors = {
            k: v for k, v in b.metrics().items() if k.startswith("prefixcache_tier_errors") and v
        }
        assert reply.prefix_len == TOKENS, errors
        got = client.read_kv("m", reply.slots, session=s)
    assert all(torch.equal(x, y) for x, y in zip([*got.k, *got.v], kv, strict=True))
    assert not errors


def test_calls_are_cut_at_the_part_limit() -> None:
    """Consecutive objects up to MAX_CALL_PARTS parts a call; an object with more parts
    than that (a page in scattered slots of a wide model) goes alone."""
    ptrs = [[0] * 64] * 40 + [[0] * 3000] + [[0] * 64] * 2
    chunks = list(part_chunks(ptrs))
    assert [(s, e) for s, e, _ in chunks] == [(0, 16), (16, 32), (32, 40), (40, 41), (41, 43)]
    assert [n for _, _, n in chunks] == [1024, 1024, 512, 3000, 128]
    assert list(part_chunks([])) == []


def test_chunked_calls_stop_where_told() -> None:
    """Each call carries one chunk; after a code ``stop_on`` names, no more calls are
    made (a dead master would hold each for seconds) and the rest answer that code."""
    keys = [str(i) for i in range(40)]
    ptrs = [[0] * 64] * 40  # 16 objects a call
    made: list[list[str]] = []

    def store(answers: dict[str, int]) -> Any:
        def call(k: list[str], p: Parts, z: Parts) -> list[int]:
            assert sum(map(len, p)) <= MAX_CALL_PARTS and len(k) == len(p) == len(z)
            made.append(k)
            return [answers.get(key, 0) for key in k]

        return call

    budget = PartBudget()
    assert chunked(store({}), budget, keys, ptrs, ptrs, lambda c: c < 0) == [0] * 40
    assert [len(k) for k in made] == [16, 16, 8]
    made.clear()
    codes = chunked(store({"3": -800}), budget, keys, ptrs, ptrs, lambda c: c < 0)
    assert codes == [0, 0, 0, -800] + [0] * 12 + [-800] * 24 and len(made) == 1
    made.clear()
    codes = chunked(store({"3": -800, "20": -900}), budget, keys, ptrs, ptrs, lambda c: c == -900)
    assert (codes[3], codes[20], codes[32:], len(made)) == (-800, -900, [-900] * 8, 2)
