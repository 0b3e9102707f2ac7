"""RemoteRadixCache answers SGLang's current BasePrefixCache calls as the in-process
cache does.

SGLang's scheduler loop (bench/sglang_sched.py: LPM ranking, PrefillAdder admission with
budget reads and lock receipts, paged allocation, cache_finished_req and chunked
cache_unfinished_req) runs the same requests against LocalSGLangCache and against
RemoteRadixCache on a real server; every step must admit the same requests with the
same hits, finish the same ones and leave the same sizes. Then the remote-only parts,
call by call: estimates, shortfalls, receipts, counters without calls, and a chunk's
move onto the tree's slots.
"""

from __future__ import annotations

import random
import sys
import time
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import ServerThread, running

from prefixcache.client import PrefixCacheClient, RemoteRadixCache
from prefixcache.client.page_chain import RequestHashes
from prefixcache.client.worker.sglang_api import (
    DecLockRefParams,
    EvictParams,
    IncLockRefResult,
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
)
from prefixcache.client.worker.sglang_local import LocalSGLangCache
from prefixcache.server.config import ModelConfig, PoolConfig

_REPO = Path(__file__).resolve().parents[3]
if str(_REPO) not in sys.path:  # bench/ is a script folder, not an installed package
    sys.path.insert(0, str(_REPO))

from bench.sglang_sched import Req, Scheduler  # noqa: E402

PAGE, POOL = 4, 4096
MODELS = (
    ModelConfig(name="r", page_size=PAGE, pool=PoolConfig(size=POOL, k_heads=1, k_head_dim=4)),
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    with running(tmp_path_factory.mktemp("sglang"), MODELS) as srv:
        yield srv


@pytest.fixture
def remote(server: ServerThread) -> Iterator[RemoteRadixCache]:
    with RemoteRadixCache(server.address, "r", ttl=30) as cache:
        cache.reset()
        yield cache
    server.check_integrity()


def workload(seed: int, n: int) -> list[Req]:
    """Requests sharing a few system prompts and each other's turns."""
    rng = random.Random(seed)
    systems = [array("I", range(1000 * s, 1000 * s + rng.randrange(8, 40))) for s in range(1, 4)]
    reqs: list[Req] = []
    for rid in range(n):
        if reqs and rng.random() < 0.3:  # a later turn of an earlier conversation
            base = reqs[rng.randrange(len(reqs))].origin_input_ids
        else:
            base = systems[rng.randrange(len(systems))]
        tail = array("I", (rng.randrange(50_000, 60_000) for _ in range(rng.randrange(1, 30))))
        extra = "lora" if rng.random() < 0.1 else None
        reqs.append(Req(rid, base + tail, rng.randrange(1, 8), extra_key=extra))
    return reqs


def wait_shadow(cache: RemoteRadixCache, timeout: float = 5.0) -> None:
    """Until the shadow index holds as many pages as the service caches (a quiet
    point: the test's steps are the only traffic)."""
    index = cache.window.shadow.index
    deadline = time.monotonic() + timeout
    while len(index) * PAGE != cache.total_size():
        if time.monotonic() > deadline:
            raise AssertionError(
                f"shadow holds {len(index)} pages, the service {cache.total_size() // PAGE}"
            )
        time.sleep(0.005)


def wait_cached(cache: RemoteRadixCache, tokens: list[int], timeout: float = 5.0) -> None:
    """Until the shadow index holds every whole page of ``tokens``."""
    want = set(RequestHashes(tokens, page_size=PAGE).keys())
    index = cache.window.shadow.index
    deadline = time.monotonic() + timeout
    while not want <= index.pages().get((None, 1), frozenset()):
        if time.monotonic() > deadline:
            raise AssertionError("the shadow index never caught up")
        time.sleep(0.005)


def reserved(cache: RemoteRadixCache) -> int:
    """Slots the allocator holds in reserve (the session's, free to this worker)."""
    reserve = cache.token_to_kv_pool_allocator.reserve
    return len(reserve.slots) if reserve is not None else 0


def run(
    cache: Any, reqs: list[Req], *, batch: int, chunk: int | None, remote: bool, wait: bool = True
) -> list[tuple[Any, ...]]:
    sched = Scheduler(cache, batch=batch, chunk=chunk)
    pending = list(reqs)
    story = []
    for _ in range(200):
        while pending and len(sched.waiting) < 6:
            sched.waiting.append(pending.pop(0))
        if not (sched.waiting or sched.running):
            break
        if remote and wait:
            wait_shadow(cache)
        out = sched.step()
        hits = sorted((r.rid, r.hit_tokens) for r in reqs if r.hit_tokens >= 0)
        story.append(
            (
                out.admitted,
                out.finished,
                out.hit_tokens,
                out.extend_tokens,
                out.decode_tokens,
                tuple(hits),
                cache.evictable_size(),
                cache.protected_size(),
                cache.total_size(),
                cache.token_to_kv_pool_allocator.available_size(),
            )
        )
    else:
        raise AssertionError("the workload did not finish")
    return story


@pytest.mark.parametrize(("seed", "batch", "chunk"), [(1, 4, None), (2, 3, 12), (3, 8, 16)])
def test_scheduler_steps_tell_the_same_story(
    remote: RemoteRadixCache, seed: int, batch: int, chunk: int | None
) -> None:
    local = LocalSGLangCache(POOL, PAGE)
    expected = run(local, workload(seed, 40), batch=batch, chunk=chunk, remote=False)
    local.check_integrity()
    got = run(remote, workload(seed, 40), batch=batch, chunk=chunk, remote=True)
    assert got == expected
    assert sum(step[2] for step in got) > 0  # hits happened
    assert remote.errors == []
    stats = remote.stats()
    assert (stats.locks, stats.session_slots) == (0, reserved(remote))
    assert remote.calls <= 3 * len(got)


@pytest.mark.parametrize(
    ("seed", "batch", "chunk"), [(5, 3, 12), (6, 8, 16), (7, 4, 24), (4, 6, None)]
)
def test_own_inserts_rank_at_once(
    remote: RemoteRadixCache, seed: int, batch: int, chunk: int | None
) -> None:
    """Without waiting for the stream between steps: the worker's own inserts (queued
    at the end of a step, sent with the next step's first call, reported by the stream
    after that) rank the next step as in-process (the shadow's local overlay)."""
    local = LocalSGLangCache(POOL, PAGE)
    expected = run(local, workload(seed, 40), batch=batch, chunk=chunk, remote=False)
    got = run(remote, workload(seed, 40), batch=batch, chunk=chunk, remote=True, wait=False)
    assert [step[5] for step in got] == [step[5] for step in expected]  # same hits
    assert remote.errors == [] and remote.window.shortfalls == 0


def admitted(cache: Any, tokens: list[int]) -> Req:
    """A request ranked and admitted as PrefillAdder does, then prefilled, one page
    at a time allocated, its row written."""
    from bench.sglang_sched import ReqToTokenPool, _Key

    pool = cache.req_to_token_pool or ReqToTokenPool()
    cache.req_to_token_pool = pool
    req = Req(0, array("I", tokens), 2)
    m = cache.match_prefix(MatchPrefixParams(_Key(req.origin_input_ids[:-1]), req=req))
    req.prefix_indices, req.last_node = m.device_indices, m.last_device_node
    if m.host_hit_length:
        indices, req.last_node = cache.init_load_back(
            InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req)
        )
        req.prefix_indices = indices
    req.lock_receipt = cache.inc_lock_ref(req.last_node).to_dec_params()
    req.cache_protected_len = len(req.prefix_indices)
    return req


