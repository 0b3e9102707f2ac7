"""Client sessions: who holds which locks and slots, and for how long.

A worker that dies must not pin the cache forever, so every lock and every allocated
slot belongs to a session, and a session ends by an explicit close, by its stream
closing, or by its lease lapsing. Ending it hands everything back (``ModelEngine.
release_session``). Streams have a lease too, renewed by every message they carry, so a
frozen worker's stream does not hold its slots forever.

Leases run on "lease time": the monotonic clock less the time the event loop could not
run on schedule (``credit_stall``; reaper.py measures it). A server that was stopped or
busy for ten seconds has not given its clients ten seconds less to renew: their
KeepAlives were waiting, unread, for the loop.
"""

from __future__ import annotations

import heapq
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import NotFoundError, OverLimitError
from .opaque_ids import OpaqueIds
from .retention import Hint

if TYPE_CHECKING:
    from prefixcache.cache import TreeNode

# Replies kept per session for idempotent retries (request_id); a retry arrives within a
# few calls of the original. Match replies carry slot vectors (8 bytes a token), so the
# window is also bounded in bytes: the newest reply is always kept, older ones only while
# the total stays under REPLAY_BYTES (32 whole replies can hold 65 MiB per session).
REPLAY_WINDOW = 32
REPLAY_BYTES = 1 << 20


class OutcomeCounter(Protocol):
    """Where a lock's unused tokens are counted: the engine's ``Lookups``."""

    def add(self, outcome: str, tokens: int) -> None: ...


class LockEngine(Protocol):
    """The engine a lock was taken on, as a ``HeldLock`` names it: a ``ModelEngine``,
    which imports this module (its calls take sessions), so it is named by its shape."""

    name: str
    lookups: OutcomeCounter

    def unlock(self, session: Session, lock_id: int) -> None: ...


@dataclass(eq=False, slots=True)
class HeldLock:
    """One lock a session holds on a node; ``boundary`` is the SWA unlock token;
    ``tokens`` the prefix it protects (root to node), counted in the session's quota;
    ``hit`` the tokens of it that its lookup counted as a hit.

    A lock taken by a lookup is a reservation (0 ``hit``: taken otherwise): if it goes
    unused (its lease lapsed, or a client releases it with a reason) its ``hit`` is
    counted under that outcome, the tokens the lookup counted and no more. For a Match
    or Step admission that is the whole prefix; for a GetPages run (hash_pages.py) only
    the run's pages, as ExistsPages counted them: the prefix the lock protects may
    start before the pages SGLang asked for."""

    engine: LockEngine
    node: TreeNode
    boundary: Any = None
    tokens: int = 0
    hit: int = 0


@dataclass(eq=False)
class Session:
    """A client's claim on locks and slots.

    Attributes:
        id: The secret handle clients pass as ``session_id``.
        tag: A small int naming the session in the engines' slot-owner arrays.
        ttl: Lease length in seconds (for a stream: how long it may stay silent).
        expires_at: Deadline of the lease, in the registry's lease time.
        locks: Lock id -> the lock.
        slots: Model name -> slots this session holds in that model's pool.
        pages: Model name -> pages it holds slots on (models with pages of more than
            one slot): what ``max_session_slots`` counts, in whole pages.
        stream: Carried by a Session stream rather than leased by OpenSession.
        on_lapse: Called after the lease lapsed and the session was closed (a stream's
            handler is told to end the stream).
        lapsed: Ended by its lease lapsing.
        locked_tokens: Model name -> tokens this session's locks there protect (the sum
            of their ``HeldLock.tokens``; quotas.py).
        streams: ReadKV and WriteKV streams of this session in flight.
        keepalive_slot: When its latest KeepAlive is (or was) answered, monotonic
            seconds (keepalive.py paces them).
        client: Who it belongs to (``tenants.client_identity``), for
            ``max_sessions_per_client`` and the Evict budget.
        internal: The service's own (the tier's): no client quota applies to it.
        retention: The retention hint of its calls that carry none (retention.py).
    """

    id: str
    tag: int
    name: str
    ttl: float | None
    expires_at: float
    locks: dict[int, HeldLock] = field(default_factory=dict)
    slots: dict[str, int] = field(default_factory=dict)
    pages: dict[str, int] = field(default_factory=dict)
    replies: OrderedDict[tuple[str, int], tuple[Any, int]] = field(default_factory=OrderedDict)
    replay_bytes: int = 0
    closed: bool = False
    stream: bool = False
    on_lapse: Callable[[], object] | None = None
    lapsed: bool = False
    locked_tokens: dict[str, int] = field(default_factory=dict)
    streams: int = 0
    keepalive_slot: float = float("-inf")
    client: str = ""
    retention: Hint | None = None
    internal: bool = False

    def renew(self, now: float) -> None:
        if self.ttl is not None:
            self.expires_at = now + self.ttl

    def replay(self, op: str, request_id: int) -> Any:
        """The stored reply to an earlier call with this request id, or None."""
        kept = self.replies.get((op, request_id)) if request_id else None
        return kept[0] if kept is not None else None

    def remember(self, op: str, request_id: int, reply: Any) -> None:
        if not request_id:
            return
        size = reply.ByteSize() if hasattr(reply, "ByteSize") else 0
        old = self.replies.pop((op, request_id), None)
        if old is not None:
            self.replay_bytes -= old[1]
        self.replies[(op, request_id)] = (reply, size)
        self.replay_bytes += size
        while len(self.replies) > 1 and (
            len(self.replies) > REPLAY_WINDOW or self.replay_bytes > REPLAY_BYTES
        ):
            self.replay_bytes -= self.replies.popitem(last=False)[1][1]

    def forget_replies(self) -> None:
        """Drop every kept reply (after a Reset, their handles name nothing)."""
        self.replies.clear()
        self.replay_bytes = 0


