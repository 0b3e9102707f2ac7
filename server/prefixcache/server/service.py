"""CacheService: the hosted models and the sessions that hold their locks and slots.

Everything the RPC layer calls lives here or in the engines; nothing here knows gRPC,
so the unary calls and the Session stream share one implementation.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from prefixcache.cache import IntegrityError
from prefixcache.cache.index.change_log import DEFAULT_CAPACITY

from .access.limits import Limits, limits_of
from .access.tenant_stats import TenantCounts
from .access.tenants import CALLER, PEER, client_identity
from .config import ModelConfig
from .engine.model_engine import ModelEngine
from .engine.retention import Retentions
from .engine.slot_engine import SlotEngine
from .errors import NotFoundError, PreconditionError, StaleEpochError
from .memory.page_seal import IntegrityFailures
from .memory.shared_pool import SharedPools
from .memory.write_fence import WriteFences
from .sessions import lock_audit, quotas
from .sessions.opaque_ids import OpaqueIds
from .sessions.quotas import Quota
from .sessions.session import Session, SessionRegistry, expiry_summary

log = logging.getLogger("prefixcache.server")


class CacheService:
    """The models a service hosts, by name, and its session registry.

    Args:
        models: One engine is built per model, in order.
        session_ttl: Default lease; requests are clamped to ``[ttl_min, ttl_max]``.
        clock: Monotonic seconds, for leases.
        limits: ``max_sessions`` and ``stream_ttl`` (see limits.py); the defaults if None.
        change_logs: give each tree model a ``ChangeLog`` (``engine.change_log``).
        change_log_capacity: the changes each change log keeps (for Subscribe).
        adopt: pool files a warm restart takes over (``SharedPools``).
        shm_service: this service's name in shm_dir (``shared_pool.service_tag``).
    """

    def __init__(
        self,
        models: tuple[ModelConfig, ...] | list[ModelConfig],
        session_ttl: float = 30.0,
        ttl_min: float = 1.0,
        ttl_max: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        shm_dir: str | None = None,
        shm_mode: int = 0o600,
        limits: Limits | None = None,
        change_logs: bool = False,
        change_log_capacity: int = DEFAULT_CAPACITY,
        adopt: dict[str, tuple[Path, int]] | None = None,
        shm_service: str | None = None,
    ) -> None:
        # A client that sees this change knows every handle it holds is gone.
        self.epoch = secrets.randbits(63) or 1
        # Node handles and lock ids are keyed permutations of counters, with a key drawn
        # per start (opaque_ids.py): unguessable, and an id kept from before a restart
        # names nothing now (instead of somebody else's node or lock).
        self.ids = OpaqueIds()
        self.limits = limits_of() if limits is None else limits
        self.sessions = SessionRegistry(
            self._release,
            clock,
            self.ids,
            self.limits.max_sessions,
            self.limits.max_sessions_per_client,
        )
        # CPU pools in shared memory under shm_dir (None: private), for attach.
        self.shared = SharedPools(shm_dir, self.epoch, shm_mode, adopt, shm_service)
        self.engines: dict[str, ModelEngine | SlotEngine] = {}
        try:
            for model in models:
                kind = SlotEngine if model.kind == "slot" else ModelEngine
                # Change logs (KV events): the tree kinds only; a slot cache has no pages.
                extra = (
                    {"change_log": change_logs, "change_log_capacity": change_log_capacity}
                    if kind is ModelEngine
                    else {}
                )
                self.engines[model.name] = kind(
                    model,
                    self.sessions.next_lock_id,
                    self.shared.pool_factory(model.name, model.pool.device),
                    self.ids,
                    **extra,
                )
                self.engines[model.name].quota = Quota.of(self.limits, self.engines[model.name])
                self.engines[model.name].retentions = Retentions(
                    self.limits.retention, self.engines[model.name], len(self.limits.tenants)
                )
                if self.limits.tenants:  # Stats shows a tenant its namespaces' lookups
                    self.engines[model.name].tenant_counts = TenantCounts(self.limits.tenants)
        except BaseException:
            self.shared.close()
            raise
        self.session_ttl, self.ttl_min, self.ttl_max = session_ttl, ttl_min, ttl_max
        self.draining = False
        # Pages refused because their seal did not check (the tier's, a snapshot's).
        self.integrity = IntegrityFailures()
        # Workers that write through the mapped pool hold off the freeing of their
        # session's slots while they copy (write_fence.py).
        self.fences = WriteFences(self.shared, self.limits.max_sessions)
        for engine in self.engines.values():  # and of slots it frees while they copy
            engine.fence_holder = self.fences.holder

    def close(self, keep: frozenset[str] = frozenset()) -> None:
        """Release what outlives the process otherwise: the shared-memory files, but
        the pool files in ``keep`` (a warm restart's snapshot names them)."""
        self.fences.close()
        self.shared.close(keep)

    def engine(self, name: str) -> ModelEngine | SlotEngine:
        try:
            return self.engines[name]
        except KeyError:
            raise NotFoundError(
                f"model {name!r} is not hosted here (hosted: {', '.join(self.engines)})"
            ) from None

    def session(self, session_id: str) -> Session:
        return self.sessions.get(session_id)

    def check_epoch(self, epoch: int) -> None:
        """Refuse a request whose handles come from an earlier start (0: unchecked)."""
        if epoch and epoch != self.epoch:
            raise StaleEpochError(
                f"server_epoch {epoch} is not this service's ({self.epoch}): the service "
                "restarted, and the sessions, nodes, locks and slots from before are gone",
                self.epoch,
            )

    def lapse_retentions(self, batch: int) -> int:
        """End up to ``batch`` retentions per model whose time has passed (the reaper's
        tick); how many ended in the model that ended the most."""
        return max((e.retentions.lapse(batch) for e in self.engines.values()), default=0)

    def open_session(self, ttl: float, name: str = "", client: str | None = None) -> Session:
        """A leased session of ``client`` (None: the calling client, from the call's
        caller and peer, ``tenants.client_identity``)."""
        granted = min(max(ttl or self.session_ttl, self.ttl_min), self.ttl_max)
        if client is None:
            client = client_identity(CALLER.get(), PEER.get(), name)
        session = self.sessions.open(granted, name, client=client)
        log.info(
            "session opened", extra={"session": session.id[:8], "client": name, "ttl": granted}
        )
        return session

    def open_stream_session(self, name: str = "") -> Session:
        """A Session stream's session: its lease (``stream_ttl``) is renewed by every
        message on the stream (``sessions.touch``)."""
        client = client_identity(CALLER.get(), PEER.get(), name)
        return self.sessions.open(self.limits.stream_ttl, name, stream=True, client=client)

    def close_session(self, session: Session) -> tuple[int, int]:
        return self.sessions.close(session)

    def expire_sessions(self, limit: int | None = None) -> int:
        """Close lapsed sessions, at most ``limit`` (None: all), with one log line."""
        self.settle_fences()
        expired = self.sessions.expire(limit)
        if expired:
            log.warning("session leases expired", extra=expiry_summary(expired))
        return len(expired)

    def settle_fences(self) -> int:
        """Free the slots of ended sessions whose mapped-pool writers let go of them
        (write_fence.py); returns the slots freed."""
        freed = 0
        for session in self.fences.settle():
            slots = sum(e.release_session(session)[1] for e in self.engines.values())
            freed += slots
            log.info(
                "fenced slots freed after their writer let go",
                extra={"session": session.id[:8], "slots_freed": slots},
            )
        return freed

    def unlock(self, session: Session, lock_id: int, unused: str | None = None) -> None:
        """Release ``lock_id`` whichever model it is on; ``unused``: the lookup outcome
        its hit is counted under (lookups.CLIENT_REASONS), once released: the tokens its
        lookup counted as a hit (``HeldLock.hit``; none for a lock no lookup took)."""
        if not lock_id:
            return
        held = session.locks.get(lock_id)
        if held is None and not self.sessions.issued(lock_id):
            raise NotFoundError(
                f"lock {lock_id} was never issued by this server (or comes from before a restart)"
            )
        if held is None:
            raise PreconditionError(
                f"lock {lock_id} is not held by this session "
                "(already released, or never taken by it)"
            )
        held.engine.unlock(session, lock_id)
        if unused is not None:
            held.engine.lookups.add(unused, held.hit)

    def reset(self, name: str) -> tuple[int, int]:
        engine = self.engine(name)
        # Slots a fenced writer may still copy into (write_fence.py) survive the Reset
        # with their ended sessions and holders, out of the allocator, until settled.
        waiting = self.fences.waiting()
        held = engine.held_rows(waiting)
        window = engine.held_window(held)
        dropped = engine.reset([*self.sessions, *waiting])
        engine.keep_held(held, window)
        for session in self.sessions:  # kept replies name locks and slots that are gone
            session.forget_replies()
        log.warning(
            "model reset",
            extra={"model": name, "dropped_tokens": dropped[0], "dropped_locks": dropped[1]},
        )
        return dropped

    def check_integrity(self) -> None:
        """Every model's own check, then its lock and slot counts, and its tree's lock
        counts, against what the sessions hold (``lock_audit``)."""
        for engine in self.engines.values():
            engine.check_integrity()
        # Ended sessions whose slots wait for a writer (write_fence.py) still hold them.
        lock_audit.audit(self.engines, [*self.sessions, *self.fences.waiting()])
        problems = quotas.audit(self.sessions)
        if problems:
            raise IntegrityError("; ".join(problems[:20]))

    def _release(self, session: Session) -> tuple[int, int]:
        if not self.fences.end(session):
            # A worker may be copying into the session's slots through the mapped pool:
            # its locks go now, its slots once the worker lets go (settle_fences).
            locks = list(session.locks.items())
            for lock_id, held in locks:
                held.engine.unlock(session, lock_id)
            return len(locks), 0
        locks = slots = 0
        for engine in self.engines.values():
            lk, sl = engine.release_session(session)
            locks, slots = locks + lk, slots + sl
        return locks, slots
