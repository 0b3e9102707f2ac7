"""Client sessions: who holds which locks and slots, and for how long.

A worker that dies must not pin the cache forever, so every lock and every allocated
slot belongs to a session, and a session ends by an explicit close, by its stream
closing, or by its lease lapsing. Ending it hands everything back (``ModelEngine.
release_session``). Leases run on the monotonic clock.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count
from typing import TYPE_CHECKING, Any

from .errors import NotFoundError

if TYPE_CHECKING:
    from prefixcache.cache import TreeNode

    from .engine import ModelEngine

# Replies kept per session for idempotent retries (request_id); a retry arrives within a
# few calls of the original, and match replies can be large.
REPLAY_WINDOW = 32


@dataclass(eq=False, slots=True)
class HeldLock:
    """One lock a session holds on a node; ``boundary`` is the SWA unlock token."""

    engine: ModelEngine
    node: TreeNode
    boundary: Any = None


@dataclass(eq=False)
class Session:
    """A client's claim on locks and slots.

    Attributes:
        id: The secret handle clients pass as ``session_id``.
        tag: A small int naming the session in the engines' slot-owner arrays.
        ttl: Lease length in seconds; None for stream sessions, which end with the stream.
        expires_at: Monotonic deadline of the lease (inf for streams).
        locks: Lock id -> the lock.
        slots: Model name -> slots this session holds in that model's pool.
    """

    id: str
    tag: int
    name: str
    ttl: float | None
    expires_at: float
    locks: dict[int, HeldLock] = field(default_factory=dict)
    slots: dict[str, int] = field(default_factory=dict)
    replies: OrderedDict[tuple[str, int], Any] = field(default_factory=OrderedDict)
    closed: bool = False

    def renew(self, now: float) -> None:
        if self.ttl is not None:
            self.expires_at = now + self.ttl

    def replay(self, op: str, request_id: int) -> Any:
        """The stored reply to an earlier call with this request id, or None."""
        return self.replies.get((op, request_id)) if request_id else None

    def remember(self, op: str, request_id: int, reply: Any) -> None:
        if request_id:
            self.replies[(op, request_id)] = reply
            if len(self.replies) > REPLAY_WINDOW:
                self.replies.popitem(last=False)


class SessionRegistry:
    """Every open session, with lease expiry.

    Args:
        release: Called with a session when it ends, to hand back its locks and slots;
            returns ``(locks_released, slots_freed)``.
        clock: Monotonic seconds (injectable for tests).
        id_base: Lock ids are ``id_base + 1``, ``+ 2``, ... (see ``CacheService``).
    """

    def __init__(self, release: Callable[[Session], tuple[int, int]],
                 clock: Callable[[], float] = time.monotonic, id_base: int = 0) -> None:
        self._sessions: dict[str, Session] = {}
        self._release = release
        self._clock = clock
        # Tag 0 means "no session" in the owner arrays.
        self._tags = count(1)
        # Lock ids are id_base + 1, + 2, ...: see CacheService.id_base.
        self._first_lock_id = id_base + 1
        self.last_lock_id = id_base
        self.expired_total = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self):
        return iter(list(self._sessions.values()))

    def open(self, ttl: float | None, name: str = "") -> Session:
        """A new session; ``ttl=None`` makes a stream session with no lease."""
        now = self._clock()
        session = Session(
            id=secrets.token_hex(16),
            tag=next(self._tags),
            name=name,
            ttl=ttl,
            expires_at=float("inf") if ttl is None else now + ttl,
        )
        self._sessions[session.id] = session
        return session

    def get(self, session_id: str) -> Session:
        """The open session with this id, its lease renewed.

        Raises:
            NotFoundError: no such session (never opened, closed or expired).
        """
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFoundError(f"session {session_id[:8]!r}... is not open "
                                "(closed, expired or never opened)" if session_id
                                else "this call needs a session_id (OpenSession)")
        session.renew(self._clock())
        return session

    def next_lock_id(self) -> int:
        self.last_lock_id += 1
        return self.last_lock_id

    def issued(self, lock_id: int) -> bool:
        """Whether this registry has handed out ``lock_id`` (held or not)."""
        return self._first_lock_id <= lock_id <= self.last_lock_id

    def close(self, session: Session) -> tuple[int, int]:
        """End ``session`` and hand back what it holds."""
        if session.closed:
            return 0, 0
        session.closed = True
        self._sessions.pop(session.id, None)
        return self._release(session)

    def expire(self) -> list[tuple[Session, int, int]]:
        """Close every session whose lease has lapsed; returns them with what was released."""
        now = self._clock()
        lapsed = [s for s in self._sessions.values() if s.expires_at <= now]
        out = []
        for session in lapsed:
            locks, slots = self.close(session)
            out.append((session, locks, slots))
        self.expired_total += len(lapsed)
        return out

    def next_expiry(self) -> float:
        """Seconds until the earliest lease lapses (inf if none)."""
        soonest = min((s.expires_at for s in self._sessions.values()), default=float("inf"))
        return max(0.0, soonest - self._clock())