class SessionRegistry:
    """Every open session, with lease expiry.

    Args:
        release: Called with a session when it ends, to hand back its locks and slots;
            returns ``(locks_released, slots_freed)``.
        clock: Monotonic seconds (injectable for tests).
        ids: Makes lock ids from a counter (opaque_ids.py; None: a fresh key).
        max_sessions: Open sessions (leased and streams) beyond which ``open`` refuses.
        max_per_client: Open sessions of one client (``Session.client``) beyond which
            ``open`` refuses, checked first, so that one client cannot take every
            session and lock the others out (0: no cap but ``max_sessions``).

    Attributes:
        stalled: Seconds the loop could not run on schedule, credited to every lease.
    """

    def __init__(
        self,
        release: Callable[[Session], tuple[int, int]],
        clock: Callable[[], float] = time.monotonic,
        ids: OpaqueIds | None = None,
        max_sessions: int = 10000,
        max_per_client: int = 0,
    ) -> None:
        self._sessions: dict[str, Session] = {}
        self.max_per_client = max_per_client
        # Open sessions per client; a client with none has no entry (bounded by the
        # open sessions).
        self._per_client: dict[str, int] = {}
        self._release = release
        self.clock = clock
        self.max_sessions = max_sessions
        self.stalled = 0.0
        # (deadline when pushed, tag, session). A renewal does not touch the heap: a
        # popped entry whose session was renewed since goes back with its new deadline,
        # so renewing costs nothing and finding the lapsed costs O(log n) each.
        self._heap: list[tuple[float, int, Session]] = []
        # Tag 0 means "no session" in the owner arrays.
        self._tags = count(1)
        # Lock ids are the keyed permutation of 1, 2, ...: unguessable, yet the counter
        # behind an id tells whether it was issued (opaque_ids.py).
        self._ids = OpaqueIds() if ids is None else ids
        self._locks_issued = 0
        self.expired_total = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self):
        return iter(list(self._sessions.values()))

    def now(self) -> float:
        """Lease time: the clock less the stalls credited so far."""
        return self.clock() - self.stalled

    def credit_stall(self, seconds: float) -> None:
        """Extend every lease by ``seconds`` the loop could not run (in O(1))."""
        if seconds > 0:
            self.stalled += seconds

    def open(
        self, ttl: float | None, name: str = "", stream: bool = False, client: str = ""
    ) -> Session:
        """A new session of ``client``; ``ttl=None`` gives it no lease (it ends only
        when closed).

        Raises:
            OverLimitError: ``client`` has ``max_per_client`` sessions open, or
                ``max_sessions`` sessions are open already.
        """
        held = self._per_client.get(client, 0)
        if self.max_per_client and held >= self.max_per_client:
            raise OverLimitError(
                f"this client ({_shown(client)}) has {held} sessions open, the most one "
                "client may have (server.max_sessions_per_client): close some, or reuse "
                "one session for many requests",
                "max_sessions_per_client",
            )
        if len(self._sessions) >= self.max_sessions:
            raise OverLimitError(
                f"{len(self._sessions)} sessions are open, the limit server.max_sessions",
                "max_sessions",
            )
        session = Session(
            id=secrets.token_hex(16),
            tag=next(self._tags),
            name=name,
            ttl=ttl,
            expires_at=float("inf") if ttl is None else self.now() + ttl,
            stream=stream,
            client=client,
        )
        self._sessions[session.id] = session
        self._per_client[client] = held + 1
        if len(self._heap) > 2 * len(self._sessions) + 64:
            # Closed sessions wait in the heap until their deadline; rebuilding now and
            # then keeps it in proportion to the open ones.
            self._heap = [
                (s.expires_at, s.tag, s) for s in self._sessions.values() if s.ttl is not None
            ]
            heapq.heapify(self._heap)
        elif ttl is not None:
            heapq.heappush(self._heap, (session.expires_at, session.tag, session))
        return session

    def count_of(self, client: str) -> int:
        """Open sessions of ``client``."""
        return self._per_client.get(client, 0)

    def touch(self, session: Session) -> None:
        """Renew ``session``'s lease (a stream renews on every message)."""
        session.renew(self.now())

    def find(self, session_id: str) -> Session | None:
        """The open session with this id, or None; its lease is not renewed."""
        return self._sessions.get(session_id)

    def get(self, session_id: str) -> Session:
        """The open session with this id, its lease renewed.

        Raises:
            NotFoundError: no such session (never opened, closed or expired).
        """
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFoundError(
                f"session {session_id[:8]!r}... is not open (closed, expired or never opened)"
                if session_id
                else "this call needs a session_id (OpenSession)"
            )
        session.renew(self.now())
        return session

    def next_lock_id(self) -> int:
        self._locks_issued += 1
        return self._ids.lock(self._locks_issued)

    def issued(self, lock_id: int) -> bool:
        """Whether this registry has handed out ``lock_id`` (held or not)."""
        return 1 <= self._ids.lock_counter(lock_id) <= self._locks_issued

    def close(self, session: Session) -> tuple[int, int]:
        """End ``session`` and hand back what it holds."""
        if session.closed:
            return 0, 0
        session.closed = True
        self._sessions.pop(session.id, None)
        left = self._per_client.get(session.client, 0) - 1
        if left > 0:
            self._per_client[session.client] = left
        else:
            self._per_client.pop(session.client, None)
        session.replies.clear()  # it may wait in the heap a while yet
        return self._release(session)

    def expire(self, limit: int | None = None) -> list[tuple[Session, int, int]]:
        """Close the sessions whose lease has lapsed, at most ``limit`` of them (None: all);
        returns them with what each released. A lapsed stream's ``on_lapse`` is called."""
        now = self.now()
        heap = self._heap
        out: list[tuple[Session, int, int]] = []
        while heap and heap[0][0] <= now and (limit is None or len(out) < limit):
            _, tag, session = heapq.heappop(heap)
            if session.closed:
                continue
            if session.expires_at > now:  # renewed since it was pushed
                heapq.heappush(heap, (session.expires_at, tag, session))
                continue
            session.lapsed = True
            locks, slots = self.close(session)
            out.append((session, locks, slots))
            if session.on_lapse is not None:
                session.on_lapse()
        self.expired_total += len(out)
        return out

    def next_expiry(self) -> float:
        """Seconds until the earliest lease may lapse (inf if none); a lower bound, since
        renewals since are found only when the reaper looks."""
        heap = self._heap
        while heap and heap[0][2].closed:
            heapq.heappop(heap)
        return max(0.0, heap[0][0] - self.now()) if heap else float("inf")


def _shown(client: str) -> str:
    """A client identity as a refusal names it: kind and the start of its name."""
    kind, _, who = client.partition(":")
    return f"{kind} {who[:64]!r}" if who else kind or "anonymous"


# Sessions and clients named in one expiry log line; the rest are only counted.
_NAMED = 8


def expiry_summary(expired: list[tuple[Session, int, int]]) -> dict[str, object]:
    """The fields of the one log line for a batch of lapsed sessions."""
    names = list(dict.fromkeys(s.name for s, _, _ in expired if s.name))
    return {
        "count": len(expired),
        "streams": sum(s.stream for s, _, _ in expired),
        "locks_released": sum(locks for _, locks, _ in expired),
        "slots_freed": sum(slots for _, _, slots in expired),
        "sessions": ",".join(s.id[:8] for s, _, _ in expired[:_NAMED])
        + (",..." if len(expired) > _NAMED else ""),
        "clients": ",".join(names[:_NAMED]) + (",..." if len(names) > _NAMED else ""),
    }
