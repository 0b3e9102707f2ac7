"""The KV-event replay socket against hostile or careless peers.

Real ZMQ DEALERs against a real server: 100 requests for a seq older than the buffer
(were each a whole-tree snapshot built on the event loop, 50 of them would stall every
RPC for 9 s), a requester that never reads, and a flood of malformed requests. A victim
making gRPC calls meanwhile never waits long; answers in flight stay capped; the one
snapshot is shared; the non-reader is dropped; malformed requests cost a counter, not a
log line each (that part through a real `prefixcache serve` subprocess and its stderr).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from harness import ServerThread, make_config, pb, serve_process
from kv_events_harness import (
    Replica,
    Subscriber,
    Worker,
    decode_batch,
    expected_pages,
    quiet_seq,
)
from stall_harness import HELD, NODES, LoopWatch, Victim, grow_tree, match_call

from prefixcache.server.config import KvEventsConfig, ModelConfig, PoolConfig
from prefixcache.server.events.replay import BUSY, END_SEQ

MODEL = ModelConfig(name="r", page_size=4, pool=PoolConfig(size=400_000, k_heads=1, k_head_dim=4))
MAX_REPLAYS = 16


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def dealer(ctx: zmq.Context, endpoint: str, **options: int) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect(endpoint)
    return sock


def read_answer(sock: zmq.Socket, timeout: float = 20.0) -> list[tuple[bytes, bytes]]:
    """Every [seq, payload] up to and including the end marker."""
    out = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0 and sock.poll(int(left * 1000)), f"no end marker after {len(out)}"
        empty, seq, payload = sock.recv_multipart()
        assert empty == b""
        out.append((seq, payload))
        if seq == END_SEQ:
            return out


def test_a_replay_storm_never_stalls_other_clients(tmp_path: Path, ctx: zmq.Context) -> None:
    kv = KvEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"ipc://{tmp_path}/ev",
        replay_endpoint=f"ipc://{tmp_path}/replay",
        buffer_steps=150,
        max_replays=MAX_REPLAYS,
        replay_timeout=1.0,
    )
    srv = ServerThread(make_config(tmp_path, (MODEL,), kv_events=kv), check_integrity=False)
    publisher = srv.server.kv_events.publishers["r"]
    worker = Worker(srv)
    victim = Victim(srv.address, match_call("r"))
    socks: list[zmq.Socket] = []
    try:
        rng = random.Random(21)
        for i in range(40):  # a tree whose snapshot costs tens of milliseconds to encode
            worker.insert("r", [i] + [rng.randrange(30000) for _ in range(3999)])
        for i in range(160):  # then more batches than the buffer keeps, ~10 KB each
            worker.insert("r", [1000 + i] + [rng.randrange(30000) for _ in range(1499)])
        oldest = quiet_seq(srv, "r") + 1 - 150  # the buffer's first batch
        # A requester that never reads, asking twice for the whole buffer (150 batches,
        # 1.2 MB): more than its queue (64 messages) and the socket buffers hold.
        stuck = dealer(ctx, publisher.replay_endpoint, RCVHWM=1, RCVBUF=4096)
        socks.append(stuck)
        for _ in range(3):  # the third is over max_replays_per_peer (2): refused
            stuck.send_multipart([b"", oldest.to_bytes(8, "big")])
        time.sleep(0.2)
        with LoopWatch(srv) as watch:
            victim.start()
            time.sleep(0.2)
            # The storm: 100 peers, each asking for seq 0 (long gone: a snapshot each, before).
            storm = [dealer(ctx, publisher.replay_endpoint) for _ in range(100)]
            socks.extend(storm)
            time.sleep(0.2)  # connected
            for sock in storm:
                sock.send_multipart([b"", (0).to_bytes(8, "big")])
            bad = dealer(ctx, publisher.replay_endpoint)
            socks.append(bad)
            for i in range(500):  # and malformed requests
                bad.send_multipart([b"x"] if i % 2 else [b"", b"1234"])
            answers = [read_answer(sock) for sock in storm]
            time.sleep(0.3)
            answered = victim.finish()
        print(f"{victim.report()}; longest loop callback {watch.worst * 1000:.0f} ms of CPU")
        assert answered > 20  # served throughout the storm, each call by its deadline
        assert watch.worst < HELD, f"one loop callback held the loop {watch.worst:.2f} s"

        refused = [a for a in answers if a == [(END_SEQ, BUSY)]]
        full = [a for a in answers if a != [(END_SEQ, BUSY)]]
        # Never more than max_replays answers in flight; the rest were refused.
        assert len(full) + len(refused) == 100
        assert publisher.replay.peak == MAX_REPLAYS
        assert full and len(refused) >= 50
        # One snapshot, shared by every answer; each answer is whole and correct.
        assert publisher.replay_snapshots == 1
        assert len({a[0][1] for a in full}) == 1
        newest = quiet_seq(srv, "r")
        for answer in full:
            assert answer[-1] == (END_SEQ, b"")
            seqs = [int.from_bytes(s, "big") for s, _ in answer[:-1]]
            assert seqs == list(range(seqs[0], newest + 1))
        replica = Replica()
        for _, payload in full[0][:-1]:
            replica.apply(decode_batch(payload, "map", "vllm")[1])
        cache = srv.service.engines["r"].cache
        assert replica.pages == srv.run(lambda: expected_pages(cache, "vllm"))

        # The requester that reads nothing is dropped after replay_timeout.
        deadline = time.monotonic() + 10
        while publisher.replays_dropped < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert publisher.replays_dropped == 2
        assert srv.run(lambda: publisher.replay.in_flight) == 0
        assert publisher.replays_served == len(full)
        assert publisher.replays_refused == len(refused) + 1  # and the stuck one's third
        assert publisher.replay_requests_invalid == 500
        sample = srv.server.metrics.registry.get_sample_value
        for name, value in (
            ("replays", len(full)),
            ("replays_refused", len(refused) + 1),
            ("replays_dropped", 2),
            ("replay_requests_invalid", 500),
            ("replay_snapshots", 1),
        ):
            assert sample(f"prefixcache_kv_event_{name}_total", {"model": "r"}) == value, name
        # The socket still serves: a fresh requester gets the buffer's tail.
        sub = Subscriber(ctx, publisher.endpoint, publisher.replay_endpoint)
        assert [s for s, _ in sub.replay(newest - 1)] == [newest - 1, newest]
        sub.close()
        srv.check_integrity()
    finally:
        victim.stop.set()
        for sock in socks:
            sock.close(linger=0)
        worker.close()
        srv.stop()


def test_malformed_requests_are_counted_not_logged_each(tmp_path: Path, ctx: zmq.Context) -> None:
    config = f"""\
