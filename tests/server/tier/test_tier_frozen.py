"""A frozen master (SIGSTOP): its store calls hang. Lookups still answer within their
deadline, and writes waiting on it pin at most a share of the pool, so the sidecar's
workers go on caching (and evicting) without running out of room."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from tier_harness import frozen_master_node

from prefixcache.client import PrefixCacheClient

POOL = {"size": 256, "layers": 1, "k_heads": 1, "k_head_dim": 8}


def _outcomes(node) -> dict[str, float]:
    return {
        k.split('result="')[1].split('"')[0]: v
        for k, v in node.metrics().items()
        if k.startswith("prefixcache_tier_lookups_total")
    }


def _errors(node) -> dict[str, float]:
    return {k: v for k, v in node.metrics().items() if k.startswith("prefixcache_tier_errors")}


@pytest.mark.slow
def test_a_frozen_master_pins_no_more_than_a_share_of_the_pool(tmp_path: Path) -> None:
    model = {"name": "m", "page_size": 4, "pool": POOL}
    with frozen_master_node(tmp_path, model) as (_, node):
        with PrefixCacheClient(node.address, timeout=10) as client:
            for i in range(24):  # 24 prompts of 16 tokens: 1.5 pools
                tokens = (np.arange(16) + 100 * i + 1).tolist()
                with client.session() as s:
                    slots = client.alloc("m", len(tokens), session=s).slots
                    client.insert("m", tokens, slots, session=s)
                assert client.match("m", tokens).prefix_len == len(tokens)
            # Lookups that ask the store: each answered, whether it meets the hanging
            # master (given up at its deadline: TIMEOUT), the breaker or busy threads.
            before = _outcomes(node)
            errors = _errors(node)
            for i in range(6):
                assert client.match("m", (np.arange(16) + 9000 + 100 * i).tolist()).prefix_len == 0
                time.sleep(0.4)
            after = _outcomes(node)
            grew = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
            assert sum(grew.values()) == 6 and set(grew) <= {"error", "breaker_open", "busy"}, grew
            new_errors = {k for k, v in _errors(node).items() if v != errors.get(k, 0)}
            assert all('code="TIMEOUT"' in k for k in new_errors), _errors(node)
        assert (
            node.metric(r'prefixcache_tier_put_dropped_pages_total\{.*reason="pin_limit".*\}') > 0
        )