def test_estimates_shortfalls_and_receipts(remote: RemoteRadixCache, server: ServerThread) -> None:
    other = RemoteRadixCache(server.address, "r", ttl=30)
    slots = other.token_to_kv_pool_allocator.alloc(12)
    other.insert(InsertParams(key=list(range(12)), value=slots))
    wait_cached(remote, list(range(12)))
    req = Req(1, array("I", range(14)), 1)
    m = remote.match_prefix(MatchPrefixParams(list(range(13)), req=req))
    assert (len(m.device_indices), m.host_hit_length) == (0, 12)  # an estimate, no call
    assert remote.supports_fast_match_prefix()

    other.evict(EvictParams(num_tokens=100))  # gone before the admission
    calls = remote.calls
    assert remote.init_load_back(InitLoadBackParams(m.best_match_node, 12)) is None
    assert remote.calls == calls + 1
    again = remote.match_prefix(MatchPrefixParams(list(range(13)), req=req))
    assert again.host_hit_length == 0  # the service's answer caps the estimate

    slots = other.token_to_kv_pool_allocator.alloc(12)
    other.insert(InsertParams(key=list(range(12)), value=slots))
    wait_cached(remote, list(range(12)))
    for expected in (0, 12):  # the cap holds for the next round only
        remote.token_to_kv_pool_allocator.alloc_decode(*_lens([], [], [])[2:])  # a step ends
        ranked = remote.match_prefix(MatchPrefixParams(list(range(13)), req=req))
        assert ranked.host_hit_length == expected
    m = remote.match_prefix(MatchPrefixParams(list(range(13)), req=Req(2, array("I"), 1)))
    indices, node = remote.init_load_back(m.best_match_node, m.host_hit_length)
    assert indices.tolist() == slots.tolist()
    first = remote.inc_lock_ref(node)  # takes over the admission's lock: no call
    second = remote.inc_lock_ref(node)
    assert isinstance(first, IncLockRefResult)
    r1, r2 = first.to_dec_params(), second.to_dec_params()
    assert isinstance(r1, DecLockRefParams) and r1.lock_id and r1.lock_id != r2.lock_id
    remote.dec_lock_ref(node, r1)
    assert remote.stats().locks == 1
    calls = remote.calls
    sizes = [
        remote.evictable_size(),
        remote.protected_size(),
        remote.token_to_kv_pool_allocator.available_size(),
    ]
    assert sizes[1] == 12 and remote.calls == calls  # counters came with the reply
    remote.dec_lock_ref(node, r2)
    assert remote.protected_size() == 0 and remote.calls == calls + 1
    other.close()


