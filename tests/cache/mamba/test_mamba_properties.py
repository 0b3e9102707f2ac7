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
* state recency, SGLang's policy: an insert refreshes each state it walks
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
unlocks, and run for page sizes 1 and 4 with a chunk size of 1 or 3. The state and the
checked cache operations are ``MambaOps`` in tests/mamba_model.py.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from cache_model import (
    INDEX,
    LONG,
    SEQS,
    Handle,
    Model,
    Seq,
    ints,
    machine_settings,
    node_path,
    walk,
)
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from mamba_model import MambaOps, Request, state_key


class MambaHarness(MambaOps):
    """Shared state, checks and rules; subclasses add the insert protocol."""

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
            self.held_states
        ), "a state slot leaked"
        assert not (self.held & set(model.pos_of))
        assert not (self.held_states & set(self.state_at.values()))
        order = sorted(self.state_at, key=self.recency.__getitem__, reverse=True)
        assert [ints(n.mamba_value)[0] for n in cache.mamba_lru_list] == [
            self.state_at[k] for k in order
        ], "the Mamba LRU list is not in recency order"
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
                    "a locked node lost its state"
                )
            protected.update(model.keys(h.seq, h.length))
            if h.node.key_len:
                assert h.node.own_lock_ref == counts[id(h.node)]
        assert prot == len(protected), f"protected_size {prot}, locks cover {len(protected)}"
        mamba_locked = {
            id(lk.handle.node)
            for lk in self.locks
            if lk.handle.node.key_len and lk.handle.node.mamba_value is not None
        }
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
            assert node_path(h.node)[:3] == (h.seq.ns, h.seq.width, h.seq.tokens[: h.length])
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
        seq = self.seq((ns_choice, page_ids or [1], tail, (len(self.history) - 1, self.MAX_PAGES)))
        self._insert_fresh(seq, (False, False))

    @precondition(lambda self: len(self.locks) < 8)
    @rule(i=INDEX, tombstone=st.booleans())
    def lock_node(self, i: int, tombstone: bool) -> None:
        """Lock any node in the tree, a tombstone or not, as a handle would name it."""
        nodes = [
            n
            for n in walk(self.cache.root_node)
            if n.key_len and (n.mamba_value is None) == tombstone
        ]
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
