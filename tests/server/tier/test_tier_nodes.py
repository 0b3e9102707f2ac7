"""The tier across "nodes": a real mooncake_master and two `prefixcache serve` processes.

A prompt cached on node A, its KV written through the client, is a hit on node B with
byte-identical KV (ReadKV); namespaces never read each other's pages; a master killed
mid-run leaves both serving locally within their deadlines, and a restarted master is
an empty tier: counted misses, nothing else.

One master and one pair of servers per module (CI has 2 cores); the tests run in file
order, the master's death last.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from harness import pb, stub_for, toks
from tier_harness import Node, tier_config, two_nodes

from prefixcache.cache import hash_token_ids
from prefixcache.cache.radix.lookup_outcomes import OUTCOMES
from prefixcache.client import PrefixCacheClient
from prefixcache.client.step import Admit
from prefixcache.integrations.vllm.keys import RequestInfo
from prefixcache.integrations.vllm.layout import split_kv

# SGLang's host pools and backend core, as tests/integrations/sglang drives them.
sys.path.insert(0, str(Path(__file__).parents[2] / "integrations" / "sglang"))
from hicache_hosts import HostPool, host_indices, make_core
from integrations.vllm.vllm_support import (
    backend_for,
    make_caches,
    make_scheduler,
    make_worker,
    settle,
    token_rows,
)

MODEL = "m"
PAGE = 4
ROW = (2, 8)  # k_heads, k_head_dim
TIMEOUT = 0.5
# tier/service.py: how long the breaker skips the store after a failure.
COOLDOWN = max(1.0, 4 * TIMEOUT)
ERRORS = r"prefixcache_tier_errors_total\{.*\}"
TIMEOUTS = r'prefixcache_tier_errors_total\{.*code="TIMEOUT".*\}'
LOOKUPS = r"prefixcache_tier_lookups_total\{.*\}"
LOCAL = r'prefixcache_tier_lookups_total\{.*result="local".*\}'
MISSES = r'prefixcache_tier_lookups_total\{.*result="miss".*\}'


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with two_nodes(
        tmp_path_factory.mktemp("tier"),
        lambda address: tier_config(address, timeout=TIMEOUT, change_log_capacity=1024),
    ) as (master, a, b):
        yield {"master": master, "a": a, "b": b}


def _tokens(seed: int, n: int = 16) -> list[int]:
    return np.random.default_rng(seed).integers(1, 30000, n).tolist()


def _cache(
    node: Node, tokens: list[int], seed: int, extra_key: str | None = None, scattered: bool = False
) -> list[torch.Tensor]:
    """Cache ``tokens`` on ``node`` with KV written through the client; returns the KV
    (k layers, then v layers). ``scattered``: in slots given in reverse, so no page's
    slots are one run."""
    gen = torch.Generator().manual_seed(seed)
    kv = [torch.randn(len(tokens), *ROW, generator=gen).half() for _ in range(4)]
    with PrefixCacheClient(node.address, timeout=10) as client, client.session() as s:
        slots = client.alloc(MODEL, len(tokens), session=s).slots
        if scattered:
            slots = slots[::-1]
        client.write_kv(MODEL, slots, kv[:2], kv[2:], session=s)
        client.insert(MODEL, tokens, slots, session=s, extra_key=extra_key)
    return kv


def _read(
    node: Node, tokens: list[int], extra_key: str | None = None
) -> tuple[int, list[torch.Tensor]]:
    """Match on ``node`` (timed), then ReadKV of the hit under the match's lock."""
    with PrefixCacheClient(node.address, timeout=10) as client, client.session() as s:
        reply = client.match(MODEL, tokens, session=s, lock=True, extra_key=extra_key)
        if not reply.prefix_len:
            return 0, []
        data = client.read_kv(MODEL, reply.slots, session=s)
        return reply.prefix_len, [*data.k, *data.v]


def _chain(tokens: list[int]) -> list[str]:
    """SGLang's page keys for ``tokens`` (whole pages)."""
    keys: list[str] = []
    for i in range(0, len(tokens) - PAGE + 1, PAGE):
        keys.append(hash_token_ids(tokens[i : i + PAGE], keys[-1] if keys else None))
    return keys


def _put_pages(node: Node) -> float:
    return node.metric(r"prefixcache_tier_put_pages_total\{.*\}")


def _outcomes(node: Node) -> dict[str, float]:
    """``node``'s prefixcache_lookup_tokens_total of the model, by outcome."""
    return {
        o: node.metric(r'prefixcache_lookup_tokens_total\{.*outcome="' + o + r'".*\}')
        for o in OUTCOMES
    }


