"""Subscribe under abuse: a storm of Subscribes, subscribers that never
read, too many streams. Against a real server:

* a storm of Subscribes leaves other clients served (the snapshot is no longer a tree
  walk on the loop per Subscribe; one snapshot per change-log position, shared);
* streams are capped per session and in total (RESOURCE_EXHAUSTED), and end with
  their session;
* a subscriber that stops reading is dropped once it is too far behind, with a clear
  status, and the service forgets it.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from harness import SOURCE_PATH, ServerThread, make_config, pb, running, stub_for, toks
from kv_events_harness import Worker
from stall_harness import HELD, NODES, LoopWatch, Victim, grow_tree

from prefixcache.server.config import ModelConfig, PoolConfig

CODE = grpc.StatusCode
POOL = PoolConfig(size=40000, layers=1, k_heads=1, k_head_dim=4)
MODELS = (ModelConfig(name="m", page_size=1, vocab_size=100000, pool=POOL),)
# A client that reads only what it asks for: no window growth (BDP probing), so a
# subscriber that stops reading stalls the server's writes after ~100 KiB.
STINGY = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 65536)]


def fill(stub, first: int, prompts: int, width: int = 2) -> None:
    """Cache ``prompts`` prompts of ``width`` tokens, each its own node(s)."""
    for start in range(0, prompts, 4096):
        count = min(4096, prompts - start)
        grown = stub.Step(pb.StepRequest(model="m", session_id=SESSION[0], decodes=[width] * count))
        finishes = []
        for i, d in enumerate(grown.decodes):
            n = first + start + i
            finishes.append(
                pb.StepFinish(
                    token_ids=toks([n // 128 + 1, *(n % 128 + 1 + k for k in range(width - 1))]),
                    slot_indices=d.decode.slot_indices,
                )
            )
        done = stub.Step(pb.StepRequest(model="m", session_id=SESSION[0], finishes=finishes))
        assert not any(f.HasField("error") for f in done.finishes)


SESSION: list[str] = [""]


@pytest.fixture
def srv(tmp_path, request) -> Iterator:
    # The drop test lets a subscriber fall only 64 KiB behind; the others keep the
    # default (which a snapshot of the whole pool fits in).
    pending = 64 * 1024 if "dropped" in request.node.name else 0
    with running(
        tmp_path,
        MODELS,
        max_subscribe_streams=12,
        max_session_subscribes=2,
        max_subscriber_pending_bytes=pending,
    ) as server:
        yield server


@pytest.fixture
def stub(srv) -> Iterator:
    channel, stub = stub_for(srv.address)
    with channel:
        SESSION[0] = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=60)).session_id
        yield stub


def read_snapshot(call) -> int:
    pages = 0
    for event in call:
        pages += sum(len(r.page_hashes) for r in event.snapshot_pages.runs) // 32
        if event.HasField("snapshot_end"):
            return pages
    raise AssertionError("the stream ended inside its snapshot")


def open_streams(srv) -> int:
    return srv.run(lambda: len(srv.server.servicer.subscriptions.streams))


@pytest.mark.slow
def test_a_subscribe_storm_leaves_other_clients_served(srv, stub) -> None:
    fill(stub, 0, 16384)  # 128 + 16384 nodes
    stop = threading.Event()
    snapshots: list[int] = []
    refusals: list[grpc.StatusCode] = []

    def storm() -> None:
        channel, own = stub_for(srv.address)
        with channel:
            while not stop.is_set():
                call = own.Subscribe(pb.SubscribeRequest(model="m"), timeout=60)
                try:
                    snapshots.append(read_snapshot(call))
                except grpc.RpcError as exc:  # over max_subscribe_streams (12)
                    refusals.append(exc.code())
                    time.sleep(0.01)
                call.cancel()

    threads = [threading.Thread(target=storm) for _ in range(16)]
    victim = Victim(srv.address)
    with LoopWatch(srv) as watch:
        for thread in threads:
            thread.start()
        victim.start()
        time.sleep(4.0)
        answered = victim.finish()
        stop.set()
        for thread in threads:
            thread.join()
    assert len(snapshots) >= 10 and set(snapshots) == {128 + 16384}
    assert set(refusals) <= {CODE.RESOURCE_EXHAUSTED}
    print(f"{victim.report()}; longest loop callback {watch.worst * 1000:.0f} ms of CPU")
    assert answered > 10  # served throughout the storm, each call by its deadline
    assert watch.worst < HELD, f"one loop callback held the loop {watch.worst:.2f} s"
    feed = srv.server.servicer.subscriptions.feeds["m"]
    # The tree was walked once; the tree did not change, so one snapshot served them all.
    assert (feed.walks, feed.built) == (1, 1)
    srv.check_integrity()


def test_streams_are_capped_per_session_and_in_all(srv, stub) -> None:
    def subscribe(**kw):
        call = stub.Subscribe(pb.SubscribeRequest(model="m", **kw), timeout=30)
        read_snapshot(call)
        return call

    def refused(code, **kw) -> str:
        with pytest.raises(grpc.RpcError) as err:
            next(stub.Subscribe(pb.SubscribeRequest(model="m", **kw), timeout=30))
        assert err.value.code() == code, err.value.details()
        return err.value.details()

    mine = [subscribe(session_id=SESSION[0]) for _ in range(2)]
    assert "server.max_session_subscribes" in refused(
        CODE.RESOURCE_EXHAUSTED, session_id=SESSION[0]
    )
    refused(CODE.NOT_FOUND, session_id="no-such-session")
    others = [subscribe() for _ in range(10)]
    assert open_streams(srv) == 12
    assert "server.max_subscribe_streams" in refused(CODE.RESOURCE_EXHAUSTED)
    others.pop().cancel()
    deadline = time.monotonic() + 10
    while open_streams(srv) > 11 and time.monotonic() < deadline:
        time.sleep(0.05)
    others.append(subscribe())
    # Closing the session ends its streams, NOT_FOUND.
    stub.CloseSession(pb.CloseSessionRequest(session_id=SESSION[0]))
    for call in mine:
        with pytest.raises(grpc.RpcError) as err:
            next(call)
        assert err.value.code() == CODE.NOT_FOUND
    for call in others:
        call.cancel()


def test_a_subscriber_that_stops_reading_is_dropped(srv, stub) -> None:
    fill(stub, 0, 1000)
    channel, lazy = stub_for(srv.address, options=STINGY)
    with channel:
        call = lazy.Subscribe(pb.SubscribeRequest(model="m"), timeout=120)
        read_snapshot(call)  # then it reads no more
        subs = srv.server.servicer.subscriptions
        before = subs.dropped
        # Changes: far more than the 64 KiB of page hashes it may fall behind by, as the
        # tree churns (insert, evict) while it does not read.
        deadline = time.monotonic() + 60
        cycle = 0
        while open_streams(srv) and time.monotonic() < deadline:
            fill(stub, 100000 + 2048 * cycle, 2048, width=4)
            stub.Evict(pb.EvictRequest(model="m", num_tokens=40000))
            cycle += 1
        assert open_streams(srv) == 0 and subs.dropped == before + 1
        codes = []
        try:
            for _ in call:  # what it had been sent, then its status
                pass
        except grpc.RpcError as exc:
            codes.append((exc.code(), exc.details()))
        assert codes and codes[0][0] == CODE.RESOURCE_EXHAUSTED
        assert "server.max_subscriber_pending_bytes" in codes[0][1]
    # A reading subscriber is not dropped by the same churn.
    call = stub.Subscribe(pb.SubscribeRequest(model="m"), timeout=120)
    read_snapshot(call)
    received = [0]

    def reader() -> None:
        try:
            for _ in call:
                received[0] += 1
        except grpc.RpcError as exc:
            received.append(exc.code())

    thread = threading.Thread(target=reader)
    thread.start()
    for cycle in range(2):
        fill(stub, 300000 + 4096 * cycle, 4096, width=4)
        stub.Evict(pb.EvictRequest(model="m", num_tokens=40000))
    time.sleep(1.0)
    assert open_streams(srv) == 1 and subs.dropped == before + 1
    call.cancel()
    thread.join()
    assert received[0] > 0 and received[1:] in ([], [CODE.CANCELLED])
    srv.check_integrity()


def test_snapshots_kept_from_the_log_match_the_tree(srv, stub) -> None:
    """The page set a snapshot is copied from is kept up to date from the log, not
    walked: after inserts, evictions, a reset and more inserts it is still the tree's."""
    follower = stub.Subscribe(pb.SubscribeRequest(model="m"), timeout=60)
    read_snapshot(follower)  # the feed exists (its page set filled once)
    fill(stub, 0, 3000)
    stub.Evict(pb.EvictRequest(model="m", num_tokens=2500))
    stub.Reset(pb.ResetRequest(model="m"))
    fill(stub, 5000, 2000, width=3)
    stub.Evict(pb.EvictRequest(model="m", num_tokens=1000))

    def walked() -> set[bytes]:
        log = srv.service.engine("m").change_log
        return {bytes.fromhex(h) for r in log.snapshot().pages for h in r.page_hashes}

    call = stub.Subscribe(pb.SubscribeRequest(model="m"), timeout=60)
    got: set[bytes] = set()
    for event in call:
        for run in event.snapshot_pages.runs:
            got.update(run.page_hashes[i : i + 32] for i in range(0, len(run.page_hashes), 32))
        if event.HasField("snapshot_end"):
            break
    assert got == srv.run(walked) and len(got) > 1000
    assert srv.server.servicer.subscriptions.feeds["m"].walks == 1
    call.cancel()
    follower.cancel()


