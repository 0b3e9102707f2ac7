"""Leases against a real server: streams have one, a busy loop does not cost clients
theirs, and many lapsing together are reaped in batches."""

from __future__ import annotations

import logging
import queue
import threading
import time

import grpc
import pytest
from harness import pb, running, stub_for

from prefixcache.server import reaper


def session_slots(stub) -> int:
    return stub.Stats(pb.StatsRequest(model="m"), timeout=10).models[0].session_slots


def test_a_silent_stream_ends_within_its_ttl_and_releases_what_it_held(tmp_path) -> None:
    with running(tmp_path, stream_ttl=1.0) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            requests: queue.Queue = queue.Queue()
            replies = stub.Session(iter(requests.get, None), timeout=30)
            requests.put(pb.SessionRequest(seq=1, alloc=pb.AllocRequest(model="m", num_slots=4)))
            next(replies)
            # Talking keeps it: 2.5 TTLs of a message every 0.2 s.
            for seq in range(2, 14):
                time.sleep(0.2)
                requests.put(pb.SessionRequest(seq=seq, stats=pb.StatsRequest(model="m")))
                assert next(replies).seq == seq
            assert session_slots(stub) == 4
            # Silence ends it: the server's TTL (UNAVAILABLE, naming it), long before
            # the call's own 30 s deadline would have (DEADLINE_EXCEEDED).
            with pytest.raises(grpc.RpcError) as err:
                next(replies)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "server.stream_ttl" in err.value.details()
            assert session_slots(stub) == 0
            assert stub.Stats(pb.StatsRequest()).sessions == 0
            srv.check_integrity()
            requests.put(None)


def test_a_busy_loop_does_not_cost_a_client_its_lease(tmp_path) -> None:
    """The loop blocked for 2.5 leases (a long call): the KeepAlives that waited meanwhile
    count, and the lease holds. The reaper used to run first and expire it."""
    with running(tmp_path) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            sid = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=1.0)).session_id
            stub.Alloc(pb.AllocRequest(model="m", num_slots=3, session_id=sid))
            stop = threading.Event()
            failures: list[grpc.StatusCode] = []

            def keep_alive() -> None:
                while not stop.is_set():
                    try:
                        stub.KeepAlive(pb.KeepAliveRequest(session_id=sid), timeout=10)
                    except grpc.RpcError as exc:
                        failures.append(exc.code())
                    stop.wait(0.2)

            keeper = threading.Thread(target=keep_alive)
            keeper.start()
            time.sleep(0.5)
            srv.run(time.sleep, 2.5)  # the loop can do nothing else meanwhile
            time.sleep(0.8)
            stop.set()
            keeper.join()
            assert failures == []
            assert session_slots(stub) == 3
            assert srv.service.sessions.stalled >= 2.0
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


def test_many_lapsing_leases_are_reaped_in_batches_with_a_line_each(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    count = 3 * reaper.BATCH + 10
    with running(tmp_path, session_ttl_min=0.2) as srv:
        caplog.set_level(logging.INFO, logger="prefixcache")
        srv.run(lambda: [srv.service.open_session(0.2, f"w{i % 3}") for i in range(count)])
        deadline = time.monotonic() + 10
        while len(srv.service.sessions) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(srv.service.sessions) == 0
        lines = [r for r in caplog.records if r.getMessage() == "session leases expired"]
        assert sum(r.count for r in lines) == count
        assert all(r.count <= reaper.BATCH for r in lines)
        # Not one per session. Nor exactly one per batch: the leases end as they were
        # opened, over the one loop turn that opened them, and a tick reaps what has
        # lapsed by then (7 lines for these 778 once, at load 10; 4 when all lapse by one tick).
        assert len(lines) <= count // 16
        assert lines[0].clients == "w0,w1,w2"
        assert lines[0].sessions.endswith(",...")
        assert srv.service.sessions.expired_total == count
