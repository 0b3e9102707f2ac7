"""SlotEngine: a hosted model of kind ``slot`` (one contiguous KV slot per sequence).

It answers the same calls as ``ModelEngine`` so the RPC layer need not care, with the
slot model's meaning (see ``SlotPrefixCache``): a match names one sequence slot and a
version, and ``allocate`` hands the session a slot that already holds the matched
prefix's KV, reusing the cached slot in place when its owner has freed it and copying
the prefix into a fresh slot otherwise. Insert records that a session's slot holds a
sequence; the slot stays the session's until Free. Locks are pins.

Slot 0 is a real slot here (a row of the KV tensors), so ownership tags use the same
int64 array as ``ModelEngine`` over ``max_slots`` rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from prefixcache.cache import EvictResult, IntegrityError, InvalidInputError, RadixKey
from prefixcache.cache.distinct import has_repeats
from prefixcache.cache.pools.kv_pool import BufferFactory, checked_buffer
from prefixcache.cache.pools.slot_allocator import SlotAllocator
from prefixcache.cache.radix.lookup_outcomes import CAPACITY
from prefixcache.cache.slot.slot_cache import SlotPrefixCache

from ..config import ModelConfig
from ..errors import PoolExhaustedError, PreconditionError
from ..sessions.opaque_ids import OpaqueIds
from ..sessions.session import Session
from .base import EngineBase, needs_session
from .model_engine import _EMPTY
from .outcomes import InsertOutcome, MatchOutcome


class SlotEngine(EngineBase):
    """The slot allocator, KV tensors and slot prefix cache of one model."""

    def __init__(
        self,
        config: ModelConfig,
        next_lock_id: Any,
        buffer_factory: BufferFactory | None = None,
        handles: OpaqueIds | None = None,
    ) -> None:
        super().__init__(config, next_lock_id, handles)
        self.page_size = 1
        pool = config.pool
        self.max_seq_len = config.max_seq_len
        self.pool_size = pool.size
        self.allocator = SlotAllocator(pool.size)
        self.cache = SlotPrefixCache(
            self.allocator,
            pool.size * config.max_seq_len,
            max_seq_len=config.max_seq_len,
            eviction_policy=config.eviction_policy,
        )
        dtype = getattr(torch, pool.dtype)
        shape = (pool.size, config.max_seq_len, pool.layers)
        k_shape = (*shape, pool.k_heads, pool.k_head_dim)
        v_shape = (*shape, pool.v_heads or pool.k_heads, pool.v_head_dim or pool.k_head_dim)
        device = torch.device(pool.device)
        if buffer_factory is not None:  # shared memory, for workers that attach
            self.k_cache = checked_buffer(buffer_factory, k_shape, dtype, device)
            self.v_cache = checked_buffer(buffer_factory, v_shape, dtype, device)
        else:
            self.k_cache = torch.zeros(k_shape, dtype=dtype, device=device)
            self.v_cache = torch.zeros(v_shape, dtype=dtype, device=device)
        self.kv_pool = None
        self.swa_kv_pool = None
        self.mamba_pool = None
        self._owner = np.zeros(pool.size, dtype=np.int64)
        self.session_state_slots = 0

    def sizes(self) -> dict[str, int]:
        c = self.cache
        return {
            "evictable": c.evictable_size(),
            "protected": c.protected_size(),
            "swa_evictable": 0,
            "swa_protected": 0,
            "free_slots": self.allocator.free_count(),
            "used_slots": self.allocator.num_allocated(),
            "mamba_evictable": 0,
            "mamba_protected": 0,
            "free_state_slots": 0,
        }

    def match(
        self, key: RadixKey, session: Session | None, lock: bool = False, allocate: bool = False
    ) -> MatchOutcome:
        """The cached prefix's slot; with ``lock`` it is pinned, with ``allocate`` the
        session gets a slot holding it. Either all of that happens or nothing does."""
        if not (lock or allocate):
            found = self.cache.find(key)
            self._count_match(key, found.prefix_len)
            return _outcome(found)
        owner = needs_session(session, "a match with lock or allocate")
        found = self.cache.find(key)
        if lock and found.prefix_len:  # quotas first: a refused match pins nothing
            self.quota.check_lock(owner, found.prefix_len)
        if allocate:
            self.quota.check_slots(owner, 1)
        reuse = allocate and found.prefix_len > 0 and self.allocator.is_free(found.slot)
        if allocate and not reuse and not self.allocator.free_count():
            # Before the pin: a refused match changes nothing but the outcome count.
            self.lookups.add(CAPACITY, len(key))
            raise self._exhausted()
        # Pin before taking the slot: reusing it in place moves its version on, and the
        # prefix's entries, which name the old version, would no longer match.
        node = self._pin_found(key, found) if lock else None
        allocated, version = _EMPTY, None
        if allocate:
            try:
                slot, version = self._take(found, key, reuse)
            except BaseException as exc:
                if node is not None:
                    self.cache.release(node)
                if isinstance(exc, PoolExhaustedError):
                    self.lookups.add(CAPACITY, len(key))  # refused whole: no other outcome
                raise
            self._owner[slot] = owner.tag
            self.session_slots += 1
            owner.slots[self.name] = owner.slots.get(self.name, 0) + 1
            allocated = np.array([slot], dtype=np.int64)
        # A reservation: unused, it counts the hit (HeldLock.hit) under its outcome.
        lock_id = self._hold(owner, node, hit=found.prefix_len) if node is not None else 0
        # Counted once answered: a refused match changes nothing.
        self._count_match(key, found.prefix_len)
        return _outcome(found, self._handle(node), lock_id, allocated, version)

    def _pin_found(self, key: RadixKey, found: Any) -> Any:
        """Pin the prefix ``found`` names (None on a miss)."""
        if not found.prefix_len:
            return None
        node = self.cache.pin(key)
        if node is None or node.depth != found.prefix_len:
            # find and pin walk the same tree unchanged: a mismatch is a bug, not a refusal.
            if node is not None:
                self.cache.release(node)
            raise IntegrityError(
                f"model {self.name!r}: pin found "
                f"{0 if node is None else node.depth} tokens where find "
                f"found {found.prefix_len}"
            )
        return node

    def _take(self, found: Any, key: RadixKey, reuse: bool) -> tuple[int, int]:
        """A slot for the session holding the matched prefix: the cached slot itself if
        its owner freed it (no copy), else a fresh slot with the prefix copied in."""
        if reuse:
            version = self.allocator.occupy(found.slot, found.version)
            if version is not None:
                return found.slot, version
        slot = self.allocator.alloc()
        if slot is None:
            raise self._exhausted()
        if found.prefix_len:
            try:
                self.cache.copy_kv(key, slot, (self.k_cache, self.v_cache))
            except BaseException:
                self.allocator.free(slot)
                raise
        return slot, self.allocator.version(slot)

    def _exhausted(self) -> PoolExhaustedError:
        return PoolExhaustedError(
            f"model {self.name!r}: all {self.pool_size} sequence slots are held by sessions",
            self.name,
        )

    def insert(
        self,
        key: RadixKey,
        slots: np.ndarray,
        session: Session | None,
        lock: bool = False,
        release_lock_id: int = 0,
        state_slot: int | None = None,
        slot_version: int = 0,
    ) -> InsertOutcome:
        if state_slot is not None:
            raise PreconditionError(f"model {self.name!r} has no Mamba state pool")
        if len(slots) != 1:
            raise InvalidInputError(
                f"a slot model's insert names one sequence slot, got {len(slots)}"
            )
        slot = int(slots[0])
        self._check_held(session, slots)
        owner = needs_session(session, "an insert into a slot model")
        # Checked before the insert: a lock of another model (or none) changes nothing.
        self._check_release(owner, release_lock_id)
        if lock:  # the entry's prefix is at most the key
            self._check_lock_quota(owner, len(key), release_lock_id)
        result = self.cache.insert(key, slot, slot_version)
        self.ops["insert"] += 1
        self.evicted_tokens["pressure"] += result.evicted
        node = result.node
        lock_id = self._hold(owner, self.cache.pin(node)) if lock and node else 0
        if release_lock_id:
            self.unlock(owner, release_lock_id)
        cached = node.depth if node is not None else 0
        return InsertOutcome(result.prefix_len, cached, self._handle(node), lock_id, _EMPTY)

    def evict(self, num_tokens: int, swa_num_tokens: int = 0, mamba_num: int = 0) -> EvictResult:
        gone = self.cache.evict(num_tokens)
        self.ops["evict"] += 1
        self.evicted_tokens["requested"] += gone
        return EvictResult(full_evicted=gone)

    def lock(self, session: Session, node_id: int) -> int:
        if node_id == 0:
            return 0
        node = self._node(node_id)
        self.quota.check_lock(session, node.depth)
        return self._hold(session, self.cache.pin(node))

    def unlock(self, session: Session, lock_id: int) -> None:
        """Release one of ``session``'s locks on this model; refused if it is not one."""
        self.cache.release(self._held(session, lock_id).node)
        self._drop(session, lock_id)

    def alloc(
        self, session: Session, num_slots: int, num_states: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        if num_states:
            raise PreconditionError(f"model {self.name!r} has no Mamba state pool")
        self.quota.check_slots(session, num_slots)
        if num_slots > self.allocator.free_count():
            raise PoolExhaustedError(
                f"model {self.name!r}: {num_slots} slots asked, {self.allocator.free_count()} free",
                self.name,
                "larger_than_pool" if num_slots > self.pool_size else "pool_exhausted",
            )
        got = np.array([self.allocator.alloc() for _ in range(num_slots)], dtype=np.int64)
        self._owner[got] = session.tag
        self.session_slots += num_slots
        session.slots[self.name] = session.slots.get(self.name, 0) + num_slots
        self.ops["alloc"] += 1
        return got, _EMPTY

    def versions(self, slots: np.ndarray) -> np.ndarray:
        return np.array([self.allocator.version(int(s)) for s in slots], dtype=np.int64)

    def free(self, session: Session, slots: np.ndarray, states: np.ndarray = _EMPTY) -> None:
        if len(states):
            raise PreconditionError(f"model {self.name!r} has no Mamba state pool")
        self._check_held(session, slots)
        if not self._fenced(session, slots):
            self._release_slots(session, slots)

    def release_session(self, session: Session) -> tuple[int, int]:
        locks = self._my_locks(session)
        for lock_id in locks:
            self.unlock(session, lock_id)
        mine = np.flatnonzero(self._owner == session.tag)
        self._release_slots(session, mine)
        return len(locks), len(mine)

    def check_integrity(self) -> None:
        self.cache.check_integrity()
        self.allocator.check_integrity()
        owned = int(np.count_nonzero(self._owner))
        if owned != self.session_slots or owned != self.allocator.num_allocated():
            raise IntegrityError(
                f"{owned} slots owned by sessions, {self.session_slots} "
                f"counted, {self.allocator.num_allocated()} allocated"
            )

    def _check_held(self, session: Session | None, slots: np.ndarray) -> None:
        if len(slots) and (int(slots.min()) < 0 or int(slots.max()) >= self.pool_size):
            raise InvalidInputError(f"slot outside model {self.name!r}'s [0, {self.pool_size})")
        tag = session.tag if session is not None else -1
        held = self._owner[slots] == tag
        if not held.all():
            raise PreconditionError(
                f"slot {int(slots[np.argmin(held)])} is not held by this session"
            )
        if has_repeats(slots):
            raise InvalidInputError("a slot is named twice")

    def _retake(self, rows: np.ndarray, window: np.ndarray | None) -> None:
        for slot in rows.tolist():  # free after the clear, each under its version
            if self.allocator.occupy(slot, self.allocator.version(slot)) is None:
                raise PreconditionError(f"slot {slot} cannot be taken again after a reset")

    def _own(self, session: Session, rows: np.ndarray) -> None:
        self._owner[rows] = session.tag
        self.session_slots += len(rows)
        session.slots[self.name] = session.slots.get(self.name, 0) + len(rows)

    def _release_slots(self, session: Session, slots: np.ndarray) -> None:
        for slot in slots.tolist():
            self.allocator.free(slot)
        self._owner[slots] = 0
        self.session_slots -= len(slots)
        left = session.slots.get(self.name, 0) - len(slots)
        if left > 0:
            session.slots[self.name] = left
        else:
            session.slots.pop(self.name, None)


def _outcome(
    found: Any,
    node_id: int = 0,
    lock_id: int = 0,
    allocated: np.ndarray = _EMPTY,
    version: int | None = None,
) -> MatchOutcome:
    indices = np.array([found.slot], dtype=np.int64) if found.prefix_len else _EMPTY
    return MatchOutcome(
        found.prefix_len,
        indices,
        node_id,
        lock_id,
        allocated,
        slot_version=found.version,
        allocated_version=version,
    )