class Follower(threading.Thread):
    """A subscriber that keeps what it is sent (applied afterwards: the Python work of
    applying it here would take the GIL from the in-process server and its victim)."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        self.channel, self.stub = stub_for(address)
        self.runs: list[tuple[int, bytes]] = []
        self.seq = -1
        self.snapshot_done = threading.Event()
        self.call = None

    def run(self) -> None:
        self.call = self.stub.Subscribe(pb.SubscribeRequest(model="m"), timeout=300)
        try:
            for event in self.call:
                self.runs.extend(
                    (run.op, run.page_hashes)
                    for run in event.snapshot_pages.runs or event.changes.runs
                )
                if event.HasField("snapshot_end"):
                    self.snapshot_done.set()
                self.seq = event.seq
        except grpc.RpcError:
            pass  # cancelled at the end
        finally:
            self.channel.close()

    def pages(self) -> set[bytes]:
        """The page set its snapshot and changes add up to."""
        pages: set[bytes] = set()
        for op, data in self.runs:
            hashes = [data[i : i + 32] for i in range(0, len(data), 32)]
            if op == pb.PAGE_OP_CLEARED:
                pages.clear()
            elif op == pb.PAGE_OP_REMOVED:
                pages.difference_update(hashes)
            else:
                pages.update(hashes)
        return pages


@pytest.mark.slow
def test_the_first_subscribe_walks_a_large_tree_in_slices(tmp_path) -> None:
    # A model's first Subscribe walked its whole tree in one loop turn (100k nodes: over
    # half a second, with the garbage collection its records set off). Four first
    # Subscribes at once, while a worker changes the tree (splits, evictions): one walk,
    # in slices, shared; a victim is never held long; every replica is the tree.
    models = (
        ModelConfig(
            name="m",
            page_size=1,
            vocab_size=1 << 20,
            pool=PoolConfig(size=2 * NODES + 20_000, layers=1, k_heads=1, k_head_dim=4),
        ),
    )
    srv = ServerThread(make_config(tmp_path, models), check_integrity=False)
    worker = Worker(srv)
    stop = threading.Event()

    def churn() -> None:
        rng = random.Random(3)
        while not stop.is_set():
            worker.insert("m", [rng.randrange(1, 60)] + [rng.randrange(600, 700) for _ in range(4)])
            if rng.random() < 0.2:
                worker.stub.Evict(
                    pb.EvictRequest(model="m", num_tokens=8, session_id=worker.session)
                )
            time.sleep(0.002)

    churner = threading.Thread(target=churn, daemon=True)
    victim = Victim(srv.address)
    followers = [Follower(srv.address) for _ in range(4)]
    try:
        grow_tree(srv, "m")
        with LoopWatch(srv) as watch:
            victim.start()
            churner.start()
            time.sleep(0.3)
            for follower in followers:
                follower.start()
            for follower in followers:
                assert follower.snapshot_done.wait(60)
            time.sleep(0.3)
            stop.set()
            churner.join(30)
            answered = victim.finish()
        print(
            f"{victim.report()}; "
            f"longest loop callback {watch.worst * 1000:.0f} ms of CPU: {watch.what}"
        )
        assert watch.worst < HELD, f"one loop callback held the loop {watch.worst:.2f} s"
        assert answered > 0  # served throughout, each call by its deadline
        log = srv.service.engine("m").change_log
        head = srv.run(lambda: log.last_seq)
        deadline = time.monotonic() + 30
        while min(f.seq for f in followers) < head and time.monotonic() < deadline:
            time.sleep(0.05)
        walked = srv.run(
            lambda: {bytes.fromhex(h) for r in log.snapshot().pages for h in r.page_hashes}
        )
        assert len(walked) > NODES
        for follower in followers:
            assert follower.seq == head and follower.pages() == walked
        assert srv.server.servicer.subscriptions.feeds["m"].walks == 1
        srv.check_integrity()
    finally:
        stop.set()
        victim.stop.set()
        for follower in followers:
            if follower.call is not None:
                follower.call.cancel()
        worker.close()
        srv.stop()


def test_a_resubscribe_storm_while_the_tree_changes_packs_each_snapshot_in_slices(tmp_path) -> None:
    # Subscribes opened and hung up in a loop while a worker changes the tree: each one
    # at a new change-log position needs a snapshot of the whole page set. Each is packed
    # in slices from the page set held still meanwhile (calls are answered while one is
    # packed), one at a time, and what a subscriber is sent adds up to the tree.
    nodes = 40_000  # pages enough for several slices (subscriptions' ENCODE_SLICE each)
    models = (
        ModelConfig(
            name="m",
            page_size=1,
            vocab_size=1 << 20,
            pool=PoolConfig(size=2 * nodes + 20_000, layers=1, k_heads=1, k_head_dim=4),
        ),
    )
    srv = ServerThread(make_config(tmp_path, models), check_integrity=False)
    worker = Worker(srv)
    stop = threading.Event()
    storms = [0]

    def churn() -> None:
        rng = random.Random(5)
        while not stop.is_set():
            worker.insert("m", [rng.randrange(1, 60)] + [rng.randrange(600, 700) for _ in range(4)])
            time.sleep(0.002)

    def storm() -> None:
        channel, stub = stub_for(srv.address)
        with channel:
            while not stop.is_set():
                call = stub.Subscribe(pb.SubscribeRequest(model="m"), timeout=60)
                try:
                    next(call)
                    storms[0] += 1
                except grpc.RpcError:
                    pass
                call.cancel()

    threads = [
        threading.Thread(target=churn, daemon=True),
        *(threading.Thread(target=storm, daemon=True) for _ in range(4)),
    ]
    first, late = Follower(srv.address), Follower(srv.address)
    try:
        grow_tree(srv, "m", nodes)
        first.start()
        assert first.snapshot_done.wait(60)
        feed = srv.server.servicer.subscriptions.feeds["m"]
        built = feed.built
        with LoopWatch(srv) as watch:
            for thread in threads:
                thread.start()
            answered_while_packing, deadline = 0, time.monotonic() + 30
            while answered_while_packing < 3 and time.monotonic() < deadline:
                answered_while_packing += srv.run(lambda: feed._frozen > 0)
            late.start()
            assert late.snapshot_done.wait(60)
            time.sleep(0.3)
            stop.set()
            for thread in threads:
                thread.join(30)
        assert answered_while_packing == 3
        assert storms[0] > 0 and feed.built > built + 1
        assert watch.worst < HELD, f"one loop callback held the loop {watch.worst:.2f} s"
        log = srv.service.engine("m").change_log
        head = srv.run(lambda: log.last_seq)
        deadline = time.monotonic() + 30
        while min(first.seq, late.seq) < head and time.monotonic() < deadline:
            time.sleep(0.05)
        walked = srv.run(
            lambda: {bytes.fromhex(h) for r in log.snapshot().pages for h in r.page_hashes}
        )
        assert first.pages() == late.pages() == walked and len(walked) > nodes
        assert srv.run(lambda: feed._frozen) == 0
    finally:
        stop.set()
        for follower in (first, late):
            if follower.call is not None:
                follower.call.cancel()
        worker.close()
        srv.stop()


# Another client's Subscribe, in a process of its own: prints "snapshot" once it has read
# one.
OTHER_SUBSCRIBER = """
import sys, grpc
from prefixcache.v1 import prefix_cache_pb2 as pb, prefix_cache_pb2_grpc as pb_grpc
stub = pb_grpc.PrefixCacheStub(grpc.insecure_channel(sys.argv[1]))
for event in stub.Subscribe(pb.SubscribeRequest(model="m"), timeout=30):
    if event.HasField("snapshot_end"):
        print("snapshot")
        break
