"""Every page the tier serves is the page that was computed: another client of the
master (``RawStore``, in this process) writes garbage under a prompt's keys, swaps
valid pages' objects, replays an old version of a page and puts one tenant's page under
another's key; node B refuses each page (a shorter hit, never a wrong one, the bytes it
serves those node A computed), counts it in ``prefixcache_integrity_failures_total``
and removes the object, with ``tier.secret_file`` (a MAC) and without (a digest). A fuzz
of bit flips in fetched objects never yields a hit with changed bytes, and for any
sequence of inserts, evictions and fetches on both nodes every served page equals the
page inserted under its prefix.

Worst case for the keyed runs: the attacker knows the keys (this test computes them
with the secret, as if it had watched them go by); it still cannot make a seal.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tier_harness import Node, RawStore, node_models, prompt_keys, tier_config, two_nodes

from prefixcache.cache.hashing import hash_pages
from prefixcache.client import PrefixCacheClient
from prefixcache.server.tier.keys import KeyMaker

PAGE = 4
ROW = (2, 8)  # k_heads, k_head_dim of the harness's model
PAGE_BYTES = PAGE * 4 * 2 * 8 * 2  # 4 buffers (2 layers, K and V) of float16 rows
OBJECT_BYTES = PAGE_BYTES + 32  # and the seal
TENANTS = [
    {"name": "one", "token": "token-one", "namespaces": ["one/"]},
    {"name": "two", "token": "token-two", "namespaces": ["two/"]},
]
NS = "one/chat"
FAILURES = r'prefixcache_integrity_failures_total\{(?=.*source="tier")%s.*\}'
PUTS = r"prefixcache_tier_put_pages_total\{.*\}"
TIMEOUT = 5.0


@dataclass
class Cluster:
    a: Node
    b: Node
    raw: RawStore
    config: dict[str, Any]
    secret: bytes | None

    def keys(
        self, tokens: list[int], extra_key: str | None = NS, config: dict[str, Any] | None = None
    ) -> list[str]:
        return prompt_keys(config or self.config, tokens, extra_key, self.secret)


@pytest.fixture(scope="module", params=["digest", "mac"])
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp(f"integrity-{request.param}")
    secret = None
    tier: dict[str, Any] = {}
    if request.param == "mac":
        secret = os.urandom(32)
        (tmp / "tier-secret").write_bytes(secret)
        tier["secret_file"] = str(tmp / "tier-secret")
    configs: list[dict[str, Any]] = []

    def config_for(address: str) -> dict[str, Any]:
        # A generous deadline: these tests are about what is served, not how fast, and
        # a timed-out fetch on a loaded machine would answer a shorter hit.
        configs.append(tier_config(address, timeout=TIMEOUT, tenants=TENANTS, tier=tier))
        return configs[-1]

    with two_nodes(tmp, config_for) as (master, a, b):
        raw = RawStore(master)
        try:
            yield Cluster(a, b, raw, configs[0], secret)
        finally:
            raw.close()


def _tokens(seed: int, n: int = 16) -> list[int]:
    return np.random.default_rng(seed).integers(1, 30000, n).tolist()


def _kv(tokens: list[int]) -> list[torch.Tensor]:
    """The KV of ``tokens`` (k layers, then v layers): each token's rows a function of
    its whole prefix, so a page is right only at its own place under its own prefix."""
    rows: list[list[torch.Tensor]] = [[] for _ in range(4)]
    for i in range(len(tokens)):
        prefix = np.asarray(tokens[: i + 1], "<u4").tobytes()
        gen = torch.Generator().manual_seed(
            int.from_bytes(hashlib.sha256(prefix).digest()[:7], "little")
        )
        for buf in rows:
            buf.append(torch.randn(1, *ROW, generator=gen).half())
    return [torch.cat(buf) for buf in rows]


def _cache(
    node: Node, tokens: list[int], extra_key: str = NS, token: str = "token-one"
) -> list[torch.Tensor]:
    kv = _kv(tokens)
    with PrefixCacheClient(node.address, timeout=10, token=token) as client, client.session() as s:
        slots = client.alloc("m", len(tokens), session=s).slots
        client.write_kv("m", slots, kv[:2], kv[2:], session=s)
        client.insert("m", tokens, slots, session=s, extra_key=extra_key)
    return kv


def _cache_and_put(cl: Cluster, node: Node, tokens: list[int], **kw: Any) -> list[torch.Tensor]:
    before = node.metric(PUTS)
    kv = _cache(node, tokens, **kw)
    node.wait(PUTS, before + len(tokens) // PAGE)
    return kv


def _read(
    node: Node, tokens: list[int], extra_key: str = NS, token: str = "token-one"
) -> tuple[int, list[torch.Tensor]]:
    """Match on ``node``, then ReadKV of the hit under the match's lock."""
    with PrefixCacheClient(node.address, timeout=10, token=token) as client, client.session() as s:
        reply = client.match("m", tokens, session=s, lock=True, extra_key=extra_key)
        if not reply.prefix_len:
            return 0, []
        data = client.read_kv("m", reply.slots, session=s)
        return reply.prefix_len, [*data.k, *data.v]