@pytest.mark.parametrize("kind", ["local", "remote"])
def test_a_chunk_moves_onto_the_tree_s_slots(remote: RemoteRadixCache, kind: str) -> None:
    cache = LocalSGLangCache(POOL, PAGE) if kind == "local" else remote
    alloc = cache.token_to_kv_pool_allocator
    tokens = list(range(200, 209))
    a, b = admitted(cache, tokens), admitted(cache, tokens)
    pool = cache.req_to_token_pool
    for req in (a, b):  # both missed: both compute the same 8 tokens in their own slots
        req.req_pool_idx = pool.alloc(16)
        req.fill_ids = req.origin_input_ids[:8]
        new = alloc.alloc_extend(*_lens([0], [8], [-1]), 8)
        pool.write((req.req_pool_idx, slice(0, 8)), new)
    a.output_ids.append(7)  # a is done: its 8 committed tokens go in
    a.origin_input_ids = a.origin_input_ids[:8]
    cache.cache_finished_req(a)
    cache.cache_unfinished_req(b, chunked=True)  # b's chunk: the tree has it already
    if kind == "remote":
        remote.flush()
        wait_cached(remote, tokens[:8])
    tree = cache.match_prefix(MatchPrefixParams(tokens[:8]))
    if kind == "remote":  # the estimate, then the admission's answer
        tree_slots, node = cache.init_load_back(tree.best_match_node, tree.host_hit_length)
        cache.dec_lock_ref(node, cache.inc_lock_ref(node).to_dec_params())
    else:
        tree_slots = tree.device_indices
    row = pool.req_to_token[b.req_pool_idx, :8]
    assert row.tolist() == tree_slots.tolist() == b.prefix_indices.tolist()
    assert b.cache_protected_len == 8
    b.output_ids.append(1)
    b.origin_input_ids = b.origin_input_ids[:8]
    cache.cache_finished_req(b)
    assert cache.protected_size() == 0 and cache.total_size() == 8
    if kind == "remote":
        assert remote.stats().session_slots == reserved(remote) and remote.errors == []
    else:
        cache.check_integrity()


def _lens(prefix: list[int], seq: list[int], last: list[int]) -> tuple[Any, ...]:
    import torch

    t = [torch.tensor(v, dtype=torch.int64) for v in (prefix, prefix, seq, seq, last)]
    return tuple(t)


def test_plain_client_sessions_see_the_same_tree(
    remote: RemoteRadixCache, server: ServerThread
) -> None:
    """What the SGLang calls cached is the service's: another client matches it."""
    local = Req(0, array("I", range(300, 310)), 1)
    req = admitted(remote, list(local.origin_input_ids))
    req.req_pool_idx = remote.req_to_token_pool.alloc(16)
    new = remote.token_to_kv_pool_allocator.alloc_extend(*_lens([0], [10], [-1]), 10)
    remote.req_to_token_pool.write((req.req_pool_idx, slice(0, 10)), new)
    req.output_ids.append(5)
    remote.cache_finished_req(req)  # queued
    assert remote._buffer.pending
    with PrefixCacheClient(server.address) as client:
        assert client.match("r", list(range(300, 310))).prefix_len == 0  # not sent yet
        remote.flush()
        assert client.match("r", list(range(300, 310))).prefix_len == 8


def test_the_reserve_counts_as_free_and_goes_back_on_close(server: ServerThread) -> None:
    with PrefixCacheClient(server.address) as client, client.session() as session:
        cache = RemoteRadixCache(client, "r", session=session)
        cache.window  # noqa: B018 - serving SGLang: the allocator keeps a reserve
        alloc = cache.token_to_kv_pool_allocator
        before = alloc.available_size()
        first = alloc.alloc_extend(*_lens([0], [40], [-1]), 40)  # one call, and a top-up
        calls = cache.calls
        second = alloc.alloc_extend(*_lens([0], [8], [-1]), 8)  # from the reserve
        assert cache.calls == calls and reserved(cache) > 0
        assert alloc.available_size() == before - 48
        assert not set(first.tolist()) & set(second.tolist())
        alloc.free(first)
        alloc.free(second)
        assert client.stats("r")["r"].session_slots == reserved(cache)
        cache.close()  # the session stays open; the reserve goes back
        assert client.stats("r")["r"].session_slots == 0


