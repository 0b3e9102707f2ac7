"""A sidecar whose master is not up yet serves from its own pool and joins the tier
once the master comes up: nothing fails, the tier connects in the background."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from tier_harness import Master, Node, needs_mooncake, tier_config

from prefixcache.client import PrefixCacheClient


@pytest.mark.slow
def test_serves_before_the_master_is_up_and_connects_after(tmp_path: Path) -> None:
    needs_mooncake()
    master = Master(tmp_path)  # its ports chosen, nothing listening yet
    node = Node(tmp_path, "a", tier_config(master.address))
    try:
        tokens = np.arange(1, 17).tolist()
        deadline = time.monotonic() + 60
        while True:  # up, and answering, while the store cannot be reached
            try:
                with PrefixCacheClient(node.address, timeout=5) as client:
                    reply = client.match("m", tokens)
                break
            except Exception:
                assert time.monotonic() < deadline, node.stderr[-3000:]
                time.sleep(0.2)
        assert reply.prefix_len == 0
        assert node.metric(r"prefixcache_tier_connected") == 0
        # "unavailable": the lookup made no store call at all (none can be made before
        # the tier connects), so the answer waited on nothing; nor did a call fail.
        assert node.metric(r'prefixcache_tier_lookups_total\{.*result="unavailable".*\}') >= 1
        assert node.metric(r"prefixcache_tier_errors_total\{.*\}") == 0
        master.start()
        node.wait(r"prefixcache_tier_connected", 1, timeout=60)
    finally:
        code = node.stop()
        master.stop()
    assert code == 0, node.stderr[-2000:]