def _forget(node: Node) -> None:
    """Evict everything ``node`` caches, so that its next lookup asks the tier."""
    with PrefixCacheClient(node.address, timeout=10, token="token-one") as client:
        client.evict("m", 1 << 20)


def _served_as_computed(node: Node, tokens: list[int], pages: int, **kw: Any) -> None:
    """``node`` hits exactly ``pages`` pages of ``tokens``, with the KV computed for them."""
    hit, got = _read(node, tokens, **kw)
    assert hit == pages * PAGE, (hit, pages)
    if hit:
        assert all(torch.equal(x, y[:hit]) for x, y in zip(got, _kv(tokens), strict=True))


def _failures(node: Node, reason: str = "") -> float:
    return node.metric(FAILURES % (f'(?=.*reason="{reason}")' if reason else ""))


def _page_bytes(tokens: list[int], page: int) -> bytes:
    """The bytes of page ``page`` of ``tokens``' KV as an object carries them."""
    kv = _kv(tokens)
    return b"".join(t[page * PAGE : (page + 1) * PAGE].numpy().tobytes() for t in kv)


def test_a_sidecar_without_the_secret_says_once_whom_its_tier_trusts(cluster: Cluster) -> None:
    for node in (cluster.a, cluster.b):
        said = node.stderr.count("trusts every client of the master")
        assert said == (0 if cluster.secret else 1), node.stderr[-2000:]


def test_garbage_under_a_prompt_never_cached_is_refused(cluster: Cluster) -> None:
    b, raw = cluster.b, cluster.raw
    tokens = _tokens(1)
    keys = cluster.keys(tokens)
    for key in keys:  # right-sized garbage under every page's key
        assert raw.put(key, os.urandom(OBJECT_BYTES)) == 0
    before = _failures(b)
    _served_as_computed(b, tokens, 0)
    assert _failures(b) == before + len(keys)  # every page read was checked
    assert not any(raw.exists(k) for k in keys)  # and removed
    assert b.metric(r'prefixcache_tier_lookups_total\{.*result="refused".*\}') >= 1


def test_garbage_upserted_over_honest_pages_is_refused(cluster: Cluster) -> None:
    a, b, raw = cluster.a, cluster.b, cluster.raw
    tokens = _tokens(2)
    _cache_and_put(cluster, a, tokens)
    keys = cluster.keys(tokens)
    assert raw.upsert(keys[2], os.urandom(OBJECT_BYTES)) == 0
    assert raw.upsert(keys[3], os.urandom(PAGE_BYTES)) == 0  # the wrong size too
    before = _failures(b)
    _served_as_computed(b, tokens, 2)  # the two honest pages before them
    assert _failures(b) == before + 2
    assert _failures(b, "size") >= 1
    assert not raw.exists(keys[2]) and not raw.exists(keys[3])


