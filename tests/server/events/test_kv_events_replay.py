"""KV events replay (a DEALER against the replay endpoint) and subscribers that lag.

A late subscriber converges through replay, also after the buffer has moved on (a
snapshot); Reset sends AllBlocksCleared; a long replay arrives whole and in order.
Subscribers and requesters that do not read: test_kv_events_slow_peers.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from harness import pb
from kv_events_harness import (
    MODELS,
    Replica,
    Subscriber,
    Worker,
    decode_batch,
    expected_pages,
    quiet_seq,
    start,
)


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.term()


def test_a_late_subscriber_converges_by_replay_and_reset_clears(
    tmp_path: Path, ctx: zmq.Context
) -> None:
    srv = start(tmp_path, models=MODELS[:1])
    worker = Worker(srv)
    publisher = srv.server.kv_events.publishers["r"]
    try:
        for i in range(6):
            worker.insert("r", [i, i + 1, 7, 8, 9])
        late = Subscriber(ctx, publisher.endpoint, publisher.replay_endpoint)
        time.sleep(0.3)
        worker.insert("r", [40, 41, 42, 43])  # live, while the late one catches up
        replica, applied = Replica(), -1
        for seq, payload in late.replay(0):
            replica.apply(decode_batch(payload, "map", "vllm")[1])
            applied = seq
        for _, seq, payload in late.until(quiet_seq(srv, "r")):
            if seq > applied:  # what replay already gave is skipped, as consumers do
                replica.apply(decode_batch(payload, "map", "vllm")[1])
                applied = seq
        cache = srv.service.engines["r"].cache
        assert replica.pages == srv.run(lambda: expected_pages(cache, "vllm"))
        assert replica.pages
        worker.stub.Reset(pb.ResetRequest(model="r"))
        ((_, seq, payload),) = late.until(quiet_seq(srv, "r"))[-1:]
        assert seq == applied + 1
        _, events = decode_batch(payload, "map", "vllm")
        assert [e.kind for e in events] == ["AllBlocksCleared"]
        late.close()
    finally:
        worker.close()
        srv.stop()


def test_a_subscriber_behind_the_buffer_gets_the_state(tmp_path: Path, ctx: zmq.Context) -> None:
    srv = start(tmp_path, models=MODELS[:1], buffer_steps=3, hash_format="sglang")
    worker = Worker(srv)
    publisher = srv.server.kv_events.publishers["r"]
    try:
        for i in range(8):
            worker.insert("r", [i, 1, 2, 3], extra_key="t" if i % 2 else None)
        newest = quiet_seq(srv, "r")
        sub = Subscriber(ctx, publisher.endpoint, publisher.replay_endpoint)
        answer = sub.replay(0)  # seq 0 left the buffer long ago
        assert [s for s, _ in answer] == [newest]
        _, events = decode_batch(answer[0][1], "map", "sglang")
        assert events[0].kind == "AllBlocksCleared"
        replica = Replica()
        replica.apply(events)
        cache = srv.service.engines["r"].cache
        assert replica.pages == srv.run(lambda: expected_pages(cache, "sglang"))
        # Within the buffer, replay is exact again.
        assert [s for s, _ in sub.replay(newest - 1)] == [newest - 1, newest]
        sub.close()
    finally:
        worker.close()
        srv.stop()


def test_a_long_replay_arrives_whole_and_in_order(tmp_path: Path, ctx: zmq.Context) -> None:
    srv = start(tmp_path, models=MODELS[:1], encoding="array")
    worker = Worker(srv)
    publisher = srv.server.kv_events.publishers["r"]
    try:
        for _ in range(300):  # more batches than one loop turn sends (kv_events._REPLY_BURST)
            worker.stub.Reset(pb.ResetRequest(model="r"))
        newest = quiet_seq(srv, "r")
        assert newest == 300
        sub = Subscriber(ctx, publisher.endpoint, publisher.replay_endpoint)
        answer = sub.replay(0)
        assert [s for s, _ in answer] == list(range(newest + 1))
        for _, payload in answer:
            _, events = decode_batch(payload, "array", "vllm")
            assert [e.kind for e in events] == ["AllBlocksCleared"]
        sub.close()
    finally:
        worker.close()
        srv.stop()
