"""Who may read which KV rows, and what one KV transfer may take of a shared service.

ReadKV hands out the bytes of the pool, so it is held to the same rule as WriteKV: a
caller reads the slots its session holds, or the slots under a node its session has
locked. A model configured with ``open_reads`` lets any caller read any slot (one
tenant, trusted workers). A caller whose token is bound to a tenant (tenants.py)
reads only slots under its session's locks, whatever the model says: the tree's
slots of its own namespaces. Slots fresh from Alloc are not scrubbed, so until the
session writes them they hold bytes of whatever entry (of any namespace) used them
last; they are the tenant's to write, not to read.

A read is granted once, before its first chunk, and checked again before each chunk
against the rows that chunk copies: the session may have freed slots or released the
locks it was granted by while the stream waited to send, and those slots may by then
hold somebody else's KV.

Limits (``server.*``, see config/__init__.py): chunks of at least ``min_chunk_bytes``, so a
read cannot be split into millions of tiny messages; at most ``max_read_bytes`` per
read, duplicates included; and ``WriteBudget``, the bytes WriteKV streams hold for
rows that have not fully arrived, per session and in total.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from prefixcache.cache.distinct import distinct
from prefixcache.cache.pools.allocator import host_indices

from ..access.limits import Limits, request_tokens
from ..codec import decode_slots
from ..errors import OverLimitError, PreconditionError
from ..sessions.session import Session
from .kv_transfer import Part, plan, transfer_bytes


def chunk_bytes(requested: int, floor: int, ceiling: int) -> int:
    """The data bytes per ReadKV chunk: ``requested`` (0: the ceiling), raised to
    ``floor`` (min_chunk_bytes) and never above ``ceiling`` (the message limit).

    A request below the floor is raised rather than refused: chunking is the reader's
    convenience, and any chunk size reassembles to the same bytes.
    """
    return min(max(requested or ceiling, floor), ceiling)


def pool_bytes(engine: Any) -> int:
    """Bytes of every buffer a transfer can name in ``engine``'s pools."""
    if engine.kind == "slot":
        tensors = [engine.k_cache, engine.v_cache]
    else:
        tensors = [*engine.kv_pool.k_buffer, *engine.kv_pool.v_buffer]
        if engine.mamba_pool is not None:
            tensors += [*engine.mamba_pool.conv_state, *engine.mamba_pool.temporal_state]
    return sum(t.numel() * t.element_size() for t in tensors)


def check_read_size(engine: Any, total: int, limits: Limits) -> None:
    """Refuse a read of ``total`` bytes, more than ``max_read_bytes`` (by default the
    model's whole pool: the most a read can name without naming a slot twice).

    Raises:
        OverLimitError: naming ``max_read_bytes``.
    """
    cap = limits.max_read_bytes or pool_bytes(engine)
    if total > cap:
        raise OverLimitError(
            f"the read is {total} bytes (duplicates count), more than the "
            f"{cap} one read may answer (server.max_read_bytes; by "
            "default the model's whole pool)",
            "max_read_bytes",
        )


