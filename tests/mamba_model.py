"""The Mamba cache's model for the property tests in tests/cache/mamba/test_mamba_properties.py.

A recording ``MambaPool``, the harness's locks and requests, and ``MambaOps``: its state
(the KV model, the state model: token prefix -> state slot, and the recency of each
state) and every cache operation with the checks that the test module's docstring lists.
The invariants and rules are in the test module's ``MambaHarness``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from cache_model import (
    MAX_TOKENS,
    CacheHarness,
    Handle,
    Model,
    RecordingAllocator,
    Seq,
    ints,
    node_path,
    tensor,
    walk,
)
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import initialize

from prefixcache.cache import InvalidInputError
from prefixcache.cache.mamba.mamba_radix_cache import MambaRadixCache
from prefixcache.cache.pools.mamba_pool import MambaPool


class RecordingPool(MambaPool):
    """The real Mamba pool, logging every track slot the cache frees."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[int] = []

    def free_track_slot(self, slot: Any) -> None:
        super().free_track_slot(slot)
        self.log.append(int(slot))

    def free_own(self, slot: int) -> None:
        MambaPool.free_track_slot(self, slot)


@dataclass
class Lock:
    handle: Handle
    slots: list[int]
    state: int | None  # the node's state slot when locked (a lock protects it)
    owner: str  # "request" or "explicit"


@dataclass
class Request:
    seq: Seq
    lock: Lock
    matched: int  # cache_protected_len
    kv: list[int]
    state: int  # the request's track slot (the state after its aligned tokens)
    new: list[int] = field(default_factory=list)


StateKey = tuple[str | None, int, tuple[Any, ...]]


def state_key(seq: Seq, length: int) -> StateKey:
    return (seq.ns, seq.width, seq.tokens[:length])