server:
  shm_dir: "off"
  kv_events:
    enable_kv_cache_events: true
    endpoint: ipc://{tmp_path}/ev
    replay_endpoint: ipc://{tmp_path}/replay
models:
  - name: r
    page_size: 1
    pool: {{size: 64, layers: 1, k_heads: 1, k_head_dim: 4}}
"""
    stderr = b""
    with serve_process(tmp_path, config) as (proc, _):
        try:
            bad = dealer(ctx, f"ipc://{tmp_path}/replay")
            shapes = ([b"x"], [b"", b"1234"], [b"", b"12345678", b"more"], [b"a", b"b"])
            for i in range(4000):
                bad.send_multipart(shapes[i % len(shapes)])
            # Still answering afterwards: the first batch (seq 0) and the end marker.
            bad.send_multipart([b"", (0).to_bytes(8, "big")])
            answer = read_answer(bad)
            assert [s for s, _ in answer] == [(0).to_bytes(8, "big"), END_SEQ]
            bad.close(linger=0)
        finally:
            proc.terminate()
            stderr = proc.stderr.read() if proc.stderr else b""
    lines = [
        line
        for line in stderr.decode(errors="replace").splitlines()
        if "malformed KV-event replay request" in line
    ]
    assert 1 <= len(lines) <= 2, lines[:5]
    assert "count=1 " in lines[0]  # the first at once; the rest in the next interval's


def test_snapshots_are_rebuilt_at_most_once_a_second(tmp_path: Path, ctx: zmq.Context) -> None:
    kv = KvEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"ipc://{tmp_path}/ev",
        replay_endpoint=f"ipc://{tmp_path}/replay",
        buffer_steps=2,
    )
    small = ModelConfig(name="r", page_size=4, pool=PoolConfig(size=256, k_heads=1, k_head_dim=4))
    srv = ServerThread(make_config(tmp_path, (small,), kv_events=kv))
    publisher = srv.server.kv_events.publishers["r"]
    worker = Worker(srv)
    sock = dealer(ctx, publisher.replay_endpoint)
    try:
        for i in range(4):
            worker.insert("r", [i, 1, 2, 3])
        t0 = time.monotonic()
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        assert read_answer(sock)[-1] == (END_SEQ, b"")
        # Churn past the buffer: the kept snapshot is stale, and a peer asks again.
        for i in range(4):
            worker.insert("r", [10 + i, 1, 2, 3])
        newest = quiet_seq(srv, "r")
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        answer = read_answer(sock)
        assert time.monotonic() - t0 >= 0.95  # the second walk waited for its turn
        assert publisher.replay_snapshots == 2
        seqs = [int.from_bytes(s, "big") for s, _ in answer[:-1]]
        assert seqs == [newest]  # fresh: the state at the newest batch
    finally:
        sock.close(linger=0)
        worker.close()
        srv.stop()


@pytest.mark.slow
def test_snapshots_of_a_large_tree_are_built_in_slices_and_exact(
    tmp_path: Path, ctx: zmq.Context
) -> None:
    # A 50k-node tree: each snapshot's walk used to hold the loop for the whole tree
    # (0.1-0.3 s). Peers behind the buffer ask again and again while a worker changes
    # the tree (inserts that split nodes the walk has not reached, and evictions): the
    # victim is never held long, and every answer, brought forward with the batches
    # published after it, is exactly the tree.
    big = ModelConfig(
        name="r",
        page_size=1,
        vocab_size=1 << 20,
        pool=PoolConfig(size=2 * NODES + 20_000, k_heads=1, k_head_dim=4),
    )
    kv = KvEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"ipc://{tmp_path}/ev",
        replay_endpoint=f"ipc://{tmp_path}/replay",
        buffer_steps=4,
        hwm=100_000,
    )
    srv = ServerThread(make_config(tmp_path, (big,), kv_events=kv), check_integrity=False)
    publisher = srv.server.kv_events.publishers["r"]
    live = Subscriber(ctx, publisher.endpoint, None)  # every batch, from the first
    time.sleep(0.2)
    worker = Worker(srv)
    victim = Victim(srv.address, match_call("r"))
    stop = threading.Event()

    def churn() -> None:
        rng = random.Random(7)
        while not stop.is_set():
            head = rng.randrange(1, 60)  # under the tree's first tokens: splits
            worker.insert("r", [head] + [rng.randrange(600, 700) for _ in range(4)])
            if rng.random() < 0.2:
                worker.stub.Evict(
                    pb.EvictRequest(model="r", num_tokens=8, session_id=worker.session)
                )
            time.sleep(0.002)

    churner = threading.Thread(target=churn, daemon=True)
    socks: list[zmq.Socket] = []
    try:
        grow_tree(srv, "r")  # 25 batches: more than the buffer keeps
        with LoopWatch(srv) as watch:
            victim.start()
            churner.start()
            answers = []
            deadline = time.monotonic() + 4.0
            while time.monotonic() < deadline:  # a snapshot a second (the rate limit)
                sock = dealer(ctx, publisher.replay_endpoint)
                socks.append(sock)
                sock.send_multipart([b"", (0).to_bytes(8, "big")])
                answers.append(read_answer(sock, 30))
            stop.set()
            churner.join(30)
            answered = victim.finish()
        print(
            f"{victim.report()}, "
            f"{publisher.replay_snapshots} snapshots; longest loop callback "
            f"{watch.worst * 1000:.0f} ms of CPU: {watch.what}"
        )
        assert publisher.replay_snapshots >= 2
        assert watch.worst < HELD, f"one loop callback held the loop {watch.worst:.2f} s"
        assert answered > 0  # served throughout, each call by its deadline

        newest = quiet_seq(srv, "r")
        batches = {seq: payload for _, seq, payload in live.until(newest, 30)}
        expected = srv.run(lambda: expected_pages(srv.service.engines["r"].cache, "vllm"))
        for answer in answers:
            replica = Replica()
            seqs = [int.from_bytes(s, "big") for s, _ in answer[:-1]]
            for _, payload in answer[:-1]:
                replica.apply(decode_batch(payload, "map", "vllm")[1])
            for seq in range(seqs[-1] + 1, newest + 1):  # then the live stream's batches
                replica.apply(decode_batch(batches[seq], "map", "vllm")[1])
            assert replica.pages == expected
        srv.check_integrity()
    finally:
        stop.set()
        victim.stop.set()
        for sock in socks:
            sock.close(linger=0)
        live.close()
        worker.close()
        srv.stop()
