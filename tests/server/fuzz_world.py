"""The fuzzer's world (tests/reliability/test_fuzz.py): a server with one model of every
cache kind, the live ids of the state it holds (sessions, locks, nodes, slots, state
slots), and the checks after each case (an allowed code; a refusal changes no Stats;
the integrity check holds).
"""

from __future__ import annotations

from typing import Any

import grpc
from harness import EVERY_KIND, pb, slots, stub_for, toks

MODELS = EVERY_KIND
NAMES = [m.name for m in MODELS]
MAX_MESSAGE = 64 * 1024
CODE = grpc.StatusCode
# What the proto documents for a request the service refuses (no auth is configured and
# the server is not draining, so UNAUTHENTICATED, PERMISSION_DENIED, UNAVAILABLE would be
# wrong answers here too).
ALLOWED = {CODE.INVALID_ARGUMENT, CODE.NOT_FOUND, CODE.FAILED_PRECONDITION, CODE.RESOURCE_EXHAUSTED}
ALLOWED_VALUES = {c.value[0] for c in ALLOWED}
SERVICE = "/prefixcache.v1.PrefixCache/"
UNARY = (
    "ListModels",
    "DescribePool",
    "Stats",
    "OpenSession",
    "KeepAlive",
    "CloseSession",
    "Match",
    "Insert",
    "Evict",
    "Lock",
    "Unlock",
    "Alloc",
    "Free",
    "Reset",
    "Step",
    "ExistsPages",
    "GetPages",
    "SetPages",
)
# Rebuild the world's state this often, so the fuzzer keeps meeting live ids.
REBUILD_EVERY = 150
TIMEOUT = 20.0

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
            m = self.stub.Match(
                pb.MatchRequest(
                    model=name,
                    token_ids=toks([*base, 40, 41]),
                    session_id=sid,
                    lock=True,
                    allocate=True,
                ),
                timeout=TIMEOUT,
            )
            self.learn_match(name, m)
            a = self.stub.Alloc(
                pb.AllocRequest(
                    model=name, num_slots=3, session_id=sid, num_state_slots=1 if name == "h" else 0
                ),
                timeout=TIMEOUT,
            )
            self.learn_alloc(name, a)
        # The slot model: one cached sequence in a slot the session keeps, pinned.
        m = self.stub.Match(
            pb.MatchRequest(model="s", token_ids=toks([5, 6, 7]), session_id=sid, allocate=True),
            timeout=TIMEOUT,
        )
        self.learn_match("s", m)
        ins = self.stub.Insert(
            pb.InsertRequest(
                model="s",
                token_ids=toks([5, 6, 7]),
                slot_indices=m.allocated_slots,
                slot_version=m.allocated_slot_version,
                session_id=sid,
                lock=True,
            ),
            timeout=TIMEOUT,
        )
        self.learn_insert("s", ins)
        self.seqs["s"].append([5, 6, 7])
        # And one in a slot its owner freed: a locking, allocating match reuses it in place.
        m = self.stub.Match(
            pb.MatchRequest(
                model="s", token_ids=toks([8, 9, 10, 11]), session_id=sid, allocate=True
            ),
            timeout=TIMEOUT,
        )
        self.stub.Insert(
            pb.InsertRequest(
                model="s",
                token_ids=toks([8, 9, 10, 11]),
                slot_indices=m.allocated_slots,
                slot_version=m.allocated_slot_version,
                session_id=sid,
            ),
            timeout=TIMEOUT,
        )
        self.stub.Free(
            pb.FreeRequest(model="s", slot_indices=m.allocated_slots, session_id=sid),
            timeout=TIMEOUT,
        )
        self.seqs["s"].append([8, 9, 10, 11])
        self.learn_alloc(
            "s",
            self.stub.Alloc(
                pb.AllocRequest(model="s", num_slots=1, session_id=sid), timeout=TIMEOUT
            ),
        )
        self.since_rebuild = 0
        self.server.check_integrity()
        self.baseline = self.stats()

    def open_session(self) -> str:
        sid = self.stub.OpenSession(
            pb.OpenSessionRequest(ttl_seconds=600), timeout=TIMEOUT
        ).session_id
        self.sessions.append(sid)
        return sid

    def prefill(self, sid: str, model: str, tokens: list[int], keep_lock: bool) -> None:
        m = self.stub.Match(
            pb.MatchRequest(
                model=model, token_ids=toks(tokens), session_id=sid, lock=True, allocate=True
            ),
            timeout=TIMEOUT,
        )
        self.learn_match(model, m)
        req = pb.InsertRequest(
            model=model,
            token_ids=toks(tokens),
            session_id=sid,
            lock=keep_lock,
            slot_indices=m.slot_indices + m.allocated_slots,
            release_lock_id=m.lock_id,
        )
        if m.HasField("allocated_state_slot"):
            req.state_slot = m.allocated_state_slot
        self.learn_insert(model, self.stub.Insert(req, timeout=TIMEOUT))
        self.seqs[model].append(tokens)
        if model != "c":
            got = self.stub.Match(
                pb.MatchRequest(model=model, token_ids=toks(tokens)), timeout=TIMEOUT
            )
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

    def learn_step(self, model: str, reply: pb.StepResponse) -> None:
        for result in reply.admits:
            if result.HasField("admit"):
                self.learn_match(model, result.admit)
        for result in reply.finishes:
            if result.HasField("finish"):
                self.learn_insert(model, result.finish)
        for result in reply.decodes:
            if result.HasField("decode"):
                self.held[model] += slots(result.decode.slot_indices)

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
        elif method == "GetPages":
            self.locks += list(reply.lock_ids)
        elif model in NAMES and method == "Step":
            self.learn_step(model, reply)
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
            assert _state(after) == _state(self.baseline), (
                f"{what} was refused ({code}: {detail}) but changed Stats "
                f"({_diff(self.baseline, after)}); the cases before it: {self.history}"
            )
        self.history = [*self.history[-2:], f"{what[:600]} -> {code.name}"]
        self.server.check_integrity()
        self.baseline = after

    def maybe_rebuild(self) -> None:
        if self.since_rebuild >= REBUILD_EVERY:
            self.rebuild()


def _state(stats: pb.StatsResponse | None) -> pb.StatsResponse | None:
    """Stats without the lookup outcomes: a Match refused for room counts its tokens as
    a "capacity" lookup, which is a record of the refusal, not a change it made."""
    if stats is None:
        return None
    out = pb.StatsResponse()
    out.CopyFrom(stats)
    for model in out.models:
        model.ClearField("lookup_tokens_total")
    return out


def _diff(before: pb.StatsResponse | None, after: pb.StatsResponse) -> str:
    """The Stats fields that differ, per model."""
    if before is None:
        return "no baseline"
    out = (
        [f"sessions {before.sessions} -> {after.sessions}"]
        if before.sessions != after.sessions
        else []
    )
    for old, new in zip(before.models, after.models, strict=False):
        out += [
            f"{new.model}.{f.name} {getattr(old, f.name)} -> {getattr(new, f.name)}"
            for f in new.DESCRIPTOR.fields
            if getattr(old, f.name) != getattr(new, f.name)
        ]
    return ", ".join(out)
