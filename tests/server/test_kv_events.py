"""KV events out: a real server publishing, a real ZMQ SUB (and DEALER for replay) reading.

Every batch is decoded with a schema written from the published field order (vLLM's and
SGLang's structs) in both encodings. Under a random workload over gRPC the page set
rebuilt from the events equals the tree's at every quiet point, with page hashes
computed here from ``hash_token_ids`` (checked against the spec's vectors) in both hash
formats. Sequence numbers have no gaps; a replay from any seq returns exactly the
batches from there; a late subscriber converges through replay, also after the buffer
has moved on (a snapshot); Reset sends AllBlocksCleared.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from harness import ServerThread, make_config, pb, stub_for, toks

from prefixcache.cache import hash_to_int64, hash_token_ids
from prefixcache.server.config import KvEventsConfig, ModelConfig, PoolConfig, load_config
from prefixcache.server.kv_events import END_SEQ, endpoint_for

POOL = PoolConfig(size=96, k_heads=1, k_head_dim=4)
MODELS = (
    ModelConfig(name="r", page_size=2, pool=POOL),
    ModelConfig(name="w", kind="swa", page_size=1, sliding_window_size=3, pool=POOL),
)
# The published field order: vLLM's BlockStored/BlockRemoved (SGLang's is a prefix of it).
FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                    "lora_id", "medium", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
HASH_RANGE = {"vllm": (0, 2**64 - 1), "sglang": (-(2**63), 2**63 - 1)}
# spec/semantics.md §2.4: [1,2] -> [3,4] -> [5,6], chained.
VECTORS = [("34fb5c825de7ca4aea6e712f19d439c1da0c92c37b423936c5f618545ca4fa1f",
            3817746824117602890),
           ("c57b445f90651b9a650e516ab2238c965b21af35608a31c303e6d9e407f2915c",
            -4216701448867210342),
           ("4a8a26efbf98ddb0eca98c8913c209b45b7241fb0ccbdb559f74dafba44b7c60",
            5371148316746243504)]


def wire(hex_hash: str, hash_format: str) -> int:
    """What each engine publishes for a page hash, computed here from the hex digest."""
    if hash_format == "sglang":
        return hash_to_int64(hex_hash)
    return int(hex_hash[-16:], 16)


def seed(extra_key: str | None, width: int) -> str | None:
    """The chain seed our format documents for a namespace (kv_event_wire.py)."""
    if width == 1:
        if extra_key is None:
            return None
        return hashlib.sha256(b"sglang-cache-salt-v1\0" + extra_key.encode()).hexdigest()
    key = b"\0" if extra_key is None else b"\1" + extra_key.encode()
    return hashlib.sha256(b"prefixcache-namespace-v1\0" + width.to_bytes(4, "little")
                          + key).hexdigest()


# ------------------------------------------------------------------ decoding


@dataclass
class Event:
    kind: str
    fields: dict[str, Any]


def decode_batch(payload: bytes, encoding: str, hash_format: str) -> tuple[float, list[Event]]:
    """Decode one payload strictly by the published layout; any deviation fails."""
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    assert isinstance(batch, list) and len(batch) == 3, batch
    ts, events, rank = batch
    assert isinstance(ts, float) and abs(ts - time.time()) < 600
    assert rank == 0
    assert isinstance(events, list) and events
    return ts, [decode_event(e, encoding, hash_format) for e in events]


def decode_event(raw: Any, encoding: str, hash_format: str) -> Event:
    if encoding == "map":
        assert isinstance(raw, dict), raw
        kind = raw["type"]
        assert list(raw) == ["type", *FIELDS[kind]], raw  # every field, in order
        fields = {k: v for k, v in raw.items() if k != "type"}
    else:
        assert isinstance(raw, list), raw
        kind = raw[0]
        assert len(raw) == 1 + len(FIELDS[kind]), raw
        fields = dict(zip(FIELDS[kind], raw[1:], strict=True))
    low, high = HASH_RANGE[hash_format]
    if kind != "AllBlocksCleared":
        hashes = fields["block_hashes"]
        assert hashes and all(isinstance(h, int) and low <= h <= high for h in hashes)
        assert fields["medium"] in ("CPU", "GPU")
    if kind == "BlockStored":
        parent = fields["parent_block_hash"]
        assert parent is None or (isinstance(parent, int) and low <= parent <= high)
        assert isinstance(fields["block_size"], int) and fields["block_size"] >= 1
        tokens = fields["token_ids"]
        assert all(isinstance(t, int) and 0 <= t < 2**32 for t in tokens)
        assert len(tokens) % (fields["block_size"] * len(fields["block_hashes"])) == 0
        assert fields["lora_id"] is None
        assert fields["lora_name"] is None or isinstance(fields["lora_name"], str)
    return Event(kind, fields)


class Replica:
    """A router's view: pages by published hash, rebuilt from events alone."""

    def __init__(self) -> None:
        self.pages: dict[int, tuple[int | None, tuple[int, ...], str | None]] = {}
        self.kinds: Counter[str] = Counter()

    def apply(self, events: list[Event]) -> None:
        for ev in events:
            self.kinds[ev.kind] += 1
            f = ev.fields
            if ev.kind == "AllBlocksCleared":
                self.pages.clear()
            elif ev.kind == "BlockRemoved":
                for h in f["block_hashes"]:
                    del self.pages[h]
            else:
                parent = f["parent_block_hash"]
                assert parent is None or parent in self.pages, "child of an unknown parent"
                per = len(f["token_ids"]) // len(f["block_hashes"])
                for i, h in enumerate(f["block_hashes"]):
                    assert h not in self.pages, "stored twice"
                    self.pages[h] = (parent, tuple(f["token_ids"][i * per:(i + 1) * per]),
                                     f["lora_name"])
                    parent = h


