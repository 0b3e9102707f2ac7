"""A frozen master (SIGSTOP): its store calls hang. Lookups still answer within their
deadline, and writes waiting on it pin at most a share of the pool, so the sidecar's
workers go on caching (and evicting) without running out of room."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from tier_harness import frozen_master_node

from prefixcache.client import PrefixCacheClient

POOL = {"size": 256, "layers": 1, "k_heads": 1, "k_head_dim": 8}


def test_a_frozen_master_pins_no_more_than_a_share_of_the_pool(tmp_path: Path) -> None:
    model = {"name": "m", "page_size": 4, "pool": POOL}
    with frozen_master_node(tmp_path, model) as (_, node):
        slowest = 0.0
        with PrefixCacheClient(node.address, timeout=10) as client:
            for i in range(24):  # 24 prompts of 16 tokens: 1.5 pools
                tokens = (np.arange(16) + 100 * i + 1).tolist()
                start = time.monotonic()
                with client.session() as s:
                    slots = client.alloc("m", len(tokens), session=s).slots
                    client.insert("m", tokens, slots, session=s)
                assert client.match("m", tokens).prefix_len == len(tokens)
                slowest = max(slowest, time.monotonic() - start)
            # Lookups that ask the store: each within its deadline (0.5 s) and a margin,
            # whether it meets the hanging master, the breaker or busy threads.
            for i in range(6):
                start = time.monotonic()
                assert client.match("m", (np.arange(16) + 9000 + 100 * i).tolist()).prefix_len == 0
                slowest = max(slowest, time.monotonic() - start)
                time.sleep(0.4)
        assert slowest < 2.0, slowest
        assert (
            node.metric(r'prefixcache_tier_put_dropped_pages_total\{.*reason="pin_limit".*\}') > 0
        )