def test_garbage_written_before_the_honest_write_is_refused_and_heals(cluster: Cluster) -> None:
    a, b, raw = cluster.a, cluster.b, cluster.raw
    tokens = _tokens(3)
    keys = cluster.keys(tokens)
    for key in keys:
        raw.put(key, os.urandom(OBJECT_BYTES))
    _cache_and_put(cluster, a, tokens)  # Mooncake keeps the garbage: a put never overwrites
    before = _failures(b)
    _served_as_computed(b, tokens, 0)
    assert _failures(b) == before + len(keys)
    assert not any(raw.exists(k) for k in keys)
    # Removed, the keys are free for the next node that computes the prompt: B's write
    # lands, and what the tier serves from then on is the prompt's KV.
    _cache_and_put(cluster, b, tokens)
    _forget(b)
    _served_as_computed(b, tokens, len(keys))
    assert _failures(b) == before + len(keys)
    assert all(raw.get(k)[:PAGE_BYTES] == _page_bytes(tokens, i) for i, k in enumerate(keys))


def test_two_valid_pages_swapped_are_refused(cluster: Cluster) -> None:
    a, b, raw = cluster.a, cluster.b, cluster.raw
    tokens = _tokens(4)
    _cache_and_put(cluster, a, tokens)
    keys = cluster.keys(tokens)
    one, two = raw.get(keys[1]), raw.get(keys[2])
    assert len(one) == len(two) == OBJECT_BYTES
    raw.upsert(keys[1], two)
    raw.upsert(keys[2], one)
    before = _failures(b, "seal_mismatch")
    _served_as_computed(b, tokens, 1)
    assert _failures(b, "seal_mismatch") == before + 2


def test_an_old_version_of_a_page_is_refused(cluster: Cluster) -> None:
    """A page as a sidecar with the model's previous tokenizer sealed it, valid there
    (and with the secret, MAC'd under it), replayed under the current key."""
    a, b, raw = cluster.a, cluster.b, cluster.raw
    tokens = _tokens(5)
    _cache_and_put(cluster, a, tokens)
    keys = cluster.keys(tokens)
    model, tenants = node_models(cluster.config)
    old = KeyMaker(replace(model, tokenizer="previous-tokenizer"), tenants, cluster.secret)
    ns = old.namespace(NS, 1)
    hashes = hash_pages(np.asarray(tokens, "<u4").tobytes(), 4 * PAGE, None)
    stale = os.urandom(PAGE_BYTES)  # what that model computed for the page
    raw.upsert(keys[1], stale + ns.seal.seal(ns.ident(hashes[1]), [stale]))
    before = _failures(b, "seal_mismatch")
    _served_as_computed(b, tokens, 1)
    assert _failures(b, "seal_mismatch") == before + 1


def test_a_tenants_page_under_another_tenants_key_is_refused(cluster: Cluster) -> None:
    a, b, raw = cluster.a, cluster.b, cluster.raw
    tokens = _tokens(6)
    _cache_and_put(cluster, a, tokens)
    ones, twos = cluster.keys(tokens, NS), cluster.keys(tokens, "two/chat")
    assert set(ones).isdisjoint(twos)  # keys carry the tenant and namespace
    for one, two in zip(ones, twos, strict=True):
        raw.put(two, raw.get(one))
    before = _failures(b)
    _served_as_computed(b, tokens, 0, extra_key="two/chat", token="token-two")
    assert _failures(b) == before + len(twos)


