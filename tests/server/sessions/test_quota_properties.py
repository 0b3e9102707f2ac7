"""Stateful property test of the per-session quotas, on the service core (no gRPC).

Random sessions match (with lock and allocate), insert (with lock, handing a lock
over), lock by node, unlock, allocate, free, run Step decodes and close, on every
model kind. After every step: no session holds more slots or locked tokens of a model
than its quota, the integrity check holds (it audits each session's locked tokens
against its locks, and each lock's tokens against its node's depth), and a call
refused by a quota changed nothing: not the engines' counters, not any session's
holdings.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from prefixcache.cache import CacheError, RadixKey
from prefixcache.server.access.limits import limits_of
from prefixcache.server.config import MambaConfig, ModelConfig, PoolConfig, ServerConfig
from prefixcache.server.errors import OverLimitError, ServiceError
from prefixcache.server.service import CacheService

POOL = PoolConfig(size=40, k_heads=1, k_head_dim=2)
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
    ModelConfig(
        name="s", kind="slot", max_seq_len=12, pool=PoolConfig(size=6, k_heads=1, k_head_dim=2)
    ),
)
NAMES = [m.name for m in MODELS]
SLOTS, LOCKED = 9, 14
LIMITS = limits_of(ServerConfig(max_session_slots=SLOTS, max_session_locked_tokens=LOCKED))
TOKENS = st.lists(st.sampled_from([1, 2, 3]), min_size=1, max_size=10)
SID = st.integers(0, 2)
MODEL = st.sampled_from(NAMES)


class QuotaMachine(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        self.svc = CacheService(MODELS, limits=LIMITS)
        self.sessions = [self.svc.open_session(30.0) for _ in range(3)]
        self.nodes: list[tuple[str, int]] = []

    def _session(self, i: int):
        if self.sessions[i].closed:
            self.sessions[i] = self.svc.open_session(30.0)
        return self.sessions[i]

    def _state(self) -> tuple:
        engines = tuple(
            (e.num_locks, e.session_slots, e.session_state_slots, tuple(sorted(e.sizes().items())))
            for e in self.svc.engines.values()
        )
        held = tuple(
            (tuple(sorted(s.slots.items())), tuple(sorted(s.locked_tokens.items())), len(s.locks))
            for s in self.svc.sessions
        )
        return engines, held

    def _try(self, call, *args, **kwargs):
        """Run one engine call; a quota refusal must change nothing."""
        before = self._state()
        try:
            return call(*args, **kwargs)
        except OverLimitError:
            assert self._state() == before
        except (ServiceError, CacheError):
            pass  # other refusals (pool full, a bad slot) are other tests' business
        return None

    @rule(i=SID, model=MODEL, tokens=TOKENS, lock=st.booleans(), allocate=st.booleans())
    def match(self, i, model, tokens, lock, allocate) -> None:
        engine = self.svc.engine(model)
        out = self._try(engine.match, RadixKey(tokens), self._session(i), lock, allocate)
        if out is not None and out.node_id:
            self.nodes.append((model, out.node_id))

    @rule(i=SID, model=MODEL, tokens=TOKENS, lock=st.booleans(), hand_over=st.booleans())
    def prefill(self, i, model, tokens, lock, hand_over) -> None:
        """Match with lock and allocate, then insert (maybe locking, maybe handing the
        match's lock over), as a worker does."""
        session = self._session(i)
        engine = self.svc.engine(model)
        m = self._try(engine.match, RadixKey(tokens), session, True, True)
        if m is None:
            return
        release = m.lock_id if hand_over else 0
        if engine.kind == "slot":
            if not len(m.allocated):
                return
            out = self._try(
                engine.insert,
                RadixKey(tokens),
                m.allocated,
                session,
                lock,
                release,
                slot_version=m.allocated_version,
            )
        else:
            slots = np.concatenate([m.indices, m.allocated]).astype(np.int64)
            out = self._try(
                engine.insert, RadixKey(tokens), slots, session, lock, release, m.allocated_state
            )
        if out is not None and out.node_id:
            self.nodes.append((model, out.node_id))

    @rule(i=SID, pick=st.integers(0, 1000))
    def lock_node(self, i, pick) -> None:
        if self.nodes:
            model, node_id = self.nodes[pick % len(self.nodes)]
            self._try(self.svc.engine(model).lock, self._session(i), node_id)

    @rule(i=SID, pick=st.integers(0, 1000))
    def unlock(self, i, pick) -> None:
        session = self._session(i)
        if session.locks:
            lock_id = list(session.locks)[pick % len(session.locks)]
            self.svc.unlock(session, lock_id)

    @rule(i=SID, model=MODEL, n=st.integers(0, 12))
    def alloc(self, i, model, n) -> None:
        self._try(self.svc.engine(model).alloc, self._session(i), n)

    @rule(i=SID, model=MODEL)
    def free_all(self, i, model) -> None:
        session = self._session(i)
        engine = self.svc.engine(model)
        mine = np.flatnonzero(engine._owner == session.tag).astype(np.int64)
        if len(mine):
            engine.free(session, mine)

    @rule(i=SID)
    def close(self, i) -> None:
        self.svc.close_session(self._session(i))

    @invariant()
    def within_quotas_and_sound(self) -> None:
        if not hasattr(self, "svc"):
            return
        for session in self.svc.sessions:
            for model in NAMES:
                assert session.slots.get(model, 0) <= SLOTS
                assert session.locked_tokens.get(model, 0) <= LOCKED
        self.svc.check_integrity()


TestQuotas = QuotaMachine.TestCase
TestQuotas.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
