"""Every RPC of the v1 API against a real server on a unix socket.

The server runs with the integrity check after every mutating call, so a corrupted
cache would surface as INTERNAL in whichever test caused it.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Iterator

import grpc
import pytest
from harness import (
    EVERY_KIND,
    pack_slots,
    pb,
    running,
    serve_module,
    session_of,
    slots,
    stub_for,
    stub_of,
    toks,
)

MODELS = EVERY_KIND
CODE = grpc.StatusCode


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    yield from serve_module(tmp_path_factory, "svc", MODELS, session_ttl_min=0.2)


@pytest.fixture(scope="module")
def stub(server) -> Iterator:
    yield from stub_of(server)


@pytest.fixture
def session(stub) -> Iterator[str]:
    yield from session_of(stub)


def stats(stub, model: str) -> pb.ModelStats:
    return stub.Stats(pb.StatsRequest(model=model)).models[0]


def refused(call, request, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call(request)
    assert err.value.code() == code, err.value.details()
    return err.value.details()


def prefill(stub, sid: str, model: str, tokens: list[int], *, keep_lock: bool = False,
            **key) -> pb.InsertResponse:
    """The two-RPC prefill: match+lock+allocate, then insert with lock handover."""
    m = stub.Match(pb.MatchRequest(model=model, token_ids=toks(tokens), session_id=sid,
                                   lock=True, allocate=True, **key))
    assert m.prefix_len + len(slots(m.allocated_slots)) == len(tokens)
    return stub.Insert(pb.InsertRequest(
        model=model, token_ids=toks(tokens), session_id=sid, lock=keep_lock,
        slot_indices=m.slot_indices + m.allocated_slots, release_lock_id=m.lock_id, **key))


def test_list_models_and_describe_pool(stub) -> None:
    reply = stub.ListModels(pb.ListModelsRequest())
    assert [m.name for m in reply.models] == ["m", "p", "w", "c", "h", "s"]
    assert [m.cache_kind for m in reply.models] == [
        pb.CACHE_KIND_RADIX, pb.CACHE_KIND_RADIX, pb.CACHE_KIND_SWA, pb.CACHE_KIND_CHUNK,
        pb.CACHE_KIND_MAMBA, pb.CACHE_KIND_SLOT]
    assert reply.models[4].state_pool_size == 4
    assert reply.models[1].page_size == 4 and reply.models[0].vocab_size == 1000
    assert reply.models[2].sliding_window_size == 4 and reply.server_epoch
    pool = stub.DescribePool(pb.DescribePoolRequest(model="m"))
    assert (pool.layer_num, pool.k_head_num, pool.k_head_dim, pool.v_head_num) == (1, 1, 4, 1)
    assert (pool.dtype, pool.device, pool.pool_size, pool.num_rows) == ("float16", "cpu", 256, 257)
    assert stub.DescribePool(pb.DescribePoolRequest(model="w")).swa_pool_size == 256
    refused(stub.DescribePool, pb.DescribePoolRequest(model="nope"), CODE.NOT_FOUND)
    mamba = stub.DescribePool(pb.DescribePoolRequest(model="h")).mamba
    assert (mamba.layer_num, list(mamba.conv_state_shape), list(mamba.temporal_state_shape)) \
        == (2, [3, 2], [2, 2, 2])
    assert (mamba.conv_dtype, mamba.temporal_dtype, mamba.working_slots, mamba.state_slots,
            mamba.num_rows) == ("float16", "float32", 2, 4, 7)
    assert not stub.DescribePool(pb.DescribePoolRequest(model="m")).HasField("mamba")


def test_prefill_is_two_rpcs_and_the_next_request_hits(stub, session) -> None:
    before = stats(stub, "m")
    ins = prefill(stub, session, "m", [1, 2, 3, 4, 5])
    assert (ins.prefix_len, ins.cached_len, ins.lock_id, ins.freed_slots) == (0, 5, 0, b"")
    # The match's lock was handed back by the insert: nothing stays protected.
    after = stats(stub, "m")
    assert after.protected_tokens == before.protected_tokens
    assert after.evictable_tokens == before.evictable_tokens + 5
    assert after.session_slots == 0 and after.locks == 0

    m = stub.Match(pb.MatchRequest(model="m", token_ids=toks([1, 2, 3, 4, 5, 6, 7]),
                                   session_id=session, lock=True, allocate=True))
    assert m.prefix_len == 5 and len(slots(m.allocated_slots)) == 2 and m.lock_id
    assert m.node_id == ins.node_id
    assert stats(stub, "m").protected_tokens == 5
    ins2 = stub.Insert(pb.InsertRequest(
        model="m", token_ids=toks([1, 2, 3, 4, 5, 6, 7]), session_id=session, lock=True,
        slot_indices=m.slot_indices + m.allocated_slots, release_lock_id=m.lock_id))
    assert (ins2.prefix_len, ins2.cached_len) == (5, 7) and ins2.lock_id
    assert stats(stub, "m").protected_tokens == 7
    stub.Unlock(pb.UnlockRequest(lock_id=ins2.lock_id, session_id=session))
    assert stats(stub, "m").protected_tokens == 0


def test_read_only_match_needs_no_session(stub, session) -> None:
    prefill(stub, session, "m", [20, 21, 22])
    m = stub.Match(pb.MatchRequest(model="m", token_ids=toks([20, 21, 22, 23])))
    assert (m.prefix_len, m.lock_id, m.allocated_slots) == (3, 0, b"")
    miss = stub.Match(pb.MatchRequest(model="m", token_ids=toks([999])))
    assert (miss.prefix_len, miss.node_id, miss.slot_indices) == (0, 0, b"")
    refused(stub.Match, pb.MatchRequest(model="m", token_ids=toks([20]), lock=True),
            CODE.FAILED_PRECONDITION)


def test_insert_frees_the_duplicates_of_a_racing_prefill(stub, stub_session_pair) -> None:
    s1, s2 = stub_session_pair
    tokens = [30, 31, 32, 33]
    m1 = stub.Match(pb.MatchRequest(model="m", token_ids=toks(tokens), session_id=s1,
                                    allocate=True))
    m2 = stub.Match(pb.MatchRequest(model="m", token_ids=toks(tokens), session_id=s2,
                                    allocate=True))
    free_before = stats(stub, "m").free_slots
    stub.Insert(pb.InsertRequest(model="m", token_ids=toks(tokens), session_id=s1,
                                 slot_indices=m1.allocated_slots))
    second = stub.Insert(pb.InsertRequest(model="m", token_ids=toks(tokens), session_id=s2,
                                          slot_indices=m2.allocated_slots))
    assert second.prefix_len == 4
    assert slots(second.freed_slots) == slots(m2.allocated_slots)
    after = stats(stub, "m")
    assert after.free_slots == free_before + 4 and after.session_slots == 0


@pytest.fixture
def stub_session_pair(stub) -> Iterator[tuple[str, str]]:
    ids = [stub.OpenSession(pb.OpenSessionRequest()).session_id for _ in range(2)]
    yield ids[0], ids[1]
    for sid in ids:
        with contextlib.suppress(grpc.RpcError):  # unless the test closed it
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


def test_bad_input_is_refused_and_changes_nothing(server, stub, session) -> None:
    prefill(stub, session, "m", [40, 41, 42])
    mine = slots(stub.Alloc(pb.AllocRequest(model="m", num_slots=3,
                                            session_id=session)).slot_indices)
    other = stub.OpenSession(pb.OpenSessionRequest()).session_id
    theirs = slots(stub.Alloc(pb.AllocRequest(model="m", num_slots=1,
                                              session_id=other)).slot_indices)
    tree = slots(stub.Match(pb.MatchRequest(model="m", token_ids=toks([40, 41, 42]))).slot_indices)
    before = stub.Stats(pb.StatsRequest())

    def insert(tokens: list[int], slot_ids: list[int], **kw) -> pb.InsertRequest:
        return pb.InsertRequest(model="m", token_ids=toks(tokens), session_id=session,
                                slot_indices=pack_slots(slot_ids), **kw)

    cases = [
        (insert([40, 41, 42, 43], [*tree, *theirs]), CODE.FAILED_PRECONDITION),  # not mine
        (insert([50, 51], mine[:1]), CODE.INVALID_ARGUMENT),  # count mismatch
        (insert([50, 51], [mine[0], mine[0]]), CODE.INVALID_ARGUMENT),  # named twice
        (insert([50, 51], [mine[0], 10_000]), CODE.INVALID_ARGUMENT),  # outside the pool
        (insert([50, 51], [mine[0], 0]), CODE.INVALID_ARGUMENT),  # the padding slot
        (insert([50, 51], [mine[0], -3]), CODE.INVALID_ARGUMENT),
        (insert([50, 1500], mine[:2]), CODE.INVALID_ARGUMENT),  # beyond vocab_size
        (insert([41, 40], tree[:2]), CODE.FAILED_PRECONDITION),  # tree slots, wrong tokens
        (insert([40, 41], mine[:2], release_lock_id=10**9), CODE.FAILED_PRECONDITION),
        (pb.InsertRequest(model="m", token_ids=b"\x01\x00\x00", session_id=session,
                          slot_indices=b""), CODE.INVALID_ARGUMENT),
        (pb.InsertRequest(model="m", token_ids=toks([1]), session_id=session,
                          slot_indices=b"\x01\x00"), CODE.INVALID_ARGUMENT),
        (pb.InsertRequest(model="m", token_ids=toks([1, 2]), token_width=9,
                          session_id=session, slot_indices=b""), CODE.INVALID_ARGUMENT),
        (pb.InsertRequest(model="zz", token_ids=toks([1]), session_id=session,
                          slot_indices=pack_slots(mine[:1])), CODE.NOT_FOUND),
        (pb.InsertRequest(model="m", token_ids=toks([50]), session_id="f" * 32,
                          slot_indices=pack_slots(mine[:1])), CODE.NOT_FOUND),
    ]
    for request, code in cases:
        refused(stub.Insert, request, code)
        assert stub.Stats(pb.StatsRequest()) == before, request
    for request in (pb.MatchRequest(model="m", token_ids=b"\x00" * 5),
                    pb.MatchRequest(model="m", token_ids=toks([1001])),
                    pb.MatchRequest(model="m", token_ids=toks([1]), token_width=100)):
        refused(stub.Match, request, CODE.INVALID_ARGUMENT)
    assert stub.Stats(pb.StatsRequest()) == before
    server.check_integrity()
    stub.CloseSession(pb.CloseSessionRequest(session_id=other))


def test_a_duplicate_inside_the_cached_prefix_is_freed(stub, session) -> None:
    prefill(stub, session, "m", [60, 61, 62])
    tree = slots(stub.Match(pb.MatchRequest(model="m", token_ids=toks([60, 61, 62]))).slot_indices)
    mine = slots(stub.Alloc(pb.AllocRequest(model="m", num_slots=2,
                                            session_id=session)).slot_indices)
    reply = stub.Insert(pb.InsertRequest(
        model="m", token_ids=toks([60, 61, 62, 63]), session_id=session,
        slot_indices=pack_slots([*tree[:2], *mine])))
    assert (reply.prefix_len, reply.cached_len) == (3, 4)
    assert slots(reply.freed_slots) == mine[:1]
    assert stats(stub, "m").session_slots == 0


def test_errors_of_locks_sessions_and_the_pool(stub, session) -> None:
    ins = prefill(stub, session, "m", [70, 71], keep_lock=True)
    refused(stub.Lock, pb.LockRequest(model="m", node_id=ins.node_id), CODE.FAILED_PRECONDITION)
    refused(stub.Lock, pb.LockRequest(model="m", node_id=987654321, session_id=session),
            CODE.NOT_FOUND)
    refused(stub.Lock, pb.LockRequest(model="p", node_id=ins.node_id, session_id=session),
            CODE.NOT_FOUND)  # a handle of another model
    refused(stub.Unlock, pb.UnlockRequest(lock_id=10**12, session_id=session), CODE.NOT_FOUND)
    stub.Unlock(pb.UnlockRequest(lock_id=ins.lock_id, session_id=session))
    refused(stub.Unlock, pb.UnlockRequest(lock_id=ins.lock_id, session_id=session),
            CODE.FAILED_PRECONDITION)
    refused(stub.KeepAlive, pb.KeepAliveRequest(session_id="nope"), CODE.NOT_FOUND)
    refused(stub.OpenSession, pb.OpenSessionRequest(ttl_seconds=-1), CODE.INVALID_ARGUMENT)
    got = slots(stub.Alloc(pb.AllocRequest(model="m", num_slots=2,
                                           session_id=session)).slot_indices)
    stub.Free(pb.FreeRequest(model="m", slot_indices=pack_slots(got), session_id=session))
    refused(stub.Free, pb.FreeRequest(model="m", slot_indices=pack_slots(got),
                                      session_id=session), CODE.FAILED_PRECONDITION)
    refused(stub.Alloc, pb.AllocRequest(model="m", num_slots=1), CODE.FAILED_PRECONDITION)
    before = stub.Stats(pb.StatsRequest())
    refused(stub.Alloc, pb.AllocRequest(model="m", num_slots=10**6, session_id=session),
            CODE.RESOURCE_EXHAUSTED)
    assert stub.Stats(pb.StatsRequest()) == before  # nothing evicted for a hopeless ask


def test_a_node_handle_survives_a_split_and_vanishes_on_eviction(stub, session) -> None:
    first = prefill(stub, session, "p", list(range(100, 108)))  # page 4: two pages
    prefill(stub, session, "p", [100, 101, 102, 103, 200, 201, 202, 203])  # splits it
    lock = stub.Lock(pb.LockRequest(model="p", node_id=first.node_id, session_id=session))
    assert stats(stub, "p").protected_tokens == 8  # the deeper part kept the id
    stub.Unlock(pb.UnlockRequest(lock_id=lock.lock_id, session_id=session))
    stub.Evict(pb.EvictRequest(model="p", num_tokens=64))
    refused(stub.Lock, pb.LockRequest(model="p", node_id=first.node_id, session_id=session),
            CODE.NOT_FOUND)


def test_lock_and_unlock_are_idempotent_per_request_id(stub, session) -> None:
    ins = prefill(stub, session, "m", [80, 81])
    lock = pb.LockRequest(model="m", node_id=ins.node_id, session_id=session, request_id=7)
    first, again = stub.Lock(lock), stub.Lock(lock)
    assert first.lock_id == again.lock_id and stats(stub, "m").locks == 1
    unlock = pb.UnlockRequest(lock_id=first.lock_id, session_id=session, request_id=8)
    stub.Unlock(unlock)
    stub.Unlock(unlock)  # the retry succeeds too
    assert stats(stub, "m").locks == 0
    m = pb.MatchRequest(model="m", token_ids=toks([80, 81, 82]), session_id=session,
                        lock=True, allocate=True, request_id=9)
    assert stub.Match(m) == stub.Match(m)
    assert stats(stub, "m").locks == 1 and stats(stub, "m").session_slots == 1


def test_closing_a_session_releases_its_locks_and_slots(stub) -> None:
    sid = stub.OpenSession(pb.OpenSessionRequest(client_name="w1")).session_id
    free = stats(stub, "m").free_slots
    prefill(stub, sid, "m", [90, 91, 92], keep_lock=True)
    stub.Match(pb.MatchRequest(model="m", token_ids=toks([90, 91, 92, 93, 94]),
                               session_id=sid, lock=True, allocate=True))
    stub.Alloc(pb.AllocRequest(model="p", num_slots=5, session_id=sid))
    closed = stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    assert (closed.locks_released, closed.slots_freed) == (2, 7)
    after = stats(stub, "m")
    assert (after.locks, after.session_slots, after.protected_tokens) == (0, 0, 0)
    assert after.free_slots == free - 3  # only the cached tokens stay
    refused(stub.KeepAlive, pb.KeepAliveRequest(session_id=sid), CODE.NOT_FOUND)


def test_a_lapsed_lease_releases_everything_and_keep_alive_prevents_it(stub) -> None:
    lapsing = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=0.3))
    kept = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=0.3)).session_id
    assert lapsing.ttl_seconds == pytest.approx(0.3)
    prefill(stub, lapsing.session_id, "m", [110, 111], keep_lock=True)
    stub.Alloc(pb.AllocRequest(model="m", num_slots=3, session_id=lapsing.session_id))
    prefill(stub, kept, "m", [120, 121], keep_lock=True)
    deadline = time.monotonic() + 1.2
    while time.monotonic() < deadline:
        stub.KeepAlive(pb.KeepAliveRequest(session_id=kept))
        time.sleep(0.05)
    s = stats(stub, "m")
    assert (s.locks, s.session_slots, s.protected_tokens) == (1, 0, 2)
    refused(stub.KeepAlive, pb.KeepAliveRequest(session_id=lapsing.session_id), CODE.NOT_FOUND)
    stub.CloseSession(pb.CloseSessionRequest(session_id=kept))


def test_session_stream_carries_every_operation_and_releases_on_close(stub) -> None:
    tokens = toks([130, 131, 132])
    requests = [
        pb.SessionRequest(seq=1, match=pb.MatchRequest(model="m", token_ids=tokens,
                                                       lock=True, allocate=True)),
        pb.SessionRequest(seq=2, lock=pb.LockRequest(model="m", node_id=424242)),
        pb.SessionRequest(seq=3, stats=pb.StatsRequest(model="m")),
        pb.SessionRequest(seq=4),
        pb.SessionRequest(seq=5, alloc=pb.AllocRequest(model="m", num_slots=2)),
    ]
    replies = list(stub.Session(iter(requests)))
    assert [r.seq for r in replies] == [1, 2, 3, 4, 5]
    assert len(slots(replies[0].match.allocated_slots)) == 3
    assert replies[1].error.code == CODE.NOT_FOUND.value[0]
    assert replies[2].stats.models[0].session_slots >= 3
    assert replies[3].error.code == CODE.INVALID_ARGUMENT.value[0]
    assert len(slots(replies[4].alloc.slot_indices)) == 2
    # The stream ended, so its session and everything it held are gone.
    s = stats(stub, "m")
    assert (s.session_slots, s.locks) == (0, 0)


def test_session_stream_prefill_with_lock_handover(stub) -> None:
    tokens = toks([140, 141, 142, 143])
    outbox: queue.Queue[pb.SessionRequest | None] = queue.Queue()
    call = stub.Session(iter(outbox.get, None))
    outbox.put(pb.SessionRequest(seq=1, match=pb.MatchRequest(
        model="m", token_ids=tokens, lock=True, allocate=True)))
    match = next(call).match
    outbox.put(pb.SessionRequest(seq=2, insert=pb.InsertRequest(
        model="m", token_ids=tokens, slot_indices=match.allocated_slots, lock=True)))
    insert = next(call).insert
    assert insert.cached_len == 4 and insert.lock_id
    assert stats(stub, "m").locks == 1
    call.cancel()  # the worker vanishes without closing anything
    deadline = time.monotonic() + 5
    while stats(stub, "m").locks and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stats(stub, "m").locks == 0


def test_models_and_namespaces_are_isolated(stub, session) -> None:
    tokens = [150, 151, 152, 153]
    prefill(stub, session, "m", tokens)
    prefill(stub, session, "m", tokens, extra_key="lora-a")
    for model, key, expect in (("m", {}, 4), ("p", {}, 0), ("m", {"extra_key": ""}, 0),
                               ("m", {"extra_key": "lora-a"}, 4),
                               ("m", {"extra_key": "lora-b"}, 0)):
        reply = stub.Match(pb.MatchRequest(model=model, token_ids=toks(tokens), **key))
        assert reply.prefix_len == expect, (model, key)
    pair = toks([150, 151, 152, 153])  # two width-2 tokens: never aliases the ints
    assert stub.Match(pb.MatchRequest(model="m", token_ids=pair, token_width=2)).prefix_len == 0


def test_eviction_on_request_and_under_pressure(stub, session) -> None:
    stub.Evict(pb.EvictRequest(model="p", num_tokens=10**6))
    for base in (300, 310, 320):
        prefill(stub, session, "p", list(range(base, base + 8)))
    s = stats(stub, "p")
    assert (s.evictable_tokens, s.free_slots) == (24, 40)
    evicted = stub.Evict(pb.EvictRequest(model="p", num_tokens=5))
    assert evicted.evicted_tokens == 8  # whole leaves go: the oldest, 8 tokens
    got = stub.Alloc(pb.AllocRequest(model="p", num_slots=60, session_id=session))
    assert len(slots(got.slot_indices)) == 60
    s = stats(stub, "p")
    assert s.evictable_tokens == 0 and s.evicted_tokens_total >= 24
    stub.Free(pb.FreeRequest(model="p", slot_indices=got.slot_indices, session_id=session))


def test_reset_drops_entries_locks_and_handles(tmp_path) -> None:
    with running(tmp_path, MODELS[:1]) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
            ins = prefill(stub, sid, "m", [1, 2, 3], keep_lock=True)
            stub.Alloc(pb.AllocRequest(model="m", num_slots=4, session_id=sid))
            reset = stub.Reset(pb.ResetRequest(model="m"))
            assert (reset.dropped_tokens, reset.dropped_locks) == (3, 1)
            s = stats(stub, "m")
            assert (s.evictable_tokens, s.locks, s.session_slots, s.free_slots) == (0, 0, 0, 256)
            refused(stub.Unlock, pb.UnlockRequest(lock_id=ins.lock_id, session_id=sid),
                    CODE.FAILED_PRECONDITION)
            refused(stub.Lock, pb.LockRequest(model="m", node_id=ins.node_id, session_id=sid),
                    CODE.NOT_FOUND)
            assert stub.CloseSession(pb.CloseSessionRequest(session_id=sid)).slots_freed == 0
            srv.check_integrity()


def test_swa_model_prefill_and_hit(stub, session) -> None:
    tokens = list(range(400, 410))
    prefill(stub, session, "w", tokens)
    again = prefill(stub, session, "w", [*tokens, 410, 411])
    assert (again.prefix_len, again.cached_len) == (10, 12)
    s = stats(stub, "w")
    assert s.swa_evictable_tokens == 12 and s.session_slots == 0
    evicted = stub.Evict(pb.EvictRequest(model="w", num_tokens=0, swa_num_tokens=4))
    assert evicted.swa_evicted_tokens >= 4


def test_chunk_model_caches_nothing(stub, session) -> None:
    ins = prefill(stub, session, "c", [1, 2, 3])
    assert (ins.prefix_len, ins.cached_len, ins.node_id) == (0, 0, 0)
    assert stub.Match(pb.MatchRequest(model="c", token_ids=toks([1, 2, 3]))).prefix_len == 0
    assert stats(stub, "c").session_slots == 3  # still the session's to free


def test_draining_answers_unavailable(server, stub) -> None:
    server.run(setattr, server.service, "draining", True)
    try:
        refused(stub.Stats, pb.StatsRequest(), CODE.UNAVAILABLE)
    finally:
        server.run(setattr, server.service, "draining", False)
    stub.Stats(pb.StatsRequest())


def test_mamba_model_caches_a_state_per_prefix(stub, session) -> None:
    tokens = [1, 2, 3, 4]
    m = stub.Match(pb.MatchRequest(model="h", token_ids=toks(tokens), session_id=session,
                                   lock=True, allocate=True))
    assert m.prefix_len == 0 and not m.HasField("state_slot")
    state = m.allocated_state_slot
    assert 3 <= state < 7  # after the padding slot and the two working slots
    ins = stub.Insert(pb.InsertRequest(model="h", token_ids=toks(tokens), session_id=session,
                                       slot_indices=m.allocated_slots, state_slot=state))
    assert (ins.cached_len, ins.state_exist) == (4, False)
    s = stats(stub, "h")
    assert (s.mamba_evictable_slots, s.free_state_slots, s.session_state_slots) == (1, 3, 0)

    hit = stub.Match(pb.MatchRequest(model="h", token_ids=toks([1, 2, 3, 4, 5, 6]),
                                     session_id=session, lock=True, allocate=True))
    assert (hit.prefix_len, hit.state_slot) == (4, state)
    assert stats(stub, "h").mamba_protected_slots == 1
    # A second request for the same tokens: the tree already has the state, so the
    # request's own state slot is freed rather than cached.
    again = stub.Insert(pb.InsertRequest(
        model="h", token_ids=toks(tokens), session_id=session, state_slot=hit.allocated_state_slot,
        slot_indices=hit.slot_indices, release_lock_id=hit.lock_id))
    assert again.state_exist
    # Tokens not cached yet need a state; a state slot the session does not hold is refused.
    refused(stub.Insert, pb.InsertRequest(model="h", token_ids=toks([1, 2, 3, 4, 5, 6]),
                                          session_id=session,
                                          slot_indices=hit.slot_indices + hit.allocated_slots),
            CODE.INVALID_ARGUMENT)
    refused(stub.Insert, pb.InsertRequest(model="h", token_ids=toks([1, 2, 3, 4, 5, 6]),
                                          session_id=session, state_slot=state,
                                          slot_indices=hit.slot_indices + hit.allocated_slots),
            CODE.FAILED_PRECONDITION)
    got = stub.Alloc(pb.AllocRequest(model="h", num_slots=0, num_state_slots=2,
                                     session_id=session))
    assert len(slots(got.state_slots)) == 2 and stats(stub, "h").session_state_slots == 2
    stub.Free(pb.FreeRequest(model="h", state_slots=got.state_slots, session_id=session))
    refused(stub.Free, pb.FreeRequest(model="h", state_slots=got.state_slots,
                                      session_id=session), CODE.FAILED_PRECONDITION)
    refused(stub.Alloc, pb.AllocRequest(model="m", num_state_slots=1, session_id=session),
            CODE.FAILED_PRECONDITION)
    stub.Free(pb.FreeRequest(model="h", slot_indices=hit.allocated_slots, session_id=session))
    evicted = stub.Evict(pb.EvictRequest(model="h", mamba_num=1))
    assert evicted.mamba_evicted == 1
    assert stats(stub, "h").free_state_slots == 4


def test_slot_model_reuses_a_sequence_slot_by_copy_or_in_place(server, stub,
                                                              stub_session_pair) -> None:
    a, b = stub_session_pair
    pool = stub.DescribePool(pb.DescribePoolRequest(model="s"))
    assert (pool.num_rows, pool.max_seq_len, pool.layer_num, pool.k_head_dim) == (4, 16, 1, 2)
    tokens = [1, 2, 3, 4, 5, 6]
    first = stub.Match(pb.MatchRequest(model="s", token_ids=toks(tokens), session_id=a,
                                       allocate=True))
    assert first.prefix_len == 0 and first.HasField("allocated_slot_version")
    (slot_a,) = slots(first.allocated_slots)
    k_cache = server.service.engine("s").k_cache
    server.run(lambda: k_cache[slot_a, :6].fill_(7.0))  # "prefill" writes the KV
    ins = stub.Insert(pb.InsertRequest(model="s", token_ids=toks(tokens), session_id=a,
                                       slot_indices=first.allocated_slots,
                                       slot_version=first.allocated_slot_version))
    assert ins.cached_len == 6

    # Session b: the prefix lives in a's slot, which a still holds: b gets a copy.
    hit = stub.Match(pb.MatchRequest(model="s", token_ids=toks([*tokens, 7, 8]), session_id=b,
                                     lock=True, allocate=True))
    assert (hit.prefix_len, slots(hit.slot_indices)) == (6, [slot_a])
    assert hit.slot_version == first.allocated_slot_version and hit.lock_id and hit.node_id
    (slot_b,) = slots(hit.allocated_slots)
    assert slot_b != slot_a
    assert bool(server.run(lambda: (k_cache[slot_b, :6] == 7.0).all().item()))
    stub.Unlock(pb.UnlockRequest(lock_id=hit.lock_id, session_id=b))

    # a is done and frees its slot; the next match reuses it in place at a new version.
    stub.Free(pb.FreeRequest(model="s", slot_indices=first.allocated_slots, session_id=a))
    again = stub.Match(pb.MatchRequest(model="s", token_ids=toks(tokens), session_id=a,
                                       allocate=True))
    assert slots(again.allocated_slots) == [slot_a]
    assert again.allocated_slot_version != first.allocated_slot_version
    refused(stub.Insert, pb.InsertRequest(model="s", token_ids=toks(tokens), session_id=a,
                                          slot_indices=again.allocated_slots,
                                          slot_version=first.allocated_slot_version),
            CODE.INVALID_ARGUMENT)  # a stale version
    refused(stub.Insert, pb.InsertRequest(model="s", token_ids=toks(tokens), session_id=b,
                                          slot_indices=again.allocated_slots,
                                          slot_version=again.allocated_slot_version),
            CODE.FAILED_PRECONDITION)  # not b's slot
    got = stub.Alloc(pb.AllocRequest(model="s", num_slots=2, session_id=b))
    assert len(slots(got.slot_versions)) == 2
    refused(stub.Alloc, pb.AllocRequest(model="s", num_slots=1, session_id=b),
            CODE.RESOURCE_EXHAUSTED)
    closed = stub.CloseSession(pb.CloseSessionRequest(session_id=b))
    assert closed.slots_freed == 3
    server.check_integrity()