class ReadGrant:
    """Why a read may go on, and ``check``, run before each chunk, that it still may.

    Args:
        engine: The model read.
        session: The request's session, or None.
        slots, states: The KV and state slots named (plan() has range-checked them).
        open_reads: The model lets any caller read any slot.
        bound: The caller's token is bound to a tenant: locked slots only.

    Raises:
        PreconditionError: a slot the session neither holds nor has locked, or no
            session where one is needed. Nothing changes.
    """

    def __init__(
        self,
        engine: Any,
        session: Session | None,
        slots: np.ndarray,
        states: np.ndarray,
        *,
        open_reads: bool,
        bound: bool,
    ) -> None:
        self.engine = engine
        self.bound = bound
        self.session = None if open_reads and not bound else session
        self.kv_locked: np.ndarray | None = None
        self.state_locked: np.ndarray | None = None
        if self.session is None:
            if not (open_reads and not bound):
                raise PreconditionError(
                    f"ReadKV needs a session_id: only slots the session holds or has "
                    f"locked may be read (model {engine.name!r} does not have open_reads)"
                )
            return
        session = self.session
        # The locks the read relies on, each with what it covers: only their release
        # (not that of the session's other locks) can end the read early.
        locks = self._locks(engine, session)
        self._cover(locks)
        need_kv = self._unheld(session, slots, False)
        need_st = self._unheld(session, states, True)
        self.locks = {
            lid: cover
            for lid, cover in locks.items()
            if _touches(cover[0], need_kv) or _touches(cover[1], need_st)
        }
        if len(self.locks) != len(locks):
            self._cover(self.locks)
        self._check_rows(session, slots, False)
        self._check_rows(session, states, True)

    def check(self, part: Part, start: int, end: int) -> None:
        """Refuse unless rows [start, end) of ``part`` may still be read."""
        session = self.session
        if session is None:
            return
        if session.closed:
            raise PreconditionError("the session closed during the read")
        gone = [
            lid
            for lid, cover in self.locks.items()
            if lid not in session.locks or not self._current(cover[2])
        ]
        if gone:
            # Another lock of the session may still cover the rows: the rows decide.
            for lid in gone:
                del self.locks[lid]
            self._cover(self.locks)
        try:
            self._check_rows(session, part.host[start:end], part.is_state)
        except PreconditionError:
            if gone:
                raise PreconditionError(
                    f"lock {gone[0]} was released (or its slot handed on) during the read"
                ) from None
            raise

    def _current(self, pin: tuple[int, int] | None) -> bool:
        return pin is None or self.engine.allocator.is_current(*pin)

    def _cover(self, locks: dict[int, _Cover]) -> None:
        """The rows under ``locks``, sorted and distinct, so a chunk's check costs its
        rows and the locks' rows, never the pool's."""
        self.kv_locked = self.state_locked = None
        if not locks:
            return
        self.kv_locked = distinct(np.concatenate([kv for kv, _, _ in locks.values()]))
        if getattr(self.engine, "states", None) is not None:
            self.state_locked = distinct(np.concatenate([st for _, st, _ in locks.values()]))

    def _owner(self, state: bool) -> np.ndarray | None:
        if not state:
            return self.engine._owner
        states = getattr(self.engine, "states", None)
        return states._owner if states is not None else None

    def _unheld(self, session: Session, rows: np.ndarray, state: bool) -> np.ndarray:
        owner = self._owner(state)
        if self.bound or owner is None or not len(rows):
            return rows
        return rows[owner[rows] != session.tag]

    def _check_rows(self, session: Session, rows: np.ndarray, state: bool) -> None:
        if not len(rows):
            return
        locked = self.state_locked if state else self.kv_locked
        owner = self._owner(state)
        ok = _members(rows, locked) if locked is not None else np.zeros(len(rows), dtype=bool)
        if not self.bound and owner is not None:
            ok = ok | (owner[rows] == session.tag)
        if not ok.all():
            what = "state slot" if state else "slot"
            bad = int(rows[np.argmin(ok)])
            if self.bound:
                raise PreconditionError(
                    f"{what} {bad} is not under a lock of this session (a tenant's token "
                    "reads only slots under its session's locks)"
                )
            raise PreconditionError(
                f"{what} {bad} is neither held nor locked by this session (only those may be read)"
            )

    @staticmethod
    def _locks(engine: Any, session: Session) -> dict[int, _Cover]:
        """``session``'s locks on ``engine``, each with the KV slots, state slots and
        (slot models) the pinned ``(slot, version)`` it covers."""
        out: dict[int, _Cover] = {}
        for lock_id, held in session.locks.items():
            if held.engine is not engine:
                continue
            node = held.node
            if engine.kind == "slot":
                # A pin names (slot, version); a slot handed on since holds other KV.
                pin = (node.slot, node.version)
                if engine.allocator.is_current(*pin):
                    out[lock_id] = (np.array([node.slot], dtype=np.int64), _EMPTY, pin)
                continue
            state = getattr(node, "mamba_value", None)
            states = _EMPTY if state is None else np.array([int(state[0])], dtype=np.int64)
            # A lock protects the node's whole path: its slots are readable too.
            kv = []
            while node is not None and node.key_len:
                if node.value is not None and len(node.value):
                    kv.append(host_indices(node.value))
                node = node.parent
            out[lock_id] = (np.concatenate(kv) if kv else _EMPTY, states, None)
        return out