def expected_pages(cache: Any, hash_format: str) -> dict[int, tuple[int | None,
                                                                     tuple[int, ...], str | None]]:
    """The tree's pages as the events must describe them, hashed here."""
    out = {}
    for (extra_key, width), ns_root in cache.root_node.children.items():
        stack = [(child, seed(extra_key, width), None) for child in ns_root.children.values()]
        while stack:
            node, prior, parent = stack.pop()
            flat = memoryview(node.key_bytes).cast("I").tolist()
            step = width * cache.page_size
            for i in range(0, len(flat), step):
                page = flat[i:i + step]
                prior = hash_token_ids(page, prior)
                h = wire(prior, hash_format)
                out[h] = (parent, tuple(page), extra_key)
                parent = h
            stack.extend((child, prior, parent) for child in node.children.values())
    return out


# ------------------------------------------------------------ the plumbing


class Subscriber:
    """A SUB socket on one model's events, plus a DEALER for replays."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay: str | None) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.replay_endpoint = replay
        self.ctx = ctx
        self.received: list[tuple[bytes, int, bytes]] = []

    def until(self, seq: int, timeout: float = 10.0) -> list[tuple[bytes, int, bytes]]:
        """Receive up to and including batch ``seq``."""
        deadline = time.monotonic() + timeout
        while not self.received or self.received[-1][1] < seq:
            left = deadline - time.monotonic()
            assert left > 0, f"no batch {seq}; got {[s for _, s, _ in self.received]}"
            if self.sub.poll(int(left * 1000)):
                topic, raw_seq, payload = self.sub.recv_multipart()
                self.received.append((topic, int.from_bytes(raw_seq, "big"), payload))
        return self.received

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        assert self.replay_endpoint is not None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        try:
            while True:
                assert dealer.poll(10_000), "replay did not finish"
                empty, raw_seq, payload = dealer.recv_multipart()
                assert empty == b""
                if raw_seq == END_SEQ:
                    assert payload == b""
                    return out
                out.append((int.from_bytes(raw_seq, "big"), payload))
        finally:
            dealer.close()

    def close(self) -> None:
        self.sub.close()


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.term()


def start(tmp: Path, models: tuple[ModelConfig, ...] = MODELS, **kv: Any) -> ServerThread:
    settings = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
                "replay_endpoint": "tcp://127.0.0.1:*", **kv}
    return ServerThread(make_config(tmp, models, kv_events=KvEventsConfig(**settings)))


def quiet_seq(srv: ServerThread, model: str) -> int:
    """On the loop, with nothing in flight: publish what is pending; the newest seq."""
    publisher = srv.server.kv_events.publishers[model]

    def newest() -> int:
        publisher.flush()
        return publisher.next_seq - 1
    return srv.run(newest)


class Worker:
    """gRPC calls as a worker makes them: match with allocation, then insert."""

    def __init__(self, srv: ServerThread) -> None:
        self.channel, self.stub = stub_for(srv.address)
        self.session = self.stub.OpenSession(pb.OpenSessionRequest()).session_id

    def insert(self, model: str, tokens: list[int], extra_key: str | None = None,
               width: int = 1) -> None:
        ns = {} if extra_key is None else {"extra_key": extra_key}
        packed = toks(tokens)
        m = self.stub.Match(pb.MatchRequest(model=model, token_ids=packed, token_width=width,
                                            session_id=self.session, allocate=True, **ns))
        self.stub.Insert(pb.InsertRequest(model=model, token_ids=packed, token_width=width,
                                          slot_indices=m.slot_indices + m.allocated_slots,
                                          session_id=self.session, **ns))

    def match(self, model: str, tokens: list[int], extra_key: str | None = None,
              width: int = 1) -> None:
        ns = {} if extra_key is None else {"extra_key": extra_key}
        self.stub.Match(pb.MatchRequest(model=model, token_ids=toks(tokens), token_width=width,
                                        **ns))

    def close(self) -> None:
        self.channel.close()


def random_step(worker: Worker, rng: random.Random, prefixes: list[list[int]]) -> None:
    model = rng.choice(["r", "r", "w"])
    op = rng.random()
    width = 2 if model == "r" and rng.random() < 0.2 else 1
    tokens = rng.choice(prefixes) + [rng.randrange(6) for _ in range(rng.randrange(0, 9))]
    tokens = tokens[: len(tokens) // width * width]
    extra_key = rng.choice([None, None, "a", "lora-b"])
    if op < 0.55:
        worker.insert(model, tokens, extra_key, width)
    elif op < 0.8:
        worker.match(model, tokens, extra_key, width)  # may split: no event
    elif op < 0.97:
        swa = rng.randrange(0, 6) if model == "w" else 0
        worker.stub.Evict(pb.EvictRequest(model=model, num_tokens=rng.randrange(0, 10),
                                          swa_num_tokens=swa))
    else:
        worker.stub.Reset(pb.ResetRequest(model=model))


# --------------------------------------------------------------------- tests


def test_page_hashes_are_the_spec_chains_in_both_formats() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7]
    prior = None
    for i, (hex_hash, int64) in enumerate(VECTORS):
        prior = hash_token_ids(tokens[2 * i:2 * i + 2], prior)
        assert prior == hex_hash
        assert wire(prior, "sglang") == int64
        assert wire(prior, "vllm") == int.from_bytes(bytes.fromhex(hex_hash)[24:], "big")


@pytest.mark.parametrize(("encoding", "hash_format"), [("map", "vllm"), ("array", "sglang")])
def test_events_rebuild_the_tree_under_a_random_workload(
        tmp_path: Path, ctx: zmq.Context, encoding: str, hash_format: str) -> None:
    srv = start(tmp_path, encoding=encoding, hash_format=hash_format)
    publishers = srv.server.kv_events.publishers
    subs = {m: Subscriber(ctx, p.endpoint, p.replay_endpoint) for m, p in publishers.items()}
    worker = Worker(srv)
    try:
        time.sleep(0.3)  # the SUBs' subscriptions reach the server
        rng = random.Random(f"{encoding}-{hash_format}")
        prefixes = [[rng.randrange(6) for _ in range(rng.randrange(2, 7))] for _ in range(3)]
        replicas = {m: Replica() for m in subs}
        for model, sub in subs.items():  # the first batch predates the SUB: replay it
            (first,) = sub.replay(0)[:1]
            replicas[model].apply(decode_batch(first[1], encoding, hash_format)[1])
        seen = dict.fromkeys(subs, 0)
        for round_ in range(8):
            for _ in range(12):
                random_step(worker, rng, prefixes)
            if round_ == 4:
                worker.stub.Reset(pb.ResetRequest(model=rng.choice(sorted(subs))))
            for model, sub in subs.items():  # a quiet point
                newest = quiet_seq(srv, model)
                batches = sub.until(newest)
                for topic, seq, payload in batches[seen[model]:]:
                    assert topic == publishers[model].topic.encode()
                    assert seq == seen[model] + 1, "a seq gap"  # 0 came by replay
                    replicas[model].apply(decode_batch(payload, encoding, hash_format)[1])
                    seen[model] = seq
                expected = srv.run(lambda m=model: expected_pages(
                    srv.service.engines[m].cache, hash_format))
                assert replicas[model].pages == expected, (model, round_)
        for model, replica in replicas.items():  # the workload did exercise every event
            assert len(replica.kinds) == 3, \
                (model, replica.kinds)
        # Replay from any seq returns exactly the batches from there.
        sub = subs["r"]
        live = {seq: payload for _, seq, payload in sub.received}
        newest = max(live)
        for start_seq in sorted({1, newest // 2, newest, newest + 5, min(live)}):
            answer = sub.replay(start_seq)
            assert [s for s, _ in answer] == list(range(start_seq, newest + 1))
            assert all(live[s] == payload for s, payload in answer)
    finally:
        worker.close()
        for sub in subs.values():
            sub.close()
        srv.stop()


def test_a_late_subscriber_converges_by_replay_and_reset_clears(
        tmp_path: Path, ctx: zmq.Context) -> None:
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
        (_, seq, payload), = late.until(quiet_seq(srv, "r"))[-1:]
        assert seq == applied + 1
        _, events = decode_batch(payload, "map", "vllm")
        assert [e.kind for e in events] == ["AllBlocksCleared"]
        late.close()
    finally:
        worker.close()
        srv.stop()


def test_a_subscriber_behind_the_buffer_gets_the_state(tmp_path: Path,
                                                       ctx: zmq.Context) -> None:
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


def test_namespaces_never_share_hashes_and_map_to_lora_name(tmp_path: Path,
                                                            ctx: zmq.Context) -> None:
    srv = start(tmp_path, models=MODELS[:1])
    worker = Worker(srv)
    publisher = srv.server.kv_events.publishers["r"]
    try:
        sub = Subscriber(ctx, publisher.endpoint, publisher.replay_endpoint)
        time.sleep(0.3)
        tokens = [1, 2, 3, 4]
        for extra_key in (None, "a", ""):
            worker.insert("r", tokens, extra_key)
        worker.insert("r", [1, 2, 3, 4, 5, 6, 7, 8], None, width=2)
        stored = [e for _, _, p in sub.until(quiet_seq(srv, "r"))
                  for e in decode_batch(p, "map", "vllm")[1] if e.kind == "BlockStored"]
        assert [e.fields["lora_name"] for e in stored] == [None, "a", "", None]
        hashes = [tuple(e.fields["block_hashes"]) for e in stored]
        assert len(set(hashes)) == 4
        assert all(e.fields["token_ids"][:4] == tokens for e in stored)
        assert stored[0].fields["block_hashes"] == [wire(VECTORS[0][0], "vllm"),
                                                    wire(hash_token_ids([3, 4], VECTORS[0][0]),
                                                         "vllm")]
        # A named namespace is chained as SGLang chains a request salted with its key.
        salted = hash_token_ids([1, 2], seed("a", 1))
        assert stored[1].fields["block_hashes"][0] == wire(salted, "vllm")
        # No extra_keys anywhere (llm-d would read a string there as a multimodal hash).
        assert all("extra_keys" not in e.fields for e in stored)
        sub.close()
    finally:
        worker.close()
        srv.stop()


def test_a_subscriber_that_never_reads_costs_dropped_batches_not_waiting(
        tmp_path: Path, ctx: zmq.Context) -> None:
    models = (ModelConfig(name="r", page_size=16, pool=PoolConfig(size=8192, k_heads=1,
                                                                  k_head_dim=4)),)
    srv = start(tmp_path, models=models, hwm=1, endpoint=f"ipc://{tmp_path}/ev",
                replay_endpoint=f"ipc://{tmp_path}/replay")
    worker = Worker(srv)
    publisher = srv.server.kv_events.publishers["r"]
    stuck = ctx.socket(zmq.SUB)
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt(zmq.RCVBUF, 4096)
    stuck.setsockopt(zmq.LINGER, 0)
    stuck.connect(publisher.endpoint)
    stuck.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        time.sleep(0.3)
        rng = random.Random(3)
        for _ in range(400):
            worker.insert("r", [rng.randrange(50000) for _ in range(4096)])
            worker.stub.Evict(pb.EvictRequest(model="r", num_tokens=4096))
            if publisher.batches_dropped:
                break
        quiet_seq(srv, "r")
        assert publisher.batches_dropped > 0
        registry = srv.server.metrics.registry
        sample = registry.get_sample_value
        assert sample("prefixcache_kv_event_batches_dropped_total", {"model": "r"}) == \
            publisher.batches_dropped
        assert sample("prefixcache_kv_event_batches_published_total", {"model": "r"}) == \
            publisher.batches_published
        assert publisher.batches_published + publisher.batches_dropped == publisher.next_seq
        assert sample("prefixcache_kv_events_published_total", {"model": "r"}) >= \
            publisher.batches_published
        # Dropped batches stay replayable.
        replayer = Subscriber(ctx, publisher.endpoint, publisher.replay_endpoint)
        newest = publisher.next_seq - 1
        assert [s for s, _ in replayer.replay(newest - 2)] == [newest - 2, newest - 1, newest]
        replayer.close()
        assert sample("prefixcache_kv_event_replays_total", {"model": "r"}) == 1
    finally:
        stuck.close()
        worker.close()
        srv.stop()


def test_models_get_their_own_ports_and_the_slot_kind_publishes_nothing(
        tmp_path: Path) -> None:
    assert endpoint_for("tcp://*:5557", 0) == "tcp://*:5557"
    assert endpoint_for("tcp://*:5557", 2) == "tcp://*:5559"
    assert endpoint_for("tcp://10.0.0.1:6000", 1) == "tcp://10.0.0.1:6001"
    assert endpoint_for("ipc:///run/ev", 1) == "ipc:///run/ev_1"
    assert endpoint_for("tcp://127.0.0.1:*", 3) == "tcp://127.0.0.1:*"
    models = (*MODELS, ModelConfig(name="s", kind="slot", max_seq_len=8,
                                   pool=PoolConfig(size=2, k_heads=1, k_head_dim=2)))
    srv = start(tmp_path, models=models, endpoint=f"ipc://{tmp_path}/ev",
                replay_endpoint=None, topic="kv@{host}@{model}-x")
    try:
        publishers = srv.server.kv_events.publishers
        assert sorted(publishers) == ["r", "w"]
        assert publishers["r"].endpoint == f"ipc://{tmp_path}/ev"
        assert publishers["w"].endpoint == f"ipc://{tmp_path}/ev_1"
        assert publishers["w"].topic.endswith("@w-x") and publishers["w"].replay_endpoint is None
    finally:
        srv.stop()


def test_off_by_default_and_configured_like_the_other_keys(tmp_path: Path) -> None:
    cfg = load_config(env={})
    assert not cfg.server.kv_events.enable_kv_cache_events
    assert cfg.server.kv_events.endpoint == "tcp://*:5557"
    (tmp_path / "c.yaml").write_text(
        "server:\n  kv_events:\n    enable_kv_cache_events: true\n    hwm: 7\n"
        "    encoding: array\n")
    cfg = load_config(tmp_path / "c.yaml",
                      env={"PREFIXCACHE_KV_EVENTS_HASH_FORMAT": "sglang",
                           "PREFIXCACHE_KV_EVENTS_HWM": "8"},
                      overrides={"kv_events": '{"topic": "kv@pod:8000@m", "hwm": 9}'})
    kv = cfg.server.kv_events
    assert (kv.enable_kv_cache_events, kv.encoding, kv.hash_format, kv.topic, kv.hwm) == \
        (True, "array", "sglang", "kv@pod:8000@m", 9)
    srv = ServerThread(make_config(tmp_path, MODELS[:1]))
    try:
        assert srv.server.kv_events is None
    finally:
        srv.stop()


@pytest.mark.parametrize(("env", "message"), [
    ({"PREFIXCACHE_KV_EVENTS_ENCODING": "json"}, "encoding"),
    ({"PREFIXCACHE_KV_EVENTS_ENDPOINT": "http://x:1"}, "endpoint"),
    ({"PREFIXCACHE_KV_EVENTS_BUFFER_STEPS": "0"}, "buffer_steps"),
    ({"PREFIXCACHE_KV_EVENTS": "{nope"}, "PREFIXCACHE_KV_EVENTS"),
    ({"PREFIXCACHE_KV_EVENTS": '{"enable": true}'}, "enable"),
])
def test_bad_settings_name_their_key(env: dict[str, str], message: str) -> None:
    from prefixcache.server.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config(env=env)


def test_endpoints_that_collide_or_cannot_bind_fail_the_start(tmp_path: Path,
                                                              ctx: zmq.Context) -> None:
    from prefixcache.server.app import PrefixCacheServer
    from prefixcache.server.config import ConfigError

    # Two models: model 1's events port would be model 0's replay port.
    overlap = make_config(tmp_path, MODELS, kv_events=KvEventsConfig(
        enable_kv_cache_events=True, endpoint="tcp://*:47001",
        replay_endpoint="tcp://*:47002"))
    with pytest.raises(ConfigError, match="more ports apart than there are models"):
        asyncio.run(PrefixCacheServer(overlap).start())
    busy = ctx.socket(zmq.PUB)
    port = busy.bind_to_random_port("tcp://*")
    try:
        taken = make_config(tmp_path, MODELS[:1], kv_events=KvEventsConfig(
            enable_kv_cache_events=True, endpoint=f"tcp://*:{port}"))
        with pytest.raises(ConfigError, match=r"server\.kv_events\.endpoint"):
            asyncio.run(PrefixCacheServer(taken).start())
        assert not (tmp_path / "pc.sock").exists()  # the failed start left nothing
    finally:
        busy.close()


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


def test_the_changes_of_one_call_go_out_as_one_batch(tmp_path: Path, ctx: zmq.Context) -> None:
    srv = start(tmp_path, models=MODELS[:1])  # 96 slots, page 2
    worker = Worker(srv)
    publisher = srv.server.kv_events.publishers["r"]
    try:
        sub = Subscriber(ctx, publisher.endpoint, publisher.replay_endpoint)
        time.sleep(0.3)
        for i in range(4):
            worker.insert("r", [100 * i + t for t in range(20)])
        before = quiet_seq(srv, "r")
        # Room for 60 new tokens means evicting three of the four sequences, in one call.
        worker.stub.Match(pb.MatchRequest(model="r", token_ids=toks(range(1000, 1060)),
                                          session_id=worker.session, allocate=True))
        newest = quiet_seq(srv, "r")
        assert newest == before + 1
        (_, seq, payload), = sub.until(newest)[-1:]
        assert seq == newest
        _, events = decode_batch(payload, "map", "vllm")
        assert [e.kind for e in events] == ["BlockRemoved"] * 3
        sub.close()
    finally:
        worker.close()
        srv.stop()
