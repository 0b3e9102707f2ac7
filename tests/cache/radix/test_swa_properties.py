"""Stateful property tests of ``RadixCache`` in SWA mode (``SWARadixCache``).

The harness keeps the same model as ``test_radix_properties.py`` — token position ->
slot for every position the tree must hold — and reads each position's SWA state from
the allocator (a position is live iff its slot still has an SWA slot; a tombstone's
slots have none; ``check_integrity`` ties the two together). Against it the harness
checks:

* every match: the prefix is held with the right slots, it satisfies the window rule
  (no tombstone on it, or at least ``sliding_window_size`` live tokens after the last
  one, also checked on the returned node chain), and it is the longest such prefix;
* every insert, position by position: what is stored, what is revived and what insert
  itself frees (it owns ``value[prev_prefix_len:aligned]``; the caller frees only the
  unaligned tail), following SGLang where the reference is wrong (docs/semantics.md,
  departure 11) and the documented choice that a full-locked tombstone is not revived;
* every eviction: the full and SWA counts equal what reached the allocator, only
  unlocked positions lose full KV, the tree stays prefix-closed, and eviction stops
  short only when nothing more is evictable;
* after every step: ``check_integrity()``, both size identities, no slot leaked or freed
  twice in either pool, locked prefixes keep their slots and the last window of tokens
  of every lock keeps its SWA KV.

``WorkerMachine`` follows the worker protocol (match -> lock -> alloc -> free the
request's own out-of-window SWA -> insert(prev_prefix_len, swa_evicted_seqlen) -> free
tail -> rematch/relock -> unlock); ``DirectMachine`` inserts fresh slots with
``prev_prefix_len=0``. Both also match, evict (full and SWA-only), lock handles from
earlier calls (split, tombstoned, evicted, or from before an occasional admin
``reset``), try unbalanced unlocks (no own lock, evicted node, a boundary id off the
path: ``LockError`` and no change), and pick an eviction policy and eager page hashes
per run. Both run for page sizes 1 and 16 (windows of 3 and 24 tokens, an SWA pool half
the full one). ``swa_evicted_seqlen`` is 0, page-aligned, inside a page (insert must
refuse it with ``InvalidInputError`` and change nothing; the caller then frees the rest
of the page's SWA KV and retries), or the whole request including its unaligned tail.
Counter-examples are kept as plain unit tests at the end of the file.
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
    InvalidInputError,
    RadixCache,
    SWATokenToKVPoolAllocator,
)


class RecordingAllocator(SWATokenToKVPoolAllocator):
    """The real SWA allocator, logging every slot the cache frees through it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[int] = []
        self.log_swa: list[int] = []

    def free(self, indices: Any) -> None:
        super().free(indices)
        self.log.extend(ints(indices))

    def free_swa(self, indices: Any) -> None:
        super().free_swa(indices)
        self.log_swa.extend(ints(indices))

    def free_own(self, slots: list[int]) -> None:
        """A free by the harness itself (not logged)."""
        SWATokenToKVPoolAllocator.free(self, tensor(slots))

    def free_swa_own(self, slots: list[int]) -> None:
        SWATokenToKVPoolAllocator.free_swa(self, tensor(slots))

    def mapped(self, slots: list[int]) -> list[bool]:
        if not slots:
            return []
        return [bool(b) for b in self.is_swa_mapped(tensor(slots)).tolist()]

    def swa_allocated(self) -> int:
        return self.swa_attn_allocator.num_allocated()


@dataclass
class Lock:
    handle: Handle
    token: Any  # the SWA boundary id inc_lock_ref returned
    slots: list[int]
    window: list[int]  # slots of the last W positions that had SWA KV at lock time
    owner: str  # "request" or "explicit"


@dataclass
class Request:
    seq: Seq
    lock: Lock
    matched: int  # cache_protected_len = prev_prefix_len
    kv: list[int]
    new: list[int] = field(default_factory=list)


BOGUS_BOUNDARY = 10**9
# swa_evicted_seqlen choices (see SWAHarness._swa_seqlen): mostly none, sometimes some
# pages past the match, one token past the match (unaligned when pages are > 1 token), or
# the whole request including its unaligned tail.
SWA_CHOICE = st.sampled_from([0, 0, 0, 1, 2, 3, 4, 8, 9, 10])


