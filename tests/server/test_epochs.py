"""Epochs: every handle-bearing reply carries the service's epoch, a request fenced with
another epoch is refused before anything changes, and ids from one start of the service
name nothing in the next.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from harness import SMALL_POOL, ModelConfig, pb, running, slots, stub_for, toks

from prefixcache.server.rpc.status import EPOCH_TRAILER

CODE = grpc.StatusCode
MODELS = (ModelConfig(name="m", page_size=1, pool=SMALL_POOL),)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[Any, Any]]:
    with running(tmp_path, MODELS) as srv:
        channel, stub = stub_for(srv.address)
        yield srv, stub
        channel.close()


def _prefill(stub: Any, sid: str, tokens: list[int]) -> tuple[pb.MatchResponse, pb.InsertResponse]:
    m = stub.Match(
        pb.MatchRequest(model="m", token_ids=toks(tokens), session_id=sid, lock=True, allocate=True)
    )
    i = stub.Insert(
        pb.InsertRequest(
            model="m",
            token_ids=toks(tokens),
            slot_indices=m.slot_indices + m.allocated_slots,
            session_id=sid,
            lock=True,
            release_lock_id=m.lock_id,
        )
    )
    return m, i


def _state(srv: Any, stub: Any) -> tuple[Any, ...]:
    srv.check_integrity()
    s = stub.Stats(pb.StatsRequest(model="m"))
    m = s.models[0]
    return (
        s.sessions,
        m.evictable_tokens,
        m.protected_tokens,
        m.free_slots,
        m.session_slots,
        m.locks,
    )


def test_handle_bearing_replies_carry_the_epoch(world: tuple[Any, Any]) -> None:
    srv, stub = world
    epoch = stub.ListModels(pb.ListModelsRequest()).server_epoch
    assert epoch == srv.service.epoch
    sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
    m, i = _prefill(stub, sid, [1, 2, 3])
    lock = stub.Lock(pb.LockRequest(model="m", node_id=i.node_id, session_id=sid))
    alloc = stub.Alloc(pb.AllocRequest(model="m", num_slots=2, session_id=sid))
    pool = stub.DescribePool(pb.DescribePoolRequest(model="m"))
    assert {
        m.server_epoch,
        i.server_epoch,
        lock.server_epoch,
        alloc.server_epoch,
        pool.server_epoch,
    } == {epoch}


def _fenced_requests(
    sid: str, node_id: int, lock_id: int, held: bytes, epoch: int
) -> list[tuple[str, Any]]:
    """One request of each fenced RPC, every one of which would succeed unfenced."""
    return [
        (
            "Match",
            pb.MatchRequest(
                model="m",
                token_ids=toks([1, 2, 3, 4]),
                session_id=sid,
                lock=True,
                allocate=True,
                server_epoch=epoch,
            ),
        ),
        (
            "Insert",
            pb.InsertRequest(
                model="m",
                token_ids=toks([7, 8]),
                slot_indices=held,
                session_id=sid,
                server_epoch=epoch,
            ),
        ),
        ("Lock", pb.LockRequest(model="m", node_id=node_id, session_id=sid, server_epoch=epoch)),
        ("Unlock", pb.UnlockRequest(lock_id=lock_id, session_id=sid, server_epoch=epoch)),
        ("Alloc", pb.AllocRequest(model="m", num_slots=1, session_id=sid, server_epoch=epoch)),
        ("Free", pb.FreeRequest(model="m", slot_indices=held, session_id=sid, server_epoch=epoch)),
        ("KeepAlive", pb.KeepAliveRequest(session_id=sid, server_epoch=epoch)),
        ("CloseSession", pb.CloseSessionRequest(session_id=sid, server_epoch=epoch)),
    ]


def test_a_stale_epoch_is_refused_with_the_current_one_and_changes_nothing(
    world: tuple[Any, Any],
) -> None:
    srv, stub = world
    epoch = srv.service.epoch
    sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
    _, i = _prefill(stub, sid, [1, 2, 3])
    held = stub.Alloc(pb.AllocRequest(model="m", num_slots=2, session_id=sid)).slot_indices
    before = _state(srv, stub)
    stale = epoch ^ 0x5A5A
    for method, request in _fenced_requests(sid, i.node_id, i.lock_id, held, stale):
        with pytest.raises(grpc.RpcError) as err:
            getattr(stub, method)(request)
        assert err.value.code() == CODE.FAILED_PRECONDITION, method
        assert "restarted" in err.value.details()
        trailers = dict(err.value.trailing_metadata() or ())
        assert trailers[EPOCH_TRAILER] == str(epoch), method
        assert _state(srv, stub) == before, method
    # The KV transfer RPCs are fenced too.
    with pytest.raises(grpc.RpcError) as err:
        list(stub.ReadKV(pb.ReadKVRequest(model="m", slot_indices=held, server_epoch=stale)))
    assert err.value.code() == CODE.FAILED_PRECONDITION
    header = pb.WriteKVHeader(
        model="m", slot_indices=held, session_id=sid, layers=[0], server_epoch=stale
    )
    with pytest.raises(grpc.RpcError) as err:
        stub.WriteKV(iter([pb.KVChunk(header=header)]))
    assert err.value.code() == CODE.FAILED_PRECONDITION
    assert dict(err.value.trailing_metadata())[EPOCH_TRAILER] == str(epoch)
    assert _state(srv, stub) == before
    # The right epoch, or none, is accepted: every request above now succeeds.
    for fence in (epoch, 0):
        sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
        _, i = _prefill(stub, sid, [1, 2, 3])
        held = stub.Alloc(pb.AllocRequest(model="m", num_slots=2, session_id=sid)).slot_indices
        for method, request in _fenced_requests(sid, i.node_id, i.lock_id, held, fence):
            if method == "Free":  # the Insert before it cached the held slots
                request.slot_indices = stub.Alloc(
                    pb.AllocRequest(model="m", num_slots=1, session_id=sid)
                ).slot_indices
            getattr(stub, method)(request)
        srv.check_integrity()


def test_the_stream_fences_its_operations(world: tuple[Any, Any]) -> None:
    srv, stub = world
    requests = [
        pb.SessionRequest(
            seq=1, alloc=pb.AllocRequest(model="m", num_slots=1, server_epoch=srv.service.epoch + 1)
        ),
        pb.SessionRequest(
            seq=2, alloc=pb.AllocRequest(model="m", num_slots=1, server_epoch=srv.service.epoch)
        ),
    ]
    first, second = list(stub.Session(iter(requests)))
    assert first.error.code == CODE.FAILED_PRECONDITION.value[0]
    assert len(slots(second.alloc.slot_indices)) == 1


def test_ids_from_one_start_name_nothing_in_the_next(tmp_path: Path) -> None:
    """Two starts doing the same calls hand out different node and lock ids, so a
    handle kept across a restart is NOT_FOUND rather than somebody else's."""
    handles = []
    for _ in range(2):  # the same socket: a restart
        with running(tmp_path, MODELS) as srv:
            channel, stub = stub_for(srv.address)
            sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
            _, i = _prefill(stub, sid, [5, 6, 7])
            if handles:
                old_node, old_lock = handles[0]
                assert (i.node_id, i.lock_id) != (old_node, old_lock)
                with pytest.raises(grpc.RpcError) as err:
                    stub.Lock(pb.LockRequest(model="m", node_id=old_node, session_id=sid))
                assert err.value.code() == CODE.NOT_FOUND
                with pytest.raises(grpc.RpcError) as err:
                    stub.Unlock(pb.UnlockRequest(lock_id=old_lock, session_id=sid))
                assert err.value.code() == CODE.NOT_FOUND
                assert "restart" in err.value.details()
                stub.Unlock(pb.UnlockRequest(lock_id=i.lock_id, session_id=sid))
            handles.append((i.node_id, i.lock_id))
            srv.check_integrity()
            channel.close()
