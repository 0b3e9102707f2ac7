"""Two tenants on two nodes (``server.tenants``): a tenant's pages cached on node A are
a hit for the same tenant on node B, and never reach the other tenant: its lookup in
its own namespace misses, and naming the first tenant's namespace is refused before the
tier is asked (nothing is fetched for it). A node that does not list the tenant finds
none of its pages."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tier_harness import Master, Node, needs_mooncake, tier_config, two_nodes

from prefixcache.client import PrefixCacheClient
from prefixcache.client.errors import PrefixCacheError

TENANTS = [
    {"name": "one", "token": "token-one", "namespaces": ["one/"]},
    {"name": "two", "token": "token-two", "namespaces": ["two/"]},
]


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[tuple[Node, Node]]:
    with two_nodes(tmp_path, lambda address: tier_config(address, tenants=TENANTS)) as (_, a, b):
        yield a, b


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


@pytest.mark.slow
def test_a_sidecar_without_a_tenants_config_reads_none_of_its_pages(tmp_path: Path) -> None:
    """Node B lists no tenants (or another tenant on the same prefix): naming acme's
    namespace there finds nothing of what acme cached on node A, since tier keys carry
    the namespace's tenants, not just the namespace."""
    acme = [{"name": "acme", "token": "token-acme", "namespaces": ["acme/"]}]
    other = [{"name": "other", "token": "token-other", "namespaces": ["acme/"]}]
    needs_mooncake()
    master = Master(tmp_path)
    master.start()
    nodes = [
        Node(tmp_path, "a", tier_config(master.address, tenants=acme)),
        Node(tmp_path, "b", tier_config(master.address)),
        Node(tmp_path, "c", tier_config(master.address, tenants=other)),
    ]
    a, b, c = nodes
    try:
        for node in nodes:
            node.wait(r"prefixcache_tier_connected", 1)
        tokens = np.arange(100, 164).tolist()
        with (
            PrefixCacheClient(a.address, timeout=10, token="token-acme") as client,
            client.session() as s,
        ):
            slots = client.alloc("m", len(tokens), session=s).slots
            client.insert("m", tokens, slots, session=s, extra_key="acme/app")
        a.wait(r"prefixcache_tier_put_pages_total\{.*\}", len(tokens) // 4)
        with PrefixCacheClient(b.address, timeout=10) as client:
            assert client.match("m", tokens, extra_key="acme/app").prefix_len == 0
        with PrefixCacheClient(c.address, timeout=10, token="token-other") as client:
            assert client.match("m", tokens, extra_key="acme/app").prefix_len == 0
        for node in (b, c):
            assert node.metric(r'prefixcache_tier_lookups_total\{.*result="miss".*\}') == 1
        assert a.metric(r"prefixcache_tier_lookups_total\{.*\}") == 0
    finally:
        codes = [node.stop() for node in nodes]
        master.stop()
    assert codes == [0, 0, 0], [n.stderr[-2000:] for n in nodes]
