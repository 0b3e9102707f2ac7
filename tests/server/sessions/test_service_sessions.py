"""The v1 API's sessions, leases, locks and Session streams against a real server.

The server runs with the integrity check after every mutating call, so a corrupted
cache would surface as INTERNAL in whichever test caused it.
"""

from __future__ import annotations

import queue
import time

import pytest
from harness import pack_slots, pb, slots, toks
from service_calls import CODE, prefill, refused, service_fixtures, stats

server, stub, session = service_fixtures("svc_sessions")


def test_errors_of_locks_sessions_and_the_pool(stub, session) -> None:
    ins = prefill(stub, session, "m", [70, 71], keep_lock=True)
    refused(stub.Lock, pb.LockRequest(model="m", node_id=ins.node_id), CODE.FAILED_PRECONDITION)
    refused(
        stub.Lock, pb.LockRequest(model="m", node_id=987654321, session_id=session), CODE.NOT_FOUND
    )
    refused(
        stub.Lock,
        pb.LockRequest(model="p", node_id=ins.node_id, session_id=session),
        CODE.NOT_FOUND,
    )  # a handle of another model
    refused(stub.Unlock, pb.UnlockRequest(lock_id=10**12, session_id=session), CODE.NOT_FOUND)
    stub.Unlock(pb.UnlockRequest(lock_id=ins.lock_id, session_id=session))
    refused(
        stub.Unlock,
        pb.UnlockRequest(lock_id=ins.lock_id, session_id=session),
        CODE.FAILED_PRECONDITION,
    )
    refused(stub.KeepAlive, pb.KeepAliveRequest(session_id="nope"), CODE.NOT_FOUND)
    refused(stub.OpenSession, pb.OpenSessionRequest(ttl_seconds=-1), CODE.INVALID_ARGUMENT)
    got = slots(
        stub.Alloc(pb.AllocRequest(model="m", num_slots=2, session_id=session)).slot_indices
    )
    stub.Free(pb.FreeRequest(model="m", slot_indices=pack_slots(got), session_id=session))
    refused(
        stub.Free,
        pb.FreeRequest(model="m", slot_indices=pack_slots(got), session_id=session),
        CODE.FAILED_PRECONDITION,
    )
    refused(stub.Alloc, pb.AllocRequest(model="m", num_slots=1), CODE.FAILED_PRECONDITION)
    before = stub.Stats(pb.StatsRequest())
    refused(
        stub.Alloc,
        pb.AllocRequest(model="m", num_slots=10**6, session_id=session),
        CODE.RESOURCE_EXHAUSTED,
    )
    assert stub.Stats(pb.StatsRequest()) == before  # nothing evicted for a hopeless ask


def test_a_node_handle_survives_a_split_and_vanishes_on_eviction(stub, session) -> None:
    first = prefill(stub, session, "p", list(range(100, 108)))  # page 4: two pages
    prefill(stub, session, "p", [100, 101, 102, 103, 200, 201, 202, 203])  # splits it
    lock = stub.Lock(pb.LockRequest(model="p", node_id=first.node_id, session_id=session))
    assert stats(stub, "p").protected_tokens == 8  # the deeper part kept the id
    stub.Unlock(pb.UnlockRequest(lock_id=lock.lock_id, session_id=session))
    stub.Evict(pb.EvictRequest(model="p", num_tokens=64))
    refused(
        stub.Lock,
        pb.LockRequest(model="p", node_id=first.node_id, session_id=session),
        CODE.NOT_FOUND,
    )


def test_lock_and_unlock_are_idempotent_per_request_id(stub, session) -> None:
    ins = prefill(stub, session, "m", [80, 81])
    lock = pb.LockRequest(model="m", node_id=ins.node_id, session_id=session, request_id=7)
    first, again = stub.Lock(lock), stub.Lock(lock)
    assert first.lock_id == again.lock_id and stats(stub, "m").locks == 1
    unlock = pb.UnlockRequest(lock_id=first.lock_id, session_id=session, request_id=8)
    stub.Unlock(unlock)
    stub.Unlock(unlock)  # the retry succeeds too
    assert stats(stub, "m").locks == 0
    m = pb.MatchRequest(
        model="m",
        token_ids=toks([80, 81, 82]),
        session_id=session,
        lock=True,
        allocate=True,
        request_id=9,
    )
    assert stub.Match(m) == stub.Match(m)
    assert stats(stub, "m").locks == 1 and stats(stub, "m").session_slots == 1


def test_closing_a_session_releases_its_locks_and_slots(stub) -> None:
    sid = stub.OpenSession(pb.OpenSessionRequest(client_name="w1")).session_id
    free = stats(stub, "m").free_slots
    prefill(stub, sid, "m", [90, 91, 92], keep_lock=True)
    stub.Match(
        pb.MatchRequest(
            model="m",
            token_ids=toks([90, 91, 92, 93, 94]),
            session_id=sid,
            lock=True,
            allocate=True,
        )
    )
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
    # Renewed for four leases at least, and until the other has lapsed (polled).
    start = time.monotonic()
    deadline = start + 30
    while True:
        stub.KeepAlive(pb.KeepAliveRequest(session_id=kept))
        s = stats(stub, "m")
        lapsed = (s.locks, s.session_slots, s.protected_tokens) == (1, 0, 2)
        if lapsed and time.monotonic() - start >= 1.2:
            break
        assert time.monotonic() < deadline, f"never only the kept session's lock: {s}"
        time.sleep(0.05)
    refused(stub.KeepAlive, pb.KeepAliveRequest(session_id=lapsing.session_id), CODE.NOT_FOUND)
    stub.CloseSession(pb.CloseSessionRequest(session_id=kept))


def test_session_stream_carries_every_operation_and_releases_on_close(stub) -> None:
    tokens = toks([130, 131, 132])
    requests = [
        pb.SessionRequest(
            seq=1, match=pb.MatchRequest(model="m", token_ids=tokens, lock=True, allocate=True)
        ),
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
    outbox.put(
        pb.SessionRequest(
            seq=1, match=pb.MatchRequest(model="m", token_ids=tokens, lock=True, allocate=True)
        )
    )
    match = next(call).match
    outbox.put(
        pb.SessionRequest(
            seq=2,
            insert=pb.InsertRequest(
                model="m", token_ids=tokens, slot_indices=match.allocated_slots, lock=True
            ),
        )
    )
    insert = next(call).insert
    assert insert.cached_len == 4 and insert.lock_id
    assert stats(stub, "m").locks == 1
    call.cancel()  # the worker vanishes without closing anything
    deadline = time.monotonic() + 5
    while stats(stub, "m").locks and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stats(stub, "m").locks == 0
