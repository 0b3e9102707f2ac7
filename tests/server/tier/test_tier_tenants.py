"""Two tenants on two nodes (``server.tenants``): a tenant's pages cached on node A are
a hit for the same tenant on node B, and never reach the other tenant: its lookup in
its own namespace misses, and naming the first tenant's namespace is refused before the
tier is asked (nothing is fetched for it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tier_harness import Master, Node, needs_mooncake, tier_config

from prefixcache.client import PrefixCacheClient
from prefixcache.client.errors import PrefixCacheError

TENANTS = [{"name": "one", "token": "token-one", "namespaces": ["one/"]},
           {"name": "two", "token": "token-two", "namespaces": ["two/"]}]


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[tuple[Node, Node]]:
    needs_mooncake()
    master = Master(tmp_path)
    master.start()
    made = [Node(tmp_path, name, tier_config(master.address, tenants=TENANTS))
            for name in ("a", "b")]
    try:
        for node in made:
            node.wait(r"prefixcache_tier_connected", 1)
        yield made[0], made[1]
    finally:
        codes = [node.stop() for node in made]
        master.stop()
    assert codes == [0, 0], [n.stderr[-2000:] for n in made]


def test_tenants_never_read_each_others_pages(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    tokens = np.arange(1, 17).tolist()
    with PrefixCacheClient(a.address, timeout=10, token="token-one") as one, one.session() as s:
        slots = one.alloc("m", len(tokens), session=s).slots
        one.insert("m", tokens, slots, session=s, extra_key="one/chat")
    a.wait(r"prefixcache_tier_put_pages_total\{.*\}", len(tokens) // 4)
    lookups = r"prefixcache_tier_lookups_total\{.*\}"
    with PrefixCacheClient(b.address, timeout=10, token="token-two") as two:
        asked = b.metric(lookups)
        with pytest.raises(PrefixCacheError, match=r"PERMISSION_DENIED|namespace"):
            two.match("m", tokens, extra_key="one/chat")
        assert b.metric(lookups) == asked  # refused before the tier was asked
        assert two.match("m", tokens, extra_key="two/chat").prefix_len == 0
    with PrefixCacheClient(b.address, timeout=10, token="token-one") as one:
        assert one.match("m", tokens, extra_key="one/chat").prefix_len == len(tokens)
    assert b.metric(r'prefixcache_tier_hit_tokens_total\{.*tier="remote".*\}') == len(tokens)
