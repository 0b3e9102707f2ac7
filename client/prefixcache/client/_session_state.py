"""What a leased client session knows of its session on the service, shared by the
blocking and the asyncio client.

A service-side session ends when the service restarts or its lease lapses, and its
locks and slots go with it. The client session then opens a new one on its next call
that names no handle but the session (``match``, ``alloc``), so a worker keeps going.
Calls that name handles of the old session are refused without being sent: a lock id
the old session took, a ``server_epoch`` that is not the session's, or any such call
made before the new session is open. Sending them could release or free what now
belongs to somebody else.
"""

from __future__ import annotations

from typing import Any

from .errors import PrefixCacheError, SessionLost, StaleEpoch
from .results import InsertReply, LockReply, MatchReply, SessionInfo, UnlockReply

# Calls that name no handle but the session: they may open a new one first.
FRESH = frozenset({"match", "alloc"})
# What a refused call answers when it fails open (absent: it raises).
STAND_INS: dict[str, Any] = {
    "match": MatchReply(skipped=True),
    "insert": InsertReply(skipped=True),
    "lock": LockReply(skipped=True),
    "unlock": UnlockReply(skipped=True),
    "free": None,
}


def take_fail_open(name: str, kwargs: dict[str, Any], default: bool | None) -> bool | None:
    """The call's fail-open setting, left in ``kwargs`` for the calls that take one."""
    fail_open: bool | None = kwargs.pop("fail_open", default)
    if name != "alloc":  # which never fails open
        kwargs["fail_open"] = fail_open
    return fail_open


def stand_in(name: str) -> Any:
    """The fail-open answer of a session call (None: it cannot fail open)."""
    if name not in STAND_INS:
        return None
    value = STAND_INS[name]
    return lambda: value


class SessionState:
    """The current service-side session of a client session, and its stale handles.

    Attributes:
        session_id, ttl, server_epoch: of the current service-side session.
        lost: why the current session is gone (None while the service has it).
        reopened: how many times a new session replaced a lost one.
        dropped: calls refused because they named stale handles.
    """

    def __init__(self, info: SessionInfo) -> None:
        self.opened = bool(info.session_id)
        self.session_id = info.session_id
        self.ttl = info.ttl
        self.server_epoch = info.server_epoch
        self.lost: PrefixCacheError | None = None
        self.reopened = 0
        self.dropped = 0
        self._locks: set[int] = set()  # taken in the current session, not yet released
        self._stale_locks: set[int] = set()  # taken in earlier ones, not yet dropped

    @classmethod
    def unopened(cls, ttl: float | None, why: PrefixCacheError) -> SessionState:
        """A session the service could not open (failing open): its first fresh call
        opens it, as after a lost session, and nothing is sent before that."""
        state = cls(SessionInfo("", float(ttl or 0.0), 0))
        state.mark_lost(why)
        return state

    def service_restarted(self, epoch: int) -> None:
        if epoch != self.server_epoch:
            self.mark_lost(
                StaleEpoch(
                    f"the service restarted (epoch {self.server_epoch} -> {epoch})",
                    server_epoch=epoch,
                )
            )

    def mark_lost(self, err: PrefixCacheError) -> None:
        if self.lost is None:
            self.lost = err

    def replaced_by(self, info: SessionInfo) -> None:
        """A new service-side session took over; the old one's locks are stale."""
        self._stale_locks |= self._locks
        self._locks = set()
        self.session_id, self.ttl = info.session_id, info.ttl
        self.server_epoch = info.server_epoch
        self.lost = None
        if self.opened:
            self.reopened += 1
        self.opened = True

    def needs_reopen(self, name: str) -> bool:
        return self.lost is not None and name in FRESH

    def again(
        self, name: str, attempt: int, reply: Any = None, err: PrefixCacheError | None = None
    ) -> bool:
        """Whether a first try of a fresh call should run once more, in a new session:
        the service refused it as stale, or it failed open on a stale epoch."""
        if attempt or name not in FRESH:
            return False
        if err is not None:
            return isinstance(err, StaleEpoch)
        return getattr(reply, "skipped", False) and self.lost is not None

    def refusal(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> PrefixCacheError | None:
        """Why a call must not be sent (it names stale handles), or None."""
        epoch = kwargs.get("server_epoch")
        if epoch and epoch != self.server_epoch:
            return self._dropped(
                StaleEpoch(
                    f"{name} names handles of epoch {epoch}; the session is in epoch "
                    f"{self.server_epoch}",
                    server_epoch=self.server_epoch,
                )
            )
        lock = _lock_named(name, args, kwargs)
        if lock and lock in self._stale_locks:
            self._stale_locks.discard(lock)
            return self._dropped(
                SessionLost(f"lock {lock} was taken by a session the service no longer has")
            )
        if self.lost is not None and name not in FRESH:
            return self._dropped(
                SessionLost(
                    f"{name} names handles of a session the service no longer has ({self.lost})"
                )
            )
        return None

    def record(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], reply: Any) -> None:
        """Track the lock ids the current session holds."""
        if getattr(reply, "skipped", False):
            return
        if released := _lock_named(name, args, kwargs):
            self._locks.discard(released)
        if taken := getattr(reply, "lock_id", 0):
            self._locks.add(taken)

    def _dropped(self, err: PrefixCacheError) -> PrefixCacheError:
        self.dropped += 1
        return err


def _lock_named(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    if name == "unlock":
        return int(args[0] if args else kwargs.get("lock_id", 0))
    if name == "insert":
        return int(kwargs.get("release_lock_id", 0) or 0)
    return 0