def _grew(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The outcomes that grew, and by how much."""
    return {o: after[o] - before[o] for o in OUTCOMES if after[o] != before[o]}


def test_b_hits_what_a_cached_with_identical_kv(cluster: dict[str, Any]) -> None:
    a, b = cluster["a"], cluster["b"]
    tokens = _tokens(1)
    before = _put_pages(a)
    kv = _cache(a, tokens, seed=1)
    a.wait(r"prefixcache_tier_put_pages_total\{.*\}", before + len(tokens) // PAGE)
    outcomes = _outcomes(b)
    hit, got = _read(b, tokens)
    assert hit == len(tokens)
    # A lookup the tier answered is a hit in the lookup outcomes, like a local one.
    assert _grew(outcomes, _outcomes(b)) == {"hit": len(tokens)}
    assert all(torch.equal(x, y) for x, y in zip(got, kv, strict=True))
    assert b.metric(r'prefixcache_tier_hit_tokens_total\{.*tier="remote".*\}') == len(tokens)
    # Node B now holds the pages itself: the next lookup is local, and B wrote nothing back.
    assert _read(b, tokens)[0] == len(tokens)
    assert b.metric(r'prefixcache_tier_lookups_total\{.*result="local".*\}') >= 1
    assert _put_pages(b) == 0


def test_pages_in_scattered_slots_arrive_whole(cluster: dict[str, Any]) -> None:
    """A page written from slots that are not one run (a part per row) is read back
    into one run of fresh slots, byte for byte."""
    a, b = cluster["a"], cluster["b"]
    tokens = _tokens(16)
    before = _put_pages(a)
    kv = _cache(a, tokens, seed=16, scattered=True)
    a.wait(r"prefixcache_tier_put_pages_total\{.*\}", before + len(tokens) // PAGE)
    hit, got = _read(b, tokens)
    assert hit == len(tokens)
    assert all(torch.equal(x, y) for x, y in zip(got, kv, strict=True))


def test_b_fetches_only_what_follows_its_local_hit(cluster: dict[str, Any]) -> None:
    a, b = cluster["a"], cluster["b"]
    head = _tokens(2, 8)
    tokens = head + _tokens(3, 12)
    _cache(b, head, seed=4)  # B has the first two pages, with its own KV
    before = _put_pages(a)
    kv = _cache(a, tokens, seed=5)
    a.wait(r"prefixcache_tier_put_pages_total\{.*\}", before + len(tokens) // PAGE)
    remote = b.metric(r'prefixcache_tier_hit_tokens_total\{.*tier="remote".*\}')
    hit, got = _read(b, tokens)
    assert hit == len(tokens)
    # The tail came from A, the head is B's own.
    assert all(torch.equal(x[8:], y[8:]) for x, y in zip(got, kv, strict=True))
    assert b.metric(r'prefixcache_tier_hit_tokens_total\{.*tier="remote".*\}') == remote + 12


def test_namespaces_never_read_each_others_pages(cluster: dict[str, Any]) -> None:
    a, b = cluster["a"], cluster["b"]
    tokens = _tokens(6)
    before = _put_pages(a)
    kv = _cache(a, tokens, seed=6, extra_key="tenant-1/")
    a.wait(r"prefixcache_tier_put_pages_total\{.*\}", before + len(tokens) // PAGE)
    outcomes = _outcomes(b)
    for other in ("tenant-2/", "", None):
        assert _read(b, tokens, extra_key=other)[0] == 0
    # Neither B's tree nor the tier had them for these namespaces: cold misses.
    assert _grew(outcomes, _outcomes(b)) == {"miss_cold": 3 * len(tokens)}
    hit, got = _read(b, tokens, extra_key="tenant-1/")
    assert hit == len(tokens)
    assert all(torch.equal(x, y) for x, y in zip(got, kv, strict=True))


def test_step_admits_see_remote_pages(cluster: dict[str, Any]) -> None:
    a, b = cluster["a"], cluster["b"]
    tokens = _tokens(12)
    before = _put_pages(a)
    kv = _cache(a, tokens, seed=12)
    a.wait(r"prefixcache_tier_put_pages_total\{.*\}", before + len(tokens) // PAGE)
    with PrefixCacheClient(b.address, timeout=10) as client, client.session() as s:
        reply = client.step(MODEL, admits=[Admit([*tokens, 7], allocate=False)], session=s)
        admit = reply.admits[0]
        assert admit.prefix_len == len(tokens)
        got = client.read_kv(MODEL, admit.slots, session=s)
    assert all(torch.equal(x, y) for x, y in zip([*got.k, *got.v], kv, strict=True))


def test_session_stream_match_sees_remote_pages(cluster: dict[str, Any]) -> None:
    a, b = cluster["a"], cluster["b"]
    tokens = _tokens(14)
    before = _put_pages(a)
    _cache(a, tokens, seed=14)
    a.wait(r"prefixcache_tier_put_pages_total\{.*\}", before + len(tokens) // PAGE)
    channel, stub = stub_for(b.address)
    with channel:
        request = pb.SessionRequest(
            seq=1, match=pb.MatchRequest(model=MODEL, token_ids=toks(tokens))
        )
        replies = list(stub.Session(iter([request]), timeout=10))
    assert replies[0].match.prefix_len == len(tokens)


def test_vllm_scheduler_core_sees_remote_pages(cluster: dict[str, Any]) -> None:
    """The vLLM connector's scheduler on node B: its lookup (a locking Match) answers
    the blocks node A cached."""
    a, b = cluster["a"], cluster["b"]
    tokens = _tokens(13)
    before = _put_pages(a)
    _cache(a, tokens, seed=13)
    a.wait(r"prefixcache_tier_put_pages_total\{.*\}", before + len(tokens) // PAGE)
    core = make_scheduler(b.address, model=MODEL, block=PAGE)
    try:
        req = RequestInfo("r1", [*tokens, 5], len(tokens) + 1)
        assert core.probe(req, 0) == (None, False)  # asks again once the lookup lands
        core.build_meta()
        settle(core)
        assert core.probe(req, 0) == (len(tokens), False)
        core.finished(req, [], 0)
        core.build_meta()
        settle(core)
    finally:
        core.close()


def _engine_step(core: Any, workers: list[Any], finished: frozenset[str] = frozenset()) -> Any:
    """One vLLM engine step (as tests/integrations/vllm/test_worker.py drives it)."""
    meta = core.build_meta()
    done, failed = None, set()
    for worker in workers:
        worker.start_step(meta)
        sent = worker.finished_sends(set(finished))
        done = sent if done is None else done & sent
        failed |= worker.take_failed_saves()
    core.saves_failed(failed)
    core.sends_done(done or ())
    settle(core)
    return meta


def test_vllm_connector_cores_across_nodes(cluster: dict[str, Any]) -> None:
    """vLLM's connector on each node (scheduler and worker cores, KV through the
    service): a request saved on node A is loaded on node B into other blocks, byte for
    byte."""
    a, b = cluster["a"], cluster["b"]
    cores = [make_scheduler(n.address, model=MODEL, block=PAGE, transfer="remote") for n in (a, b)]
    workers = [make_worker(n.address, model=MODEL, block=PAGE, transfer="remote") for n in (a, b)]
    a_blocks, b_blocks = [2, 5, 7, 9, 11], [1, 3, 4, 6, 8]
    prompt = _tokens(15, 18)
    try:
        caches = [make_caches("kv_first"), make_caches("kv_first")]
        for worker, cache in zip(workers, caches, strict=True):
            worker.register(cache, backend_for("kv_first"))
        before = _put_pages(a)
        assert cores[0].finished(RequestInfo("A", prompt, 18), a_blocks, 18)
        for _ in range(3):
            _engine_step(cores[0], workers[:1], frozenset({"A"}))
        a.wait(r"prefixcache_tier_put_pages_total\{.*\}", before + 4)
        req = RequestInfo("B", prompt, 18)
        assert cores[1].probe(req, 0) == (None, False)
        _engine_step(cores[1], workers[1:])
        assert cores[1].probe(req, 0) == (16, False)
        cores[1].allocated("B", b_blocks, 16)
        assert len(_engine_step(cores[1], workers[1:]).loads) == 1
        assert workers[1].take_load_errors() == set()
        views = [
            [split_kv(name, t, "kv_first", ROW[1]) for name, t in cache.items()] for cache in caches
        ]
        for va, vb in zip(*views, strict=True):
            assert torch.equal(token_rows(va, a_blocks, 16), token_rows(vb, b_blocks, 16))
        cores[1].finished(req, b_blocks, 17)
        _engine_step(cores[1], workers[1:], frozenset({"B"}))
    finally:
        for closable in (*cores, *workers):
            closable.close()


def test_sglang_cores_across_nodes(cluster: dict[str, Any]) -> None:
    """SGLang's HiCache backend core on each node: pages node A's core stores
    (``batch_set_v1``) are found (``batch_exists``) and loaded (``batch_get_v1``) by
    node B's core, byte for byte, in another host layout; and pages cached on A by
    tokens are found by hash on B."""
    a, b = cluster["a"], cluster["b"]
    a_pool, b_pool = HostPool("page_first", seed=11), HostPool("layer_first", seed=12)
    a_core = make_core(a.address, a_pool, model=MODEL)
    b_core = make_core(b.address, b_pool, model=MODEL)
    try:
        keys = _chain(_tokens(9, 12))
        before = _put_pages(a)
        outcomes = _outcomes(b)
        assert b_core.exists(keys) == 0
        after = _outcomes(b)
        assert _grew(outcomes, after) == {"miss_cold": 12}
        outcomes = after
        assert a_core.set(keys, host_indices([3, 0, 7])) == [True] * 3
        a.wait(r"prefixcache_tier_put_pages_total\{.*\}", before + 3)
        assert b_core.exists(keys) == 3
        # ExistsPages that the tier answered: hits in the lookup outcomes.
        assert _grew(outcomes, _outcomes(b)) == {"hit": 12}
        assert b_core.get(keys, host_indices([9, 4, 2])) == [True] * 3
        for pa, pb in zip([3, 0, 7], [9, 4, 2], strict=True):
            assert b_pool.page_bytes(pb * PAGE) == a_pool.page_bytes(pa * PAGE)
        # Token pages written on A are the same objects by hash.
        tokens = _tokens(10)
        before = _put_pages(a)
        _cache(a, tokens, seed=10)
        a.wait(r"prefixcache_tier_put_pages_total\{.*\}", before + len(tokens) // PAGE)
        assert b_core.exists(_chain(tokens)) == len(tokens) // PAGE
    finally:
        a_core.close()
        b_core.close()


def test_master_killed_then_restarted(cluster: dict[str, Any]) -> None:
    a, b, master = cluster["a"], cluster["b"], cluster["master"]
    before = _put_pages(a)
    stored = _tokens(7)
    _cache(a, stored, seed=7)
    a.wait(r"prefixcache_tier_put_pages_total\{.*\}", before + len(stored) // PAGE)
    master.kill()
    # Both keep serving locally (each call answered, by the client's deadline): A's
    # own prompts whole from its pool, without asking the tier at all, B's as misses.
    asked, local = a.metric(LOOKUPS), a.metric(LOCAL)
    for i in range(6):
        tokens = _tokens(100 + i)
        _cache(a, tokens, seed=100 + i)
        assert _read(a, tokens)[0] == len(tokens)
        assert _read(b, tokens)[0] == 0
    # Each of A's lookups answered from its own pool ("local"), none asking the store.
    assert a.metric(LOOKUPS) - asked == a.metric(LOCAL) - local == 6
    # Past the breaker's cooldown a lookup meets the dead master again (a call that
    # blocks for seconds there): it still answers, given up at its deadline.
    timeouts = b.metric(TIMEOUTS)
    for i in range(2):
        time.sleep(COOLDOWN + 0.2)
        tokens = _tokens(200 + i)
        assert _read(b, tokens)[0] == 0
    assert b.metric(TIMEOUTS) > timeouts, b.metrics()  # not waited out: given up
    failed = b.metric(ERRORS) + b.metric(
        r'prefixcache_tier_lookups_total\{.*result="(breaker_open|busy|error)".*\}'
    )
    assert failed >= 6
    # The failures are counted under Mooncake's code (a dead master's RPC_FAIL) or as
    # calls past the deadline, and nothing else.
    codes = {
        re.search(r'code="([^"]*)"', k).group(1)  # type: ignore[union-attr]
        for k, v in b.metrics().items()
        if k.startswith("prefixcache_tier_errors") and v
    }
    assert codes and codes <= {"RPC_FAIL", "TIMEOUT"}, codes
    # Restarted: an empty tier. What A stored before is a counted miss on B...
    master.start()
    misses = b.metric(MISSES)
    deadline = time.monotonic() + 30
    while b.metric(MISSES) <= misses:
        assert time.monotonic() < deadline, b.stderr[-3000:]
        assert _read(b, stored)[0] == 0
        time.sleep(0.5)
    # ... and nothing else: once the store answers again, each lookup of it is one
    # more miss and no error.
    errors, misses = b.metric(ERRORS), b.metric(MISSES)
    for _ in range(3):
        assert _read(b, stored)[0] == 0
    assert (b.metric(ERRORS), b.metric(MISSES)) == (errors, misses + 3)
    # ... and the tier works again for what is written after.
    fresh = _tokens(8)
    kv = _cache(a, fresh, seed=8)
    deadline = time.monotonic() + 30
    while True:
        hit, got = _read(b, fresh)
        if hit:
            break
        assert time.monotonic() < deadline, a.stderr[-3000:]
        time.sleep(0.5)
        _cache(a, fresh, seed=8)  # a write dropped while the client reconnected: again
    assert hit == len(fresh)
    assert all(torch.equal(x, y) for x, y in zip(got, kv, strict=True))
