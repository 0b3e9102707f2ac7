"""Per-session quotas: how much of a model one session may hold, and its KV streams.

One session must not take the pool (allocate every slot) or pin the cache (lock every
cached token) from the other clients of a shared sidecar. So each engine checks, before
it changes anything, that the call keeps the session within its model's caps:

* **slots** (``max_session_slots``): KV slots (for a ``slot`` model, sequence slots)
  the session holds in the model's pool, allocated and not yet inserted or freed,
  counted in whole pages: an allocation takes whole pages, and a page comes back only
  when none of its slots is held, so ``Alloc(1)`` with 16-slot pages takes 16 slots
  of the pool and counts 16 (counting 1 would let 256 of them take a 4096-slot pool
  under a cap of 512). 0, the default, takes the pool size: no cap but the pool's own,
  since the one worker of a per-pod sidecar legitimately uses all of it.
* **state slots** (``max_session_state_slots``): a ``mamba`` model's state slots the
  session holds (Alloc's ``num_state_slots``, one per Match with ``allocate``), counted
  apart from KV slots since the state pool is small and separate. 0, the default, takes
  the state pool's size, like ``max_session_slots``.
* **locked tokens** (``max_session_locked_tokens``): a lock on a node protects the
  node's whole path from the root, so it counts that path's length in tokens,
  ``HeldLock.tokens``, fixed when the lock is taken (a split keeps the node object on
  the deeper part, so the node's depth does not change while it is locked). A
  session's locked tokens are the sum over its locks: a prefix shared by ten of its
  locks counts ten times. That makes the count an upper bound of the distinct tokens
  the session pins, and keeps it a counter updated once per lock and unlock, instead
  of a union of paths per session. By default (None) a ``radix``, ``swa`` or ``mamba``
  model takes 90% of its pool's tokens (``DEFAULT_LOCKED_SHARE``): since the sum bounds
  the distinct tokens from above, one session can then never protect the whole cache,
  and the others always have a tenth of it to evict into. A worker whose concurrent
  requests lock one long shared prefix counts it per lock, so it may need more (or 0,
  off); ``slot`` and ``chunk`` models have no default cap.
* **streams** (``max_session_streams``): ReadKV and WriteKV streams naming the session
  that are in flight at once (each holds loop time and, for WriteKV, partial rows).

The service's own sessions (``Session.internal``: the tier's, which bounds its fetches
by ``tier.max_fetch_slots``) are no client's: no quota applies to them.

A refusal is RESOURCE_EXHAUSTED naming the setting, and the call changes nothing. A
Match with ``lock`` and ``allocate`` is checked for both before the lock is taken, an
Insert with ``lock`` before the insert (its ``release_lock_id``'s tokens are taken off,
as the insert hands the lock over), GetPages before each lock it takes (undoing the
others on a refusal), and Step items as their unary calls are, since they run the
same engine calls.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..access.limits import Limits
from ..errors import OverLimitError
from .session import Session

# The share of a tree model's pool tokens that one session's locks may protect by
# (max_session_locked_tokens "auto", None here): short of all, so others can still evict.
DEFAULT_LOCKED_SHARE = 0.9
_TREE_KINDS = ("radix", "swa", "mamba")


class Quota:
    """One model's per-session caps, which its engine checks (0: no cap)."""

    __slots__ = ("locked_tokens", "model", "slots", "state_slots")

    def __init__(
        self, model: str = "", slots: int = 0, locked_tokens: int = 0, state_slots: int = 0
    ) -> None:
        self.model = model
        self.slots = slots
        self.locked_tokens = locked_tokens
        self.state_slots = state_slots

    @classmethod
    def of(cls, limits: Limits, engine: Any) -> Quota:
        """``engine``'s caps under ``limits`` (0 slots: the model's pool size; 0 state
        slots: its state pool's; None locked tokens: ``DEFAULT_LOCKED_SHARE`` of a tree
        model's pool, off for the other kinds)."""
        locked = limits.max_session_locked_tokens
        if locked is None:
            locked = (
                int(engine.pool_size * DEFAULT_LOCKED_SHARE) if engine.kind in _TREE_KINDS else 0
            )
        states = getattr(engine, "states", None)
        return cls(
            engine.name,
            limits.max_session_slots or engine.pool_size,
            locked,
            limits.max_session_state_slots or (states.capacity if states else 0),
        )

    def check_slots(self, session: Session, n: int, held: int | None = None) -> None:
        """Refuse ``n`` more slots for ``session``, which takes ``held`` (None: the slots
        it holds; a paged model passes both in whole pages).

        Raises:
            OverLimitError: naming ``max_session_slots``.
        """
        if session.internal:
            return
        if held is None:
            held = session.slots.get(self.model, 0)
        self._check("max_session_slots", self.slots, held, n)

    def check_state_slots(self, session: Session, n: int, held: int) -> None:
        """Refuse ``n`` more state slots for ``session``, which holds ``held``.

        Raises:
            OverLimitError: naming ``max_session_state_slots``.
        """
        if session.internal:
            return
        self._check("max_session_state_slots", self.state_slots, held, n)

    def check_lock(self, session: Session, tokens: int) -> None:
        """Refuse a lock protecting ``tokens`` more for ``session`` (net of a lock it
        hands over in the same call).

        Raises:
            OverLimitError: naming ``max_session_locked_tokens``.
        """
        if session.internal:
            return
        self._check(
            "max_session_locked_tokens",
            self.locked_tokens,
            session.locked_tokens.get(self.model, 0),
            tokens,
        )

    def _check(self, setting: str, cap: int, held: int, n: int) -> None:
        """Refuse ``n`` more of what ``setting`` caps at ``cap`` (0: no cap) for a session
        that holds ``held``."""
        if cap and n > 0 and held + n > cap:
            raise OverLimitError(
                _REFUSALS[setting].format(
                    held=held, n=n, cap=cap, model=self.model, setting=setting
                ),
                setting,
            )


