"""The slot index: which page each slot of the slot file holds, in memory.

Per slot: the page's key (a 16-byte digest of its tier key, keys.py), its seal (32
bytes: the seal is kept here and in the journal, not in the slot, so a slot is the
page's bytes alone and reads straight into pool rows), when it was last used, how many
lookups read it, its write sequence number, and how many reads are in flight on it
(a pinned slot is never evicted, so a read never sees another page's bytes). A dict
finds a key's slot.

Eviction goes through the model's eviction policy (``models[].eviction_policy``,
prefixcache.cache.eviction): the policy is a priority function of a node's
``last_access_time``, ``hit_count`` and ``id``, and it is applied here to every slot
at once (``Entries``: the same fields, as arrays), lowest first; any policy written the
same way (elementwise: arithmetic and tuples of fields) ranks disk slots too. Within a
read, a deeper page counts as used a microsecond earlier than the one before it, so
ties evict the tail of a prefix first (the pages after a missing one are never found).
A batch of at least ``EVICT_FRACTION`` of the slots goes at once, ranked on a copy of
the fields and sorted outside the lock.

Retention (prefixcache.cache.retention) comes with a page from the pool
(``PageRetention``: priority, seconds, expiry on the wall clock, owner) and is kept per
slot: the ranking is the pool's (``eviction.Retaining``: a page whose retention is in
force is evicted after every page without one, the lower priority first), so a lapsed
retention counts as none. Each read of the page renews one in force for its seconds; a
page the pool evicts again while the slot holds it (``holds``) takes the larger of both,
as a second owner's hint does in the pool. Each owner (a tenant) may retain at most
``retain_limit`` slots: past it a page is kept unretained, until lapses (found when the
owner is at its bound) or evictions make room.

A slot whose page is forgotten (evicted, dropped) is **stale** until the journal says
so: its page's record is still there, and would bring the page back after a crash.
That is harmless while the slot's bytes are the page's, so the record that frees it is
written only before the slot is written over (``reserve`` names those slots; the
store journals them, then ``settled``). A page forgotten while a read is in flight on
its slot frees the slot once the read is done.

Thread-safe: every method takes the index's lock (the event loop's probes, the read
threads, the write thread).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from prefixcache.cache.distinct import distinct_counts
from prefixcache.cache.eviction import Retaining, held_priority

from ..backend import PageRetention

KEY_BYTES = 16
SEAL_BYTES = 32
# Slots evicted at once at least, as a fraction of all (the ranking sorts every slot).
EVICT_FRACTION = 1 / 64
# Seconds a deeper page of one read counts as used before the page in front of it.
DEPTH_STEP = 1e-6


class Entries:
    """Every slot's fields, as the eviction policy reads a node's (arrays)."""

    def __init__(
        self,
        last_access_time: np.ndarray,
        hit_count: np.ndarray,
        ids: np.ndarray,
        retain_priority: np.ndarray | None = None,
        retain_until: np.ndarray | None = None,
    ) -> None:
        self.last_access_time = last_access_time
        self.hit_count = hit_count
        self.id = ids
        self.retain_priority = retain_priority
        self.retain_until = retain_until


def owner_id(owner: str | None) -> int:
    """A retention owner as the index keeps it: a nonzero int64 (0: no owner)."""
    name = b"\x00" if owner is None else b"t" + owner.encode()
    value = int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "little", signed=True)
    return value or 1


class SlotIndex:
    """The pages of ``slots`` slots, evicted by ``policy`` (a priority function), with
    retention on top; an owner retains at most ``retain_limit`` slots (None: any)."""

    def __init__(
        self,
        slots: int,
        policy: Callable[[Any], Any],
        retain_limit: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.slots = slots
        self.policy = policy
        self.ranking = Retaining(policy, clock)
        self.clock = clock
        self.retain_limit = slots if retain_limit is None else retain_limit
        self.used = np.zeros(slots, dtype=bool)
        self.keys = np.zeros((slots, KEY_BYTES), dtype=np.uint8)
        self.seals = np.zeros((slots, SEAL_BYTES), dtype=np.uint8)
        self.last_access = np.zeros(slots, dtype=np.float64)
        self.hits = np.zeros(slots, dtype=np.int64)
        self.ids = np.zeros(slots, dtype=np.int64)
        self.pins = np.zeros(slots, dtype=np.int32)
        self.reserved = np.zeros(slots, dtype=bool)
        self.stale = np.zeros(slots, dtype=bool)
        self._orphans = np.zeros(slots, dtype=bool)  # forgotten while pinned
        # Retention per slot (priority 0: none); expiries on ``clock``.
        self.retain_priority = np.zeros(slots, dtype=np.int16)
        self.retain_seconds = np.zeros(slots, dtype=np.float64)
        self.retain_until = np.zeros(slots, dtype=np.float64)
        self.retain_owner = np.zeros(slots, dtype=np.int64)
        # Slots each owner retains (lapses not yet found count), and until when a
        # search for lapses of an owner at its bound would find none.
        self.retained: dict[int, int] = {}
        self._no_lapse_before: dict[int, float] = {}
        self.where: dict[bytes, int] = {}
        # Free slots, a stack popped from the end (the smallest on top at first).
        self._free = np.arange(slots - 1, -1, -1, dtype=np.int64)
        self._top = slots
        self.seq = 0  # the last write sequence number handed out
        self.evicted = 0
        self.lock = threading.Lock()

    @property
    def held(self) -> int:
        return len(self.where)

    # ------------------------------------------------------------------ reads

    def leading(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, the index holds."""
        where = self.where
        with self.lock:
            for i, key in enumerate(keys):
                if key not in where:
                    return i
        return len(keys)

    def holds(
        self, keys: Sequence[bytes], now: float, retain: PageRetention | None = None
    ) -> list[bool]:
        """Whether each key is held; each held one counts as used at ``now`` (and takes
        ``retain``)."""
        out = []
        with self.lock:
            for key in keys:
                slot = self.where.get(key)
                out.append(slot is not None)
                if slot is not None:
                    self.last_access[slot] = max(self.last_access[slot], now)
                    if retain is not None:
                        self._retain(slot, retain, now)
        return out

    def retentions(self, keys: Sequence[bytes], now: float) -> list[tuple[int, float, int] | None]:
        """Each key's retention in force at ``now`` as (priority, seconds, owner id), or
        None (not held, none, or lapsed); touches nothing."""
        out: list[tuple[int, float, int] | None] = []
        with self.lock:
            for key in keys:
                slot = self.where.get(key)
                if slot is None or not self.retain_priority[slot] or self.retain_until[slot] <= now:
                    out.append(None)
                else:
                    out.append(
                        (
                            int(self.retain_priority[slot]),
                            float(self.retain_seconds[slot]),
                            int(self.retain_owner[slot]),
                        )
                    )
        return out

    def slot_of(self, key: bytes) -> int:
        with self.lock:
            return self.where.get(key, -1)

    def pin(self, keys: Sequence[bytes]) -> tuple[list[int], np.ndarray]:
        """The slots of the leading keys held, pinned (``unpin`` them), and a copy of
        their seals."""
        slots: list[int] = []
        with self.lock:
            for key in keys:
                slot = self.where.get(key)
                if slot is None:
                    break
                slots.append(slot)
            if slots:
                self.pins[slots] += 1
            return slots, self.seals[slots].copy()

    def unpin(self, slots: Sequence[int], read: int, now: float) -> None:
        """Unpin ``slots``; the first ``read`` were read (used at ``now``, each deeper
        one a step earlier, and hit once more)."""
        if not slots:
            return
        with self.lock:
            mine = np.asarray(slots, dtype=np.int64)
            self.pins[mine] -= 1
            done = mine[(self.pins[mine] == 0) & self._orphans[mine]]
            if len(done):
                self._orphans[done] = False
                self._push_free(done.tolist())
            if read:
                mine = np.asarray(slots[:read], dtype=np.int64)
                live = self.used[mine]
                mine = mine[live]
                when = now - DEPTH_STEP * np.flatnonzero(live)
                self.last_access[mine] = when
                self.hits[mine] += 1
                # A hit renews a retention in force; a lapsed one stays out.
                held = mine[(self.retain_priority[mine] > 0) & (self.retain_until[mine] > now)]
                if len(held):
                    self.retain_until[held] = np.maximum(
                        self.retain_until[held], now + self.retain_seconds[held]
                    )

    # ----------------------------------------------------------------- writes

    def reserve(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``n`` slots for new pages (free ones first, then evicted ones by the
        policy); returns them and the stale ones among them (the caller journals their
        freeing before it writes over them, then calls ``settled``). Reserved slots hold
        no page until ``commit``, or go back with ``release``."""
        # The ranking reads the fields without the lock (a value a read changes meanwhile
        # only moves a page's rank); _evict checks each slot again under it.
        snapshot = self._snapshot() if self._top < n else None
        if snapshot is not None:
            order = self._rank(*snapshot)
            self._evict(order, max(n, int(self.slots * EVICT_FRACTION)))
        with self.lock:
            take = min(n, self._top)
            self._top -= take
            slots = self._free[self._top : self._top + take][::-1].copy()
            self.reserved[slots] = True
            return slots, slots[self.stale[slots]]

    def settled(self, slots: np.ndarray) -> None:
        """The journal says ``slots`` are free: no record brings their pages back."""
        with self.lock:
            self.stale[slots] = False

    def _snapshot(self) -> tuple[np.ndarray, ...]:
        candidates = np.flatnonzero(self.used & (self.pins == 0))
        return (
            candidates,
            self.last_access[candidates].copy(),
            self.hits[candidates].copy(),
            self.ids[candidates].copy(),
            self.retain_priority[candidates].copy(),
            self.retain_until[candidates].copy(),
        )

    def _rank(
        self,
        candidates: np.ndarray,
        last_access: np.ndarray,
        hits: np.ndarray,
        ids: np.ndarray,
        retain_priority: np.ndarray,
        retain_until: np.ndarray,
    ) -> np.ndarray:
        """``candidates`` in eviction order (the policy's lowest first, retention on
        top: the pool's ranking)."""
        now = self.clock()
        entries = Entries(last_access, hits, ids, retain_priority, retain_until)
        if held_priority(retain_priority, retain_until, now).any():
            priority = self.ranking.rank(entries, now)
        else:  # no retention in force: the policy alone orders them the same
            priority = self.policy(entries)
        if isinstance(priority, tuple):
            keys = [
                np.broadcast_to(np.asarray(p, dtype=np.float64), candidates.shape) for p in priority
            ]
            order = np.lexsort(keys[::-1])
        else:
            order = np.argsort(np.asarray(priority, dtype=np.float64), kind="stable")
        return candidates[order]

    def _evict(self, order: np.ndarray, want: int) -> None:
        """Evict up to ``want`` of ``order`` that are still held and unpinned."""
        gone: list[int] = []
        at = 0
        while len(gone) < want and at < len(order):
            chunk = order[at : at + want + 64].tolist()  # Python ints outside the lock
            at += len(chunk)
            with self.lock:
                for slot in chunk:
                    if len(gone) >= want:
                        break
                    if self.used[slot] and not self.pins[slot]:
                        self._clear(slot)
                        gone.append(slot)
        with self.lock:
            self.evicted += len(gone)
            self._push_free(gone)

    def commit(
        self,
        slots: Sequence[int],
        keys: Sequence[bytes],
        seals: np.ndarray,
        now: float,
        ids: Sequence[int],
        retain: Sequence[PageRetention | None] | None = None,
    ) -> None:
        """Reserved ``slots`` now hold the pages ``keys`` (written, journaled), each
        with its retention in ``retain`` (None: none)."""
        with self.lock:
            for slot, key, seq in zip(slots, keys, ids, strict=True):
                old = self.where.get(key)
                if old is not None:  # written twice meanwhile: keep the newer
                    self._forget([old])
                self.used[slot] = True
                self.keys[slot] = np.frombuffer(key, dtype=np.uint8)
                self.where[key] = slot
                self.last_access[slot] = now
                self.hits[slot] = 0
                self.ids[slot] = seq
            for slot, r in zip(slots, retain or (), strict=False):
                if r is not None:
                    self._retain(int(slot), r, now)
            if len(slots):
                self.seals[list(slots)] = seals
                self.reserved[list(slots)] = False

    def release(self, slots: Iterable[int]) -> None:
        """Reserved slots that got no page (their write failed) go back, free."""
        mine = [int(s) for s in slots]
        with self.lock:
            self.reserved[mine] = False
            self._push_free(mine)

    def next_ids(self, n: int) -> list[int]:
        with self.lock:
            first = self.seq + 1
            self.seq += n
        return list(range(first, first + n))

    def drop(self, keys: Iterable[bytes]) -> list[int]:
        """Forget the pages ``keys`` (those held); returns their slots."""
        with self.lock:
            gone = [slot for slot in map(self.where.get, keys) if slot is not None]
            self._forget(gone)
        return gone

    def drop_from(self, first: int) -> int:
        """Forget every page in slots ``first`` and after (a file cut short); how many."""
        with self.lock:
            gone = (np.flatnonzero(self.used[first:]) + first).tolist()
            self._forget(gone)
        return len(gone)

    def clear(self) -> None:
        """Forget every page, and every record of one (the files were made anew)."""
        with self.lock:
            self._forget(np.flatnonzero(self.used).tolist())
            self.stale[:] = False

    def load(
        self,
        slots: np.ndarray,
        keys: np.ndarray,
        seals: np.ndarray,
        last_access: np.ndarray,
        hits: np.ndarray,
        ids: np.ndarray,
        where: dict[bytes, int] | None = None,
        retention: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """Set the pages a start found (journal.py), on an empty index (``where``: their
        keys' slots, if made already; ``retention``: their priorities, seconds, expiries
        and owners; those lapsed by now are dropped)."""
        with self.lock:
            if retention is not None:
                self._load_retention(slots, ids, *retention)
            self.used[slots] = True
            self.keys[slots] = keys
            self.seals[slots] = seals
            self.last_access[slots] = last_access
            self.hits[slots] = hits
            self.ids[slots] = ids
            self.where = (
                where
                if where is not None
                else dict(zip(map(bytes, keys), slots.tolist(), strict=True))
            )
            self.seq = int(ids.max()) if len(ids) else 0
            free = np.flatnonzero(~self.used)
            self._free[: len(free)] = free[::-1]
            self._top = len(free)

    def _load_retention(
        self,
        slots: np.ndarray,
        ids: np.ndarray,
        priority: np.ndarray,
        seconds: np.ndarray,
        until: np.ndarray,
        owner: np.ndarray,
    ) -> None:
        """Set the retentions in force of loaded ``slots``, each owner's first written
        ones within its bound (the bound may be smaller than when they were written)."""
        live = np.flatnonzero((priority > 0) & (until > self.clock()))
        order = live[np.lexsort((ids[live], owner[live]))]
        owners = owner[order]
        heads = np.flatnonzero(np.concatenate(([True], owners[1:] != owners[:-1])))
        if len(order):
            runs = np.diff(heads, append=len(order))
            rank = np.arange(len(order)) - np.repeat(heads, runs)
            order = order[rank < self.retain_limit]
        on = slots[order]
        self.retain_priority[on] = priority[order]
        self.retain_seconds[on] = seconds[order]
        self.retain_until[on] = until[order]
        self.retain_owner[on] = owner[order]
        held, counts = distinct_counts(owner[order])
        self.retained = dict(zip(held.tolist(), counts.tolist(), strict=True))

    def entries(self) -> tuple[np.ndarray, ...]:
        """A copy of every held page's fields: slots, keys, seals, last access, hits,
        ids, retention priorities, seconds, expiries and owners (for the index file),
        and which slots are stale now (once that file replaces the journal, no record
        names them: ``settled`` them)."""
        with self.lock:
            slots = np.flatnonzero(self.used)
            return (
                slots,
                self.keys[slots].copy(),
                self.seals[slots].copy(),
                self.last_access[slots].copy(),
                self.hits[slots].copy(),
                self.ids[slots].copy(),
                self.retain_priority[slots].copy(),
                self.retain_seconds[slots].copy(),
                self.retain_until[slots].copy(),
                self.retain_owner[slots].copy(),
                np.flatnonzero(self.stale),
            )

    def retained_slots(self, owner: str | None = None) -> int:
        """Slots ``owner`` retains now (lapsed ones not counted)."""
        mine = owner_id(owner)
        with self.lock:
            return int(
                np.count_nonzero(
                    (self.retain_owner == mine)
                    & (self.retain_priority > 0)
                    & (self.retain_until > self.clock())
                )
            )

    # --------------------------------------------------------------- internal

    def _retain(self, slot: int, r: PageRetention, now: float) -> None:
        """Give ``slot`` the retention ``r`` (under the lock): the larger of both where
        one is in force (it stays counted against its first owner), else ``r`` if its
        owner is within its bound."""
        if r.until <= now or r.priority <= 0:
            return
        if self.retain_priority[slot] and self.retain_until[slot] > now:
            self.retain_priority[slot] = max(int(self.retain_priority[slot]), r.priority)
            self.retain_seconds[slot] = max(float(self.retain_seconds[slot]), r.seconds)
            self.retain_until[slot] = max(float(self.retain_until[slot]), r.until)
            return
        if self.retain_priority[slot]:  # lapsed: its owner's count goes
            self._unretain(slot)
        owner = owner_id(r.owner)
        if self.retained.get(owner, 0) >= self.retain_limit:
            self._find_lapses(owner, now)
            if self.retained.get(owner, 0) >= self.retain_limit:
                return  # past its owner's bound: an ordinary page
        self.retain_priority[slot] = min(r.priority, np.iinfo(np.int16).max)
        self.retain_seconds[slot] = r.seconds
        self.retain_until[slot] = r.until
        self.retain_owner[slot] = owner
        self.retained[owner] = self.retained.get(owner, 0) + 1
        if owner in self._no_lapse_before:
            self._no_lapse_before[owner] = min(self._no_lapse_before[owner], r.until)

    def _unretain(self, slot: int) -> None:
        owner = int(self.retain_owner[slot])
        left = self.retained.get(owner, 0) - 1
        if left > 0:
            self.retained[owner] = left
        else:
            self.retained.pop(owner, None)
        self.retain_priority[slot] = 0
        self.retain_seconds[slot] = 0.0
        self.retain_until[slot] = 0.0
        self.retain_owner[slot] = 0

    def _find_lapses(self, owner: int, now: float) -> None:
        """Uncount ``owner``'s lapsed retentions (a pass over every slot, so at most
        once until its earliest retention in force lapses)."""
        if now < self._no_lapse_before.get(owner, 0.0):
            return
        mine = (self.retain_owner == owner) & (self.retain_priority > 0)
        lapsed = np.flatnonzero(mine & (self.retain_until <= now))
        for slot in lapsed.tolist():
            self._unretain(slot)
        live = self.retain_until[mine & (self.retain_until > now)]
        self._no_lapse_before[owner] = float(live.min()) if len(live) else 0.0

    def _clear(self, slot: int) -> None:
        if self.retain_priority[slot]:
            self._unretain(slot)
        self.used[slot] = False
        self.stale[slot] = True
        key = self.keys[slot].tobytes()
        if self.where.get(key) == slot:
            del self.where[key]

    def _forget(self, slots: list[int]) -> None:
        """Clear ``slots`` and free them, or mark those being read to be freed once
        their reads are done."""
        for slot in slots:
            self._clear(slot)
        mine = np.asarray(slots, dtype=np.int64)
        busy = self.pins[mine] > 0
        self._orphans[mine[busy]] = True
        self._push_free(mine[~busy].tolist())

    def _push_free(self, slots: list[int]) -> None:
        """Put ``slots`` on top of the free stack, the smallest last (popped first), so
        that a batch freed together is taken again as runs of consecutive slots."""
        if not slots:
            return
        n = len(slots)
        mine = np.sort(np.asarray(slots, dtype=np.int64))[::-1]
        self._free[self._top : self._top + n] = mine
        self._top += n
