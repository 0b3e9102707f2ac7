"""The disk tier under the Mooncake tier, in real processes with a real master: a lookup
takes the pool's hit, then the disk's pages, then the store's, and counts each where it
was found (``prefixcache_tier_hit_tokens_total{tier="local"|"disk"|"remote"}``); the
bytes are the ones cached."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from disk_harness import DEMOTED, cache, read, same, tokens_of
from tier_harness import tier_config, two_nodes

from prefixcache.client import PrefixCacheClient

HITS = r'prefixcache_tier_hit_tokens_total\{model="m",tier="%s"\}'
PUT = r'prefixcache_tier_put_pages_total\{model="m"\}'


@pytest.mark.slow
def test_pool_then_disk_then_mooncake(tmp_path: Path) -> None:
    made: list[str] = []

    def config(address: str) -> dict[str, Any]:
        cfg = tier_config(address, timeout=5.0)
        if not made:  # node a: the disk tier too
            (tmp_path / "disk-a").mkdir()
            cfg["server"]["disk"] = {
                "path": str(tmp_path / "disk-a"),
                "bytes": 8 << 20,
                "timeout": 5.0,
            }
        made.append(address)
        return cfg

    with two_nodes(tmp_path, config) as (_, a, b):
        head = tokens_of(1, 8)
        kv_head = cache(a, head, seed=1)
        a.wait(PUT, 2)
        with PrefixCacheClient(a.address, timeout=10) as client:
            client.evict("m", 256)
        a.wait(DEMOTED, 2)
        whole = [*head, *tokens_of(2, 8)]
        b_put = b.metric(PUT)
        kv_whole = cache(b, whole, seed=2)  # b's own KV for the whole prompt
        b.wait(PUT, b_put + 2)  # the first two pages are in the store already
        hit, got = read(a, whole)
        assert hit == 16
        assert a.metric(HITS % "local") == 0
        assert a.metric(HITS % "disk") == 8  # the head, from a's disk
        assert a.metric(HITS % "remote") == 8  # the rest, from the store
        # The head is a's own bytes (its disk), the tail b's (the store).
        assert same([g[:8] for g in got], kv_head, 8)
        assert all(torch.equal(g[8:], w[8:16]) for g, w in zip(got, kv_whole, strict=True))
