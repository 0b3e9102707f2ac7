"""EngineBase: what every hosted model keeps for the service, whatever its cache kind.

Counters for Stats and metrics, opaque node handles, and the locks sessions hold on
this model's nodes. The engines (``ModelEngine`` for the radix kinds, ``SlotEngine``
for sequence slots) add their pools and cache on top.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from prefixcache.cache import RadixKey
from prefixcache.cache.distinct import count_distinct
from prefixcache.cache.radix.lookup_outcomes import LEASE_EXPIRED

from ..access.tenant_stats import TenantCounts
from ..config import ModelConfig, RetentionConfig
from ..errors import NotFoundError, PreconditionError
from ..sessions.opaque_ids import OpaqueIds
from ..sessions.quotas import NO_QUOTA, Quota, prefix_tokens
from ..sessions.session import HeldLock, Session
from .lookups import Lookups
from .retention import Retentions

OPERATIONS = ("match", "insert", "evict", "lock", "unlock", "alloc")
# Why tokens left the cache: an Evict call, room for an allocation, or an admin Reset.
EVICTION_REASONS = ("requested", "pressure", "reset")


class EngineBase:
    """Counters, node handles and session locks of one model.

    Subclasses set ``cache``, ``allocator`` (with ``clear``) and ``_owner`` (the
    slot -> session tag array), which ``reset`` clears.

    Args:
        config: The model's configuration.
        next_lock_id: Hands out service-wide lock ids.
        handles: Makes node handles from node ids (opaque_ids.py): the service's, with
            a key drawn per start, so a handle is unguessable and one from before a
            restart names no node now (None: a fresh key).
    """

    def __init__(
        self, config: ModelConfig, next_lock_id: Callable[[], int], handles: OpaqueIds | None = None
    ) -> None:
        self.config = config
        self.name = config.name
        self.kind = config.kind
        # Nodes are handed out by id and looked up weakly: one that leaves the tree is
        # simply gone, and a later call naming it gets NOT_FOUND.
        self._nodes: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self._next_lock_id = next_lock_id
        self._handles = OpaqueIds() if handles is None else handles
        self.num_locks = 0
        self.session_slots = 0
        self.match_tokens = 0
        self.hit_tokens = 0
        # Fixed keys: the metrics thread iterates these while the loop updates them.
        self.ops: dict[str, int] = dict.fromkeys(OPERATIONS, 0)
        self.evicted_tokens: dict[str, int] = dict.fromkeys(EVICTION_REASONS, 0)
        # Per-session caps (quotas.py), checked before a call changes anything; the
        # service sets each model's from its limits.
        self.quota: Quota = NO_QUOTA
        # Lookups by tenant, where tenants are configured (tenant_stats.py).
        self.tenant_counts: TenantCounts | None = None
        # Lookups by outcome, and the hit-rate ceiling (lookups.py).
        self.lookups = Lookups(config.page_size)
        # Clients' retention hints (retention.py); the service sets each model's.
        self.retentions = Retentions(RetentionConfig(), self)
        # Who takes the slots a session frees while one of its workers may still copy
        # into them through the mapped pool (the service's ``WriteFences.holder``).
        self.fence_holder: Callable[[Session], Session | None] | None = None

    def _fenced(self, session: Session | None, slots: Any) -> bool:
        """Hand ``slots`` (``session``'s) to its fence holder if a worker holds its
        write fence now (write_fence.py): they leave the session but stay out of the
        free list until the holder is settled. False: nobody holds it; free them."""
        if self.fence_holder is None or session is None or not len(slots):
            return False
        holder = self.fence_holder(session)
        if holder is None:
            return False
        n = len(slots)
        self._owner[slots] = holder.tag  # type: ignore[attr-defined]
        for who, change in ((session, -n), (holder, n)):
            left = who.slots.get(self.name, 0) + change
            if left:
                who.slots[self.name] = left
            else:
                who.slots.pop(self.name, None)
        runs = getattr(self, "_alloc_runs", None)
        if runs is not None and not session.slots.get(self.name):
            runs.pop(session.tag, None)
        page_size = getattr(self, "page_size", 1)
        if page_size > 1:  # pages may now hold slots of both: count each one's again
            for who in (session, holder):
                rows = np.flatnonzero(self._owner == who.tag)  # type: ignore[attr-defined]
                pages = count_distinct(rows // page_size)
                if pages:
                    who.pages[self.name] = pages
                else:
                    who.pages.pop(self.name, None)
        return True

    def _count_match(self, key: RadixKey, hit: int) -> None:
        self.ops["match"] += 1
        self.match_tokens += len(key)
        self.hit_tokens += hit
        if self.tenant_counts is not None:
            self.tenant_counts.count(key.extra_key, len(key), hit)
        self._count_outcomes(key, hit)

    def _count_outcomes(self, key: RadixKey, hit: int) -> None:
        """Count an answered lookup by outcome (lookups.py); tree models classify it."""
        self.lookups.count_plain(len(key), hit)

    def _handle(self, node: Any) -> int:
        """The opaque id a client may name ``node`` by (0 for none)."""
        if node is None:
            return 0
        handle = self._handles.node(node.id)
        self._nodes[handle] = node
        return handle

    def _node(self, node_id: int) -> Any:
        node = self._nodes.get(node_id)
        if node is None or node.evicted:
            raise NotFoundError(
                f"node {node_id} is not in model {self.name!r}'s cache "
                "(evicted, reset, never handed out, or from before a "
                "restart)"
            )
        return node

    def _hold(
        self,
        session: Session,
        node: Any,
        boundary: Any = None,
        tokens: int | None = None,
        hit: int = 0,
    ) -> int:
        """Record a lock the caller just took on ``node`` as ``session``'s; ``tokens``,
        the prefix it protects, when the caller already knows it; ``hit``: taken by a
        lookup, the tokens it counted as a hit (a lapsed lease counts them as
        ``lease_expired``; ``HeldLock``)."""
        lock_id = self._next_lock_id()
        tokens = prefix_tokens(node) if tokens is None else tokens
        session.locks[lock_id] = HeldLock(self, node, boundary, tokens, hit)  # type: ignore[arg-type]
        session.locked_tokens[self.name] = session.locked_tokens.get(self.name, 0) + tokens
        self.num_locks += 1
        self.ops["lock"] += 1
        return lock_id

    def _held(self, session: Session, lock_id: int) -> HeldLock:
        """``session``'s lock ``lock_id`` on this model; refused, changing nothing, if the
        session does not hold it or holds it on another model (whose tree has the node)."""
        held = session.locks.get(lock_id)
        if held is None:
            raise PreconditionError(
                f"lock {lock_id} is not held by this session (already "
                "released, or never taken by it)"
            )
        if held.engine is not self:
            raise PreconditionError(
                f"lock {lock_id} is on another model ({held.engine.name!r}), not on {self.name!r}"
            )
        return held

    def _check_release(self, session: Session | None, lock_id: int) -> None:
        """Refuse an insert's ``release_lock_id`` before the insert changes anything."""
        if lock_id:
            self._held(needs_session(session, "release_lock_id"), lock_id)

    def _check_lock_quota(self, session: Session, tokens: int, release_lock_id: int) -> None:
        """Refuse an insert's lock of ``tokens`` past the session's quota, counting the
        lock it hands over (``release_lock_id``, already checked to be this model's)."""
        handed = session.locks.get(release_lock_id) if release_lock_id else None
        self.quota.check_lock(session, tokens - (handed.tokens if handed else 0))

    def _drop(self, session: Session, lock_id: int) -> None:
        """Forget one of ``session``'s locks, once the cache has released it."""
        held = session.locks.pop(lock_id)
        if held.hit and session.lapsed:  # a reservation that lapsed before use
            self.lookups.add(LEASE_EXPIRED, held.hit)
        self._unlocked_tokens(session, held.tokens)
        self.num_locks -= 1
        self.ops["unlock"] += 1

    def _unlocked_tokens(self, session: Session, tokens: int) -> None:
        left = session.locked_tokens.get(self.name, 0) - tokens
        if left:
            session.locked_tokens[self.name] = left
        else:
            session.locked_tokens.pop(self.name, None)

    def _my_locks(self, session: Session) -> list[int]:
        return [lid for lid, held in session.locks.items() if held.engine is self]

    def reset(self, sessions: list[Session]) -> tuple[int, int]:
        """Forget every entry, lock and allocation; returns (tokens, locks) dropped."""
        dropped = self.cache.total_size()
        locks = self._forget_sessions(sessions, dropped)
        self.cache.reset()
        self.allocator.clear()
        self._owner[:] = 0
        return dropped, locks

    def held_rows(self, sessions: list[Session]) -> list[tuple[Session, np.ndarray]]:
        """The rows each of ``sessions`` holds here (before a Reset: ``keep_held``)."""
        owner = self._owner  # type: ignore[attr-defined]
        return [(s, np.flatnonzero(owner == s.tag)) for s in sessions]

    def keep_held(
        self, held: list[tuple[Session, np.ndarray]], window: np.ndarray | None = None
    ) -> None:
        """After a Reset cleared the allocator: ``held``'s rows (``held_rows``) are
        taken again and owned by their sessions again (slots a fenced writer may still
        copy into: write_fence.py); every other slot stays free. ``window``: the SWA
        slots those rows mapped to before the Reset (``held_window``), kept too."""
        held = [(s, rows) for s, rows in held if len(rows)]
        if not held:
            return
        self._retake(np.concatenate([rows for _, rows in held]), window)
        for session, rows in held:
            self._own(session, rows)

    def held_window(self, held: list[tuple[Session, np.ndarray]]) -> np.ndarray | None:
        """The SWA slots ``held``'s rows map to (None: not an SWA model)."""
        return None

    def _retake(self, rows: np.ndarray, window: np.ndarray | None) -> None:
        raise NotImplementedError

    def _own(self, session: Session, rows: np.ndarray) -> None:
        raise NotImplementedError

    def _forget_sessions(self, sessions: list[Session], dropped_tokens: int) -> int:
        """On reset: every session loses its locks and slots here; returns the locks."""
        locks = 0
        for session in sessions:
            mine = self._my_locks(session)
            for lock_id in mine:
                self._unlocked_tokens(session, session.locks.pop(lock_id).tokens)
            locks += len(mine)
            session.slots.pop(self.name, None)
            session.pages.pop(self.name, None)
        self._nodes.clear()
        self.num_locks = self.session_slots = 0
        self.evicted_tokens["reset"] += dropped_tokens
        return locks


def needs_session(session: Session | None, what: str) -> Session:
    """``session``, or a refusal naming ``what`` needs one (never an ``assert``: under
    ``python -O`` that would let the call go on without one)."""
    if session is None:
        raise PreconditionError(f"{what} needs a session_id (OpenSession or the Session stream)")
    return session