class MambaOps(CacheHarness):
    """Shared state and the cache operations with their checks."""

    PAGE = 1
    POOL = 24
    STATES = 6
    MAX_PAGES = 8

    def __init__(self) -> None:
        super().__init__()
        self.alloc = RecordingAllocator(self.POOL, page_size=self.PAGE)
        self.pool = RecordingPool(max_reqs=2, max_track_slots=self.STATES)
        self.evicted_ids: set[int] = set()
        self.chunk = 1
        self.cache = self._new_mamba_cache(False)
        self.model = Model(self.PAGE)
        self.state_at: dict[StateKey, int] = {}
        self.recency: dict[StateKey, int] = {}  # state -> tick of its last refresh
        self.tick = 0
        self.held: set[int] = set()
        self.held_states: set[int] = set()
        self.locks: list[Lock] = []
        self.handles: list[Handle] = []
        self.requests: list[Request] = []
        self.history: list[Seq] = []
        self.epoch = 0
        self.seen_ids: set[int] = set()
        self.fresh_notified: set[int] = set()

    def _new_mamba_cache(self, eager_hashes: bool) -> MambaRadixCache:
        return MambaRadixCache(
            self.PAGE,
            self.alloc,
            self.pool,
            self._on_evict,
            mamba_cache_chunk_size=self.chunk,
            eager_page_hashes=eager_hashes,
        )

    @initialize(eager_hashes=st.booleans(), chunk=st.sampled_from([1, 3]))
    def configure(self, eager_hashes: bool, chunk: int) -> None:  # type: ignore[override]
        """Branching seqlens round to the chunk size; eager hashes must chain."""
        self.chunk = chunk
        self.cache = self._new_mamba_cache(eager_hashes)

    # -- plumbing -----------------------------------------------------------------
    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, list[int], list[int]]:
        """Run a cache call; return its result and the KV and state slots it freed."""
        self.alloc.log.clear()
        self.pool.log.clear()
        result = fn(*args, **kwargs)
        freed, states = list(self.alloc.log), list(self.pool.log)
        self.alloc.log.clear()
        self.pool.log.clear()
        return result, freed, states

    def snapshot(self) -> Any:
        c = self.cache
        nodes = sorted(
            (
                n.id,
                n.key_len,
                n.lock_ref,
                n.own_lock_ref,
                n.mamba_lock_ref,
                n.evicted,
                None if n.mamba_value is None else tuple(ints(n.mamba_value)),
                tuple(ints(n.value)),
            )
            for n in walk(c.root_node)
        )
        order = ([n.id for n in c.full_lru_list], [n.id for n in c.mamba_lru_list])
        return (
            c.evictable_size(),
            c.protected_size(),
            c.mamba_evictable_size(),
            c.mamba_protected_size(),
            self.alloc.num_allocated(),
            self.pool.num_allocated_track_slots(),
            nodes,
            order,
        )

    def _refused(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        before = self.snapshot()
        with pytest.raises(InvalidInputError):
            fn(*args, **kwargs)
        assert self.snapshot() == before, "a refused call changed the cache"

    def locked_keys(self) -> set[tuple[Any, ...]]:
        keys: set[tuple[Any, ...]] = set()
        for lk in self.locks:
            keys.update(self.model.keys(lk.handle.seq, lk.handle.length))
        return keys

    def _alloc(self, n: int) -> list[int] | None:
        v = self.alloc.alloc(n)
        if v is None:
            need = -(-n // self.PAGE) * self.PAGE
            self._evict(max(0, need - self.alloc.available_size()), 0)
            v = self.alloc.alloc(n)
            event("alloc: evicted under pressure" if v is not None else "alloc: pool exhausted")
            assert v is not None or self.cache.evictable_size() == 0, (
                "eviction freed enough tokens but the pool still cannot allocate"
            )
        if v is None:
            return None
        slots = ints(v)
        self.held |= set(slots)
        return slots

    def _alloc_state(self) -> int | None:
        slot = self.pool.alloc_track_slot()
        if slot is None:
            self._evict(0, 1)
            slot = self.pool.alloc_track_slot()
            event(
                "state alloc: evicted a state"
                if slot is not None
                else "state alloc: pool exhausted"
            )
            assert slot is not None or self.cache.mamba_evictable_size() == 0
        if slot is not None:
            self.held_states.add(slot)
        return slot

    def _free_state(self, slot: int) -> None:
        self.held_states.remove(slot)
        self.pool.free_own(slot)

    def _walked(self, seq: Seq, held: int) -> list[tuple[int, StateKey]]:
        """(end, state) of each node with state that a walk of ``seq`` over its
        ``held`` cached tokens enters, top-down (the last may reach past ``held``).

        Node boundaries come from the tree; which states exist, from the model.
        """
        out = []
        for node in walk(self.cache.root_node):
            if not node.key_len or node.mamba_value is None:
                continue
            ns, width, tokens, _ = node_path(node)
            end = len(tokens)
            cut = min(end, held)
            if (
                (ns, width) == (seq.ns, seq.width)
                and end - node.key_len < held
                and tokens[:cut] == seq.tokens[:cut]
            ):
                out.append((end, (ns, width, tokens)))
        return sorted(out)

    def _refresh(self, states: list[StateKey]) -> None:
        for key in states:
            assert key in self.state_at, f"refresh of {key}, which holds no state"
            self.tick += 1
            self.recency[key] = self.tick

    # -- cache operations with their checks ----------------------------------------
    def _match(self, seq: Seq) -> Any:
        held = self.model.present(seq)
        walked = self._walked(seq, held)
        m, freed, states = self._call(self.cache.match_prefix, seq.key())
        assert freed == [] and states == [], "match_prefix freed slots"
        best = max(
            [0]
            + [
                n
                for n in range(self.PAGE, held + 1, self.PAGE)
                if state_key(seq, n) in self.state_at
            ]
        )
        n = m.prefix_len
        # The node the walk splits first, then the answered state alone (SGLang's
        # _match_post_processor refreshes only the used node in the Mamba list).
        self._refresh([k for end, k in walked if end > held] + [k for end, k in walked if end == n])
        assert n == best, f"match of {seq} gave {n}; the deepest held state is at {best}"
        assert ints(m.indices) == self.model.slots(seq, n), "match indices differ"
        walked = held // self.chunk * self.chunk
        assert m.mamba_branching_seqlen == (walked if walked > best else None), (
            f"branching seqlen {m.mamba_branching_seqlen}: walked {held}, answered {best}"
        )
        if best < held:
            event("match cut back to a node with state")
        node = m.last_node
        if n == 0:
            assert node is self.cache.root_node, "a miss must end at the root"
        else:
            assert node_path(node)[:3] == (seq.ns, seq.width, seq.tokens[:n])
            assert ints(node.mamba_value) == [self.state_at[state_key(seq, n)]]
        self._remember(Handle(node, seq, n))
        return m

    def _insert(
        self,
        seq: Seq,
        kv: list[int],
        matched: int,
        state: int,
        try_unaligned: bool,
        try_stateless: bool,
    ) -> Any:
        """Insert the aligned key with ``state``; the caller's frees follow the result."""
        model, cache = self.model, self.cache
        a = model.aligned(seq)
        present = model.present(seq)
        assert present >= matched, "a locked prefix vanished before insert"
        if try_unaligned and a < len(seq.tokens):
            event("insert refused: state for an unaligned key")
            self._refused(cache.insert, seq.key(), tensor(kv), mamba_value=state)
        if try_stateless:
            if present < a:
                event("insert refused: new tokens without a state")
                self._refused(cache.insert, seq.key(a), tensor(kv[:a]))
            else:
                walked = self._walked(seq, a)
                r, freed, states = self._call(cache.insert, seq.key(a), tensor(kv[:a]))
                assert freed == states == [] and r.prefix_len == a
                self._refresh([k for _, k in walked])
                assert r.mamba_exist == (a == 0 or state_key(seq, a) in self.state_at)
                if a:
                    self._remember(Handle(r.last_node, seq, a))
        exist = a == 0 or state_key(seq, a) in self.state_at
        walked = self._walked(seq, present)
        r, freed, states = self._call(cache.insert, seq.key(a), tensor(kv[:a]), mamba_value=state)
        # Every state walked through, top-down; the existing state at the end is the
        # last of them, a new or adopted one comes after (below).
        self._refresh([k for _, k in walked])
        assert freed == [] and states == [], "insert freed slots"
        assert r.prefix_len == present, f"insert reported {r.prefix_len}; tree held {present}"
        assert r.mamba_exist == exist, f"mamba_exist {r.mamba_exist}, expected {exist}"
        for p in range(present, a):
            model.add(seq, p, kv[p])
        self.held -= set(kv[present:a])
        self._free_own(kv[matched:present] + kv[a:])
        if exist:
            self._free_state(state)
            event("insert: mamba_exist")
        else:
            if present == a:
                event("insert: a tombstone adopted the state")
            self.state_at[state_key(seq, a)] = state
            self._refresh([state_key(seq, a)])
            self.held_states.remove(state)
        if a:
            assert node_path(r.last_node)[:4] == (
                seq.ns,
                seq.width,
                seq.tokens[:a],
                model.slots(seq, a),
            )
            assert ints(r.last_node.mamba_value) == [self.state_at[state_key(seq, a)]]
            self._remember(Handle(r.last_node, seq, a))
        else:
            assert r.last_node is cache.root_node
        return r

    def _evict(self, num: int, mamba_num: int) -> Any:
        cache, model = self.cache, self.model
        before_ev, before_mamba = cache.evictable_size(), cache.mamba_evictable_size()
        locked = self.locked_keys()
        locked_states = {lk.state for lk in self.locks}
        # A node's own locks cover its state, including one it adopted while locked.
        pinned = {state_key(lk.handle.seq, lk.handle.length) for lk in self.locks}
        lru = sorted((k for k in self.state_at if k not in pinned), key=self.recency.__getitem__)
        r, freed, states = self._call(cache.evict, num, mamba_num)
        if num == 0:
            assert states == [self.state_at[k] for k in lru[:mamba_num]], (
                "the Mamba phase did not free the least recently used unlocked states"
            )
        assert len(set(freed)) == len(freed) == r.full_evicted
        assert len(set(states)) == len(states) == r.mamba_evicted
        assert r.full_evicted <= before_ev and r.mamba_evicted <= before_mamba
        assert r.full_evicted >= num or cache.evictable_size() == 0, (
            f"evict({num}) stopped at {r.full_evicted} with tokens left"
        )
        assert r.mamba_evicted >= mamba_num or cache.mamba_evictable_size() == 0, (
            f"evict(mamba={mamba_num}) stopped at {r.mamba_evicted} with states left"
        )
        if mamba_num == 0:
            assert r.full_evicted == 0 if num == 0 else r.full_evicted < num + MAX_TOKENS
        for s in freed:
            assert s not in self.held, f"evict freed caller slot {s}"
            assert model.drop_slot(s) not in locked, f"evict freed locked slot {s}"
        by_slot = {v: k for k, v in self.state_at.items()}
        for s in states:
            assert s in by_slot and s not in locked_states, f"evict freed state slot {s}"
            ns, width, tokens = by_slot.pop(s)
            del self.state_at[(ns, width, tokens)]
            del self.recency[(ns, width, tokens)]
            if model.key(Seq(ns, width, tokens), len(tokens) - 1) in model.slot_of:
                event("evict tombstoned a node")
        model.check_prefix_closed()
        if r.full_evicted:
            event("evict freed KV")
        if states:
            event("evict freed states")
        return r

    def _lock(self, handle: Handle, owner: str) -> Lock:
        _, freed, states = self._call(self.cache.inc_lock_ref, handle.node)
        assert freed == states == []
        node = handle.node
        state = ints(node.mamba_value)[0] if node.key_len and node.mamba_value is not None else None
        lock = Lock(handle, self.model.slots(handle.seq, handle.length), state, owner)
        self.locks.append(lock)
        return lock

    def _unlock(self, lock: Lock) -> None:
        """Unlock; a tombstone left childless and unlocked goes (with its chain)."""
        _, freed, states = self._call(self.cache.dec_lock_ref, lock.handle.node)
        assert states == [], "unlock freed a state"
        self.locks.remove(lock)
        locked = self.locked_keys()
        if freed:
            event("unlock deleted a childless tombstone")
        for s in freed:
            assert self.model.drop_slot(s) not in locked
        self.model.check_prefix_closed()
