"""Every RPC of the v1 API against a real server on a unix socket: models and pools,
prefill, match and insert, bad input, namespaces, eviction, reset and draining.
Sessions, locks and streams: test_service_sessions.py; the other cache kinds:
test_service_kinds.py; shared calls: service_calls.py.

The server runs with the integrity check after every mutating call, so a corrupted
cache would surface as INTERNAL in whichever test caused it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc
import pytest
from harness import (
    pack_slots,
    pb,
    running,
    slots,
    stub_for,
    toks,
)
from service_calls import CODE, MODELS, prefill, refused, service_fixtures, stats

server, stub, session = service_fixtures("svc")


def test_list_models_and_describe_pool(stub) -> None:
    reply = stub.ListModels(pb.ListModelsRequest())
    assert [m.name for m in reply.models] == ["m", "p", "w", "c", "h", "s"]
    assert [m.cache_kind for m in reply.models] == [
        pb.CACHE_KIND_RADIX,
        pb.CACHE_KIND_RADIX,
        pb.CACHE_KIND_SWA,
        pb.CACHE_KIND_CHUNK,
        pb.CACHE_KIND_MAMBA,
        pb.CACHE_KIND_SLOT,
    ]
    assert reply.models[4].state_pool_size == 4
    assert reply.models[1].page_size == 4 and reply.models[0].vocab_size == 1000
    assert reply.models[2].sliding_window_size == 4 and reply.server_epoch
    pool = stub.DescribePool(pb.DescribePoolRequest(model="m"))
    assert (pool.layer_num, pool.k_head_num, pool.k_head_dim, pool.v_head_num) == (1, 1, 4, 1)
    assert (pool.dtype, pool.device, pool.pool_size, pool.num_rows) == ("float16", "cpu", 256, 257)
    assert stub.DescribePool(pb.DescribePoolRequest(model="w")).swa_pool_size == 256
    refused(stub.DescribePool, pb.DescribePoolRequest(model="nope"), CODE.NOT_FOUND)
    mamba = stub.DescribePool(pb.DescribePoolRequest(model="h")).mamba
    assert (mamba.layer_num, list(mamba.conv_state_shape), list(mamba.temporal_state_shape)) == (
        2,
        [3, 2],
        [2, 2, 2],
    )
    assert (
        mamba.conv_dtype,
        mamba.temporal_dtype,
        mamba.working_slots,
        mamba.state_slots,
        mamba.num_rows,
    ) == ("float16", "float32", 2, 4, 7)
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

    m = stub.Match(
        pb.MatchRequest(
            model="m",
            token_ids=toks([1, 2, 3, 4, 5, 6, 7]),
            session_id=session,
            lock=True,
            allocate=True,
        )
    )
    assert m.prefix_len == 5 and len(slots(m.allocated_slots)) == 2 and m.lock_id
    assert m.node_id == ins.node_id
    assert stats(stub, "m").protected_tokens == 5
    ins2 = stub.Insert(
        pb.InsertRequest(
            model="m",
            token_ids=toks([1, 2, 3, 4, 5, 6, 7]),
            session_id=session,
            lock=True,
            slot_indices=m.slot_indices + m.allocated_slots,
            release_lock_id=m.lock_id,
        )
    )
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
    refused(
        stub.Match,
        pb.MatchRequest(model="m", token_ids=toks([20]), lock=True),
        CODE.FAILED_PRECONDITION,
    )


def test_insert_frees_the_duplicates_of_a_racing_prefill(stub, stub_session_pair) -> None:
    s1, s2 = stub_session_pair
    tokens = [30, 31, 32, 33]
    m1 = stub.Match(
        pb.MatchRequest(model="m", token_ids=toks(tokens), session_id=s1, allocate=True)
    )
    m2 = stub.Match(
        pb.MatchRequest(model="m", token_ids=toks(tokens), session_id=s2, allocate=True)
    )
    free_before = stats(stub, "m").free_slots
    stub.Insert(
        pb.InsertRequest(
            model="m", token_ids=toks(tokens), session_id=s1, slot_indices=m1.allocated_slots
        )
    )
    second = stub.Insert(
        pb.InsertRequest(
            model="m", token_ids=toks(tokens), session_id=s2, slot_indices=m2.allocated_slots
        )
    )
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
    mine = slots(
        stub.Alloc(pb.AllocRequest(model="m", num_slots=3, session_id=session)).slot_indices
    )
    other = stub.OpenSession(pb.OpenSessionRequest()).session_id
    theirs = slots(
        stub.Alloc(pb.AllocRequest(model="m", num_slots=1, session_id=other)).slot_indices
    )
    tree = slots(stub.Match(pb.MatchRequest(model="m", token_ids=toks([40, 41, 42]))).slot_indices)
    before = stub.Stats(pb.StatsRequest())

    def insert(tokens: list[int], slot_ids: list[int], **kw) -> pb.InsertRequest:
        return pb.InsertRequest(
            model="m",
            token_ids=toks(tokens),
            session_id=session,
            slot_indices=pack_slots(slot_ids),
            **kw,
        )

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
        (
            pb.InsertRequest(
                model="m", token_ids=b"\x01\x00\x00", session_id=session, slot_indices=b""
            ),
            CODE.INVALID_ARGUMENT,
        ),
        (
            pb.InsertRequest(
                model="m", token_ids=toks([1]), session_id=session, slot_indices=b"\x01\x00"
            ),
            CODE.INVALID_ARGUMENT,
        ),
        (
            pb.InsertRequest(
                model="m",
                token_ids=toks([1, 2]),
                token_width=9,
                session_id=session,
                slot_indices=b"",
            ),
            CODE.INVALID_ARGUMENT,
        ),
        (
            pb.InsertRequest(
                model="zz",
                token_ids=toks([1]),
                session_id=session,
                slot_indices=pack_slots(mine[:1]),
            ),
            CODE.NOT_FOUND,
        ),
        (
            pb.InsertRequest(
                model="m",
                token_ids=toks([50]),
                session_id="f" * 32,
                slot_indices=pack_slots(mine[:1]),
            ),
            CODE.NOT_FOUND,
        ),
    ]
    for request, code in cases:
        refused(stub.Insert, request, code)
        assert stub.Stats(pb.StatsRequest()) == before, request
    for request in (
        pb.MatchRequest(model="m", token_ids=b"\x00" * 5),
        pb.MatchRequest(model="m", token_ids=toks([1001])),
        pb.MatchRequest(model="m", token_ids=toks([1]), token_width=100),
    ):
        refused(stub.Match, request, CODE.INVALID_ARGUMENT)
    assert stub.Stats(pb.StatsRequest()) == before
    server.check_integrity()
    stub.CloseSession(pb.CloseSessionRequest(session_id=other))


def test_a_duplicate_inside_the_cached_prefix_is_freed(stub, session) -> None:
    prefill(stub, session, "m", [60, 61, 62])
    tree = slots(stub.Match(pb.MatchRequest(model="m", token_ids=toks([60, 61, 62]))).slot_indices)
    mine = slots(
        stub.Alloc(pb.AllocRequest(model="m", num_slots=2, session_id=session)).slot_indices
    )
    reply = stub.Insert(
        pb.InsertRequest(
            model="m",
            token_ids=toks([60, 61, 62, 63]),
            session_id=session,
            slot_indices=pack_slots([*tree[:2], *mine]),
        )
    )
    assert (reply.prefix_len, reply.cached_len) == (3, 4)
    assert slots(reply.freed_slots) == mine[:1]
    assert stats(stub, "m").session_slots == 0


def test_models_and_namespaces_are_isolated(stub, session) -> None:
    tokens = [150, 151, 152, 153]
    prefill(stub, session, "m", tokens)
    prefill(stub, session, "m", tokens, extra_key="lora-a")
    for model, key, expect in (
        ("m", {}, 4),
        ("p", {}, 0),
        ("m", {"extra_key": ""}, 0),
        ("m", {"extra_key": "lora-a"}, 4),
        ("m", {"extra_key": "lora-b"}, 0),
    ):
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
            refused(
                stub.Unlock,
                pb.UnlockRequest(lock_id=ins.lock_id, session_id=sid),
                CODE.FAILED_PRECONDITION,
            )
            refused(
                stub.Lock,
                pb.LockRequest(model="m", node_id=ins.node_id, session_id=sid),
                CODE.NOT_FOUND,
            )
            assert stub.CloseSession(pb.CloseSessionRequest(session_id=sid)).slots_freed == 0
            srv.check_integrity()


def test_draining_answers_unavailable(server, stub) -> None:
    server.run(setattr, server.service, "draining", True)
    try:
        refused(stub.Stats, pb.StatsRequest(), CODE.UNAVAILABLE)
    finally:
        server.run(setattr, server.service, "draining", False)
    stub.Stats(pb.StatsRequest())