"""


def test_one_client_cannot_take_every_stream(tmp_path) -> None:
    # Defaults: 64 streams in all, 32 per client. One client without a session must
    # not take all 64, leaving every other subscriber refused.
    with running(tmp_path, MODELS) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            taken, refusal = [], None
            while refusal is None and len(taken) <= 64:
                call = stub.Subscribe(pb.SubscribeRequest(model="m"), timeout=30)
                try:
                    read_snapshot(call)
                    taken.append(call)
                except grpc.RpcError as exc:
                    refusal = exc
            assert refusal is not None and refusal.code() == CODE.RESOURCE_EXHAUSTED
            assert "server.max_subscribes_per_client" in refusal.details()
            assert len(taken) == 32
            # A session of this process is this client too; another process is not.
            session = stub.OpenSession(pb.OpenSessionRequest(client_name="router")).session_id
            with pytest.raises(grpc.RpcError) as err:
                read_snapshot(
                    stub.Subscribe(pb.SubscribeRequest(model="m", session_id=session), timeout=30)
                )
            assert "server.max_subscribes_per_client" in err.value.details()
            other = subprocess.run(
                [sys.executable, "-c", OTHER_SUBSCRIBER, srv.address],
                env={**os.environ, "PYTHONPATH": SOURCE_PATH},
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert other.stdout.strip() == "snapshot", other.stderr[-2000:]
            subs = srv.server.servicer.subscriptions
            me = f"unix:uid={os.geteuid()},pid={os.getpid()}"
            assert srv.run(lambda: dict(subs.per_client)) == {me: 32}
            for call in taken:
                call.cancel()
            deadline = time.monotonic() + 10
            while open_streams(srv) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert open_streams(srv) == 0 and srv.run(lambda: dict(subs.per_client)) == {}
