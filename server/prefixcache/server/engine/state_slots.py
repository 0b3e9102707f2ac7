"""StateSlots: the Mamba state slots of one hybrid model, and which session holds which.

A state slot is held by exactly one of: the pool's free list, a tree node (a snapshot
of the state after its prefix), or a session (allocated for a request, not yet
inserted or freed). Like KV slots, session holdings are one int64 tag array, so a
client naming a slot it does not hold is refused before anything changes.
"""

from __future__ import annotations

import numpy as np
import torch

from prefixcache.cache import IntegrityError, InvalidInputError
from prefixcache.cache.distinct import distinct_counts
from prefixcache.cache.mamba.mamba_radix_cache import MambaRadixCache
from prefixcache.cache.pools.kv_pool import BufferFactory
from prefixcache.cache.pools.mamba_pool import MambaPool

from ..config import MambaConfig
from ..errors import PoolExhaustedError, PreconditionError
from ..sessions.session import Session
from .slot_checks import check_distinct


def mamba_pool(
    config: MambaConfig, device: str, buffer_factory: BufferFactory | None = None
) -> MambaPool:
    return MambaPool(
        config.working_slots,
        config.state_slots,
        config.layers,
        config.conv_state_shape,
        config.temporal_state_shape,
        getattr(torch, config.dtype),
        getattr(torch, config.temporal_dtype),
        device,
        buffer_factory,
    )


class StateSlots:
    """Session ownership of a ``MambaPool``'s state (track) slots."""

    def __init__(self, name: str, pool: MambaPool, cache: MambaRadixCache) -> None:
        self.name = name
        self.pool = pool
        self.cache = cache
        self._owner = np.zeros(pool.num_slots, dtype=np.int64)
        self.held = 0  # slots held by sessions
        # Per session tag, for its quota (max_session_state_slots) without a scan.
        self._held_by: dict[int, int] = {}
        # Slots tree nodes and sessions may hold (the rest are attached workers').
        self.capacity = pool.max_track_slots

    def held_by(self, session: Session) -> int:
        """State slots ``session`` holds."""
        return self._held_by.get(session.tag, 0)

    def allocate(self, n: int, session: Session) -> tuple[np.ndarray, int]:
        """``n`` slots for ``session``, evicting snapshots if short; also returns the KV
        tokens that eviction freed (a snapshot's leaf goes with its KV)."""
        short = n - self.pool.available_track_slots()
        if short > self.cache.mamba_evictable_size():
            raise PoolExhaustedError(
                f"model {self.name!r} cannot supply {n} state slots: "
                f"{self.pool.available_track_slots()} free and "
                f"{self.cache.mamba_evictable_size()} evictable",
                self.name,
                "larger_than_pool" if n > self.capacity else "pool_exhausted",
            )
        freed_tokens = self.cache.evict(0, short).full_evicted if short > 0 else 0
        slots = np.array([self.pool.alloc_track_slot() for _ in range(n)], dtype=np.int64)
        self._owner[slots] = session.tag
        self.held += n
        if n:
            self._held_by[session.tag] = self._held_by.get(session.tag, 0) + n
        return slots, freed_tokens

    def check(self, session: Session | None, slots: np.ndarray) -> None:
        """Refuse unless ``session`` holds every one of ``slots`` (each named once)."""
        if len(slots) and (int(slots.min()) < 0 or int(slots.max()) >= len(self._owner)):
            raise InvalidInputError(f"state slot outside [0, {len(self._owner)})")
        tag = session.tag if session is not None else -1
        held = self._owner[slots] == tag
        if not held.all():
            raise PreconditionError(
                f"state slot {int(slots[np.argmin(held)])} is not held by this session"
            )
        check_distinct(slots)

    def free(self, slots: np.ndarray) -> None:
        """Back to the pool (the caller checked that the session holds them)."""
        for slot in slots.tolist():
            self.pool.free_track_slot(slot)
        self.disown(slots)

    def disown(self, slots: np.ndarray) -> None:
        """The session no longer holds ``slots`` (the tree took them, or they were freed)."""
        tags, counts = distinct_counts(self._owner[slots])
        for tag, n in zip(tags.tolist(), counts.tolist(), strict=True):
            left = self._held_by.get(tag, 0) - n
            if left > 0:
                self._held_by[tag] = left
            else:
                self._held_by.pop(tag, None)
        self._owner[slots] = 0
        self.held -= len(slots)

    def release(self, session: Session) -> None:
        if self.held:
            self.free(np.flatnonzero(self._owner == session.tag))

    def reset(self) -> None:
        self.pool.clear()
        self._owner[:] = 0
        self.held = 0
        self._held_by.clear()

    def check_integrity(self) -> None:
        owned = int(np.count_nonzero(self._owner))
        if owned != self.held:
            raise IntegrityError(f"{owned} state slots owned by sessions, {self.held} counted")
        tags, counts = distinct_counts(self._owner[self._owner != 0])
        if dict(zip(tags.tolist(), counts.tolist(), strict=True)) != self._held_by:
            raise IntegrityError("state slots counted per session disagree with their owners")
        in_use = self.pool.num_allocated_track_slots()
        if in_use != self.cache.mamba_total_size() + self.held:
            raise IntegrityError(
                f"{in_use} state slots allocated, {self.cache.mamba_total_size()}"
                f" in the tree and {self.held} held by sessions"
            )
