"""The Mooncake tier under real vLLM engines, with ``tier.secret_file`` on: an engine on
sidecar A saves a prompt, A writes its pages to a real ``mooncake_master``'s store
(MAC'd under the cluster secret, under keyed keys), and a new engine on sidecar B, which
never saw the prompt, loads it: B fetches the pages from A's segment, checks their
MACs, and the engine's output is vLLM's own prefix-cache hit's, B's pool rows A's, bit
for bit. Sidecar C holds another secret: it computes other keys (a miss), and A's
valid objects copied under C's keys by another client of the master are refused
(counted, removed), never served."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e.e2e_support import TOL, Engine, Sidecar, expected_hit, mismatches, prompts
from tier_harness import Master, RawStore, needs_mooncake, prompt_keys

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "p16"
BLOCK = 32
PAGE_BYTES = 16 * 2 * 2 * 2 * 64 * 4  # tokens x (K, V) x layers x heads x head dim x fp32
# Generous: what is served is under test here, not how fast, and a timed-out fetch on a
# loaded machine would answer a shorter hit.
TIER_TIMEOUT = 5.0


@dataclass
class Cluster:
    master: Master
    raw: RawStore  # another client of the master, without any secret
    a: Sidecar
    b: Sidecar  # a's secret
    c: Sidecar  # another secret
    secret: bytes
    other: bytes

    def keys(self, tokens: list[int], secret: bytes) -> list[str]:
        """The store keys of ``tokens``' whole pages under ``secret``, as a sidecar of
        this config with that secret names them."""
        config = yaml.safe_load(self.a.config.read_text())
        return prompt_keys(config, tokens, None, secret)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    needs_mooncake()
    tmp = tmp_path_factory.mktemp("pct")
    secret, other = os.urandom(32), os.urandom(32)
    (tmp / "secret").write_bytes(secret)
    (tmp / "other").write_bytes(other)
    master = Master(tmp)
    master.start()
    sidecars: list[Sidecar] = []
    raw: RawStore | None = None
    try:
        for name, secret_file in (("a", "secret"), ("b", "secret"), ("c", "other")):
            (tmp / name).mkdir()
            tier = {
                "master": master.address,
                "local_hostname": "127.0.0.1",
                "segment_bytes": 32 << 20,
                "timeout": TIER_TIMEOUT,
                "secret_file": str(tmp / secret_file),
            }
            sidecars.append(Sidecar(tmp / name, size=4096, tier=tier))
        for side in sidecars:
            _wait(lambda side=side: side.metric("prefixcache_tier_connected") >= 1, side)
        raw = RawStore(master)
        a, b, c = sidecars
        yield Cluster(master, raw, a, b, c, secret, other)
    finally:
        if raw is not None:
            raw.close()
        for side in sidecars:
            side.stop()
        master.stop()


@dataclass
class Saved:
    prompt: list[int]
    cached: int  # tokens A saved: whole blocks but the one holding the last token
    own: list[dict[str, Any]]  # vLLM's own hit on the saver
    kv: list[Any]  # A's K and V buffers of the prompt's cached prefix
    keys: list[str]  # the store keys of its pages under the cluster secret


@pytest.fixture(scope="module")
def saved(cluster: Cluster, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Saved:
    """A prompt an engine on A generated, saved in A and written to the store."""
    a, raw = cluster.a, cluster.raw
    (prompt,) = prompts(61, (300,))
    cached = expected_hit(len(prompt), BLOCK)
    keys = cluster.keys(prompt[:cached], cluster.secret)
    saver = Engine(tmp_path_factory.mktemp("tier-saver"), "tier-saver", model_dir, BLOCK, a, MODEL)
    try:
        saver.generate([prompt])
        a.wait_cached(MODEL, [prompt], unit=BLOCK)
        _wait(lambda: all(raw.exists(k) for k in keys), a, "A's pages never reached the store")
        hit, kv = _kv(a, prompt)
        assert hit == cached
        own = saver.generate([prompt])  # what vLLM's own hit answers (its local cache)
        assert own[0]["cached"] == cached
    finally:
        saver.close()
    return Saved(prompt, cached, own, kv, keys)


def _wait(ready: Any, side: Sidecar, what: str = "", timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{what or 'not ready'} after {timeout} s: put "
                f"{side.metric('prefixcache_tier_put_pages_total')} pages, dropped "
                f"{side.metric('prefixcache_tier_put_dropped_pages_total')}; log tail:\n"
                f"{side.log.read_text(errors='replace')[-3000:]}"
            )
        time.sleep(0.1)


def _kv(sidecar: Sidecar, tokens: list[int]) -> tuple[int, list[Any]]:
    """The prompt's cached prefix and its KV (every K and V buffer), read under a lock:
    on a sidecar that lacks it, the Match looks it up in the tier."""
    client = sidecar.client
    with client.session() as s:
        reply = client.match(MODEL, tokens, session=s, lock=True)
        if not reply.prefix_len:
            return 0, []
        data = client.read_kv(MODEL, reply.slots, session=s)
        client.unlock(reply.lock_id, session=s)
    return reply.prefix_len, [*data.k, *data.v]


def test_a_prompt_saved_on_one_node_is_loaded_through_the_tier_on_another(
    cluster: Cluster, saved: Saved, model_dir: Path, tmp_path: Path
) -> None:
    b = cluster.b
    fetched = b.metric("prefixcache_tier_fetch_bytes_total")
    remote = b.metric("prefixcache_tier_hit_tokens_total", 'tier="remote"')
    loader = Engine(tmp_path, "tier-loader", model_dir, BLOCK, b, MODEL)
    try:
        got = loader.generate([saved.prompt])
        assert got[0]["cached"] == saved.cached, loader.log_tail()
    finally:
        loader.close()
    # The hit came from the store: every page of it fetched and checked.
    pages = saved.cached // 16
    assert b.metric("prefixcache_tier_fetch_bytes_total") >= fetched + pages * PAGE_BYTES
    assert b.metric("prefixcache_tier_hit_tokens_total", 'tier="remote"') >= remote + saved.cached
    assert b.metric("prefixcache_integrity_failures_total") == 0
    assert not (bad := mismatches(got, saved.own, TOL)), "\n".join(bad)
    hit, loaded = _kv(b, saved.prompt)
    assert hit >= saved.cached
    for x, y in zip(saved.kv, loaded, strict=True):  # bit for bit
        assert x[: saved.cached].numpy().tobytes() == y[: saved.cached].numpy().tobytes()


def test_a_node_with_another_secret_never_serves_the_pages(cluster: Cluster, saved: Saved) -> None:
    c, raw = cluster.c, cluster.raw
    theirs = cluster.keys(saved.prompt[: saved.cached], cluster.other)
    assert not set(theirs) & set(saved.keys)  # keyed keys: another secret, other names
    misses = c.metric("prefixcache_tier_lookups_total", 'result="miss"')
    assert _kv(c, saved.prompt) == (0, [])
    assert c.metric("prefixcache_tier_lookups_total", 'result="miss"') == misses + 1
    # Another client of the master copies A's valid objects under C's keys: their MACs
    # are under the cluster secret's tenant key, not C's, so C refuses and removes them.
    for mine, copy in zip(saved.keys, theirs, strict=True):
        assert raw.put(copy, raw.get(mine)) == 0
    failures = c.metric("prefixcache_integrity_failures_total", 'source="tier"')
    refused = c.metric("prefixcache_tier_lookups_total", 'result="refused"')
    assert _kv(c, saved.prompt) == (0, [])
    assert c.metric("prefixcache_tier_lookups_total", 'result="refused"') == refused + 1
    assert c.metric("prefixcache_integrity_failures_total", 'source="tier"') > failures
    assert c.metric("prefixcache_integrity_failures_total", 'reason="seal_mismatch"') > 0
    assert not raw.exists(theirs[0])
    assert c.metric("prefixcache_tier_fetch_bytes_total") == 0  # nothing entered C's pool
