"""Adversarial requests against a real server: no crash, only documented codes, no harm.

A server with one model of every cache kind runs in-process on a unix socket, with a
session that holds real state (cached prefixes, locks, slots, state slots). Hypothesis
builds malformed and adversarial versions of every request message, mixing the live ids
of that state with garbage (odd-length token bytes, tokens out of the vocabulary, width
mismatches, huge and negative numbers, unknown models, nodes, locks and sessions,
unbalanced unlocks, double frees, oversized messages), and also sends raw random bytes to
every method. For each case:

* the answer is OK or a status code the proto documents for client mistakes (never
  INTERNAL or UNKNOWN, and the server stays up);
* a refused call leaves every model's Stats exactly as they were, and the integrity
  check holds after every case (the server also runs it after every mutating call).

The default run is a few hundred cases; the long run (>= 10,000 cases) is marked slow
and needs PREFIXCACHE_SLOW=1 (PREFIXCACHE_FUZZ_CASES sets its size):

    PREFIXCACHE_SLOW=1 python -m pytest -m slow -s tests/reliability/test_fuzz.py
"""

from __future__ import annotations

import os
import queue
import struct
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from harness import EVERY_KIND, pack_slots, pb, running, slots, stub_for, toks
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

MODELS = EVERY_KIND
NAMES = [m.name for m in MODELS]
MAX_MESSAGE = 64 * 1024
CODE = grpc.StatusCode
# What the proto documents for a request the service refuses (no auth is configured and
# the server is not draining, so UNAUTHENTICATED, PERMISSION_DENIED, UNAVAILABLE would be
# wrong answers here too).
ALLOWED = {CODE.INVALID_ARGUMENT, CODE.NOT_FOUND, CODE.FAILED_PRECONDITION,
           CODE.RESOURCE_EXHAUSTED}
ALLOWED_VALUES = {c.value[0] for c in ALLOWED}
SERVICE = "/prefixcache.v1.PrefixCache/"
UNARY = ("ListModels", "DescribePool", "Stats", "OpenSession", "KeepAlive", "CloseSession",
         "Match", "Insert", "Evict", "Lock", "Unlock", "Alloc", "Free", "Reset")
# Rebuild the world's state this often, so the fuzzer keeps meeting live ids.
REBUILD_EVERY = 150
TIMEOUT = 20.0

LONG = pytest.mark.skipif(not os.environ.get("PREFIXCACHE_SLOW"),
                          reason="set PREFIXCACHE_SLOW=1 for the long fuzz run")


# ------------------------------------------------------------------- the world


