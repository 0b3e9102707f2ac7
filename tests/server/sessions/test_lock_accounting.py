"""Lock accounting across models and sessions, against a real
server in invariant mode.

* A slot model's Match with ``lock`` and ``allocate`` on a prefix whose slot its owner
  freed (the in-place reuse that examples/worker.py does) locks the prefix and hands
  the slot over, or changes nothing.
* A lock id of one model, named on another (``release_lock_id``), is refused before
  anything changes, on every kind of model.
* The integrity check compares every model's lock counter and the tree's lock counts
  with the locks sessions hold, so a lock lost on either side is caught.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from harness import EVERY_KIND, pb, serve_module, session_of, slots, stub_of, toks

from prefixcache.cache import IntegrityError

CODE = grpc.StatusCode


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    yield from serve_module(tmp_path_factory, "locks", EVERY_KIND)


@pytest.fixture(scope="module")
def stub(server) -> Iterator:
    yield from stub_of(server)


@pytest.fixture
def sid(stub) -> Iterator[str]:
    yield from session_of(stub)


def stats(stub) -> dict[str, pb.ModelStats]:
    return {m.model: m for m in stub.Stats(pb.StatsRequest()).models}


def refused(call, request) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call(request)
    return err.value.code()


def cache_sequence(stub, sid: str, tokens: list[int]) -> pb.MatchResponse:
    """Cache ``tokens`` in the slot model in a slot the session then frees."""
    m = stub.Match(
        pb.MatchRequest(model="s", token_ids=toks(tokens), session_id=sid, allocate=True)
    )
    stub.Insert(
        pb.InsertRequest(
            model="s",
            token_ids=toks(tokens),
            session_id=sid,
            slot_indices=m.allocated_slots,
            slot_version=m.allocated_slot_version,
        )
    )
    stub.Free(pb.FreeRequest(model="s", slot_indices=m.allocated_slots, session_id=sid))
    return m


def test_slot_model_locking_match_reuses_a_freed_slot_in_place(server, stub, sid) -> None:
    tokens = [101, 102, 103, 104]
    first = cache_sequence(stub, sid, tokens)
    (slot,) = slots(first.allocated_slots)
    before = stats(stub)["s"]

    # The worker's prefill: the prefix is cached in a free slot, so it is reused in place.
    hit = stub.Match(
        pb.MatchRequest(
            model="s", token_ids=toks([*tokens, 105, 106]), session_id=sid, lock=True, allocate=True
        )
    )
    assert hit.prefix_len == 4 and hit.lock_id and hit.node_id
    assert slots(hit.allocated_slots) == [slot]
    assert hit.allocated_slot_version != first.allocated_slot_version
    after = stats(stub)["s"]
    assert (after.locks, after.session_slots) == (1, 1)
    assert after.protected_tokens == 4
    assert after.match_tokens_total == before.match_tokens_total + 6
    server.check_integrity()

    # ...then the insert under the new version, handing the lock over, and the finish.
    full = [*tokens, 105, 106]
    ins = stub.Insert(
        pb.InsertRequest(
            model="s",
            token_ids=toks(full),
            session_id=sid,
            slot_indices=hit.allocated_slots,
            slot_version=hit.allocated_slot_version,
            lock=True,
            release_lock_id=hit.lock_id,
        )
    )
    assert (ins.prefix_len, ins.cached_len) == (4, 6) and ins.lock_id
    stub.Unlock(pb.UnlockRequest(lock_id=ins.lock_id, session_id=sid))
    stub.Free(pb.FreeRequest(model="s", slot_indices=hit.allocated_slots, session_id=sid))
    assert stub.Match(pb.MatchRequest(model="s", token_ids=toks(full))).prefix_len == 6
    closed = stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    assert (closed.locks_released, closed.slots_freed) == (0, 0)
    server.check_integrity()


def test_slot_model_refused_locking_match_changes_nothing(server, stub, sid) -> None:
    tokens = [111, 112, 113]
    cache_sequence(stub, sid, tokens)
    # Every slot but the cached one is taken by another session: the cached one is
    # free, so the locking match still gets it in place...
    other = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=60)).session_id
    pool = stub.DescribePool(pb.DescribePoolRequest(model="s")).pool_size
    stub.Alloc(pb.AllocRequest(model="s", num_slots=pool - 1, session_id=other))
    hit = stub.Match(
        pb.MatchRequest(model="s", token_ids=toks(tokens), session_id=sid, lock=True, allocate=True)
    )
    assert hit.lock_id and len(slots(hit.allocated_slots)) == 1
    # ...and a second one finds no slot at all: refused, with no lock, counted only as
    # a lookup refused for room (the capacity outcome).
    before = stats(stub)["s"]
    try:
        assert (
            refused(
                stub.Match,
                pb.MatchRequest(
                    model="s", token_ids=toks(tokens), session_id=sid, lock=True, allocate=True
                ),
            )
            == CODE.RESOURCE_EXHAUSTED
        )
        after = stats(stub)["s"]
        assert after.lookup_tokens_total["capacity"] == before.lookup_tokens_total[
            "capacity"
        ] + len(tokens)
        after.lookup_tokens_total["capacity"] = before.lookup_tokens_total["capacity"]
        assert after == before
    finally:
        stub.CloseSession(pb.CloseSessionRequest(session_id=other))
    server.check_integrity()


def _lock_on(stub, sid: str, model: str) -> int:
    """A lock the session holds on a cached prefix of ``model``."""
    tokens = [201, 202, 203, 204]
    if model == "s":
        m = stub.Match(
            pb.MatchRequest(model="s", token_ids=toks(tokens), session_id=sid, allocate=True)
        )
        ins = stub.Insert(
            pb.InsertRequest(
                model="s",
                token_ids=toks(tokens),
                session_id=sid,
                slot_indices=m.allocated_slots,
                lock=True,
                slot_version=m.allocated_slot_version,
            )
        )
        return ins.lock_id
    m = stub.Match(
        pb.MatchRequest(model=model, token_ids=toks(tokens), session_id=sid, allocate=True)
    )
    req = pb.InsertRequest(
        model=model,
        token_ids=toks(tokens),
        session_id=sid,
        lock=True,
        slot_indices=m.slot_indices + m.allocated_slots,
    )
    if m.HasField("allocated_state_slot"):
        req.state_slot = m.allocated_state_slot
    return stub.Insert(req).lock_id


def _insert_into(stub, sid: str, model: str, release_lock_id: int) -> pb.InsertRequest:
    tokens = [301, 302, 303, 304]
    m = stub.Match(
        pb.MatchRequest(model=model, token_ids=toks(tokens), session_id=sid, allocate=True)
    )
    req = pb.InsertRequest(
        model=model,
        token_ids=toks(tokens),
        session_id=sid,
        lock=True,
        release_lock_id=release_lock_id,
        slot_indices=m.allocated_slots if model == "s" else m.slot_indices + m.allocated_slots,
    )
    if model == "s":
        req.slot_version = m.allocated_slot_version
    if m.HasField("allocated_state_slot"):
        req.state_slot = m.allocated_state_slot
    return req


@pytest.mark.parametrize(
    ("target", "owner"), [("s", "m"), ("s", "h"), ("m", "s"), ("w", "s"), ("h", "m")]
)
def test_insert_refuses_another_models_lock_and_changes_nothing(
    server, stub, sid, target: str, owner: str
) -> None:
    lock_id = _lock_on(stub, sid, owner)
    req = _insert_into(stub, sid, target, lock_id)
    before = stats(stub)
    assert refused(stub.Insert, req) == CODE.FAILED_PRECONDITION
    assert stats(stub) == before  # nothing inserted, no lock taken or dropped
    server.check_integrity()
    # The lock is still the session's, on its own model, and releases normally.
    stub.Unlock(pb.UnlockRequest(lock_id=lock_id, session_id=sid))
    assert stats(stub)[owner].locks == 0
    # The session's own lock on the target is accepted.
    own = _lock_on(stub, sid, target) if target != owner else 0
    stub.Insert(_insert_into(stub, sid, target, own))
    closed = stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    assert closed.locks_released == 1  # the insert's lock=True
    assert all(s.locks == 0 for s in stats(stub).values())
    server.check_integrity()


def test_unlock_of_another_sessions_or_models_lock(server, stub, sid) -> None:
    lock_id = _lock_on(stub, sid, "s")
    other = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=60)).session_id
    assert (
        refused(stub.Unlock, pb.UnlockRequest(lock_id=lock_id, session_id=other))
        == CODE.FAILED_PRECONDITION
    )
    # The engine refuses a lock of another model too, whoever calls it.
    engine, session = server.service.engine("m"), server.service.session(sid)
    with pytest.raises(Exception, match="another model"):
        server.run(engine.unlock, session, lock_id)
    server.check_integrity()
    stub.Unlock(pb.UnlockRequest(lock_id=lock_id, session_id=sid))
    stub.CloseSession(pb.CloseSessionRequest(session_id=other))
    assert stats(stub)["s"].locks == 0


def _corrupt_and_check(server, corrupt, undo, match: str) -> None:
    server.run(corrupt)
    try:
        with pytest.raises(IntegrityError, match=match):
            server.check_integrity()
    finally:
        server.run(undo)
    server.check_integrity()


def test_integrity_check_compares_locks_with_the_sessions_that_hold_them(server, stub, sid) -> None:
    lock_id = _lock_on(stub, sid, "m")
    slot_lock = _lock_on(stub, sid, "s")
    session = server.service.session(sid)
    engine = server.service.engine("m")
    held = session.locks[lock_id]

    def bump(n: int):
        return lambda: setattr(engine, "num_locks", engine.num_locks + n)

    _corrupt_and_check(server, bump(1), bump(-1), "num_locks")
    # A lock that left the session but stayed in the tree (and in the counter).
    _corrupt_and_check(
        server,
        lambda: session.locks.pop(lock_id),
        lambda: session.locks.__setitem__(lock_id, held),
        "lock",
    )
    # A lock in the tree that no session holds.
    node = held.node
    _corrupt_and_check(
        server,
        lambda: engine.cache.inc_lock_ref(node),
        lambda: engine.cache.dec_lock_ref(node),
        "own lock",
    )
    # The same on the slot model (pins).
    slot_engine = server.service.engine("s")
    pinned = session.locks[slot_lock].node
    _corrupt_and_check(
        server,
        lambda: slot_engine.cache.pin(pinned),
        lambda: slot_engine.cache.release(pinned),
        "own lock",
    )
    stub.Unlock(pb.UnlockRequest(lock_id=lock_id, session_id=sid))
    stub.Unlock(pb.UnlockRequest(lock_id=slot_lock, session_id=sid))
    server.check_integrity()


def test_integrity_check_follows_swa_window_locks(server, stub, sid) -> None:
    lock_id = _lock_on(stub, sid, "w")
    again = stub.Match(
        pb.MatchRequest(model="w", token_ids=toks([201, 202, 203, 204]), session_id=sid, lock=True)
    ).lock_id
    engine = server.service.engine("w")
    node = server.service.session(sid).locks[lock_id].node
    assert server.service.session(sid).locks[again].node is node and node.swa_lock_ref == 2

    def swa(n: int):
        return lambda: setattr(node, "swa_lock_ref", node.swa_lock_ref + n)

    # Still SWA-locked, so the cache's own sizes agree; only the lock count is off.
    _corrupt_and_check(server, swa(-1), swa(1), "swa_lock_ref 1, sessions' windows")
    for lock in (lock_id, again):
        stub.Unlock(pb.UnlockRequest(lock_id=lock, session_id=sid))
    assert engine.num_locks == 0