def test_a_forged_digest_is_refused_where_a_mac_is_required(cluster: Cluster) -> None:
    """Without the secret an attacker can compute a digest seal for anything; a sidecar
    with the secret takes MACs only."""
    if cluster.secret is None:
        pytest.skip("a digest is what a sidecar without the secret checks")
    a, b, raw = cluster.a, cluster.b, cluster.raw
    tokens = _tokens(7)
    _cache_and_put(cluster, a, tokens)
    keys = cluster.keys(tokens)
    model, tenants = node_models(cluster.config)
    ns = KeyMaker(model, tenants, None).namespace(NS, 1)  # the digest, as anyone makes it
    hashes = hash_pages(np.asarray(tokens, "<u4").tobytes(), 4 * PAGE, None)
    forged = os.urandom(PAGE_BYTES)
    raw.upsert(keys[0], forged + ns.seal.seal(ns.ident(hashes[0]), [forged]))
    before = _failures(b, "wrong_kind")
    _served_as_computed(b, tokens, 0)
    assert _failures(b, "wrong_kind") == before + 1


FUZZ_TOKENS = _tokens(8)


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    page=st.integers(0, 3),
    bits=st.lists(st.integers(0, OBJECT_BYTES * 8 - 1), min_size=1, max_size=3, unique=True),
)
def test_bit_flips_in_a_fetched_object_never_serve_changed_bytes(
    cluster: Cluster, page: int, bits: list[int]
) -> None:
    a, b, raw = cluster.a, cluster.b, cluster.raw
    keys = cluster.keys(FUZZ_TOKENS)
    if not all(map(raw.exists, keys)):  # the first example: the honest pages, from A
        _cache_and_put(cluster, a, FUZZ_TOKENS)
    honest = raw.get(keys[page])
    flipped = bytearray(honest)
    for bit in bits:
        flipped[bit // 8] ^= 1 << (bit % 8)
    raw.upsert(keys[page], bytes(flipped))
    _forget(b)
    before = _failures(b)
    try:
        _served_as_computed(b, FUZZ_TOKENS, page)
        assert _failures(b) == before + 1
    finally:
        # B removes the refused object, off the lookup's path: let that land first, so
        # that it cannot remove the honest page put back for the next example.
        deadline = time.monotonic() + 5
        while raw.exists(keys[page]) and time.monotonic() < deadline:
            time.sleep(0.02)
        raw.upsert(keys[page], honest)


ALPHABET = [_tokens(100 + i, PAGE) for i in range(4)]  # pages that prompts share
ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("insert"),
            st.sampled_from("ab"),
            st.lists(st.integers(0, 3), min_size=1, max_size=4),
        ),
        st.tuples(st.just("evict"), st.sampled_from("ab"), st.integers(4, 64)),
        st.tuples(
            st.just("lookup"),
            st.sampled_from("ab"),
            st.lists(st.integers(0, 3), min_size=1, max_size=4),
        ),
    ),
    min_size=1,
    max_size=8,
)


@settings(
    max_examples=10,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(steps=ops)
def test_every_served_page_is_the_page_inserted_under_its_prefix(
    cluster: Cluster, steps: list[tuple[str, str, Any]]
) -> None:
    """Prompts are made of four shared pages in any order, so they share prefixes and
    diverge; each token's KV is a function of its whole prefix (``_kv``). Whatever both
    nodes insert, evict and fetch from each other, a hit serves exactly that KV, and
    no honest page is ever refused."""
    nodes = {"a": cluster.a, "b": cluster.b}
    before = {name: _failures(node) for name, node in nodes.items()}
    for op, name, arg in steps:
        node = nodes[name]
        if op == "evict":
            with PrefixCacheClient(node.address, timeout=10, token="token-one") as client:
                client.evict("m", arg)
            continue
        tokens = [t for i in arg for t in ALPHABET[i]]
        if op == "insert":
            _cache(node, tokens)
            continue
        hit, got = _read(node, tokens)
        assert hit % PAGE == 0
        if hit:
            assert all(torch.equal(x, y[:hit]) for x, y in zip(got, _kv(tokens), strict=True))
    assert {name: _failures(node) for name, node in nodes.items()} == before