class SWAHarness(CacheHarness):
    """Shared state, checks and rules; subclasses add the insert protocol."""

    PAGE = 1
    POOL = 24
    SWA_POOL = 12
    WINDOW = 3
    MAX_PAGES = 8

    def __init__(self) -> None:
        super().__init__()
        self.alloc = RecordingAllocator(self.POOL, self.SWA_POOL, page_size=self.PAGE)
        self.evicted_ids: set[int] = set()
        self.cache = self._new_cache("lru", False)
        self.model = Model(self.PAGE)
        self.held: set[int] = set()
        self.locks: list[Lock] = []
        self.handles: list[Handle] = []
        self.requests: list[Request] = []
        self.history: list[Seq] = []
        self.epoch = 0
        self.seen_ids: set[int] = set()  # non-root node ids in the tree at the last check
        self.fresh_notified: set[int] = set()  # on_node_evict ids since the last check

    def _new_cache(self, policy: str, eager_hashes: bool) -> RadixCache:
        cache = RadixCache(
            page_size=self.PAGE,
            sliding_window_size=self.WINDOW,
            token_to_kv_pool_allocator=self.alloc,
            on_node_evict=self._on_evict,
            eviction_policy=policy,
            eager_page_hashes=eager_hashes,
        )
        assert type(cache).__name__ == "SWARadixCache"
        return cache

    # -- plumbing -----------------------------------------------------------------
    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, list[int], list[int]]:
        """Run a cache call; return its result and the slots it freed (full, SWA-only)."""
        self.alloc.log.clear()
        self.alloc.log_swa.clear()
        result = fn(*args, **kwargs)
        freed, freed_swa = list(self.alloc.log), list(self.alloc.log_swa)
        self.alloc.log.clear()
        self.alloc.log_swa.clear()
        return result, freed, freed_swa

    def live(self, slots: list[int]) -> list[bool]:
        return self.alloc.mapped(slots)

    def locked_keys(self) -> set[tuple[Any, ...]]:
        keys: set[tuple[Any, ...]] = set()
        for lk in self.locks:
            keys.update(self.model.keys(lk.handle.seq, lk.handle.length))
        return keys

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
            self.alloc.swa_allocated(),
            nodes,
        )

    # -- cache operations with their checks ----------------------------------------
    def expected_match(self, seq: Seq) -> int:
        """Longest page-aligned held prefix with no tombstone or >= W live tokens after one."""
        model = self.model
        held = model.present(seq)
        live = self.live(model.slots(seq, held))
        for x in range(held, -1, -self.PAGE):
            if all(live[:x]):
                return x
            trailing = next(i for i in range(x) if not live[x - 1 - i])
            if trailing >= self.WINDOW:
                return x
        return 0

    def _match(self, seq: Seq) -> Any:
        nodes = len(walk(self.cache.root_node))
        m, freed, freed_swa = self._call(self.cache.match_prefix, seq.key())
        assert freed == [] and freed_swa == [], "match_prefix freed slots"
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
        live = self.live(got)
        if not all(live):
            trailing = next(i for i in range(n) if not live[n - 1 - i])
            assert trailing >= self.WINDOW, (
                f"match of {seq} ends {trailing} live tokens after a tombstone "
                f"(window {self.WINDOW})"
            )
        expected = self.expected_match(seq)
        if n < model.present(seq):
            event("match shorter than the held prefix (window rule)")
        assert n == expected, (
            f"match of {seq} gave {n} tokens; the longest held prefix satisfying the window "
            f"rule has {expected} (held: {model.present(seq)})"
        )
        node = m.last_node
        if n == 0:
            assert node is not None and node.key_len == 0, "a miss must end at a root"
            return
        ns, width, tokens, slots = node_path(node)
        assert (ns, width, tokens, slots) == (seq.ns, seq.width, seq.tokens[:n], got), (
            "last_node's path is not the matched prefix"
        )
        since, n_ = 0, node
        while n_.key_len and not n_.swa_tombstone:
            since += n_.key_len
            n_ = n_.parent
        assert n_.key_len == 0 or since >= self.WINDOW, (
            "the returned node chain has fewer than W live tokens after a tombstone"
        )

    def _evict(self, num: int, swa_num: int) -> Any:
        cache, model = self.cache, self.model
        before_full, before_swa = self.alloc.num_allocated(), self.alloc.swa_allocated()
        before_ev, before_swa_ev = cache.evictable_size(), cache.swa_evictable_size()
        was_live = dict(zip(model.pos_of, self.live(list(model.pos_of)), strict=True))
        r, freed, freed_swa = self._call(cache.evict, num, swa_num)
        assert len(set(freed)) == len(freed) == r.full_evicted, (
            f"evict reported {r.full_evicted} full tokens but freed {len(freed)} slots"
        )
        assert self.alloc.num_allocated() == before_full - r.full_evicted
        assert self.alloc.swa_allocated() == before_swa - r.swa_evicted, (
            f"evict reported {r.swa_evicted} SWA tokens but "
            f"{before_swa - self.alloc.swa_allocated()} SWA slots came back"
        )
        assert r.full_evicted <= before_ev
        assert r.full_evicted >= num or cache.evictable_size() == 0, (
            f"evict({num}) stopped at {r.full_evicted} with "
            f"{cache.evictable_size()} evictable tokens left"
        )
        assert r.swa_evicted >= swa_num or cache.swa_evictable_size() == 0, (
            f"evict(swa={swa_num}) stopped at {r.swa_evicted} with "
            f"{cache.swa_evictable_size()} SWA-evictable tokens left"
        )
        assert r.swa_evicted <= before_swa_ev
        # Overshoot: by less than one leaf and its tombstone chain per phase. Phase 2
        # deletes whole unlocked leaves (with their tombstoned ancestors) while it chases
        # SWA tokens, so only the SWA count is bounded once it runs.
        assert r.swa_evicted < max(num, swa_num) + MAX_TOKENS
        if swa_num == 0:
            assert r.full_evicted == 0 if num == 0 else r.full_evicted < num + MAX_TOKENS
        for s in freed_swa:
            assert was_live.get(s), f"free_swa of slot {s}, not live tree KV"
            assert s not in self.held, f"evict freed the SWA KV of caller slot {s}"
        for s in freed:
            assert s not in self.held, f"evict freed slot {s}, which the caller owns"
            model.drop_slot(s)
        model.check_prefix_closed()
        if r.full_evicted:
            event("evict freed full tokens")
        if freed_swa:
            event("evict tombstoned a node")
        return r

    def _alloc(self, n: int) -> list[int] | None:
        v = self.alloc.alloc(n)
        if v is None:
            need = -(-n // self.PAGE) * self.PAGE
            full_short = max(0, need - self.alloc.full_available_size())
            swa_short = max(0, need - self.alloc.swa_available_size())
            self._evict(full_short, swa_short)
            v = self.alloc.alloc(n)
            event("alloc: evicted under pressure" if v is not None else "alloc: pool exhausted")
            assert (
                v is not None
                or self.cache.evictable_size() == 0
                or self.cache.swa_evictable_size() == 0
            ), "eviction freed enough tokens but the pool still cannot allocate"
        if v is None:
            return None
        slots = ints(v)
        assert not (set(slots) & self.held) and not (set(slots) & set(self.model.pos_of))
        self.held |= set(slots)
        return slots

    def _lock(self, handle: Handle, owner: str) -> Lock:
        token, freed, freed_swa = self._call(self.cache.inc_lock_ref, handle.node)
        assert freed == [] and freed_swa == []
        slots = self.model.slots(handle.seq, handle.length)
        tail = slots[max(0, handle.length - self.WINDOW) :]
        window = [s for s, alive in zip(tail, self.live(tail), strict=True) if alive]
        lock = Lock(handle, token, slots, window, owner)
        self.locks.append(lock)
        return lock

    def _unlock(self, lock: Lock) -> None:
        """Unlock; a tombstone left childless and unlocked may be freed (with its chain)."""
        model = self.model
        dead = {
            s
            for s, alive in zip(model.pos_of, self.live(list(model.pos_of)), strict=True)
            if not alive
        }
        _, freed, freed_swa = self._call(self.cache.dec_lock_ref, lock.handle.node, lock.token)
        assert freed_swa == [], "unlock freed SWA KV"
        self.locks.remove(lock)
        if freed:
            event("unlock freed a childless tombstone")
        for s in freed:
            assert s in dead, f"unlock freed slot {s}, which is not a tombstone's"
            model.drop_slot(s)
        model.check_prefix_closed()

    def _swa_seqlen(self, choice: int, matched: int, seq: Seq) -> int:
        """The point before which the request's own SWA KV (from ``matched`` on) is gone.

        0; a page-aligned point in [matched, aligned] (choices 1-8); one token past the
        match (9; not page-aligned for pages > 1); the whole request with its tail (10).
        """
        aligned = self.model.aligned(seq)
        if choice == 0:
            return 0
        if choice == 9:
            return min(len(seq.tokens), matched + 1)
        if choice == 10:
            return len(seq.tokens)
        return min(aligned, matched + (choice - 1) * self.PAGE)

    def _insert(self, seq: Seq, kv: list[int], matched: int, swa_seqlen: int) -> Any:
        """The request freed the SWA KV of its own slots in [matched, swa_seqlen); insert."""
        ps, model = self.PAGE, self.model
        a = model.aligned(seq)
        own_gone = kv[matched : max(matched, swa_seqlen)]
        if own_gone:
            self.alloc.free_swa_own(own_gone)
        if swa_seqlen % ps and swa_seqlen < a:
            # Inside a page: rounding either way would be wrong, so insert refuses it;
            # the caller then drops the SWA KV of the rest of that page and retries.
            before = self.snapshot()
            with pytest.raises(InvalidInputError):
                self.cache.insert(
                    seq.key(), tensor(kv), prev_prefix_len=matched, swa_evicted_seqlen=swa_seqlen
                )
            assert self.snapshot() == before, "a refused insert changed the cache"
            event("insert refused an unaligned swa_evicted_seqlen")
            rounded = -(-swa_seqlen // ps) * ps
            rest = kv[max(matched, swa_seqlen) : rounded]
            if rest:
                self.alloc.free_swa_own(rest)
            swa_seqlen = rounded
        present = model.present(seq)
        assert present >= matched, "a locked prefix vanished before insert"
        sw = min(swa_seqlen, a)
        locked = self.locked_keys()
        store: dict[int, int | None] = {}  # position -> slot it replaces (revival)
        expect_freed = []
        for p in range(matched, a):
            if p < present:
                old = model.slot_of[model.key(seq, p)]
                if not self.live([old])[0] and p >= sw and model.key(seq, p) not in locked:
                    store[p] = old
                    expect_freed.append(old)
                else:
                    expect_freed.append(kv[p])
            elif sw >= a:
                expect_freed.append(kv[p])
            else:
                store[p] = None
        r, freed, freed_swa = self._call(
            self.cache.insert,
            seq.key(),
            tensor(kv),
            prev_prefix_len=matched,
            swa_evicted_seqlen=swa_seqlen,
        )
        assert freed_swa == [], "insert called free_swa"
        assert r.prefix_len == present, (
            f"insert of {seq} reported prefix_len {r.prefix_len}; the tree held {present}"
        )
        assert sorted(freed) == sorted(expect_freed), (
            f"insert(prev_prefix_len={matched}, swa_evicted_seqlen={swa_seqlen}) of {seq} "
            f"freed {sorted(freed)}, expected {sorted(expect_freed)} (held {present} tokens)"
        )
        if any(old is not None for old in store.values()):
            event("insert revived a tombstone")
        if present < a and sw >= a:
            event("insert dropped a tail whose SWA KV is gone")
        elif present < sw < a:
            event("insert added a tombstone leaf")
        for p, old in store.items():
            if old is not None:
                model.drop_slot(old)
            model.add(seq, p, kv[p])
        self.held -= set(kv[matched:a])
        end = a if (present == a or sw < a) else present
        if end:
            assert node_path(r.last_node) == (
                seq.ns,
                seq.width,
                seq.tokens[:end],
                model.slots(seq, end),
            )
            self._remember(Handle(r.last_node, seq, end))
        else:
            assert r.last_node.key_len == 0
        self._free_own(kv[a:])
        event(
            "insert: " + ("new" if present == 0 else "partial hit" if present < a else "full hit")
        )
        return r

    # -- invariants ------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        cache, model, alloc = self.cache, self.model, self.alloc
        cache.check_integrity()
        ev, prot, total = cache.evictable_size(), cache.protected_size(), cache.total_size()
        assert ev >= 0 and prot >= 0 and ev + prot == total
        assert total == len(model.slot_of), (
            f"total_size {total}, but {len(model.slot_of)} tokens were inserted and not evicted"
        )
        assert alloc.num_allocated() == total + len(self.held), (
            f"allocated {alloc.num_allocated()} != tree {total} + caller {len(self.held)}"
        )
        live_tree = sum(self.live(list(model.pos_of)))
        swa_ev, swa_prot = cache.swa_evictable_size(), cache.swa_protected_size()
        assert swa_ev >= 0 and swa_prot >= 0 and swa_ev + swa_prot == live_tree, (
            f"SWA sizes {swa_ev}+{swa_prot}, but {live_tree} tree tokens have SWA KV"
        )
        held_live = sum(self.live(sorted(self.held)))
        assert alloc.swa_allocated() == live_tree + held_live, (
            f"SWA pool has {alloc.swa_allocated()} slots out; tree {live_tree} + caller {held_live}"
        )
        assert not (self.held & set(model.pos_of))
        if self.held:
            assert bool(alloc.is_allocated(tensor(sorted(self.held))).all())
        model.check_prefix_closed()
        protected: set[tuple[Any, ...]] = set()
        window: set[int] = set()
        counts = Counter(id(lk.handle.node) for lk in self.locks)
        for lk in self.locks:
            h = lk.handle
            assert not h.node.evicted or not h.node.key_len, "a locked node was evicted"
            assert model.slots(h.seq, h.length) == lk.slots, "a locked prefix changed slots"
            assert all(self.live(lk.window)), "a locked window lost its SWA KV"
            protected.update(model.keys(h.seq, h.length))
            window.update(lk.window)
            if h.node.key_len:
                assert h.node.own_lock_ref == counts[id(h.node)]
        assert prot == len(protected), (
            f"protected_size {prot}, but locks cover {len(protected)} tokens"
        )
        assert swa_prot >= len(window), "SWA-protected tokens miss a locked window"
        live_ids = {n.id for n in walk(cache.root_node) if n.key_len}
        assert not (live_ids & self.evicted_ids), "on_node_evict named a node still in the tree"
        gone = self.seen_ids - live_ids
        assert gone <= self.fresh_notified, f"nodes {gone} left without on_node_evict"
        self.seen_ids, self.fresh_notified = live_ids, set()
        for h in self.handles:
            if h.node.evicted and h.node.key_len:
                assert h.node.id in self.evicted_ids, "a node left without on_node_evict"

    # -- shared rules ------------------------------------------------------------------
    @rule(num=st.integers(0, 16), swa_num=st.integers(0, 16))
    def evict(self, num: int, swa_num: int) -> None:
        scale = self.PAGE // 2 if self.PAGE > 1 else 1
        self._evict(num * scale if num % 2 else 0, swa_num * scale)

    @rule(swa_num=st.integers(1, 16))
    def evict_swa(self, swa_num: int) -> None:
        """SWA-only eviction: tombstones inner nodes."""
        self._evict(0, swa_num * (self.PAGE // 2 if self.PAGE > 1 else 1))

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
            ns, width, tokens, slots = node_path(h.node)
            assert (ns, width, tokens) == (h.seq.ns, h.seq.width, h.seq.tokens[: h.length]), (
                "a node handle no longer ends where it did"
            )
            assert slots == self.model.slots(h.seq, h.length)
            if h.node.swa_tombstone:
                event("lock of a tombstone")
        self._lock(h, "explicit")

    @precondition(lambda self: self.handles or self.locks)
    @rule(i=INDEX, kind=st.integers(0, 2))
    def bad_unlock(self, i: int, kind: int) -> None:
        """Unbalanced unlocks: no own lock, evicted, or a boundary id off the path."""
        if kind == 2 and self.locks:
            lk = self.locks[i % len(self.locks)]
            if lk.handle.node.key_len and not lk.handle.node.evicted:
                event("bad unlock refused (bogus boundary)")
                self._expect_lock_error(self.cache.dec_lock_ref, lk.handle.node, BOGUS_BOUNDARY)
            return
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


class WorkerMachine(SWAHarness):
    """Requests follow the worker protocol, with locks held across steps."""

    def _begin(self, seq: Seq) -> Request | None:
        """Prefill start: match, lock the hit, allocate the rest."""
        m = self._match(seq)
        lock = self._lock(Handle(m.last_node, seq, m.prefix_len), "request")
        new = self._alloc(len(seq.tokens) - m.prefix_len)
        if new is None:
            self._unlock(lock)
            return None
        return Request(seq, lock, m.prefix_len, ints(m.indices) + new, new)

    def _commit(self, req: Request, swa_choice: int, relock: bool, relock_first: bool) -> None:
        """Prefill end: insert (which frees duplicates), free the tail, move the lock."""
        seq = req.seq
        self._insert(seq, req.kv, req.matched, self._swa_seqlen(swa_choice, req.matched, seq))
        if not relock:
            self._unlock(req.lock)
            return
        m = self._match(seq)
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
    @rule(i=INDEX, swa_choice=SWA_CHOICE, relock=st.booleans(), relock_first=st.booleans())
    def commit(self, i: int, swa_choice: int, relock: bool, relock_first: bool) -> None:
        req = self.requests.pop(i % len(self.requests))
        self._commit(req, swa_choice, relock, relock_first)

    @precondition(lambda self: len(self.locks) < 8)
    @rule(spec=SEQS, swa_choice=SWA_CHOICE, relock=st.booleans())
    def prefill(self, spec: Any, swa_choice: int, relock: bool) -> None:
        """begin + commit in one step (no other request interleaves)."""
        req = self._begin(self.seq(spec))
        if req is not None:
            self._commit(req, swa_choice, relock, False)

    @precondition(lambda self: self.requests)
    @rule(i=INDEX)
    def abort(self, i: int) -> None:
        """A request dropped before insert: unlock and free its new slots."""
        req = self.requests.pop(i % len(self.requests))
        self._unlock(req.lock)
        self._free_own(req.new)


class DirectMachine(SWAHarness):
    """Insert fresh slots for the whole key (prev_prefix_len=0); insert frees duplicates."""

    @rule(spec=SEQS, swa_choice=SWA_CHOICE)
    def insert(self, spec: Any, swa_choice: int) -> None:
        seq = self.seq(spec)
        kv = self._alloc(len(seq.tokens))
        if kv is not None:
            self._insert(seq, kv, 0, self._swa_seqlen(swa_choice, 0, seq))


PAGES = {
    1: dict(PAGE=1, POOL=24, SWA_POOL=12, WINDOW=3, MAX_PAGES=8),
    16: dict(PAGE=16, POOL=16 * 32, SWA_POOL=16 * 16, WINDOW=24, MAX_PAGES=6),
}


MACHINES = {"worker": WorkerMachine, "direct": DirectMachine}


def _machine(kind: str, page: int) -> type[RuleBasedStateMachine]:
    base = MACHINES[kind]
    return type(f"SWA{base.__name__}Page{page}", (base,), dict(PAGES[page]))


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("kind", ["worker", "direct"])
def test_swa_machine(kind: str, page: int) -> None:
    run_state_machine_as_test(_machine(kind, page), settings=machine_settings(120, 50))


@pytest.mark.slow
@LONG
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("kind", ["worker", "direct"])
def test_swa_machine_long(kind: str, page: int) -> None:
    run_state_machine_as_test(_machine(kind, page), settings=machine_settings(500, 100))
