"""Stateful property tests of ``RadixCache`` in plain (full-attention) mode.

Next to the cache the harness keeps a model of what the tree must hold: token position
-> KV slot, a position being ``(extra_key, token width, tokens up to the end of its
page, offset in the page)``. Inserts add the positions that were not there yet;
evictions remove the positions whose slots the cache hands back to the allocator (which
must be unlocked tree positions and must leave the model prefix-closed). Every match is
checked against the model: the matched prefix is one the model holds, its indices are
the model's slots, and it is the longest page-aligned prefix the model holds; every
insert must report exactly the held prefix and store the rest. After every step the
harness also checks ``check_integrity()``, the size identities, that no slot leaked or
was freed twice (``num_allocated == total_size + slots the harness holds``), that
locked prefixes keep their slots, that ``protected_size`` is exactly the set of
positions under a lock, and that every node that left the tree was reported once to
``on_node_evict``. Each run picks an eviction policy and whether page hashes are eager.

Two machines, each for page sizes 1 and 16:

* ``WorkerMachine`` drives the cache as an inference worker does (match -> lock ->
  alloc -> insert -> free duplicates -> rematch/relock -> unlock), holding locks across
  other steps, evicting under pool pressure, locking stale handles and trying
  unbalanced unlocks (which must raise ``LockError`` and change nothing);
* ``DirectMachine`` inserts with fresh slots and frees the duplicates at once, to mix
  splits and evictions densely.

Both also match, evict, and lock handles from earlier calls that may have been split or
evicted since, or predate an occasional admin ``reset`` (those locks must be refused).

Keys use a tiny page vocabulary so prefixes collide often, three int namespaces
(``None``, ``""``, ``"a"``) and width-2 tuple tokens in ``None`` and ``"t"`` (whose
packed bytes equal some int keys': they must not alias). Counter-examples found by the
machines are kept as plain unit tests at the end of the file.
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
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from prefixcache.cache import (
    RadixCache,
)


@dataclass
class Lock:
    handle: Handle
    token: Any
    slots: list[int]
    owner: str  # "request" or "explicit"


@dataclass
class Request:
    seq: Seq
    lock: Lock
    matched: int  # cache_protected_len
    kv: list[int]
    new: list[int] = field(default_factory=list)


class PlainHarness(CacheHarness):
    """Shared state, checks and rules; subclasses add the insert protocol."""

    PAGE = 1
    POOL = 40
    MAX_PAGES = 8

    def __init__(self) -> None:
        super().__init__()
        ps = self.PAGE
        self.alloc = RecordingAllocator(self.POOL, page_size=ps)
        self.evicted_ids: set[int] = set()
        self.cache = RadixCache(
            page_size=ps, token_to_kv_pool_allocator=self.alloc, on_node_evict=self._on_evict
        )
        self.model = Model(ps)
        self.held: set[int] = set()
        self.locks: list[Lock] = []
        self.handles: list[Handle] = []
        self.requests: list[Request] = []
        self.history: list[Seq] = []
        self.epoch = 0
        self.seen_ids: set[int] = set()  # non-root node ids in the tree at the last check
        self.fresh_notified: set[int] = set()  # on_node_evict ids since the last check

    def _new_cache(self, policy: str, eager_hashes: bool) -> RadixCache:
        return RadixCache(
            page_size=self.PAGE,
            token_to_kv_pool_allocator=self.alloc,
            on_node_evict=self._on_evict,
            eviction_policy=policy,
            eager_page_hashes=eager_hashes,
        )

    # -- plumbing -----------------------------------------------------------------
    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, list[int]]:
        """Run a cache call and return its result and the slots it freed."""
        self.alloc.log.clear()
        result = fn(*args, **kwargs)
        freed = list(self.alloc.log)
        self.alloc.log.clear()
        return result, freed

    def snapshot(self) -> Any:
        c = self.cache
        nodes = sorted(
            (
                n.id,
                n.key_len,
                n.lock_ref,
                n.own_lock_ref,
                n.swa_lock_ref,
                n.swa_tombstone,
                n.swa_boundary_id,
                n.evicted,
                tuple(ints(n.value)),
            )
            for n in walk(c.root_node)
        )
        return (
            c.evictable_size(),
            c.protected_size(),
            c.total_size(),
            c.swa_evictable_size(),
            c.swa_protected_size(),
            self.alloc.num_allocated(),
            nodes,
        )

    # -- cache operations with their checks ----------------------------------------
    def _match(self, seq: Seq) -> Any:
        nodes = len(walk(self.cache.root_node))
        m, freed = self._call(self.cache.match_prefix, seq.key())
        assert freed == [], "match_prefix freed slots"
        if len(walk(self.cache.root_node)) != nodes:
            event("match split a node")
        self.check_match(seq, m)
        self._remember(Handle(m.last_node, seq, m.prefix_len))
        return m

    def check_match(self, seq: Seq, m: Any) -> None:
        ps, model = self.PAGE, self.model
        n = m.prefix_len
        got = ints(m.indices)
        assert len(got) == n, "prefix_len != len(indices)"
        assert n % ps == 0 and n <= model.aligned(seq), f"unaligned or too long match {n}"
        for p in range(n):
            assert model.key(seq, p) in model.slot_of, (
                f"match returned {n} tokens of {seq}, but only {model.present(seq)} "
                "were inserted (and not evicted) in that namespace"
            )
        assert got == model.slots(seq, n), "match indices differ from the inserted slots"
        assert n == model.present(seq), (
            f"match of {seq} gave {n} tokens; the tree holds {model.present(seq)}"
        )
        node = m.last_node
        if n == 0:
            assert node is not None and node.key_len == 0, "a miss must end at a root"
        else:
            ns, width, tokens, slots = node_path(node)
            assert (ns, width, tokens, slots) == (seq.ns, seq.width, seq.tokens[:n], got), (
                "last_node's path is not the matched prefix"
            )

    def _evict(self, num: int) -> Any:
        cache, before_ev = self.cache, self.cache.evictable_size()
        before_alloc = self.alloc.num_allocated()
        r, freed = self._call(cache.evict, num)
        assert len(set(freed)) == len(freed) == r.full_evicted, (
            f"evict reported {r.full_evicted} but freed {len(freed)} slots"
        )
        assert r.swa_evicted == r.full_evicted
        assert self.alloc.num_allocated() == before_alloc - r.full_evicted
        assert r.full_evicted <= before_ev
        assert r.full_evicted >= num or cache.evictable_size() == 0, (
            f"evict({num}) stopped at {r.full_evicted} with "
            f"{cache.evictable_size()} evictable tokens left"
        )
        assert r.full_evicted == 0 if num == 0 else r.full_evicted < num + MAX_TOKENS
        if r.full_evicted:
            event("evict freed tokens")
        for s in freed:
            assert s not in self.held, f"evict freed slot {s}, which the caller owns"
            self.model.drop_slot(s)
        self.model.check_prefix_closed()
        return r

    def _alloc(self, n: int) -> list[int] | None:
        v = self.alloc.alloc(n)
        if v is None:
            need = -(-n // self.PAGE) * self.PAGE
            self._evict(max(0, need - self.alloc.available_size()))
            v = self.alloc.alloc(n)
            event("alloc: evicted under pressure" if v is not None else "alloc: pool exhausted")
            assert v is not None or self.cache.evictable_size() == 0, (
                "eviction freed enough tokens but the pool still cannot allocate"
            )
        if v is None:
            return None
        slots = ints(v)
        assert not (set(slots) & self.held) and not (set(slots) & set(self.model.pos_of))
        self.held |= set(slots)
        return slots

    def _lock(self, handle: Handle, owner: str) -> Lock:
        node = handle.node
        token, freed = self._call(self.cache.inc_lock_ref, node)
        assert freed == []
        slots = self.model.slots(handle.seq, handle.length)
        lock = Lock(handle, token, slots, owner)
        self.locks.append(lock)
        return lock

    def _unlock(self, lock: Lock) -> None:
        _, freed = self._call(self.cache.dec_lock_ref, lock.handle.node, lock.token)
        assert freed == []
        self.locks.remove(lock)

    def _insert_plain(self, seq: Seq, kv: list[int], matched: int) -> Any:
        """insert(seq, kv); the caller frees kv[matched:prefix_len] and the tail."""
        a = self.model.aligned(seq)
        present = self.model.present(seq)
        r, freed = self._call(self.cache.insert, seq.key(), tensor(kv))
        assert freed == [], "plain-mode insert freed slots (the caller owns duplicates)"
        assert r.prefix_len == present, (
            f"insert of {seq} reported prefix_len {r.prefix_len}; the tree held {present}"
        )
        assert present >= matched, "a locked prefix vanished before insert"
        event(
            "insert: " + ("new" if present == 0 else "partial hit" if present < a else "full hit")
        )
        for p in range(present, a):
            self.model.add(seq, p, kv[p])
            self.held.discard(kv[p])
        if a:
            assert node_path(r.last_node) == (
                seq.ns,
                seq.width,
                seq.tokens[:a],
                self.model.slots(seq, a),
            )
            self._remember(Handle(r.last_node, seq, a))
        else:
            assert r.last_node is self.cache.root_node
        self._free_own(kv[matched:present] + kv[a:])
        return r

    # -- invariants ------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        cache, model = self.cache, self.model
        cache.check_integrity()
        ev, prot, total = cache.evictable_size(), cache.protected_size(), cache.total_size()
        assert ev >= 0 and prot >= 0 and ev + prot == total
        assert total == len(model.slot_of), (
            f"total_size {total}, but {len(model.slot_of)} tokens were inserted and not evicted"
        )
        assert self.alloc.num_allocated() == total + len(self.held), (
            f"allocated {self.alloc.num_allocated()} != tree {total} + caller {len(self.held)}"
        )
        assert not (self.held & set(model.pos_of))
        if self.held:
            assert bool(self.alloc.is_allocated(tensor(sorted(self.held))).all())
        model.check_prefix_closed()
        protected: set[tuple[Any, ...]] = set()
        counts = Counter(id(lk.handle.node) for lk in self.locks)
        for lk in self.locks:
            h = lk.handle
            assert not h.node.evicted or not h.node.key_len, "a locked node was evicted"
            assert model.slots(h.seq, h.length) == lk.slots, "a locked prefix changed slots"
            protected.update(model.keys(h.seq, h.length))
            if h.node.key_len:
                assert h.node.own_lock_ref == counts[id(h.node)]
        if any(lk.slots for lk in self.locks):
            every = [s for lk in self.locks for s in lk.slots]
            assert bool(self.alloc.is_allocated(tensor(every)).all())
        assert prot == len(protected), (
            f"protected_size {prot}, but locks cover {len(protected)} tokens"
        )
        live_ids = {n.id for n in walk(cache.root_node) if n.key_len}
        assert not (live_ids & self.evicted_ids), "on_node_evict named a node still in the tree"
        gone = self.seen_ids - live_ids
        assert gone <= self.fresh_notified, f"nodes {gone} left without on_node_evict"
        self.seen_ids, self.fresh_notified = live_ids, set()
        for h in self.handles:
            if h.node.evicted and h.node.key_len:
                assert h.node.id in self.evicted_ids, "a node left without on_node_evict"

    # -- shared rules ------------------------------------------------------------------
    @rule(num=st.integers(0, 16))
    def evict(self, num: int) -> None:
        self._evict(num * self.PAGE // 2 if self.PAGE > 1 else num)

    @precondition(lambda self: self.handles and len(self.locks) < 8)
    @rule(i=INDEX)
    def lock_handle(self, i: int) -> None:
        """Lock a node from an earlier match or insert (maybe split or evicted since)."""
        h = self.handles[i % len(self.handles)]
        if h.node.evicted or h.epoch != self.epoch:
            event("lock of an evicted or pre-reset handle refused")
            self._expect_lock_error(self.cache.inc_lock_ref, h.node)
            return
        if h.length:
            ns, width, tokens, slots = node_path(h.node)
            assert (ns, width, tokens) == (h.seq.ns, h.seq.width, h.seq.tokens[: h.length]), (
                "a node handle no longer ends where it did"
            )
            assert slots == self.model.slots(h.seq, h.length)
        self._lock(h, "explicit")

    @precondition(lambda self: self.handles or self.locks)
    @rule(i=INDEX, kind=st.integers(0, 1))
    def bad_unlock(self, i: int, kind: int) -> None:
        """Unlock a node that holds no lock of its own (or was evicted): LockError."""
        if kind == 0 and self.handles:
            h = self.handles[i % len(self.handles)]
            node = h.node
            if h.epoch != self.epoch:
                event("bad unlock refused (pre-reset handle)")
                self._expect_lock_error(self.cache.dec_lock_ref, node)
                return
        elif self.locks:
            node = self.locks[i % len(self.locks)].handle.node.parent  # an ancestor
        else:
            return
        if node is None or (node.key_len == 0 and not node.evicted):
            return  # unlocking a root is a no-op
        if not node.evicted and self.own_locks(node):
            return
        event(f"bad unlock refused ({'evicted' if node.evicted else 'not locked'})")
        self._expect_lock_error(self.cache.dec_lock_ref, node)


class WorkerMachine(PlainHarness):
    """Requests follow the reference runtime's worker protocol (match, lock the hit,
    allocate the rest, insert, free the duplicates, unlock), with locks held across steps."""

    def _begin(self, seq: Seq) -> Request | None:
        """Prefill start: match, lock the hit, allocate the rest."""
        m = self._match(seq)
        lock = self._lock(Handle(m.last_node, seq, m.prefix_len), "request")
        new = self._alloc(len(seq.tokens) - m.prefix_len)
        if new is None:
            self._unlock(lock)
            return None
        return Request(seq, lock, m.prefix_len, ints(m.indices) + new, new)

    def _commit(self, req: Request, relock: bool, relock_first: bool) -> None:
        """Prefill end: insert, free duplicates and tail, rematch and move the lock."""
        seq = req.seq
        self._insert_plain(seq, req.kv, req.matched)
        if not relock:
            self._unlock(req.lock)
            return
        m = self._match(seq)
        assert m.prefix_len == self.model.aligned(seq), "rematch after insert fell short"
        if relock_first:
            self._lock(Handle(m.last_node, seq, m.prefix_len), "explicit")
            self._unlock(req.lock)
        else:
            self._unlock(req.lock)
            self._lock(Handle(m.last_node, seq, m.prefix_len), "explicit")

    @precondition(lambda self: len(self.requests) < 4)
    @rule(spec=SEQS)
    def begin(self, spec: Any) -> None:
        req = self._begin(self.seq(spec))
        if req is not None:
            self.requests.append(req)

    @precondition(lambda self: self.requests)
    @rule(i=INDEX, relock=st.booleans(), relock_first=st.booleans())
    def commit(self, i: int, relock: bool, relock_first: bool) -> None:
        self._commit(self.requests.pop(i % len(self.requests)), relock, relock_first)

    @precondition(lambda self: len(self.locks) < 8)
    @rule(spec=SEQS, relock=st.booleans())
    def prefill(self, spec: Any, relock: bool) -> None:
        """begin + commit in one step (no other request interleaves)."""
        req = self._begin(self.seq(spec))
        if req is not None:
            self._commit(req, relock, False)

    @precondition(lambda self: self.requests)
    @rule(i=INDEX)
    def abort(self, i: int) -> None:
        """A request dropped before insert: unlock and free its new slots."""
        req = self.requests.pop(i % len(self.requests))
        self._unlock(req.lock)
        self._free_own(req.new)


class DirectMachine(PlainHarness):
    """Insert with fresh slots for the whole key, then free the duplicates at once."""

    @rule(spec=SEQS)
    def insert(self, spec: Any) -> None:
        seq = self.seq(spec)
        kv = self._alloc(len(seq.tokens))
        if kv is not None:
            self._insert_plain(seq, kv, 0)


PAGES = {1: dict(PAGE=1, POOL=24, MAX_PAGES=8), 16: dict(PAGE=16, POOL=16 * 24, MAX_PAGES=6)}


MACHINES = {"worker": WorkerMachine, "direct": DirectMachine}


def _machine(kind: str, page: int) -> type[RuleBasedStateMachine]:
    base = MACHINES[kind]
    return type(f"{base.__name__}Page{page}", (base,), dict(PAGES[page]))


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("kind", ["worker", "direct"])
def test_plain_machine(kind: str, page: int) -> None:
    run_state_machine_as_test(_machine(kind, page), settings=machine_settings(120, 50))


@pytest.mark.slow
@LONG
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("kind", ["worker", "direct"])
def test_plain_machine_long(kind: str, page: int) -> None:
    run_state_machine_as_test(_machine(kind, page), settings=machine_settings(500, 100))
