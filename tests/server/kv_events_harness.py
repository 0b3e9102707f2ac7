"""KV events tests' shared parts: the published layout, a strict decoder, a replica
rebuilt from events, the tree's pages hashed independently, and the plumbing (a SUB plus
a DEALER for replays, a server publishing, a worker making gRPC calls).

Used by test_kv_events.py, test_kv_events_replay.py and test_kv_events_config.py.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import zmq
from harness import ServerThread, make_config, pb, stub_for, toks

from prefixcache.cache import hash_to_int64, hash_token_ids
from prefixcache.server.config import KvEventsConfig, ModelConfig, PoolConfig
from prefixcache.server.events.publisher import END_SEQ

# When this module was loaded: before any batch its tests decode was published.
LOADED_AT = time.time()
POOL = PoolConfig(size=96, k_heads=1, k_head_dim=4)
MODELS = (
    ModelConfig(name="r", page_size=2, pool=POOL),
    ModelConfig(name="w", kind="swa", page_size=1, sliding_window_size=3, pool=POOL),
)
# The published field order: vLLM's BlockStored/BlockRemoved (SGLang's is a prefix of it).
FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
HASH_RANGE = {"vllm": (0, 2**64 - 1), "sglang": (-(2**63), 2**63 - 1)}
# The test vectors of docs/semantics.md: [1,2] -> [3,4] -> [5,6], chained.
VECTORS = [
    ("34fb5c825de7ca4aea6e712f19d439c1da0c92c37b423936c5f618545ca4fa1f", 3817746824117602890),
    ("c57b445f90651b9a650e516ab2238c965b21af35608a31c303e6d9e407f2915c", -4216701448867210342),
    ("4a8a26efbf98ddb0eca98c8913c209b45b7241fb0ccbdb559f74dafba44b7c60", 5371148316746243504),
]


def wire(hex_hash: str, hash_format: str) -> int:
    """What each engine publishes for a page hash, computed here from the hex digest."""
    if hash_format == "sglang":
        return hash_to_int64(hex_hash)
    return int(hex_hash[-16:], 16)


def seed(extra_key: str | None, width: int) -> str | None:
    """The chain seed our format documents for a namespace (events/wire.py)."""
    if width == 1:
        if extra_key is None:
            return None
        return hashlib.sha256(b"sglang-cache-salt-v1\0" + extra_key.encode()).hexdigest()
    key = b"\0" if extra_key is None else b"\1" + extra_key.encode()
    return hashlib.sha256(
        b"prefixcache-namespace-v1\0" + width.to_bytes(4, "little") + key
    ).hexdigest()


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
    # Wall-clock seconds of publishing: after this module was loaded, not in the future.
    assert isinstance(ts, float) and LOADED_AT <= ts <= time.time(), ts
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
                    self.pages[h] = (
                        parent,
                        tuple(f["token_ids"][i * per : (i + 1) * per]),
                        f["lora_name"],
                    )
                    parent = h


def expected_pages(
    cache: Any, hash_format: str
) -> dict[int, tuple[int | None, tuple[int, ...], str | None]]:
    """The tree's pages as the events must describe them, hashed here."""
    out = {}
    for (extra_key, width), ns_root in cache.root_node.children.items():
        stack = [(child, seed(extra_key, width), None) for child in ns_root.children.values()]
        while stack:
            node, prior, parent = stack.pop()
            flat = memoryview(node.key_bytes).cast("I").tolist()
            step = width * cache.page_size
            for i in range(0, len(flat), step):
                page = flat[i : i + step]
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


def start(tmp: Path, models: tuple[ModelConfig, ...] = MODELS, **kv: Any) -> ServerThread:
    settings = {
        "enable_kv_cache_events": True,
        "endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*",
        **kv,
    }
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

    def insert(
        self, model: str, tokens: list[int], extra_key: str | None = None, width: int = 1
    ) -> None:
        ns = {} if extra_key is None else {"extra_key": extra_key}
        packed = toks(tokens)
        m = self.stub.Match(
            pb.MatchRequest(
                model=model,
                token_ids=packed,
                token_width=width,
                session_id=self.session,
                allocate=True,
                **ns,
            )
        )
        self.stub.Insert(
            pb.InsertRequest(
                model=model,
                token_ids=packed,
                token_width=width,
                slot_indices=m.slot_indices + m.allocated_slots,
                session_id=self.session,
                **ns,
            )
        )

    def match(
        self, model: str, tokens: list[int], extra_key: str | None = None, width: int = 1
    ) -> None:
        ns = {} if extra_key is None else {"extra_key": extra_key}
        self.stub.Match(
            pb.MatchRequest(model=model, token_ids=toks(tokens), token_width=width, **ns)
        )

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
        worker.stub.Evict(
            pb.EvictRequest(model=model, num_tokens=rng.randrange(0, 10), swa_num_tokens=swa)
        )
    else:
        worker.stub.Reset(pb.ResetRequest(model=model))