# What one lock covers: KV slots, state slots, and (slot models) the pinned version.
_Cover = tuple[np.ndarray, np.ndarray, "tuple[int, int] | None"]
_EMPTY = np.zeros(0, dtype=np.int64)


def _touches(covered: np.ndarray, needed: np.ndarray) -> bool:
    return bool(len(covered) and len(needed) and np.isin(needed, covered).any())


class WriteBudget:
    """Bytes WriteKV streams hold for rows not yet complete, per session and in total.

    Args:
        per_session: ``max_inflight_write_bytes``.
        total: ``max_inflight_write_bytes_total``.
    """

    def __init__(self, per_session: int, total: int) -> None:
        self.per_session = per_session
        self.total_cap = total
        self.total = 0
        self._by_session: dict[str, int] = {}

    def hold(self, session_id: str, delta: int) -> None:
        """Add ``delta`` bytes (negative: give back) to what ``session_id`` holds.

        Raises:
            OverLimitError: an increase past either cap; nothing is added.
        """
        mine = self._by_session.get(session_id, 0) + delta
        if delta > 0:
            if mine > self.per_session:
                raise OverLimitError(
                    f"this session's WriteKV streams would hold {mine} bytes of rows not "
                    f"yet complete, more than server.max_inflight_write_bytes "
                    f"({self.per_session}); send whole rows, or fewer streams at once",
                    "max_inflight_write_bytes",
                )
            if self.total + delta > self.total_cap:
                raise OverLimitError(
                    f"WriteKV streams would hold {self.total + delta} bytes of rows not "
                    f"yet complete, more than server.max_inflight_write_bytes_total "
                    f"({self.total_cap})",
                    "max_inflight_write_bytes_total",
                )
        self.total += delta
        if mine > 0:
            self._by_session[session_id] = mine
        else:
            self._by_session.pop(session_id, None)


def open_read(
    service: Any, request: Any, limits: Limits, bound: bool, max_chunk: int
) -> tuple[list[Part], int, ReadGrant]:
    """A ReadKV request checked, before its first chunk: its parts, the chunk size and
    the grant to check again before each chunk. ``bound``: the caller is a tenant.

    Raises:
        the refusal; nothing has been read.
    """
    engine = service.engine(request.model)
    service.check_epoch(request.server_epoch)
    cap = request_tokens(limits, engine.config)
    slots = decode_slots(request.slot_indices, max_count=cap)
    states = decode_slots(request.state_slots, "state_slots", cap)
    # Sized from the counts and the rows' sizes before any plan or check is built: a
    # slot named a million times is refused at the cost of its decoded vector.
    layers = list(request.layers)
    check_read_size(engine, transfer_bytes(engine, len(slots), layers, len(states)), limits)
    parts = plan(engine, slots, layers, states)
    session = service.session(request.session_id) if request.session_id else None
    grant = ReadGrant(
        engine, session, slots, states, open_reads=engine.config.open_reads, bound=bound
    )
    return parts, chunk_bytes(request.max_chunk_bytes, limits.min_chunk_bytes, max_chunk), grant


def _members(rows: np.ndarray, ordered: np.ndarray) -> np.ndarray:
    """Whether each of ``rows`` is in ``ordered`` (sorted, distinct)."""
    if not len(ordered):
        return np.zeros(len(rows), dtype=bool)
    at = np.minimum(np.searchsorted(ordered, rows), len(ordered) - 1)
    return ordered[at] == rows
