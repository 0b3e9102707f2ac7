"""A node that dies (SIGKILL) with pages in its segment: until the master expires it
(``client_ttl``), the store still says those pages exist, and reading them fails with
Mooncake's TRANSFER_FAIL. On another node that is a counted local miss: the lookup
answers its local hit within its deadline, the error is counted under Mooncake's code
(and the lookup as ``result="error"``),
the fetch's slots go back to the pool, and the node goes on serving."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tier_harness import Master, Node, needs_mooncake, tier_config

from prefixcache.client import PrefixCacheClient

PAGE = 4
TIMEOUT = 0.5
# Long enough that the dead node's objects are still listed while B reads them.
CLIENT_TTL = 120


def _free(client: PrefixCacheClient) -> int:
    (model,) = [m for m in client.stats("m").models if m.model == "m"]
    return int(model.free_slots)


def _tier_metrics(node: Node) -> dict[str, float]:
    return {k: v for k, v in node.metrics().items() if k.startswith("prefixcache_tier")}


@pytest.mark.slow
def test_a_dead_peer_is_a_counted_local_miss(tmp_path: Path) -> None:
    needs_mooncake()
    master = Master(tmp_path, client_ttl=CLIENT_TTL)
    master.start()
    a = Node(tmp_path, "a", tier_config(master.address, timeout=TIMEOUT))
    b = Node(tmp_path, "b", tier_config(master.address, timeout=TIMEOUT))
    try:
        for node in (a, b):
            node.wait(r"prefixcache_tier_connected", 1)
        head = np.arange(1, 9).tolist()
        tokens = head + np.arange(1000, 1016).tolist()
        with PrefixCacheClient(a.address, timeout=10) as client, client.session() as s:
            slots = client.alloc("m", len(tokens), session=s).slots
            client.insert("m", tokens, slots, session=s)
        a.wait(r"prefixcache_tier_put_pages_total\{.*\}", len(tokens) // PAGE)
        a.proc.kill()
        a.proc.wait(10)
        with PrefixCacheClient(b.address, timeout=10) as client:
            with client.session() as s:  # B holds the first two pages itself
                slots = client.alloc("m", len(head), session=s).slots
                client.insert("m", head, slots, session=s)
            free = _free(client)
            assert client.match("m", tokens).prefix_len == len(head)
            # The fetch from the dead peer failed (TRANSFER_FAIL) rather than hung: one
            # that hung would have run past the lookup's deadline (TIMEOUT) instead.
            assert (
                b.metric(
                    r'prefixcache_tier_errors_total\{(?=.*op="get")'
                    r'(?=.*code="TRANSFER_FAIL").*\}'
                )
                >= 1
            ), _tier_metrics(b)
            # The lookup's outcome is an error (as a failed exists is), not a plain miss.
            assert b.metric(r'prefixcache_tier_lookups_total\{.*result="error".*\}') == 1
            assert b.metric(r'prefixcache_tier_lookups_total\{.*result="miss".*\}') == 0
            assert b.metric(r'prefixcache_tier_hit_tokens_total\{.*tier="remote".*\}') == 0
            assert b.metric(r'prefixcache_tier_hit_tokens_total\{.*tier="local".*\}') == len(head)
            # Nothing was fetched: neither bytes nor seconds (the GB/s they make is of
            # fetches that brought pages).
            assert b.metric(r"prefixcache_tier_fetch_bytes_total\{.*\}") == 0
            assert b.metric(r"prefixcache_tier_fetch_seconds_total\{.*\}") == 0, _tier_metrics(b)
            assert _free(client) == free  # the fetch's slots went back
            # B goes on serving: it caches and hits locally.
            other = np.arange(2000, 2016).tolist()
            with client.session() as s:
                slots = client.alloc("m", len(other), session=s).slots
                client.insert("m", other, slots, session=s)
            assert client.match("m", other).prefix_len == len(other)
    finally:
        a.stop()  # killed already: only its files are closed
        code = b.stop()
        master.stop()
    assert code == 0, b.stderr[-2000:]
