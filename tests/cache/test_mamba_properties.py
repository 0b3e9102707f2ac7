"""Stateful property tests of ``MambaRadixCache`` over a real allocator and ``MambaPool``.

The harness keeps the KV model of ``test_radix_properties.py`` (token position -> KV
slot for every position the tree must hold) plus a state model: token prefix -> state
slot for every prefix end the tree holds a Mamba state at. Against them it checks:

* every match: it answers the longest held page-aligned prefix that ends at a state
  (cut back from the KV walk), with the model's KV slots, a ``last_node`` ending there
  with that state, and ``mamba_branching_seqlen`` = the walked length rounded down to
  the chunk size when that lies past the answer;
* every insert: ``prefix_len`` is the held prefix, the new positions are stored with
  the caller's slots, ``mamba_exist`` is exactly "the key's end already had a state"
  (then the caller frees its slot), nothing is freed; a state for an unaligned key and
  a missing state for uncached tokens are refused with no change;
* every eviction: the KV and state slots reaching the allocator and pool are the ones
  reported, unique, unlocked, and held by the tree; the tree stays prefix-closed, each
  state sits on held KV, and a phase stops short only when nothing is left to take;
  a Mamba-only eviction frees exactly the least recently used unlocked states;
* state recency, SGLang's policy (issue 12): an insert refreshes each state it walks
  through, top-down (the node it splits included), then the new, adopted or existing
  state at its end; a match refreshes the state of the node it splits, then the
  answered path's states, top-down; the Mamba LRU list is in exactly that order;
* after every step: ``check_integrity()``, both size identities, no KV or state slot
  leaked or freed twice (``allocated == tree + held by the harness`` in both pools),
  locked prefixes keep their KV and locked nodes their state, ``protected`` sizes equal
  what the locks cover, and ``on_node_evict`` once per node that left the tree.

``WorkerMachine`` follows the SGLang worker protocol (match -> lock -> alloc KV and a
track slot -> insert with ``mamba_value`` -> free the slot if ``mamba_exist`` and the
duplicate KV -> rematch/relock -> unlock); ``DirectMachine`` inserts fresh slots. Both
also match, evict (both phases, and Mamba only), lock handles from earlier calls
(split, tombstoned, evicted, or from before an occasional ``reset``), try unbalanced
unlocks, and run for page sizes 1 and 4 with a chunk size of 1 or 3.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
from cache_model import (
    INDEX,
    LONG,
    MAX_TOKENS,
    SEQS,
    CacheHarness,
    Handle,
    Model,
    RecordingAllocator,
    Seq,
    ints,
    machine_settings,
    node_path,
    tensor,
    walk,
)
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from prefixcache.cache import InvalidInputError
from prefixcache.cache.mamba_pool import MambaPool
from prefixcache.cache.mamba_radix_cache import MambaRadixCache


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


class MambaHarness(CacheHarness):
    """Shared state, checks and rules; subclasses add the insert protocol."""

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
        return MambaRadixCache(self.PAGE, self.alloc, self.pool, self._on_evict,
                               mamba_cache_chunk_size=self.chunk,
                               eager_page_hashes=eager_hashes)

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
            (n.id, n.key_len, n.lock_ref, n.own_lock_ref, n.mamba_lock_ref, n.evicted,
             None if n.mamba_value is None else tuple(ints(n.mamba_value)),
             tuple(ints(n.value)))
            for n in walk(c.root_node))
        order = ([n.id for n in c.full_lru_list], [n.id for n in c.mamba_lru_list])
        return (c.evictable_size(), c.protected_size(), c.mamba_evictable_size(),
                c.mamba_protected_size(), self.alloc.num_allocated(),
                self.pool.num_allocated_track_slots(), nodes, order)

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
                "eviction freed enough tokens but the pool still cannot allocate")
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
            event("state alloc: evicted a state" if slot is not None
                  else "state alloc: pool exhausted")
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
            if (ns, width) == (seq.ns, seq.width) and end - node.key_len < held \
                    and tokens[:cut] == seq.tokens[:cut]:
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
        best = max([0] + [n for n in range(self.PAGE, held + 1, self.PAGE)
                          if state_key(seq, n) in self.state_at])
        n = m.prefix_len
        # The node the walk splits first, then the answered path, deeper newer.
        self._refresh([k for end, k in walked if end > held]
                      + [k for end, k in walked if end <= n])
        assert n == best, f"match of {seq} gave {n}; the deepest held state is at {best}"
        assert ints(m.indices) == self.model.slots(seq, n), "match indices differ"
        walked = held // self.chunk * self.chunk
        assert m.mamba_branching_seqlen == (walked if walked > best else None), (
            f"branching seqlen {m.mamba_branching_seqlen}: walked {held}, answered {best}")
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

    def _insert(self, seq: Seq, kv: list[int], matched: int, state: int,
                try_unaligned: bool, try_stateless: bool) -> Any:
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
        r, freed, states = self._call(cache.insert, seq.key(a), tensor(kv[:a]),
                                      mamba_value=state)
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
            assert node_path(r.last_node)[:4] == (seq.ns, seq.width, seq.tokens[:a],
                                                  model.slots(seq, a))
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
                "the Mamba phase did not free the least recently used unlocked states")
        assert len(set(freed)) == len(freed) == r.full_evicted
        assert len(set(states)) == len(states) == r.mamba_evicted
        assert r.full_evicted <= before_ev and r.mamba_evicted <= before_mamba
        assert r.full_evicted >= num or cache.evictable_size() == 0, (
            f"evict({num}) stopped at {r.full_evicted} with tokens left")
        assert r.mamba_evicted >= mamba_num or cache.mamba_evictable_size() == 0, (
            f"evict(mamba={mamba_num}) stopped at {r.mamba_evicted} with states left")
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
        state = ints(node.mamba_value)[0] if node.key_len and node.mamba_value is not None \
            else None
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

    # -- invariants ------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        cache, model = self.cache, self.model
        cache.check_integrity()
        ev, prot, total = cache.evictable_size(), cache.protected_size(), cache.total_size()
        assert ev >= 0 and prot >= 0 and ev + prot == total == len(model.slot_of)
        assert self.alloc.num_allocated() == total + len(self.held), "a KV slot leaked"
        m_ev, m_prot = cache.mamba_evictable_size(), cache.mamba_protected_size()
        assert m_ev >= 0 and m_prot >= 0 and m_ev + m_prot == len(self.state_at)
        assert self.pool.num_allocated_track_slots() == len(self.state_at) + len(
            self.held_states), "a state slot leaked"
        assert not (self.held & set(model.pos_of))
        assert not (self.held_states & set(self.state_at.values()))
        order = sorted(self.state_at, key=self.recency.__getitem__, reverse=True)
        assert [ints(n.mamba_value)[0] for n in cache.mamba_lru_list] == [
            self.state_at[k] for k in order], "the Mamba LRU list is not in recency order"
        for (ns, width, tokens), _ in self.state_at.items():
            seq = Seq(ns, width, tokens)
            assert len(tokens) % self.PAGE == 0
            assert model.key(seq, len(tokens) - 1) in model.slot_of, "a state without its KV"
        protected: set[tuple[Any, ...]] = set()
        counts = Counter(id(lk.handle.node) for lk in self.locks)
        for lk in self.locks:
            h = lk.handle
            assert not h.node.evicted or not h.node.key_len, "a locked node was evicted"
            assert model.slots(h.seq, h.length) == lk.slots, "a locked prefix changed slots"
            if lk.state is not None:
                assert self.state_at.get(state_key(h.seq, h.length)) == lk.state, (
                    "a locked node lost its state")
            protected.update(model.keys(h.seq, h.length))
            if h.node.key_len:
                assert h.node.own_lock_ref == counts[id(h.node)]
        assert prot == len(protected), f"protected_size {prot}, locks cover {len(protected)}"
        mamba_locked = {id(lk.handle.node) for lk in self.locks
                        if lk.handle.node.key_len and lk.handle.node.mamba_value is not None}
        assert m_prot == len(mamba_locked), "mamba_protected_size != locked nodes with state"
        live_ids = {n.id for n in walk(cache.root_node) if n.key_len}
        assert not (live_ids & self.evicted_ids), "on_node_evict named a node still in the tree"
        gone = self.seen_ids - live_ids
        assert gone <= self.fresh_notified, f"nodes {gone} left without on_node_evict"
        self.seen_ids, self.fresh_notified = live_ids, set()

    # -- shared rules ------------------------------------------------------------------
    @rule(go=st.integers(0, 19))
    def reset(self, go: int) -> None:
        """Admin reset (rarely): forget the tree, clear both pools; old handles go stale."""
        if go != 13:
            return
        self.cache.reset()
        self.alloc.clear()
        self.pool.clear()
        self.model = Model(self.PAGE)
        self.state_at.clear()
        self.recency.clear()
        self.held.clear()
        self.held_states.clear()
        self.locks.clear()
        self.requests.clear()
        self.seen_ids = set()
        self.epoch += 1
        event("reset")

    @precondition(lambda self: self.cache.total_size())
    @rule(num=st.sampled_from([0, 0, 1, 2, 5]), mamba_num=st.integers(0, 2))
    def evict(self, num: int, mamba_num: int) -> None:
        """Both phases, or the Mamba phase alone (which tombstones inner nodes); small
        asks, so that trees grow deep enough to hold states inside them."""
        self._evict(num * (self.PAGE // 2 or 1), mamba_num)

    @precondition(lambda self: self.handles and len(self.locks) < 8)
    @rule(i=INDEX)
    def lock_handle(self, i: int) -> None:
        """Lock a node from an earlier match or insert (maybe split, tombstoned, evicted)."""
        h = self.handles[i % len(self.handles)]
        if h.node.evicted or h.epoch != self.epoch:
            event("lock of an evicted or pre-reset handle refused")
            self._expect_lock_error(self.cache.inc_lock_ref, h.node)
            return
        if h.length:
            assert node_path(h.node)[:3] == (h.seq.ns, h.seq.width, h.seq.tokens[:h.length])
            if h.node.mamba_value is None:
                event("lock of a tombstone")
        self._lock(h, "explicit")

    def _insert_fresh(self, seq: Seq, tries: tuple[bool, bool]) -> None:
        """Insert ``seq`` with fresh KV and a fresh state (another worker's insert)."""
        kv = self._alloc(len(seq.tokens))
        if kv is None:
            return
        state = self._alloc_state()
        if state is None:
            self._free_own(kv)
            return
        self._insert(seq, kv, 0, state, *tries)

    @rule(i=INDEX, spec=SEQS)
    def extend(self, i: int, spec: Any) -> None:
        """Insert a continuation of a cached sequence, so its state ends up inside."""
        nodes = [n for n in walk(self.cache.root_node) if n.key_len and n.mamba_value is not None]
        if not nodes:
            return
        ns, width, tokens, _ = node_path(nodes[i % len(nodes)])
        self.history.append(Seq(ns, width, tokens))
        ns_choice, page_ids, tail, _ = spec
        seq = self.seq((ns_choice, page_ids or [1], tail, (len(self.history) - 1,
                                                          self.MAX_PAGES)))
        self._insert_fresh(seq, (False, False))

    @precondition(lambda self: len(self.locks) < 8)
    @rule(i=INDEX, tombstone=st.booleans())
    def lock_node(self, i: int, tombstone: bool) -> None:
        """Lock any node in the tree, a tombstone or not, as a handle would name it."""
        nodes = [n for n in walk(self.cache.root_node)
                 if n.key_len and (n.mamba_value is None) == tombstone]
        if not nodes:
            return
        node = nodes[i % len(nodes)]
        ns, width, tokens, _ = node_path(node)
        handle = Handle(node, Seq(ns, width, tokens), len(tokens))
        self._remember(handle)
        if tombstone:
            event("lock of a tombstone")
        self._lock(handle, "explicit")

    @precondition(lambda self: self.handles or self.locks)
    @rule(i=INDEX, kind=st.integers(0, 1))
    def bad_unlock(self, i: int, kind: int) -> None:
        """Unbalanced unlocks (no own lock, evicted, stale) raise and change nothing."""
        if kind == 0 and self.handles:
            h = self.handles[i % len(self.handles)]
            node = h.node
            if h.epoch != self.epoch:
                self._expect_lock_error(self.cache.dec_lock_ref, node)
                return
        elif self.locks:
            node = self.locks[i % len(self.locks)].handle.node.parent
        else:
            return
        if node is None or (node.key_len == 0 and not node.evicted):
            return  # unlocking a root is a no-op
        if not node.evicted and self.own_locks(node):
            return
        event("bad unlock refused")
        self._expect_lock_error(self.cache.dec_lock_ref, node)


TRY = st.sampled_from([(False, False)] * 4 + [(True, False), (False, True)])


class WorkerMachine(MambaHarness):
    """Requests follow the worker protocol, with locks held across steps."""

    def _begin(self, seq: Seq) -> Request | None:
        m = self._match(seq)
        lock = self._lock(Handle(m.last_node, seq, m.prefix_len), "request")
        new = self._alloc(len(seq.tokens) - m.prefix_len)
        state = self._alloc_state() if new is not None else None
        if new is None or state is None:
            self._unlock(lock)
            self._free_own(new or [])
            return None
        return Request(seq, lock, m.prefix_len, ints(m.indices) + new, state, new)

    def _commit(self, req: Request, tries: tuple[bool, bool], relock: bool) -> None:
        seq = req.seq
        self._insert(seq, req.kv, req.matched, req.state, *tries)
        if not relock:
            self._unlock(req.lock)
            return
        m = self._match(seq)
        self._lock(Handle(m.last_node, seq, m.prefix_len), "explicit")
        self._unlock(req.lock)

    @precondition(lambda self: len(self.requests) < 3)
    @rule(spec=SEQS)
    def begin(self, spec: Any) -> None:
        req = self._begin(self.seq(spec))
        if req is not None:
            self.requests.append(req)

    @precondition(lambda self: self.requests)
    @rule(i=INDEX, tries=TRY, relock=st.booleans())
    def commit(self, i: int, tries: tuple[bool, bool], relock: bool) -> None:
        self._commit(self.requests.pop(i % len(self.requests)), tries, relock)

    @precondition(lambda self: len(self.locks) < 8)
    @rule(spec=SEQS, tries=TRY, relock=st.booleans())
    def prefill(self, spec: Any, tries: tuple[bool, bool], relock: bool) -> None:
        req = self._begin(self.seq(spec))
        if req is not None:
            self._commit(req, tries, relock)

    @precondition(lambda self: self.requests)
    @rule(i=INDEX)
    def abort(self, i: int) -> None:
        req = self.requests.pop(i % len(self.requests))
        self._unlock(req.lock)
        self._free_own(req.new)
        self._free_state(req.state)


class DirectMachine(MambaHarness):
    """Insert fresh KV and a fresh state for the whole key; free what was not taken."""

    @rule(spec=SEQS, tries=TRY)
    def insert(self, spec: Any, tries: tuple[bool, bool]) -> None:
        self._insert_fresh(self.seq(spec), tries)


PAGES = {
    1: dict(PAGE=1, POOL=32, STATES=8, MAX_PAGES=8),
    4: dict(PAGE=4, POOL=4 * 20, STATES=8, MAX_PAGES=6),
}
MACHINES = {"worker": WorkerMachine, "direct": DirectMachine}


def _machine(kind: str, page: int) -> type[RuleBasedStateMachine]:
    base = MACHINES[kind]
    return type(f"Mamba{base.__name__}Page{page}", (base,), dict(PAGES[page]))


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("kind", ["worker", "direct"])
def test_mamba_machine(kind: str, page: int) -> None:
    run_state_machine_as_test(_machine(kind, page), settings=machine_settings(80, 40))


@pytest.mark.slow
@LONG
@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("kind", ["worker", "direct"])
def test_mamba_machine_long(kind: str, page: int) -> None:
    run_state_machine_as_test(_machine(kind, page), settings=machine_settings(500, 100))
