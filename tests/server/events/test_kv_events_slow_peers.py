"""KV events against peers that do not keep up: a real ZMQ SUB that never
reads beside a healthy one. The stuck subscriber loses its own batches (a seq gap it can
replay); the healthy one gets every batch in order, and nothing waits on anyone.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from harness import pb
from kv_events_harness import Subscriber, Worker, quiet_seq, start

from prefixcache.server.config import ModelConfig, PoolConfig

BIG = (ModelConfig(name="r", page_size=16, pool=PoolConfig(size=8192, k_heads=1, k_head_dim=4)),)


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.term()


def stuck_subscriber(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """A SUB that never reads, with the smallest queues it can have."""
    stuck = ctx.socket(zmq.SUB)
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt(zmq.RCVBUF, 4096)
    stuck.setsockopt(zmq.LINGER, 0)
    stuck.connect(endpoint)
    stuck.setsockopt(zmq.SUBSCRIBE, b"")
    return stuck


class Reader(threading.Thread):
    """A healthy subscriber, reading as fast as batches come."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        super().__init__(daemon=True)
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.seqs: list[int] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            if self.sub.poll(50):
                _, seq, _ = self.sub.recv_multipart()
                self.seqs.append(int.from_bytes(seq, "big"))
        self.sub.close()


def test_a_stuck_subscriber_never_silences_a_healthy_one(tmp_path: Path, ctx: zmq.Context) -> None:
    srv = start(
        tmp_path,
        models=BIG,
        hwm=50,
        endpoint=f"ipc://{tmp_path}/ev",
        replay_endpoint=f"ipc://{tmp_path}/replay",
    )
    worker = Worker(srv)
    publisher = srv.server.kv_events.publishers["r"]
    stuck = stuck_subscriber(ctx, publisher.endpoint)
    reader = Reader(ctx, publisher.endpoint)
    reader.start()
    try:
        time.sleep(0.3)  # both subscriptions reach the server
        first = quiet_seq(srv, "r") + 1
        rng = random.Random(4)
        for _ in range(150):  # ~20 KB a batch: far past the stuck peer's hwm and buffers
            worker.insert("r", [rng.randrange(50000) for _ in range(4096)])
            worker.stub.Evict(pb.EvictRequest(model="r", num_tokens=4096))
        newest = quiet_seq(srv, "r")
        deadline = time.monotonic() + 20
        while (not reader.seqs or reader.seqs[-1] < newest) and time.monotonic() < deadline:
            time.sleep(0.05)
        # The healthy subscriber saw every batch, in order: with XPUB_NODROP one full
        # peer would fail every send, and the healthy one stop after ~175.
        got = [s for s in reader.seqs if s >= first]
        assert got == list(range(first, newest + 1)), (
            f"healthy subscriber got {len(got)} of {newest + 1 - first}"
        )
        assert newest + 1 - first >= 300
        # The stuck one lost its own copies: a gap, which replay fills.
        stuck_seqs = []
        while stuck.poll(200):
            stuck_seqs.append(int.from_bytes(stuck.recv_multipart()[1], "big"))
        assert len(stuck_seqs) < newest + 1 - first
        assert publisher.batches_published == publisher.next_seq
        replayer = Subscriber(ctx, publisher.endpoint, publisher.replay_endpoint)
        assert [s for s, _ in replayer.replay(newest - 2)] == [newest - 2, newest - 1, newest]
        replayer.close()
        srv.check_integrity()
    finally:
        reader.stop.set()
        reader.join(5)
        stuck.close()
        worker.close()
        srv.stop()
