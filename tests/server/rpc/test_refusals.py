"""Requests the fuzzer (tests/reliability/test_fuzz.py) found, each as a case of its own:
a refused request gets a documented status code and changes nothing."""

from __future__ import annotations

import queue
from collections.abc import Iterator

import grpc
import pytest
from harness import SMALL_POOL, pb, running, stub_for, toks

from prefixcache.server.config import MambaConfig, ModelConfig, PoolConfig

MODELS = (
    ModelConfig(name="p", page_size=4, pool=PoolConfig(size=64, k_heads=1, k_head_dim=4)),
    ModelConfig(
        name="h",
        kind="mamba",
        page_size=2,
        pool=PoolConfig(size=32, k_heads=1, k_head_dim=4),
        mamba=MambaConfig(state_slots=2, layers=1),
    ),
    ModelConfig(
        name="s", kind="slot", max_seq_len=16, pool=PoolConfig(size=1, k_heads=1, k_head_dim=2)
    ),
    ModelConfig(name="m", page_size=1, pool=SMALL_POOL),
)
CODE = grpc.StatusCode
GARBAGE = b"\xff\xff\xff"  # not a protobuf message of any type


@pytest.fixture
def server(tmp_path) -> Iterator:
    with running(tmp_path, MODELS) as srv:
        yield srv


def _code(fn) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as err:
        return err.code()
    return CODE.OK


def test_undecodable_request_bytes_are_invalid_argument(server) -> None:
    """They were UNKNOWN (unary, ReadKV, Session) and INTERNAL (WriteKV)."""
    channel, _ = stub_for(server.address)
    path = "/prefixcache.v1.PrefixCache/"
    for method in ("Stats", "Match", "Insert", "Alloc", "OpenSession", "Reset"):
        call = channel.unary_unary(path + method)
        assert _code(lambda call=call: call(GARBAGE, timeout=10)) == CODE.INVALID_ARGUMENT
    read = channel.unary_stream(path + "ReadKV")
    assert _code(lambda: list(read(GARBAGE, timeout=10))) == CODE.INVALID_ARGUMENT
    write = channel.stream_unary(path + "WriteKV")
    assert _code(lambda: write(iter([GARBAGE]), timeout=10)) == CODE.INVALID_ARGUMENT
    # On the Session stream, the op's reply carries the error and the stream goes on.
    session = channel.stream_stream(path + "Session")
    ok = pb.SessionRequest(seq=7, stats=pb.StatsRequest()).SerializeToString()
    replies = [pb.SessionResponse.FromString(r) for r in session(iter([GARBAGE, ok]), timeout=10)]
    assert replies[0].error.code == CODE.INVALID_ARGUMENT.value[0]
    assert replies[1].seq == 7 and replies[1].WhichOneof("result") == "stats"
    server.check_integrity()
    channel.close()


def test_a_match_refused_for_room_counts_no_lookup(server) -> None:
    """A Match with allocate refused RESOURCE_EXHAUSTED used to add to
    match_tokens_total / hit_tokens_total (radix and slot models)."""
    channel, stub = stub_for(server.address)
    sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
    stub.Alloc(pb.AllocRequest(model="s", num_slots=1, session_id=sid))  # the only slot
    before = stub.Stats(pb.StatsRequest())
    for model, n in (("p", 100), ("s", 3)):
        req = pb.MatchRequest(
            model=model, token_ids=toks(range(n)), session_id=sid, lock=True, allocate=True
        )
        assert _code(lambda req=req: stub.Match(req)) == CODE.RESOURCE_EXHAUSTED
    assert stub.Stats(pb.StatsRequest()) == before
    channel.close()


def test_a_mamba_alloc_refused_for_kv_evicts_no_snapshot(server) -> None:
    """Alloc with state slots used to evict snapshots (and their KV) for the state slot
    first, then find the KV pool short and refuse, leaving the cache changed."""
    channel, stub = stub_for(server.address)
    sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
    for first in (1, 100):  # two snapshots fill the state pool; both evictable
        tokens = toks(range(first, first + 4))
        m = stub.Match(pb.MatchRequest(model="h", token_ids=tokens, session_id=sid, allocate=True))
        stub.Insert(
            pb.InsertRequest(
                model="h",
                token_ids=tokens,
                session_id=sid,
                slot_indices=m.allocated_slots,
                state_slot=m.allocated_state_slot,
            )
        )
    before = stub.Stats(pb.StatsRequest(model="h"))
    assert before.models[0].free_state_slots == 0
    assert before.models[0].mamba_evictable_slots == 2
    req = pb.AllocRequest(model="h", num_slots=1000, num_state_slots=1, session_id=sid)
    assert _code(lambda: stub.Alloc(req)) == CODE.RESOURCE_EXHAUSTED
    assert stub.Stats(pb.StatsRequest(model="h")) == before
    server.check_integrity()
    channel.close()


def test_a_stream_op_refusal_keeps_the_stream(server) -> None:
    channel, stub = stub_for(server.address)
    requests: queue.Queue = queue.Queue()
    replies = stub.Session(iter(requests.get, None), timeout=10)
    requests.put(pb.SessionRequest(seq=1, alloc=pb.AllocRequest(model="p", num_slots=2**64 - 1)))
    assert next(replies).error.code == CODE.RESOURCE_EXHAUSTED.value[0]
    requests.put(pb.SessionRequest(seq=2, alloc=pb.AllocRequest(model="p", num_slots=4)))
    assert len(next(replies).alloc.slot_indices) == 32
    requests.put(None)
    list(replies)
    channel.close()