# Each cap's refusal, formatted only when one is made.
_HOLD = (
    "this session holds {held} {what} of model {model!r} and asks for {n} more, past "
    "the {cap} one session may hold (server.{setting}): insert or free what it holds "
    "first"
)
_REFUSALS = {
    "max_session_slots": _HOLD.replace("{what}", "slots (whole pages)").replace(
        "asks for {n} more", "asks for {n} more (whole pages)"
    ),
    "max_session_state_slots": _HOLD.replace("{what}", "state slots"),
    "max_session_locked_tokens": (
        "this session's locks on model {model!r} protect {held} tokens and this lock {n} "
        "more, past the {cap} one session may lock (server.{setting}; a lock counts its "
        "whole prefix): unlock some first"
    ),
}


# Engines are built with this; CacheService gives each its model's quota.
NO_QUOTA = Quota()


def prefix_tokens(node: Any) -> int:
    """Tokens from the root to ``node``: what a lock on it protects. Slot-cache nodes
    know their depth; a tree node's is summed up its path (the walk the lock itself
    makes to the root, so it costs the lock no more than its own order)."""
    depth = getattr(node, "depth", None)
    if depth is not None:
        return int(depth)
    tokens = 0
    while node is not None:
        tokens += node.key_len
        node = node.parent
    return tokens


class StreamQuota:
    """ReadKV and WriteKV streams in flight per session (``max_session_streams``)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap

    def open(self, session: Session | None) -> Session | None:
        """Count a stream of ``session`` (None: a sessionless read, not counted); returns
        what to pass to ``close`` when the stream ends.

        Raises:
            OverLimitError: naming ``max_session_streams``; nothing is counted.
        """
        if session is None:
            return None
        if session.streams >= self.cap:
            raise OverLimitError(
                f"this session has {session.streams} ReadKV/WriteKV streams in flight, the "
                f"{self.cap} one session may have at once (server.max_session_streams)",
                "max_session_streams",
            )
        session.streams += 1
        return session

    @staticmethod
    def close(session: Session | None) -> None:
        if session is not None:
            session.streams -= 1


def audit(sessions: Iterable[Session]) -> list[str]:
    """What disagrees between the sessions' quota counters and their locks: each
    session's locked tokens per model are the sum of its locks' tokens there, and each
    lock's tokens are still its node's depth."""
    problems: list[str] = []
    for session in sessions:
        sums: dict[str, int] = {}
        for lock_id, held in session.locks.items():
            sums[held.engine.name] = sums.get(held.engine.name, 0) + held.tokens
            depth = prefix_tokens(held.node)
            if held.tokens != depth:
                problems.append(
                    f"session {session.id[:8]}: lock {lock_id} counts "
                    f"{held.tokens} tokens, its node's depth is {depth}"
                )
        counted = {k: v for k, v in session.locked_tokens.items() if v}
        if counted != sums:
            problems.append(
                f"session {session.id[:8]}: locked tokens {counted}, its locks sum to {sums}"
            )
        if session.streams < 0:
            problems.append(f"session {session.id[:8]}: {session.streams} streams")
    return problems