def test_plain_allocations_are_served_from_the_reserve(tmp_path: Path) -> None:
    """With one-slot pages ``alloc`` takes from the reserve, and what it answers is a
    tensor of those slots (the reserve's list was once handed to the tensor view)."""
    models = (
        ModelConfig(name="p1", page_size=1, pool=PoolConfig(size=POOL, k_heads=1, k_head_dim=4)),
    )
    with running(tmp_path, models) as srv:
        with RemoteRadixCache(srv.address, "p1") as cache:
            cache.window  # noqa: B018 - serving SGLang: the allocator keeps a reserve
            alloc = cache.token_to_kv_pool_allocator
            taken = [alloc.alloc(8) for _ in range(4)]
            assert alloc.reserve is not None and alloc.reserve.hits > 0
            slots = [s for t in taken for s in t.tolist()]
            assert len(set(slots)) == 32 and all(t.dtype == torch.int64 for t in taken)
            for t in taken:
                alloc.free(t)
        srv.check_integrity()


def test_a_receipt_releases_once(remote: RemoteRadixCache) -> None:
    from prefixcache.cache import LockError

    slots = remote.token_to_kv_pool_allocator.alloc(8)
    node = remote.insert(InsertParams(key=list(range(500, 508)), value=slots)).last_device_node
    receipt = remote.inc_lock_ref(node).to_dec_params()
    remote.dec_lock_ref(node, receipt)
    with pytest.raises(LockError):
        remote.dec_lock_ref(node, receipt)  # as in-process: nothing of ours is held
    assert remote.protected_size() == 0 and remote.errors == []


def test_own_pages_are_seen_at_once_and_end_with_the_stream(remote: RemoteRadixCache) -> None:
    """A queued insert ranks at once (no call); the stream's store confirms it (the
    overlay empties), and its removal, after an eviction, ends it."""
    tokens = list(range(600, 613))
    req = admitted(remote, tokens)
    req.req_pool_idx = remote.req_to_token_pool.alloc(16)
    new = remote.token_to_kv_pool_allocator.alloc_extend(*_lens([0], [13], [-1]), 13)
    remote.req_to_token_pool.write((req.req_pool_idx, slice(0, 13)), new)
    req.output_ids.append(5)
    index = remote.window.shadow.index
    calls = remote.calls
    remote.cache_finished_req(req)  # queued: 13 committed tokens, 3 whole pages
    probe = Req(1, array("I", [*tokens, 7]), 1)
    ranked = remote.match_prefix(MatchPrefixParams(list(probe.origin_input_ids), req=probe))
    assert ranked.host_hit_length == 12 and remote.calls == calls
    assert sum(len(k) for k in index.local_pages().values()) == 3
    remote.flush()
    wait_cached(remote, tokens[:12])
    assert index.local_pages() == {}  # confirmed: the stream's now
    assert index.match_pages(RequestHashes(tokens[:12], page_size=PAGE)) == 3
    remote.evict(EvictParams(num_tokens=100))  # the stream tells of its removal
    deadline = time.monotonic() + 5
    while len(index) and time.monotonic() < deadline:
        time.sleep(0.005)
    again = Req(2, array("I", [*tokens, 7]), 1)
    assert (
        remote.match_prefix(
            MatchPrefixParams(list(again.origin_input_ids), req=again)
        ).host_hit_length
        == 0
    )
    assert index.local_pages() == {} and remote.errors == []


def test_an_insert_that_fails_takes_its_note_back(
    remote: RemoteRadixCache, server: ServerThread
) -> None:
    """Slots the session does not hold: the queued insert is refused, and the pages
    it noted stop counting (they were never cached)."""
    other = RemoteRadixCache(server.address, "r", ttl=30)
    foreign = other.token_to_kv_pool_allocator.alloc(12)  # another session's slots
    tokens = list(range(700, 713))
    req = admitted(remote, tokens)
    req.req_pool_idx = remote.req_to_token_pool.alloc(16)
    remote.req_to_token_pool.write((req.req_pool_idx, slice(0, 12)), foreign)
    req.output_ids.append(5)
    req.origin_input_ids = req.origin_input_ids[:12]
    index = remote.window.shadow.index
    remote.cache_finished_req(req)
    hashes = RequestHashes(tokens[:12], page_size=PAGE)
    assert index.match_pages(hashes) == 3  # noted while queued
    remote.flush()
    assert [name for name, _ in remote.errors] == ["finishes"]
    assert index.local_pages() == {} and index.match_pages(hashes) == 0
    other.close()
