"""The tier's own bound on its fetches, instead of the clients' quotas: node B has
``max_session_slots: 64``, yet its tier fetches a 256-slot hit (the tier's session is
the service's, not a client's); ``tier.max_fetch_slots`` is what bounds a fetch (a
longer hit comes in its leading slots, the rest on the next lookup); and a fetch the
pool has no room for is the lookup result ``capacity``, not a plain miss."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import numpy as np
import pytest
from tier_harness import Master, Node, needs_mooncake, tier_config

from prefixcache.client import PrefixCacheClient

POOL = 512
FETCH_SLOTS = 256
MODEL = {
    "name": "m",
    "kind": "radix",
    "page_size": 4,
    "pool": {"size": POOL, "layers": 2, "k_heads": 2, "k_head_dim": 8, "dtype": "float16"},
}
TIMEOUT = 5.0  # about what is fetched, not how fast: no timeouts on a loaded machine
LOOKUPS = r'prefixcache_tier_lookups_total\{.*result="%s".*\}'
REMOTE = r'prefixcache_tier_hit_tokens_total\{.*tier="remote".*\}'


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Node, Node]]:
    needs_mooncake()
    tmp = tmp_path_factory.mktemp("capacity")
    master = Master(tmp)
    master.start()
    a = Node(tmp, "a", tier_config(master.address, timeout=TIMEOUT, models=[MODEL]))
    b = Node(
        tmp,
        "b",
        tier_config(
            master.address,
            timeout=TIMEOUT,
            models=[MODEL],
            max_session_slots=64,
            tier={"max_fetch_slots": FETCH_SLOTS},
        ),
    )
    try:
        for node in (a, b):
            node.wait(r"prefixcache_tier_connected", 1)
        yield a, b
    finally:
        codes = [a.stop(), b.stop()]
        master.stop()
    assert codes == [0, 0], [a.stderr[-2000:], b.stderr[-2000:]]


def _cache(node: Node, tokens: list[int]) -> None:
    before = node.metric(r"prefixcache_tier_put_pages_total\{.*\}")
    with PrefixCacheClient(node.address, timeout=10) as client, client.session() as s:
        slots = client.alloc("m", len(tokens), session=s).slots
        client.insert("m", tokens, slots, session=s)
    node.wait(r"prefixcache_tier_put_pages_total\{.*\}", before + len(tokens) // 4)


def _match(node: Node, tokens: list[int]) -> int:
    with PrefixCacheClient(node.address, timeout=10) as client:
        return client.match("m", tokens).prefix_len


def test_client_quotas_do_not_apply_to_the_tiers_fetch(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    tokens = np.arange(1000, 1256).tolist()
    _cache(a, tokens)
    assert _match(b, tokens) == 256  # 4x the 64 slots one client session may hold
    assert b.metric(REMOTE) == 256


def test_a_hit_longer_than_max_fetch_slots_comes_in_its_leading_slots(
    nodes: tuple[Node, Node],
) -> None:
    a, b = nodes
    tokens = np.arange(2000, 2320).tolist()
    _cache(a, tokens)
    remote = b.metric(REMOTE)
    assert _match(b, tokens) == FETCH_SLOTS
    assert _match(b, tokens) == len(tokens)  # the rest after the local hit
    assert b.metric(REMOTE) == remote + len(tokens)


def test_a_fetch_without_room_in_the_pool_is_capacity(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    tokens = np.arange(3000, 3064).tolist()
    _cache(a, tokens)
    misses, capacity = b.metric(LOOKUPS % "miss"), b.metric(LOOKUPS % "capacity")
    with PrefixCacheClient(b.address, timeout=10) as client, ExitStack() as stack:
        for _ in range(POOL // 64):  # every slot of B's pool, 64 a session (evicting)
            client.alloc("m", 64, session=stack.enter_context(client.session()))
        assert client.match("m", tokens).prefix_len == 0
    assert b.metric(LOOKUPS % "capacity") == capacity + 1
    assert b.metric(LOOKUPS % "miss") == misses
    assert _match(b, tokens) == len(tokens)  # with room again, the fetch comes
