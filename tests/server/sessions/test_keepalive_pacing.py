"""KeepAlive pacing: a renewal storm waits instead of taking the loop.

A client keeping many KeepAlives in flight in a loop, answered as fast as the loop could
go, would take its turns from every other client (a victim's prefill p99 goes from 29 ms
to 0.4-1.2 s). So each session's KeepAlives are answered at most one per tenth of its
TTL, and its lease holds throughout. The victim's latency itself is
measured in bench/noisy_neighbour.py, not here.
"""

from __future__ import annotations

import threading
import time

import grpc
from harness import pb, running, stub_for

from prefixcache.server.sessions import keepalive
from prefixcache.server.sessions.session import Session


def test_keepalives_take_the_next_free_tenth_of_the_ttl_after_a_small_burst() -> None:
    session = Session(id="x", tag=1, name="", ttl=2.0, expires_at=0.0)
    burst = [keepalive.wait(session, 100.0) for _ in range(keepalive.BURST + 1)]
    assert burst == [0.0] * (keepalive.BURST + 1)  # a few by hand are answered at once
    assert round(keepalive.wait(session, 100.0), 6) == 0.2  # then one per 0.2 s
    assert round(keepalive.wait(session, 100.0), 6) == 0.4
    keepalive.give_back(session)  # the last caller gave up: its slot is free again
    assert round(keepalive.wait(session, 100.0), 6) == 0.4
    assert keepalive.wait(session, 101.0) == 0.0  # renewing every third of the TTL: never
    assert keepalive.wait(Session(id="y", tag=2, name="", ttl=None, expires_at=0.0), 1) == 0
    assert keepalive.wait(None, 1.0) == 0.0


def test_a_keepalive_storm_is_paced_and_the_lease_holds(tmp_path) -> None:
    with running(tmp_path) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            sid = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=1.0)).session_id
            stub.Alloc(pb.AllocRequest(model="m", num_slots=3, session_id=sid))
            stop = threading.Event()
            answered: list[float] = []
            errors: list[grpc.StatusCode] = []

            def storm() -> None:
                while not stop.is_set():
                    try:
                        stub.KeepAlive(pb.KeepAliveRequest(session_id=sid), timeout=10)
                        answered.append(time.monotonic())
                    except grpc.RpcError as exc:
                        errors.append(exc.code())

            threads = [threading.Thread(target=storm) for _ in range(8)]
            start = time.monotonic()
            for t in threads:
                t.start()
            time.sleep(1.5)
            stop.set()
            for t in threads:
                t.join()
            assert errors == []
            # One answer per 0.1 s (a tenth of the 1 s TTL), plus the first, plus those
            # waiting at the end; unpaced, 8 threads got thousands in 1.5 s.
            in_window = [t for t in answered if t <= start + 1.5]
            assert 5 <= len(in_window) <= 17 + keepalive.BURST, len(in_window)
            # The lease held all along: the session still holds its slots.
            stats = stub.Stats(pb.StatsRequest(model="m"))
            assert stats.models[0].session_slots == 3
            reply = stub.KeepAlive(pb.KeepAliveRequest(session_id=sid), timeout=10)
            assert reply.ttl_seconds == 1.0
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


def test_a_paced_keepalive_of_a_closed_session_answers_not_found(tmp_path) -> None:
    """Pacing delays the answer; it does not hand a closed session a renewal."""
    with running(tmp_path) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            sid = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=5.0)).session_id
            for _ in range(keepalive.BURST + 1):  # the burst is answered at once
                stub.KeepAlive(pb.KeepAliveRequest(session_id=sid))
            late = stub.KeepAlive.future(pb.KeepAliveRequest(session_id=sid), timeout=10)
            time.sleep(0.1)  # it waits for its slot, 0.5 s after the first
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
            try:
                late.result()
                raise AssertionError("a closed session's KeepAlive was answered OK")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.NOT_FOUND


def test_a_long_lease_waits_at_most_a_second() -> None:
    """A 600 s lease renewed by hand past the burst: the next waits 1 s, not a tenth (60 s),
    which would outlast the client's deadline."""
    session = Session(id="x", tag=1, name="", ttl=600.0, expires_at=0.0)
    for _ in range(keepalive.BURST + 1):
        assert keepalive.wait(session, 10.0) == 0.0
    assert keepalive.wait(session, 10.0) == keepalive.MAX_GAP == 1.0