class World:
    """The server, the live ids the fuzzer mixes in, and the Stats baseline."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.channel, self.stub = stub_for(server.address)
        self.cases = 0
        self.since_rebuild = 0
        self.sessions: list[str] = []
        self.dead: list[str] = []
        self.locks: list[int] = []
        self.nodes: list[int] = []
        self.held: dict[str, list[int]] = {}
        self.tree: dict[str, list[int]] = {}
        self.states: list[int] = []
        self.versions: list[int] = []
        self.seqs: dict[str, list[list[int]]] = {}
        self.baseline: pb.StatsResponse | None = None
        self.history: list[str] = []
        self.rebuild()

    # -- state

    def rebuild(self) -> None:
        """Close every session, reset every model, and build fresh state."""
        for sid in self.sessions:
            try:
                self.stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=TIMEOUT)
            except grpc.RpcError as err:
                assert err.code() == CODE.NOT_FOUND, err
            self.dead.append(sid)
        self.dead = self.dead[-8:]
        for name in NAMES:
            self.stub.Reset(pb.ResetRequest(model=name), timeout=TIMEOUT)
        self.sessions, self.locks, self.nodes, self.states, self.versions = [], [], [], [], []
        self.held = {n: [] for n in NAMES}
        self.tree = {n: [] for n in NAMES}
        self.seqs = {n: [] for n in NAMES}
        sid = self.open_session()
        for name in ("m", "p", "w", "c", "h"):
            base = [7, 8, 9, 10, 11, 12, 13, 14]
            for tail in ([1, 2], [3, 4, 5, 6], []):
                self.prefill(sid, name, base + tail, keep_lock=tail == [3, 4, 5, 6])
            # A locked match with slots left allocated (held by the session).
            m = self.stub.Match(pb.MatchRequest(model=name, token_ids=toks([*base, 40, 41]),
                                                session_id=sid, lock=True, allocate=True),
                                timeout=TIMEOUT)
            self.learn_match(name, m)
            a = self.stub.Alloc(pb.AllocRequest(model=name, num_slots=3, session_id=sid,
                                                num_state_slots=1 if name == "h" else 0),
                                timeout=TIMEOUT)
            self.learn_alloc(name, a)
        # The slot model: one cached sequence in a slot the session keeps, pinned.
        m = self.stub.Match(pb.MatchRequest(model="s", token_ids=toks([5, 6, 7]),
                                            session_id=sid, allocate=True), timeout=TIMEOUT)
        self.learn_match("s", m)
        ins = self.stub.Insert(pb.InsertRequest(
            model="s", token_ids=toks([5, 6, 7]), slot_indices=m.allocated_slots,
            slot_version=m.allocated_slot_version, session_id=sid, lock=True), timeout=TIMEOUT)
        self.learn_insert("s", ins)
        self.seqs["s"].append([5, 6, 7])
        # And one in a slot its owner freed: a locking, allocating match reuses it in place.
        m = self.stub.Match(pb.MatchRequest(model="s", token_ids=toks([8, 9, 10, 11]),
                                            session_id=sid, allocate=True), timeout=TIMEOUT)
        self.stub.Insert(pb.InsertRequest(
            model="s", token_ids=toks([8, 9, 10, 11]), slot_indices=m.allocated_slots,
            slot_version=m.allocated_slot_version, session_id=sid), timeout=TIMEOUT)
        self.stub.Free(pb.FreeRequest(model="s", slot_indices=m.allocated_slots,
                                      session_id=sid), timeout=TIMEOUT)
        self.seqs["s"].append([8, 9, 10, 11])
        self.learn_alloc("s", self.stub.Alloc(pb.AllocRequest(model="s", num_slots=1,
                                                              session_id=sid), timeout=TIMEOUT))
        self.since_rebuild = 0
        self.server.check_integrity()
        self.baseline = self.stats()

    def open_session(self) -> str:
        sid = self.stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=600),
                                    timeout=TIMEOUT).session_id
        self.sessions.append(sid)
        return sid

    def prefill(self, sid: str, model: str, tokens: list[int], keep_lock: bool) -> None:
        m = self.stub.Match(pb.MatchRequest(model=model, token_ids=toks(tokens),
                                            session_id=sid, lock=True, allocate=True),
                            timeout=TIMEOUT)
        self.learn_match(model, m)
        req = pb.InsertRequest(model=model, token_ids=toks(tokens), session_id=sid,
                               lock=keep_lock, slot_indices=m.slot_indices + m.allocated_slots,
                               release_lock_id=m.lock_id)
        if m.HasField("allocated_state_slot"):
            req.state_slot = m.allocated_state_slot
        self.learn_insert(model, self.stub.Insert(req, timeout=TIMEOUT))
        self.seqs[model].append(tokens)
        if model != "c":
            got = self.stub.Match(pb.MatchRequest(model=model, token_ids=toks(tokens)),
                                  timeout=TIMEOUT)
            self.learn_match(model, got)

    def learn_match(self, model: str, m: pb.MatchResponse) -> None:
        self.tree[model] = sorted(set(self.tree[model]) | set(slots(m.slot_indices)))[-64:]
        self.held[model] += slots(m.allocated_slots)
        self.locks += [m.lock_id] if m.lock_id else []
        self.nodes += [m.node_id] if m.node_id else []
        for field in ("state_slot", "allocated_state_slot"):
            if m.HasField(field):
                self.states.append(getattr(m, field))
        for field in ("slot_version", "allocated_slot_version"):
            if m.HasField(field):
                self.versions.append(getattr(m, field))

    def learn_insert(self, model: str, ins: pb.InsertResponse) -> None:
        self.locks += [ins.lock_id] if ins.lock_id else []
        self.nodes += [ins.node_id] if ins.node_id else []

    def learn_alloc(self, model: str, a: pb.AllocResponse) -> None:
        self.held[model] += slots(a.slot_indices)
        self.states += slots(a.state_slots)
        self.versions += slots(a.slot_versions)

    def learn(self, method: str, request: Any, reply: Any) -> None:
        """Keep the ids an accepted call handed out, for later cases to name."""
        model = getattr(request, "model", "")
        if method == "OpenSession":
            self.sessions.append(reply.session_id)
        elif method == "CloseSession":
            if request.session_id in self.sessions:
                self.sessions.remove(request.session_id)
            self.dead = [*self.dead[-7:], request.session_id]
        elif model in NAMES and method == "Match":
            self.learn_match(model, reply)
        elif model in NAMES and method == "Insert":
            self.learn_insert(model, reply)
        elif model in NAMES and method == "Alloc":
            self.learn_alloc(model, reply)
        elif method == "Lock" and reply.lock_id:
            self.locks.append(reply.lock_id)
        for name in ("locks", "nodes", "states", "versions"):
            setattr(self, name, getattr(self, name)[-64:])
        for name in NAMES:
            self.held[name] = self.held[name][-64:]

    # -- checks

    def stats(self) -> pb.StatsResponse:
        return self.stub.Stats(pb.StatsRequest(), timeout=TIMEOUT)

    def settle(self, what: str, code: grpc.StatusCode, detail: str = "") -> None:
        """After one case: the code is allowed, a refusal changed nothing, and the
        cache passes its integrity check."""
        self.cases += 1
        self.since_rebuild += 1
        assert code == CODE.OK or code in ALLOWED, f"{what}: {code} {detail}"
        after = self.stats()
        if code != CODE.OK:
            assert after == self.baseline, (
                f"{what} was refused ({code}: {detail}) but changed Stats; the cases "
                f"before it: {self.history}")
        self.history = [*self.history[-2:], f"{what[:600]} -> {code.name}"]
        self.server.check_integrity()
        self.baseline = after

    def maybe_rebuild(self) -> None:
        if self.since_rebuild >= REBUILD_EVERY:
            self.rebuild()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with running(tmp_path_factory.mktemp("fuzz"), MODELS, max_message_bytes=MAX_MESSAGE,
                 session_ttl=600, session_ttl_min=300, session_ttl_max=3600) as server:
        w = World(server)
        yield w
        w.channel.close()


# ------------------------------------------------------------------ strategies

EDGES = (0, 1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 63, 64, 65, 255, 256, 257, 1000, 1024,
         2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53, 2**63 - 1, 2**63, 2**64 - 1)
U64 = st.one_of(st.integers(0, 300), st.sampled_from(EDGES), st.integers(0, 2**64 - 1))
U32 = st.one_of(st.integers(0, 300), st.sampled_from([e for e in EDGES if e < 2**32]),
                st.integers(0, 2**32 - 1))
I64 = st.one_of(st.integers(-3, 300),
                st.sampled_from([-(2**63), -(2**31), -1, *[e for e in EDGES if e < 2**63]]),
                st.integers(-(2**63), 2**63 - 1))
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
MODEL = st.one_of(st.sampled_from(NAMES), st.sampled_from(NAMES),
                  st.sampled_from(["", "nope", "M", " m", "m\x00", "é", "x" * 300]), TEXT)
WIDTH = st.one_of(st.sampled_from([0, 0, 0, 1, 2, 3, 8, 9, 16]), U32)
# Bigger than max_message_bytes once framed: RESOURCE_EXHAUSTED from gRPC itself.
HUGE = b"\x01\x00\x00\x00" * (MAX_MESSAGE // 4 + 16)


# Draws never depend on the world's state (hypothesis requires the same choices to give
# the same draws): a live id is drawn as an index, and its fallback is always drawn too.
INDEX = st.integers(0, 2**16)


def _pick(draw: Any, items: list[Any], fallback: st.SearchStrategy[Any]) -> Any:
    i, other = draw(INDEX), draw(fallback)
    return items[i % len(items)] if items else other


def _picks(draw: Any, items: list[Any], max_size: int) -> list[Any]:
    chosen = draw(st.lists(INDEX, max_size=max_size))
    return [items[i % len(items)] for i in chosen] if items else []


def token_bytes(draw: Any, world: World, model: str) -> bytes:
    kind = draw(st.integers(0, 9))
    seqs = world.seqs.get(model) or world.seqs["m"]
    if kind <= 3:  # a cached sequence, cut and maybe extended
        seq = _pick(draw, seqs, st.just([1, 2, 3]))
        cut = draw(st.integers(0, len(seq)))
        tail = draw(st.lists(st.integers(0, 50), max_size=6))
        return toks(seq[:cut] + tail)
    if kind <= 5:
        return toks(draw(st.lists(st.integers(0, 60), max_size=24)))
    if kind == 6:  # ids out of any vocabulary
        return toks(draw(st.lists(st.integers(0, 2**32 - 1), max_size=8)))
    if kind == 7:
        return draw(st.binary(max_size=41))  # often not a multiple of 4
    if kind == 8:
        return toks(draw(st.lists(st.integers(0, 60), min_size=40, max_size=300)))
    return HUGE if draw(st.integers(0, 20)) == 0 else b""


def slot_bytes(draw: Any, world: World, model: str, *, states: bool = False) -> bytes:
    live = world.states if states else world.held.get(model, []) + world.tree.get(model, [])
    kind = draw(st.integers(0, 7))
    if kind <= 1:  # live slots, maybe repeated (double free, named twice)
        return pack_slots(_picks(draw, live, 8))
    if kind == 2:  # every held slot, in order: a valid free (then a double free)
        return pack_slots(world.states if states else world.held.get(model, []))
    if kind <= 4:
        return pack_slots(draw(st.lists(I64, max_size=8)))
    if kind == 5:
        return draw(st.binary(max_size=25))
    if kind == 6:
        return struct.pack("<q", draw(I64)) * draw(st.integers(1, 3))
    return b""


def session_id(draw: Any, world: World) -> str:
    kind = draw(st.integers(0, 9))
    if kind <= 5:
        return _pick(draw, world.sessions, st.just(""))
    if kind == 6:
        return _pick(draw, world.dead, st.just("0" * 32))
    if kind == 7:
        return ""
    if kind == 8:
        return draw(st.binary(min_size=16, max_size=16)).hex()
    return draw(TEXT)


def lock_id(draw: Any, world: World) -> int:
    return _pick(draw, world.locks, U64) if draw(st.integers(0, 2)) else draw(U64)


def node_id(draw: Any, world: World) -> int:
    return _pick(draw, world.nodes, U64) if draw(st.booleans()) else draw(U64)


def state_slot(draw: Any, world: World) -> int:
    return _pick(draw, world.states, I64) if draw(st.booleans()) else draw(I64)


def _extra(draw: Any) -> dict[str, Any]:
    return {"extra_key": draw(st.sampled_from(["", "lora", "x" * 40]))} \
        if draw(st.integers(0, 4)) == 0 else {}


def match_request(draw: Any, world: World) -> pb.MatchRequest:
    model = draw(MODEL)
    return pb.MatchRequest(
        model=model, token_ids=token_bytes(draw, world, model),
        token_width=draw(WIDTH) if draw(st.integers(0, 3)) == 0 else 0,
        session_id=session_id(draw, world), lock=draw(st.booleans()),
        allocate=draw(st.booleans()), request_id=draw(st.sampled_from([0, 0, 1, 2**64 - 1])),
        **_extra(draw))


def insert_request(draw: Any, world: World) -> pb.InsertRequest:
    model = draw(MODEL)
    tokens = token_bytes(draw, world, model)
    if draw(st.booleans()) and model in NAMES:  # slots that line up with the tokens
        n = len(tokens) // 4
        pool = world.tree.get(model, [])[:n] + world.held.get(model, [])
        slot_data = pack_slots((pool + [1] * n)[:n]) if n else b""
    else:
        slot_data = slot_bytes(draw, world, model)
    req = pb.InsertRequest(
        model=model, token_ids=tokens, slot_indices=slot_data,
        token_width=draw(WIDTH) if draw(st.integers(0, 3)) == 0 else 0,
        session_id=session_id(draw, world), lock=draw(st.booleans()),
        release_lock_id=lock_id(draw, world) if draw(st.booleans()) else 0,
        request_id=draw(st.sampled_from([0, 0, 3])),
        slot_version=_pick(draw, world.versions, U64) if draw(st.booleans()) else draw(U64),
        **_extra(draw))
    if draw(st.booleans()):
        req.state_slot = state_slot(draw, world)
    return req


def evict_request(draw: Any, world: World) -> pb.EvictRequest:
    return pb.EvictRequest(model=draw(MODEL), num_tokens=draw(U64),
                           swa_num_tokens=draw(U64), mamba_num=draw(U64))


def lock_request(draw: Any, world: World) -> pb.LockRequest:
    return pb.LockRequest(model=draw(MODEL), node_id=node_id(draw, world),
                          session_id=session_id(draw, world),
                          request_id=draw(st.sampled_from([0, 0, 5])))


def unlock_request(draw: Any, world: World) -> pb.UnlockRequest:
    return pb.UnlockRequest(lock_id=lock_id(draw, world), session_id=session_id(draw, world),
                            request_id=draw(st.sampled_from([0, 0, 6])))


def alloc_request(draw: Any, world: World) -> pb.AllocRequest:
    return pb.AllocRequest(model=draw(MODEL), num_slots=draw(U64),
                           session_id=session_id(draw, world), num_state_slots=draw(U32))


def free_request(draw: Any, world: World) -> pb.FreeRequest:
    model = draw(MODEL)
    return pb.FreeRequest(model=model, slot_indices=slot_bytes(draw, world, model),
                          session_id=session_id(draw, world),
                          state_slots=slot_bytes(draw, world, model, states=True)
                          if draw(st.booleans()) else b"")


def stats_request(draw: Any, world: World) -> pb.StatsRequest:
    return pb.StatsRequest(model=draw(MODEL))


STREAM_OPS = {"match": match_request, "insert": insert_request, "evict": evict_request,
              "lock": lock_request, "unlock": unlock_request, "alloc": alloc_request,
              "free": free_request, "stats": stats_request}
UNARY_BUILDERS = {
    "Match": match_request, "Insert": insert_request, "Evict": evict_request,
    "Lock": lock_request, "Unlock": unlock_request, "Alloc": alloc_request,
    "Free": free_request, "Stats": stats_request,
    "DescribePool": lambda draw, w: pb.DescribePoolRequest(model=draw(MODEL)),
    "ListModels": lambda draw, w: pb.ListModelsRequest(),
    "OpenSession": lambda draw, w: pb.OpenSessionRequest(
        ttl_seconds=draw(st.floats(allow_nan=True, allow_infinity=True)),
        client_name=draw(TEXT)),
    "KeepAlive": lambda draw, w: pb.KeepAliveRequest(session_id=session_id(draw, w)),
    "CloseSession": lambda draw, w: pb.CloseSessionRequest(session_id=session_id(draw, w)),
    # Reset of a live model is allowed (no admin token here) and re-baselines.
    "Reset": lambda draw, w: pb.ResetRequest(
        model=draw(MODEL) if draw(st.integers(0, 9)) == 0 else draw(TEXT)),
}


def read_request(draw: Any, world: World) -> pb.ReadKVRequest:
    model = draw(MODEL)
    return pb.ReadKVRequest(
        model=model, slot_indices=slot_bytes(draw, world, model),
        layers=draw(st.lists(st.one_of(st.integers(0, 3), U32), max_size=4)),
        state_slots=slot_bytes(draw, world, model, states=True) if draw(st.booleans()) else b"",
        max_chunk_bytes=draw(U64), session_id=session_id(draw, world))


def write_chunks(draw: Any, world: World) -> list[pb.KVChunk]:
    model = draw(MODEL)
    chunks = []
    if draw(st.integers(0, 5)):
        header = pb.WriteKVHeader(
            model=model, slot_indices=slot_bytes(draw, world, model),
            layers=draw(st.lists(st.one_of(st.integers(0, 2), U32), max_size=3)),
            state_slots=slot_bytes(draw, world, model, states=True)
            if draw(st.booleans()) else b"",
            session_id=session_id(draw, world))
        chunks.append(pb.KVChunk(header=header,
                                 data=b"" if draw(st.integers(0, 5)) else b"x"))
    for _ in range(draw(st.integers(0, 4))):
        chunks.append(pb.KVChunk(
            role=draw(st.one_of(st.integers(0, 6), U32.map(lambda v: v % 2**31))),
            layer=draw(st.one_of(st.integers(0, 2), U32)),
            offset_bytes=draw(st.one_of(st.sampled_from([0, 0, 8, 16]), U64)),
            data=draw(st.one_of(st.binary(max_size=40), st.sampled_from([b"\0" * 8, b"\0" * 16])))))
    return chunks


# ---------------------------------------------------------------------- cases


def _code(fn: Any) -> tuple[grpc.StatusCode, str, Any]:
    try:
        return CODE.OK, "", fn()
    except grpc.RpcError as err:
        return err.code(), err.details() or "", None


def unary_case(draw: Any, world: World) -> None:
    method = draw(st.sampled_from(sorted(UNARY_BUILDERS)))
    request = UNARY_BUILDERS[method](draw, world)
    call = getattr(world.stub, method)
    code, detail, reply = _code(lambda: call(request, timeout=TIMEOUT))
    if code == CODE.OK:
        world.learn(method, request, reply)
    world.settle(f"{method}({request})"[:2000], code, detail)


def read_case(draw: Any, world: World) -> None:
    request = read_request(draw, world)
    code, detail, _ = _code(lambda: list(world.stub.ReadKV(request, timeout=TIMEOUT)))
    world.settle(f"ReadKV({request})", code, detail)


def write_case(draw: Any, world: World) -> None:
    chunks = write_chunks(draw, world)
    code, detail, _ = _code(lambda: world.stub.WriteKV(iter(chunks), timeout=TIMEOUT))
    world.settle(f"WriteKV({chunks})", code, detail)


def stream_case(draw: Any, world: World) -> None:
    """A Session stream, one op at a time: each refused op changes nothing."""
    # Everything is drawn first: hypothesis may abandon an example at any draw, and
    # that must not leave a stream open behind the next case's back.
    ops = []
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from([*STREAM_OPS, None]))
        req = pb.SessionRequest(seq=draw(U64))
        if op is not None:
            getattr(req, op).CopyFrom(STREAM_OPS[op](draw, world))
        ops.append((op, req))
    requests: queue.Queue[pb.SessionRequest | None] = queue.Queue()
    replies = world.stub.Session(iter(requests.get, None), timeout=TIMEOUT)
    try:
        # Once a first reply is back, the stream's session is open: that is the baseline.
        requests.put(pb.SessionRequest(seq=0, stats=pb.StatsRequest()))
        assert next(replies).WhichOneof("result") == "stats"
        world.baseline = world.stats()
        for op, req in ops:
            requests.put(req)
            try:
                reply = next(replies)
            except grpc.RpcError as err:
                # gRPC itself ends the stream on a message over the size limit.
                assert err.code() == CODE.RESOURCE_EXHAUSTED, (err.code(), err.details())
                world.settle("Session close (oversized message)", CODE.OK)
                return
            assert reply.seq == req.seq
            result = reply.WhichOneof("result")
            if result == "error":
                assert reply.error.code in ALLOWED_VALUES, f"Session/{op}: {reply.error}"
                code = CODE.INVALID_ARGUMENT  # any refusal: Stats must not move
            else:
                assert result == op
                code = CODE.OK
                world.learn(op.capitalize(), getattr(req, op), getattr(reply, result))
            world.settle(f"Session/{op}({req})", code, reply.error.message)
    finally:
        requests.put(None)
    code, detail, _ = _code(lambda: list(replies))
    assert code == CODE.OK, (code, detail)
    # Closing the stream released what it held; that is a change, not a refusal.
    world.settle("Session close", CODE.OK)


RAW = st.one_of(st.binary(max_size=64),
                st.binary(max_size=8).map(lambda b: b"\x0a\xff\xff\xff\x0f" + b),  # huge length
                st.lists(st.sampled_from([b"\x08\x01", b"\x10\xff\x01", b"\x1a\x03abc", b"\x22\x00",
                                          b"\x0a\x01m", b"\x30\x01", b"\x38\x01", b"\xff"]),
                         max_size=6).map(b"".join))


def raw_case(draw: Any, world: World) -> None:
    method = draw(st.sampled_from([*UNARY, "ReadKV", "WriteKV", "Session"]))
    path = SERVICE + method
    if method in UNARY:
        data = draw(RAW)
        code, detail, reply = _code(
            lambda: world.channel.unary_unary(path)(data, timeout=TIMEOUT))
        if code == CODE.OK and method == "OpenSession":
            world.sessions.append(pb.OpenSessionResponse.FromString(reply).session_id)
    elif method == "ReadKV":
        data = draw(RAW)
        code, detail, _ = _code(
            lambda: list(world.channel.unary_stream(path)(data, timeout=TIMEOUT)))
    elif method == "WriteKV":
        msgs = draw(st.lists(RAW, max_size=4))
        code, detail, _ = _code(
            lambda: world.channel.stream_unary(path)(iter(msgs), timeout=TIMEOUT))
    else:
        msgs = draw(st.lists(RAW, max_size=4))
        code, detail, answers = _code(
            lambda: list(world.channel.stream_stream(path)(iter(msgs), timeout=TIMEOUT)))
        for raw in answers or []:
            reply = pb.SessionResponse.FromString(raw)
            if reply.WhichOneof("result") == "error":
                assert reply.error.code in ALLOWED_VALUES, reply.error
        code = CODE.OK  # the stream's ops are re-baselined: they may have done things
    world.settle(f"raw {method}", code, detail)


def workflow_case(draw: Any, world: World) -> None:
    """A well-formed request as examples/worker.py makes it, each step settled: a locking,
    allocating match, an insert handing the lock over, and a free or an unlock.

    On the slot model the match often finds its prefix in a slot whose owner freed it
    (the worker frees its slot at the end), and reuses it in place; on the Mamba model
    every new prefix needs a state slot, so snapshots are evicted under state pressure.
    Sometimes the insert first names the session's lock on another model as
    ``release_lock_id``: refused with FAILED_PRECONDITION, changing nothing.
    """
    # Everything is drawn first, and never depends on the world (see INDEX).
    model = draw(st.sampled_from(["s", "s", "h", "h", "m", "p", "w"]))
    sid = _pick(draw, world.sessions, st.just(""))
    base = _pick(draw, world.seqs[model], st.just([1, 2, 3]))
    cut, tail = draw(INDEX), draw(st.lists(st.integers(0, 60), max_size=6))
    tokens = (base[: cut % (len(base) + 1)] + tail)[:16]  # the slot model's max_seq_len
    if model == "h":  # a Mamba state is the state after whole pages (of 2)
        tokens = tokens[: len(tokens) - len(tokens) % 2]
    other = draw(st.sampled_from([n for n in ("m", "p", "w", "h", "s") if n != model]))
    cross, free_slot = draw(st.integers(0, 2)) == 0, draw(st.integers(0, 3)) > 0
    keep, unlock = draw(st.booleans()), draw(st.booleans())
    if not tokens:
        return
    if not sid:  # the fuzzer closed every session: a worker opens a new one
        sid = world.open_session()
        world.settle("workflow: OpenSession", CODE.OK)

    refusals: list[str] = []

    def step(what: str, method: str, request: Any) -> Any:
        code, detail, reply = _code(lambda: getattr(world.stub, method)(request,
                                                                        timeout=TIMEOUT))
        if code == CODE.OK:
            world.learn(method, request, reply)
        else:
            refusals.append(f"{what}: {code.name} {detail} ({request})")
        world.settle(f"workflow {what}: {method}({request})"[:2000], code, detail)
        return reply

    before = {s.model: s for s in (world.baseline or world.stats()).models}[model]
    m = step("prefill", "Match", pb.MatchRequest(model=model, token_ids=toks(tokens),
                                                  session_id=sid, lock=True, allocate=True))
    if m is None:
        event("workflow: prefill refused")  # no room: every slot or state is held
        return
    if model == "s" and m.prefix_len and m.allocated_slots == m.slot_indices:
        event("workflow: a freed slot reused in place")
    if model == "h" and not before.free_state_slots:
        event("workflow: a state evicted for a new one")
    named = m.allocated_slots if model == "s" else m.slot_indices + m.allocated_slots
    insert = pb.InsertRequest(model=model, token_ids=toks(tokens), session_id=sid,
                              slot_indices=named, lock=keep, release_lock_id=m.lock_id)
    if model == "s":
        insert.slot_version = m.allocated_slot_version
    if m.HasField("allocated_state_slot"):
        insert.state_slot = m.allocated_state_slot
    if cross:
        theirs = step("a lock on another model", "Match", pb.MatchRequest(
            model=other, token_ids=toks(world.seqs[other][0]), session_id=sid, lock=True))
        if theirs is not None and theirs.lock_id:
            wrong = pb.InsertRequest()
            wrong.CopyFrom(insert)
            wrong.release_lock_id = theirs.lock_id
            code, detail, _ = _code(lambda: world.stub.Insert(wrong, timeout=TIMEOUT))
            assert code == CODE.FAILED_PRECONDITION, (code, detail, wrong)
            event("workflow: release_lock_id of another model refused")
            world.settle(f"workflow insert naming {other}'s lock: {wrong}", code, detail)
    ins = step("insert", "Insert", insert)
    assert ins is not None, f"an insert right after its match was refused: {refusals}"
    if model == "s" and free_slot:
        step("finish", "Free", pb.FreeRequest(model="s", slot_indices=m.allocated_slots,
                                              session_id=sid))
    if ins.lock_id and unlock:
        step("unlock", "Unlock", pb.UnlockRequest(lock_id=ins.lock_id, session_id=sid))
    if len(tokens) > 1 and tokens not in world.seqs[model]:
        world.seqs[model] = [*world.seqs[model][-15:], tokens]


CASES = {"unary": unary_case, "read": read_case, "write": write_case, "stream": stream_case,
         "workflow": workflow_case}


def run_case(data: Any, world: World, raw: bool) -> None:
    world.maybe_rebuild()
    draw = data.draw
    if raw:
        raw_case(draw, world)
    else:
        kind = draw(st.sampled_from(["unary"] * 6 + ["read", "write", "stream"]
                                    + ["workflow"] * 2))
        CASES[kind](draw, world)


def _settings(examples: int) -> settings:
    # No shrinking: a case's outcome depends on the server's state, which a replay
    # does not reproduce; the failure message names the request instead.
    return settings(max_examples=examples, deadline=None, database=None,
                    phases=(Phase.explicit, Phase.generate),
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large])


@settings(_settings(400))
@given(data=st.data())
def test_fuzz_messages(world: World, data: Any) -> None:
    run_case(data, world, raw=False)


@settings(_settings(150))
@given(data=st.data())
def test_fuzz_raw_bytes(world: World, data: Any) -> None:
    run_case(data, world, raw=True)


SLOW_CASES = int(os.environ.get("PREFIXCACHE_FUZZ_CASES", "10000"))


@pytest.mark.slow
@LONG
def test_fuzz_long(world: World) -> None:
    """>= PREFIXCACHE_FUZZ_CASES cases (default 10,000): four fifths messages, the
    rest raw bytes; prints the count and the time."""
    start, first = time.perf_counter(), world.cases

    @settings(_settings(SLOW_CASES * 4 // 5))
    @given(data=st.data())
    def messages(data: Any) -> None:
        run_case(data, world, raw=False)

    @settings(_settings(SLOW_CASES - SLOW_CASES * 4 // 5))
    @given(data=st.data())
    def raw(data: Any) -> None:
        run_case(data, world, raw=True)

    messages()
    raw()
    cases = world.cases - first
    print(f"\nfuzz: {cases} cases in {time.perf_counter() - start:.1f} s")
    assert cases >= SLOW_CASES
