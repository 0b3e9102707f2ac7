"""Stateful property test of the service core (engines + sessions), without gRPC.

Random sessions run prefills, locks, allocations, frees, evictions, bad inserts,
closes and lease expiries against radix, paged and SWA models. After every step the
integrity check holds and every slot is accounted for exactly once: free in the
allocator, cached in the tree, or held by the one session the test says holds it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from prefixcache.cache import CacheError, RadixKey
from prefixcache.server.config import MambaConfig, ModelConfig, PoolConfig
from prefixcache.server.errors import PreconditionError, ServiceError
from prefixcache.server.service import CacheService

POOL = PoolConfig(size=48, k_heads=1, k_head_dim=2)
MODELS = (
    ModelConfig(name="r1", page_size=1, pool=POOL),
    ModelConfig(name="r4", page_size=4, pool=POOL),
    ModelConfig(name="w", kind="swa", page_size=1, sliding_window_size=3, pool=POOL),
    ModelConfig(
        name="mb",
        kind="mamba",
        page_size=1,
        pool=POOL,
        mamba=MambaConfig(state_slots=6, conv_state_shape=(2,), temporal_state_shape=(2,)),
    ),
)
NAMES = [m.name for m in MODELS]
TOKENS = st.lists(st.sampled_from([1, 2, 3]), min_size=0, max_size=14)
SESSIONS = 3
SID = st.integers(0, SESSIONS - 1)
# The long runs, with the other property and fuzz tests (docs/architecture.md).
LONG = bool(os.environ.get("PREFIXCACHE_SLOW"))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ServiceMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.svc = CacheService(
            MODELS, session_ttl=10.0, ttl_min=1.0, ttl_max=100.0, clock=self.clock
        )
        # What the test believes each session holds: model -> set of slots.
        self.held: dict[str, dict[str, set[int]]] = {}
        self.states: dict[str, dict[str, set[int]]] = {}  # Mamba state slots, likewise
        self.pending: list[tuple] = []

    def _session(self, sid: str):
        return self.svc.sessions._sessions.get(sid)

    def _live(self, i: int) -> str:
        """Session ``i``, reopened if it ended (the worker reconnects)."""
        if self._session(self.sids[i]) is None:
            self.sids[i] = self._open(10.0)
        return self.sids[i]

    @initialize()
    def open_three(self) -> None:
        self.sids = [self._open(10.0) for _ in range(SESSIONS)]

    def _open(self, ttl: float) -> str:
        session = self.svc.open_session(ttl)
        self.held[session.id] = {n: set() for n in NAMES}
        self.states[session.id] = {n: set() for n in NAMES}
        return session.id

    @rule(i=SID, ttl=st.sampled_from([2.0, 10.0, 50.0]))
    def reopen(self, i: int, ttl: float) -> None:
        """A worker restarts: its old session may still be open (and leak until closed)."""
        self.sids[i] = self._open(ttl)

    @rule(i=SID)
    def close(self, i: int) -> None:
        sid = self.sids[i]
        session = self._session(sid)
        if session is None:
            return
        _, slots = self.svc.close_session(session)
        assert slots == sum(len(s) for s in self.held[sid].values())
        self.held[sid] = {n: set() for n in NAMES}
        self.states[sid] = {n: set() for n in NAMES}

    @rule(dt=st.sampled_from([0.5, 0.5, 3.0, 20.0]))
    def time_passes(self, dt: float) -> None:
        self.clock.now += dt
        live = {s.id for s in self.svc.sessions}
        self.svc.expire_sessions()
        for sid in live - {s.id for s in self.svc.sessions}:
            self.held[sid] = {n: set() for n in NAMES}
            self.states[sid] = {n: set() for n in NAMES}

    @rule(i=SID, model=st.sampled_from(NAMES), tokens=TOKENS, extra=st.sampled_from([None, "a"]))
    def start_prefill(self, i: int, model: str, tokens: list[int], extra: str | None) -> None:
        """Match with lock and allocate; the insert comes in a later step, so other
        sessions can cache the same tokens in between (and their slots get freed)."""
        sid = self._live(i)
        session = self._session(sid)
        key = RadixKey(tokens, extra)
        try:
            m = self.svc.engine(model).match(key, session, lock=True, allocate=True)
        except ServiceError:
            return  # pool exhausted: nothing changed
        self.held[sid][model] |= set(m.allocated.tolist())
        if m.allocated_state is not None:
            self.states[sid][model].add(m.allocated_state)
        self.pending.append(
            (
                sid,
                model,
                key,
                np.concatenate([m.indices, m.allocated]),
                m.lock_id,
                m.allocated_state,
            )
        )

    @rule(data=st.data(), keep=st.booleans())
    def finish_prefill(self, data: st.DataObject, keep: bool) -> None:
        if self.pending:
            self._finish(data.draw(st.integers(0, len(self.pending) - 1)), keep)

    def _finish(self, index: int, keep: bool) -> None:
        sid, model, key, slots, lock_id, state = self.pending.pop(index)
        session = self._session(sid)
        if session is None:
            return  # the session ended: its slots went back with it
        engine = self.svc.engine(model)
        aligned = len(key) - len(key) % engine.page_size
        # The rule: the slots up to the session's first one are the tree's own, token by
        # token, and the rest are all the session's. A free or a reset since the match
        # (or an eviction after an early unlock) breaks it, and the insert is refused.
        tree = engine.cache.peek_prefix(key).tolist()
        named, held = slots[:aligned].tolist(), self.held[sid][model]
        k = next((j for j, slot in enumerate(named) if slot in held), aligned)
        gone = k > len(tree) or named[:k] != tree[:k] or not set(named[k:]) <= held
        gone = gone or (state is not None and state not in self.states[sid][model])
        if (lock_id and lock_id not in session.locks) or gone:
            with pytest.raises(PreconditionError):
                self.svc.engine(model).insert(
                    key, slots, session, release_lock_id=lock_id, state_slot=state
                )
            return
        out = engine.insert(
            key, slots, session, lock=keep, release_lock_id=lock_id, state_slot=state
        )
        self.states[sid][model].discard(state)  # cached, or freed as surplus
        taken = set(slots[:aligned].tolist())
        self.held[sid][model] -= taken
        assert set(out.freed.tolist()) <= taken
        if len(out.freed):
            event("an insert freed the duplicate slots of a racing prefill")

    @rule(model=st.sampled_from(NAMES), tokens=TOKENS, i=SID)
    def racing_prefills(self, model: str, tokens: list[int], i: int) -> None:
        """Two sessions match the same tokens before either inserts: the second insert
        finds everything cached and its allocated slots are freed."""
        a, b = self._live(i), self._live((i + 1) % SESSIONS)
        for sid in (a, b):
            session = self._session(sid)
            try:
                m = self.svc.engine(model).match(RadixKey(tokens), session, allocate=True)
            except ServiceError:
                return
            self.held[sid][model] |= set(m.allocated.tolist())
            if m.allocated_state is not None:
                self.states[sid][model].add(m.allocated_state)
            self.pending.append(
                (
                    sid,
                    model,
                    RadixKey(tokens),
                    np.concatenate([m.indices, m.allocated]),
                    0,
                    m.allocated_state,
                )
            )
        for _ in range(2):
            self._finish(len(self.pending) - 2, keep=False)

    @rule(model=st.sampled_from(NAMES))
    def reset(self, model: str) -> None:
        self.svc.reset(model)
        for h in (*self.held.values(), *self.states.values()):
            h[model] = set()
        self.pending = [p for p in self.pending if p[1] != model]

    @rule(i=SID, model=st.sampled_from(NAMES), n=st.integers(0, 20))
    def alloc(self, i: int, model: str, n: int) -> None:
        sid = self._live(i)
        session = self._session(sid)
        if session is None:
            return
        try:
            got, states = self.svc.engine(model).alloc(session, n, int(model == "mb"))
        except ServiceError:
            return
        self.held[sid][model] |= set(got.tolist())
        self.states[sid][model] |= set(states.tolist())

    @rule(i=SID, model=st.sampled_from(NAMES), data=st.data())
    def free(self, i: int, model: str, data: st.DataObject) -> None:
        sid = self.sids[i]
        session = self._session(sid)
        if session is None or not self.held[sid][model]:
            return
        some = data.draw(
            st.lists(st.sampled_from(sorted(self.held[sid][model])), min_size=1, unique=True)
        )
        self.svc.engine(model).free(session, np.array(some, dtype=np.int64))
        self.held[sid][model] -= set(some)

    @rule(
        i=SID,
        model=st.sampled_from(NAMES),
        tokens=TOKENS,
        junk=st.lists(st.integers(-2, 60), min_size=0, max_size=14),
    )
    def bad_insert(self, i: int, model: str, tokens: list[int], junk: list[int]) -> None:
        """Slots the session does not hold (or garbage) are refused without a change."""
        sid = self._live(i)
        session = self._session(sid)
        if session is None:
            return
        engine = self.svc.engine(model)
        before = (engine.sizes(), engine.session_slots, engine.num_locks)
        slots = np.array(junk[: len(tokens)], dtype=np.int64)
        try:
            engine.insert(RadixKey(tokens), slots, session)
        except (ServiceError, CacheError):
            assert (engine.sizes(), engine.session_slots, engine.num_locks) == before
            return
        # Accepted: every cached slot was the tree's own or this session's; the tail's
        # slots were not looked at and stay where they were.
        aligned = len(tokens) - len(tokens) % engine.page_size
        self.held[sid][model] -= set(slots[:aligned].tolist())

    @rule(i=SID, model=st.sampled_from(NAMES), tokens=TOKENS)
    def insert_releasing_another_models_lock(self, i: int, model: str, tokens: list[int]) -> None:
        """An insert that would be accepted, but names the session's lock on another
        model as release_lock_id: refused, and nothing changes on either model."""
        session = self._session(self._live(i))
        foreign = [lid for lid, h in session.locks.items() if h.engine.name != model]
        if not foreign:  # lock the same tokens on another model
            other = NAMES[(NAMES.index(model) + 1) % len(NAMES)]
            lock_id = self.svc.engine(other).match(RadixKey(tokens), session, lock=True).lock_id
            if not lock_id:
                return
            foreign = [lock_id]
        engine = self.svc.engine(model)
        tree = engine.cache.peek_prefix(RadixKey(tokens)).numpy().astype(np.int64)
        before = [(e.sizes(), e.num_locks) for e in self.svc.engines.values()]
        locks = dict(session.locks)
        with pytest.raises(PreconditionError):
            engine.insert(RadixKey(tokens[: len(tree)]), tree, session, release_lock_id=foreign[0])
        assert [(e.sizes(), e.num_locks) for e in self.svc.engines.values()] == before
        assert session.locks == locks
        event("an insert naming another model's lock was refused")

    @rule(i=SID)
    def unlock_one(self, i: int) -> None:
        sid = self.sids[i]
        session = self._session(sid)
        if session is not None and session.locks:
            self.svc.unlock(session, next(iter(session.locks)))

    @rule(model=st.sampled_from(NAMES), n=st.integers(0, 30), swa=st.integers(0, 10))
    def evict(self, model: str, n: int, swa: int) -> None:
        self.svc.engine(model).evict(n, swa)

    @invariant()
    def consistent(self) -> None:
        self.svc.check_integrity()
        for name in NAMES:
            engine = self.svc.engine(name)
            held = sum(len(h[name]) for h in self.held.values())
            assert engine.session_slots == held
            assert engine.allocator.num_allocated() == engine.cache.total_size() + held
            states = sum(len(h[name]) for h in self.states.values())
            assert engine.session_state_slots == states
            if engine.mamba_pool is not None:
                assert (
                    engine.mamba_pool.num_allocated_track_slots()
                    == engine.cache.mamba_total_size() + states
                )
            for sid, h in self.held.items():
                session = self._session(sid)
                tag = session.tag if session else -1
                mine = set(np.flatnonzero(engine._owner == tag).tolist())
                assert mine == h[name], (name, sid)


ServiceMachine.TestCase.settings = settings(
    max_examples=400 if LONG else 40,
    stateful_step_count=60 if LONG else 30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_service_state_machine = pytest.mark.filterwarnings("ignore")(ServiceMachine.TestCase)
