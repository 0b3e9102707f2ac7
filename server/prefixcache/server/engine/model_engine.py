"""ModelEngine: one hosted model's pools and cache, driven on behalf of sessions.

The engine adds to the cache library what a shared service needs and an in-process
cache does not: node handles that can go stale, locks and slots owned by sessions,
and validation of every slot a client names before anything changes, so that a
client's mistake is refused instead of corrupting the pool.

Slot ownership (one int64 array over the pool rows, slot -> session tag) and the
checks over it live in engine/slots.py.

Not thread-safe: the service calls every engine from one event loop (see app.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from prefixcache.cache import (
    ChunkCache,
    EvictResult,
    IntegrityError,
    InvalidInputError,
    KVPool,
    RadixCache,
    RadixKey,
    SWARadixCache,
    SWATokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from prefixcache.cache.index.change_log import DEFAULT_CAPACITY, ChangeLog
from prefixcache.cache.index.page_index import PageIndex
from prefixcache.cache.mamba.mamba_radix_cache import MambaRadixCache
from prefixcache.cache.pages import whole_pages
from prefixcache.cache.pools.allocator import host_indices
from prefixcache.cache.pools.kv_pool import BufferFactory
from prefixcache.cache.radix.lookup_outcomes import CAPACITY

from ..config import ConfigError, ModelConfig
from ..errors import PoolExhaustedError, PreconditionError
from ..sessions.opaque_ids import OpaqueIds
from ..sessions.quotas import prefix_tokens
from ..sessions.session import Session
from .base import EngineBase, needs_session
from .outcomes import InsertOutcome, MatchOutcome
from .slot_checks import check_distinct
from .slots import SlotOwnership
from .state_slots import StateSlots, mamba_pool

_EMPTY = np.zeros(0, dtype=np.int64)


class ModelEngine(SlotOwnership, EngineBase):
    """The pools and cache of one model.

    Args:
        config: The model's configuration.
        next_lock_id: Hands out service-wide lock ids.
    """

    def __init__(
        self,
        config: ModelConfig,
        next_lock_id: Any,
        buffer_factory: BufferFactory | None = None,
        handles: OpaqueIds | None = None,
        *,
        change_log: bool = False,
        change_log_capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        super().__init__(config, next_lock_id, handles)
        # The page set's change log (KV events, shadow indexes); chunk caches no pages.
        self.change_log = (
            ChangeLog(change_log_capacity) if change_log and config.kind != "chunk" else None
        )
        # Radix models with page hashes find pages by hash (hash_pages.py, SGLang HiCache);
        # the index listens to the cache and passes token pages on to the change log.
        self.page_index = (
            PageIndex(self.change_log)
            if self.change_log is not None and config.kind == "radix"
            else None
        )
        self.page_size = config.page_size
        pool = config.pool
        kv = {
            "page_size": config.page_size,
            "dtype": getattr(torch, pool.dtype),
            "layer_num": pool.layers,
            "k_head_num": pool.k_heads,
            "k_head_dim": pool.k_head_dim,
            "v_head_num": pool.v_heads,
            "v_head_dim": pool.v_head_dim,
            "device": pool.device,
            "buffer_factory": buffer_factory,
            "mla": pool.mla,
        }
        self.kv_pool = KVPool(pool.size, **kv)
        self.swa_kv_pool: KVPool | None = None
        self.states: StateSlots | None = None
        # Slot indices are host data (they cross the wire), whatever the KV device.
        if config.kind == "swa":
            swa_size = pool.swa_size or pool.size
            self.swa_kv_pool = KVPool(swa_size, **kv)
            self.allocator: Any = SWATokenToKVPoolAllocator(
                pool.size, swa_size, "cpu", config.page_size
            )
            self.cache: Any = SWARadixCache(
                config.page_size,
                config.sliding_window_size,
                self.allocator,
                eviction_policy=config.eviction_policy,
                listener=self.change_log,
            )
        else:
            self.allocator = TokenToKVPoolAllocator(pool.size, "cpu", config.page_size)
            if config.kind == "mamba":
                if config.mamba is None:  # load_config refuses this; a hand-built one may not
                    raise ConfigError(f"models.{config.name}: kind mamba needs a mamba section")
                states = mamba_pool(config.mamba, pool.device, buffer_factory)
                self.cache = MambaRadixCache(
                    config.page_size,
                    self.allocator,
                    states,
                    mamba_cache_chunk_size=config.mamba.chunk_size,
                    listener=self.change_log,
                )
                self.states = StateSlots(config.name, states, self.cache)
            elif config.kind == "chunk":
                self.cache = ChunkCache(self.allocator)
            else:
                self.cache = RadixCache(
                    config.page_size,
                    None,
                    self.allocator,
                    eviction_policy=config.eviction_policy,
                    listener=self.change_log if self.page_index is None else self.page_index,
                )
        if config.kind != "chunk":  # remember evicted pages (lookups.py)
            self.lookups.attach(self.cache)
        self.pool_size = pool.size
        self.num_rows = self.kv_pool.num_rows
        self._owner = np.zeros(self.num_rows, dtype=np.int64)
        self._page_held = np.zeros(-(-self.num_rows // self.page_size), dtype=np.int32)
        self.session_slots = 0
        self._quarantined = np.zeros(self.num_rows, dtype=np.bool_)  # engine/slots.py
        self.quarantined = 0
        # Per session tag: [slots, runs] of what it was allocated since it last held
        # nothing (engine/slots.py), or None once too many to follow.
        self._alloc_runs: dict[int, list[Any] | None] = {}

    # ----------------------------------------------------------------- reads

    def sizes(self) -> dict[str, int]:
        """Gauges for Stats and metrics."""
        c = self.cache
        return {
            "evictable": c.evictable_size(),
            "protected": c.protected_size(),
            "swa_evictable": c.swa_evictable_size(),
            "swa_protected": c.swa_protected_size(),
            "free_slots": self.allocator.available_size(),
            "used_slots": self.allocator.num_allocated(),
            "mamba_evictable": c.mamba_evictable_size() if self.states else 0,
            "mamba_protected": c.mamba_protected_size() if self.states else 0,
            "free_state_slots": self.states.pool.available_track_slots() if self.states else 0,
        }

    @property
    def mamba_pool(self) -> Any:
        return self.states.pool if self.states else None

    @property
    def session_state_slots(self) -> int:
        return self.states.held if self.states else 0

    # ------------------------------------------------------------ operations

    def match(
        self,
        key: RadixKey,
        session: Session | None,
        lock: bool = False,
        allocate: bool = False,
        as_pages: bool = False,
    ) -> MatchOutcome:
        """Longest cached prefix; optionally lock it and allocate slots for the rest.

        ``as_pages``: the hit ends before the first page whose slots are not one whole
        aligned page (an insert given other slots), so it can be answered as page ids.
        """
        owner = (
            needs_session(session, "a match with lock or allocate") if lock or allocate else None
        )
        result = self.cache.match_prefix(key)
        if as_pages and result.prefix_len and self.page_size > 1:
            good = (
                whole_pages(host_indices(result.indices)[: result.prefix_len], self.page_size)
                * self.page_size
            )
            if good < result.prefix_len:  # rare: matched again, only up to that page
                result = self.cache.match_prefix(key[:good])
        node = result.last_node if result.prefix_len else None
        node_id = self._handle(node)
        lock_id, allocated, boundary, state, tokens = 0, _EMPTY, None, None, None
        if owner is not None:  # quotas first: a refused match takes no lock
            if lock and node is not None:
                tokens = prefix_tokens(node)
                self.quota.check_lock(owner, tokens)
            if allocate:
                self._check_slot_quota(owner, len(key) - result.prefix_len)
                if self.states is not None:
                    self.quota.check_state_slots(owner, 1, self.states.held_by(owner))
        if node is not None and (lock or allocate):
            # Held while allocating too, so eviction cannot free what we just matched.
            boundary = self.cache.inc_lock_ref(node)
        try:
            if allocate and owner is not None:  # owner is set whenever allocate is
                allocated, states = self.alloc(
                    owner, len(key) - result.prefix_len, 1 if self.states else 0
                )
                state = int(states[0]) if len(states) else None
        except PoolExhaustedError:
            if node is not None:
                self.cache.dec_lock_ref(node, boundary)
            self.lookups.add(CAPACITY, len(key))  # refused whole: no other outcome
            raise
        except BaseException:
            if node is not None:
                self.cache.dec_lock_ref(node, boundary)
            raise
        if node is not None and lock and owner is not None:
            lock_id = self._hold(owner, node, boundary, tokens, hit=result.prefix_len)
        elif node is not None and allocate:
            self.cache.dec_lock_ref(node, boundary)
        # Counted once answered: a refused match (no room to allocate) changes nothing.
        self._count_match(key, result.prefix_len)
        state_slot = None
        if node is not None and self.states is not None:
            state_slot = int(node.mamba_value[0])
        return MatchOutcome(
            result.prefix_len,
            host_indices(result.indices),
            node_id,
            lock_id,
            allocated,
            state_slot,
            result.mamba_branching_seqlen,
            state,
        )

    def _count_outcomes(self, key: RadixKey, hit: int) -> None:
        if self.kind == "chunk":
            super()._count_outcomes(key, hit)
            return
        classified = self.lookups.classify(self.cache, key, hit, check_same=self.kind != "radix")
        self.lookups.count(classified, len(key))

    def insert(
        self,
        key: RadixKey,
        slots: np.ndarray,
        session: Session | None,
        lock: bool = False,
        release_lock_id: int = 0,
        state_slot: int | None = None,
        *,
        keep_duplicates: bool = False,
    ) -> InsertOutcome:
        """Cache ``key`` with ``slots``; the tree takes the session's new slots.

        Each of the first ``aligned`` slots must be the tree's own slot for its token
        (a prefix from an earlier match) or a slot the session holds; the session's
        slots for tokens the tree already has are freed, or with ``keep_duplicates``
        stay the session's. All checks run first.
        """
        n = len(key)
        if len(slots) != n:
            raise InvalidInputError(f"slot_indices has {len(slots)} slots for {n} tokens")
        if keep_duplicates and self.kind == "swa":  # its insert frees what it does not keep
            raise PreconditionError(
                f"keep_duplicates is for radix, mamba and chunk models; {self.name!r} is swa"
            )
        if lock and session is None:
            raise PreconditionError("lock needs a session_id")
        # Checked before anything changes: a lock of another model (or none) is refused.
        self._check_release(session, release_lock_id)
        aligned = n - n % self.page_size
        tag = session.tag if session is not None else -1
        if self.kind == "chunk":
            aligned = 0  # nothing is cached: every slot stays the session's
        head = slots[:aligned]
        tree = host_indices(self.cache.peek_prefix(key)) if aligned else _EMPTY
        # One pass over the slots where they pass every check (the usual case); the
        # checks one by one, which name what is wrong, only where they may not.
        checked = self._checked_head(slots, head, tree, tag)
        if checked is None:
            self._check_range(slots)
        state = np.array([] if state_slot is None else [state_slot], dtype=np.int64)
        if state_slot is not None:
            self._states().check(session, state)
        if checked is None:
            first_held, runs = self._check_head(head, tree, tag), None
        else:
            first_held, runs = checked
        new = head[first_held:]
        if lock and session is not None:  # its prefix is at most the aligned tokens
            self._check_lock_quota(session, aligned, release_lock_id)

        self.ops["insert"] += 1
        value = torch.from_numpy(slots)
        if self.kind == "swa":
            result = self.cache.insert(key, value, prev_prefix_len=first_held)
            after = host_indices(self.cache.peek_prefix(key))[first_held:aligned]
            freed = new[new != after] if len(after) == len(new) else new
        else:
            if self.states is not None:
                result = self.cache.insert(key, value, mamba_value=state_slot)
            else:
                result = self.cache.insert(key, value)
            freed = new[: max(0, result.prefix_len - first_held)]
            if keep_duplicates and len(freed):  # they stay the session's
                new, runs, freed = new[len(freed) :], None, _EMPTY
            elif len(freed):
                self.allocator.free(freed)
        self._set_owner(new, runs, 0)
        self._count_pages(session, new, -1, runs)
        self._disown(session, len(new))
        state_exist = bool(getattr(result, "mamba_exist", False))
        if state_slot is not None:  # the tree took it, or had a state there already
            (self._states().free if state_exist else self._states().disown)(state)
        node = result.last_node if aligned else None
        if node is not None and node is self.cache.root_node:
            node = None
        lock_id = 0
        if lock and node is not None:
            owner = needs_session(session, "lock")  # checked above, before any change
            lock_id = self._hold(owner, node, self.cache.inc_lock_ref(node))
        if release_lock_id:
            self.unlock(needs_session(session, "release_lock_id"), release_lock_id)
        return InsertOutcome(
            result.prefix_len, aligned, self._handle(node), lock_id, freed, state_exist
        )

    def evict(self, num_tokens: int, swa_num_tokens: int = 0, mamba_num: int = 0) -> EvictResult:
        if self.states is not None:
            result = self.cache.evict(num_tokens, mamba_num)
        else:
            result = self.cache.evict(num_tokens, swa_num_tokens)
        self.ops["evict"] += 1
        self.evicted_tokens["requested"] += result.full_evicted
        return result

    def lock(self, session: Session, node_id: int) -> int:
        if node_id == 0:
            return 0
        node = self._node(node_id)
        tokens = prefix_tokens(node)
        self.quota.check_lock(session, tokens)
        return self._hold(session, node, self.cache.inc_lock_ref(node), tokens)

    def unlock(self, session: Session, lock_id: int) -> None:
        """Release one of ``session``'s locks on this model; refused if it is not one."""
        held = self._held(session, lock_id)
        self.cache.dec_lock_ref(held.node, held.boundary)
        self._drop(session, lock_id)

    def alloc(
        self, session: Session, num_slots: int, num_states: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        self._check_slot_quota(session, num_slots)
        states = _EMPTY
        if num_states:
            self.quota.check_state_slots(session, num_states, self._states().held_by(session))
            # Refuse before the state allocation evicts snapshots (and their KV).
            self._check_room(num_slots)
            states, freed_tokens = self._states().allocate(num_states, session)
            self.evicted_tokens["pressure"] += freed_tokens
        try:
            return self._allocate(num_slots, session), states
        except BaseException:
            if num_states:
                self._states().free(states)
            raise

    def free(self, session: Session, slots: np.ndarray, states: np.ndarray = _EMPTY) -> None:
        if len(states):
            self._states().check(session, states)
        self._check_range(slots)
        held = self._owner[slots] == session.tag
        if not held.all():
            bad = int(np.argmin(held))
            raise PreconditionError(
                f"slot {int(slots[bad])} is not held by this session "
                "(already freed, inserted, or never allocated to it)"
            )
        check_distinct(slots, self.page_size)
        if len(slots) and not self._fenced(session, slots):
            self.allocator.free(slots)
            self._owner[slots] = 0
            self._count_pages(session, slots, -1)
            self._disown(session, len(slots))
        if len(states):
            self._states().free(states)

    def release_session(self, session: Session) -> tuple[int, int]:
        """Unlock every lock and free every slot ``session`` holds in this model."""
        locks = self._my_locks(session)
        for lock_id in locks:
            self.unlock(session, lock_id)
        slots = 0
        if session.slots.get(self.name):
            mine = self._rows_of(session)
            if len(mine):
                self.allocator.free(mine)
                self._owner[mine] = 0
                self._count_pages(session, mine, -1)
            slots = len(mine)
            self._disown(session, slots)
        if self.states is not None:
            self.states.release(session)
        return len(locks), slots

    def reset(self, sessions: list[Session]) -> tuple[int, int]:
        dropped = super().reset(sessions)
        self.keep_quarantine()  # a late store transfer may still fill those slots
        self._page_held[:] = 0
        self._alloc_runs.clear()
        if self.states is not None:
            self.states.reset()
        return dropped

    def check_integrity(self) -> None:
        """The cache's own check, plus: session slots are exactly the owned rows."""
        self.cache.check_integrity()
        owned = int(np.count_nonzero(self._owner))
        if owned != self.session_slots:
            raise IntegrityError(f"{owned} slots owned by sessions, {self.session_slots} counted")
        problems = self.quarantine_problems()
        if problems:
            raise IntegrityError("; ".join(problems))
        if self.states is not None:
            self.states.check_integrity()
        if self.page_index is not None:
            self.page_index.check()
