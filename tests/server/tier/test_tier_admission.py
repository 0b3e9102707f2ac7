"""``tier.min_hits``: a page goes to the store only once lookups hit it that often; and
``models[].tier: false`` keeps a model out. A real master and one server."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from tier_harness import Master, Node, needs_mooncake, tier_config

from prefixcache.client import PrefixCacheClient

POOL = {"size": 128, "layers": 1, "k_heads": 1, "k_head_dim": 8}


def test_pages_are_written_once_hit_min_hits_times(tmp_path: Path) -> None:
    needs_mooncake()
    master = Master(tmp_path)
    master.start()
    config = tier_config(
        master.address,
        models=[
            {"name": "m", "page_size": 4, "pool": POOL},
            {"name": "off", "page_size": 4, "pool": POOL, "tier": False},
        ],
    )
    config["server"]["tier"]["min_hits"] = 2
    node = Node(tmp_path, "a", config)
    try:
        node.wait(r"prefixcache_tier_connected", 1)
        tokens = np.arange(1, 17).tolist()
        with PrefixCacheClient(node.address, timeout=10) as client:
            for model in ("m", "off"):
                with client.session() as s:
                    slots = client.alloc(model, len(tokens), session=s).slots
                    client.insert(model, tokens, slots, session=s)
            written = r'prefixcache_tier_put_pages_total\{model="m"\}'
            for _ in range(2):
                time.sleep(0.5)  # a write would be done by now
                assert node.metric(written) == 0
                assert client.match("m", tokens).prefix_len == len(tokens)
            node.wait(written, len(tokens) // 4)
            assert node.metric(r'prefixcache_tier_put_pages_total\{model="off"\}') == 0
            assert not [
                k for k in node.metrics() if k.startswith("prefixcache_tier") and 'model="off"' in k
            ]
    finally:
        code = node.stop()
        master.stop()
    assert code == 0, node.stderr[-2000:]
