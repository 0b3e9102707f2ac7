"""Stateful property tests of ``SlotAllocator`` and ``SlotPrefixCache`` (seed 004's model).

``SlotMachine`` drives both as a slot-per-sequence engine does: a request finds its
prefix, then either occupies the free slot that holds it or allocates a slot and
``copy_kv``s the prefix into it, prefills the rest (writing real K and V tensors),
decodes a few tokens, inserts (possibly more than once as it grows), pins, and finally
frees its slot, before or after its last insert. Around that it finds, pins and
releases prefixes and old handles (split, evicted, or from before an occasional
``reset``), evicts, and tries bad calls, which must raise and change nothing: stale or
contradicting inserts, double frees, unbalanced releases, copies into a slot whose KV
is cached. Keys come from the shared harness (tiny vocabulary, namespaces ``None``,
``""``, ``"a"``, width-2 tuple tokens).

The model has three parts:

* what each slot's positions hold (a code per ``(namespace, width, token)``), mirrored
  in the K and V tensors, which must equal it after every step (so ``copy_kv`` moved
  exactly the right rows);
* the tree's entry for every position (``(namespace, width, tokens up to it)`` ->
  ``(slot, version)``), updated by each insert as documented (the key's whole path,
  and down to the slot's deepest entry when the key is a prefix of it); the tree must
  hold exactly these positions less the ones a call may evict, which must be unpinned;
* the slots each running request holds, and its version.

Checked: every ``find`` (and ``pin`` by tokens, and ``copy_kv``) answers the deepest
position on the key's path whose entry is current; every current entry is sound (its
slot really holds the path); after every step ``check_integrity()`` on both, the sizes
(total = positions held, protected = positions under a pin, never above capacity),
pinned handles end where they did, and no slot leaked or is owned twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from cache_model import INDEX, LONG, SEQS, Seq, machine_settings, make_seq
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

from prefixcache.cache.errors import (
    DoubleFreeError,
    InvalidInputError,
    LockError,
    SlotIndexError,
)
from prefixcache.cache.key import RadixKey
from prefixcache.cache.pools.slot_allocator import SlotAllocator, StaleSlotError
from prefixcache.cache.slot.slot_cache import MISS, SlotMatch, SlotNode, SlotPrefixCache

SLOTS, MAX_LEN, LAYERS = 4, 12, 2
PosKey = tuple[Any, int, tuple[Any, ...]]


def pos_key(ns: str | None, width: int, tokens: tuple[Any, ...], i: int) -> PosKey:
    return (ns, width, tuple(tokens[: i + 1]))


def tree_entries(cache: SlotPrefixCache) -> dict[PosKey, tuple[int, int]]:
    """Every position in the tree with the entry of the node that holds it."""
    out = {}
    for (extra_key, width), ns_root in cache.root_node.children.items():
        stack: list[tuple[Any, tuple[Any, ...]]] = [(ns_root, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                tokens = prefix + tuple(child.key.token_ids)
                for i in range(len(prefix), len(tokens)):
                    out[pos_key(extra_key, width, tokens, i)] = (child.slot, child.version)
                stack.append((child, tokens))
    return out


def node_path(node: SlotNode) -> tuple[Any, int, tuple[Any, ...]]:
    parts = []
    while node.key_len:
        parts.append(tuple(node.key.token_ids))
        node = node.parent
    ns = node.namespace
    return (ns.extra_key, ns.token_width, tuple(t for p in reversed(parts) for t in p))


@dataclass
class Handle:
    node: SlotNode
    path: tuple[Any, int, tuple[Any, ...]]
    epoch: int


@dataclass
class Request:
    seq: Seq
    slot: int
    version: int
    inserted: bool = False
    pins: list[Handle] = field(default_factory=list)


class SlotMachine(RuleBasedStateMachine):
    CAPACITY = 60

    def __init__(self) -> None:
        super().__init__()
        self.alloc = SlotAllocator(SLOTS)
        self.k = torch.zeros(SLOTS, MAX_LEN, LAYERS, 1)
        self.v = torch.zeros(SLOTS, MAX_LEN, LAYERS, 1)
        self.held = [[0] * MAX_LEN for _ in range(SLOTS)]  # per slot: a code per position
        self.codes: dict[tuple[Any, ...], int] = {}
        self.entries: dict[PosKey, tuple[int, int]] = {}
        self.requests: list[Request] = []
        self.pins: list[Handle] = []  # explicit ones; requests keep their own
        self.handles: list[Handle] = []
        self.history: list[Seq] = []
        self.epoch = 0

    @initialize(policy=st.sampled_from(["lru", "lfu", "fifo"]))
    def configure(self, policy: str) -> None:
        self.cache = SlotPrefixCache(
            self.alloc, self.CAPACITY, max_seq_len=MAX_LEN, eviction_policy=policy
        )

    # -- plumbing ---------------------------------------------------------------------
    def seq(self, spec: Any) -> Seq:
        seq = make_seq(spec, 1, 8, self.history)
        self.history.append(seq)
        del self.history[:-16]
        return seq

    def key(self, seq: Seq, as_key: bool = True) -> dict[str, Any]:
        if as_key:
            return dict(tokens=RadixKey(list(seq.tokens), seq.ns))
        return dict(tokens=list(seq.tokens), extra_key=seq.ns)

    def code(self, seq: Seq, i: int) -> int:
        return self.codes.setdefault((seq.ns, seq.width, seq.tokens[i]), len(self.codes) + 1)

    def write(self, slot: int, seq: Seq, start: int) -> None:
        """The engine computes positions ``[start, len)`` of ``seq`` into ``slot``."""
        for i in range(start, len(seq.tokens)):
            code = self.code(seq, i)
            self.held[slot][i] = code
            for layer in range(LAYERS):
                self.k[slot, i, layer, 0] = code * 10 + layer + 1
                self.v[slot, i, layer, 0] = -(code * 10 + layer + 1)

    def expected_find(self, seq: Seq) -> SlotMatch:
        best = MISS
        for i in range(len(seq.tokens)):
            entry = self.entries.get(pos_key(seq.ns, seq.width, seq.tokens, i))
            if entry is None:
                break
            if self.alloc.is_current(*entry):
                best = SlotMatch(i + 1, *entry)
        return best

    def pinned_positions(self) -> set[PosKey]:
        out = set()
        for h in self.pins + [p for r in self.requests for p in r.pins]:
            ns, width, tokens = h.path
            out.update(pos_key(ns, width, tokens, i) for i in range(len(tokens)))
        return out

    def sync(
        self, expected: dict[PosKey, tuple[int, int]], may_evict: bool, evicted: int | None = None
    ) -> None:
        """The tree holds ``expected`` less what the call evicted (unpinned only)."""
        actual = tree_entries(self.cache)
        for k, entry in actual.items():
            assert expected.get(k) == entry, f"position {k} holds {entry}, not {expected.get(k)}"
        dropped = expected.keys() - actual.keys()
        assert may_evict or not dropped, "a call that cannot evict dropped positions"
        assert not dropped & self.pinned_positions(), "eviction took a pinned position"
        if evicted is not None:
            assert evicted == len(dropped), f"reported {evicted} evicted, dropped {len(dropped)}"
        if dropped:
            event("evicted")
        self.entries = actual

    def snapshot(self) -> Any:
        c, a = self.cache, self.alloc
        nodes = sorted(
            (
                n.id,
                n.key_bytes,
                n.slot,
                n.version,
                n.lock_ref,
                n.own_lock_ref,
                n.last_access_time,
                n.hit_count,
            )
            for n, _ in _walk(c)
        )
        return (
            nodes,
            c.total_size(),
            c.protected_size(),
            c.num_pins(),
            sorted(c._tips),
            list(a._free),
            [a.version(s) for s in range(SLOTS)],
            self.k.clone().tolist(),
            self.v.clone().tolist(),
        )

    def refused(self, error: type[Exception], fn: Any, *args: Any, **kwargs: Any) -> None:
        before = self.snapshot()
        with pytest.raises(error):
            fn(*args, **kwargs)
        assert self.snapshot() == before, f"a refused {fn.__name__} changed state"

    def remember(self, node: SlotNode | None, path: tuple[Any, ...]) -> Handle | None:
        if node is None:
            return None
        assert node_path(node) == path and node.depth == len(path[2])
        handle = Handle(node, path, self.epoch)
        self.handles.append(handle)
        del self.handles[:-12]
        return handle

    # -- the cache calls, each checked against the model ------------------------------
    def _find(self, seq: Seq, as_key: bool) -> SlotMatch:
        expected = self.expected_find(seq)
        got = self.cache.find(**self.key(seq, as_key))
        assert got == expected, f"find {seq} gave {got}, the model says {expected}"
        self.sync(dict(self.entries), may_evict=False)
        return got

    def _insert(self, req: Request, as_key: bool, upto: int | None = None) -> None:
        """insert the request's tokens (up to ``upto``) under its slot and version."""
        s, v = req.slot, req.version
        seq = Seq(req.seq.ns, req.seq.width, req.seq.tokens[:upto])
        cut = seq.tokens[: self.CAPACITY]
        present = 0
        while present < len(cut) and pos_key(seq.ns, seq.width, cut, present) in self.entries:
            present += 1
        expected = dict(self.entries)
        mine = [k for k, e in expected.items() if e == (s, v)]
        deepest = max(mine, key=lambda k: len(k[2]), default=None)
        if cut and deepest is not None and len(deepest[2]) > len(cut):
            assert deepest[:2] == (seq.ns, seq.width) and deepest[2][: len(cut)] == cut
            cut = deepest[2]
            event("a prefix insert wrote down to the slot's deepest entry")
        for i in range(len(cut)):
            expected[pos_key(seq.ns, seq.width, cut, i)] = (s, v)
        r = self.cache.insert(**self.key(seq, as_key), slot=s, version=v)
        assert r.prefix_len == present
        self.sync(expected, may_evict=True, evicted=r.evicted)
        req.inserted = True
        path = (seq.ns, seq.width, seq.tokens[: self.CAPACITY])
        if r.node is None and path[2]:
            event("insert evicted at once")
            assert any(
                pos_key(*path[:2], path[2], i) not in self.entries for i in range(len(path[2]))
            )
        elif r.node is not None and self.remember(r.node, path) and len(req.pins) < 2:
            req.pins.append(self.handles[-1])
            self.cache.pin(r.node)

    # -- rules -------------------------------------------------------------------------
    def _begin(self, seq: Seq, reuse_in_place: bool, as_key: bool, insert_now: bool) -> Request:
        """A request arrives: reuse its cached prefix in place or by copy, prefill."""
        m = self._find(seq, as_key)
        if m.prefix_len and reuse_in_place and self.alloc.is_free(m.slot):
            version = self.alloc.occupy(m.slot, m.version)
            assert version == m.version + 1, "occupy of a free, current slot failed"
            slot, start = m.slot, m.prefix_len
            event("reused a slot in place")
        else:
            slot = self.alloc.alloc()
            assert slot is not None, "the pool ran out with a slot per request to spare"
            version = self.alloc.version(slot)
            expected = self.expected_find(seq)  # alloc may have taken the source slot
            got = self.cache.copy_kv(
                **self.key(seq, as_key), target_slot=slot, kv_cache=(self.k, self.v)
            )
            assert got == expected
            if got.prefix_len:
                self.held[slot][: got.prefix_len] = self.held[got.slot][: got.prefix_len]
                event("copied a cached prefix")
            start = got.prefix_len
            self.sync(dict(self.entries), may_evict=False)
        self.write(slot, seq, start)
        req = Request(seq, slot, version)
        self.requests.append(req)
        if insert_now:
            self._insert(req, as_key)
        return req

    def _finish(self, req: Request, insert: bool, free_first: bool) -> None:
        """The request ends: release its pins, free its slot, insert (before or after)."""
        self.requests.remove(req)
        for h in req.pins:
            self.cache.release(h.node)
        self.sync(dict(self.entries), may_evict=False)
        if free_first:
            self.alloc.free(req.slot)
        if insert or not req.inserted:
            req.pins = []
            self._insert(req, False)
            for h in req.pins:  # _insert pinned the node for the (now gone) request
                self.cache.release(h.node)
        if not free_first:
            self.alloc.free(req.slot)
        assert self.alloc.is_free(req.slot)

    # -- rules -------------------------------------------------------------------------
    @precondition(lambda self: len(self.requests) < SLOTS - 1)
    @rule(spec=SEQS, reuse_in_place=st.booleans(), as_key=st.booleans(), insert_now=st.booleans())
    def begin(self, spec: Any, reuse_in_place: bool, as_key: bool, insert_now: bool) -> None:
        self._begin(self.seq(spec), reuse_in_place, as_key, insert_now)

    @precondition(lambda self: len(self.requests) < SLOTS)
    @rule(spec=SEQS, reuse_in_place=st.booleans(), free_first=st.booleans())
    def serve(self, spec: Any, reuse_in_place: bool, free_first: bool) -> None:
        """A whole request in one step: begin, insert, finish."""
        req = self._begin(self.seq(spec), reuse_in_place, True, False)
        self._finish(req, True, free_first)

    @precondition(lambda self: self.requests)
    @rule(i=INDEX, grow=st.lists(st.integers(0, 3), min_size=1, max_size=4), insert=st.booleans())
    def decode(self, i: int, grow: list[int], insert: bool) -> None:
        """A running request appends tokens to its slot (and may insert the longer key)."""
        req = self.requests[i % len(self.requests)]
        room = MAX_LEN - len(req.seq.tokens)
        extra = [t if req.seq.width == 1 else (t % 2, t // 2) for t in grow[:room]]
        start = len(req.seq.tokens)
        req.seq = Seq(req.seq.ns, req.seq.width, req.seq.tokens + tuple(extra))
        self.write(req.slot, req.seq, start)
        if insert:
            self._insert(req, True)

    @precondition(lambda self: any(r.inserted for r in self.requests))
    @rule(i=INDEX, upto=st.integers(0, MAX_LEN))
    def reinsert_prefix(self, i: int, upto: int) -> None:
        """Insert a prefix of what a request's slot already holds under its version."""
        done = [r for r in self.requests if r.inserted]
        self._insert(done[i % len(done)], bool(upto % 2), upto)

    @precondition(lambda self: self.requests)
    @rule(i=INDEX, insert=st.booleans(), free_first=st.booleans())
    def finish(self, i: int, insert: bool, free_first: bool) -> None:
        self._finish(self.requests[i % len(self.requests)], insert, free_first)

    @rule(spec=SEQS, as_key=st.booleans())
    def find(self, spec: Any, as_key: bool) -> None:
        self._find(self.seq(spec), as_key)

    @precondition(lambda self: len(self.pins) < 6)
    @rule(spec=SEQS)
    def pin_prefix(self, spec: Any) -> None:
        """Pin what find would return; the node must end exactly there."""
        seq = self.seq(spec)
        expected = self.expected_find(seq)
        node = self.cache.pin(seq.tokens, extra_key=seq.ns)
        if not expected.prefix_len:
            assert node is None
        else:
            assert (node.depth, node.slot, node.version) == expected
            handle = self.remember(node, (seq.ns, seq.width, seq.tokens[: expected.prefix_len]))
            self.pins.append(handle)
        self.sync(dict(self.entries), may_evict=False)

    @precondition(lambda self: self.handles and len(self.pins) < 6)
    @rule(i=INDEX)
    def pin_handle(self, i: int) -> None:
        """Pin a node from an earlier call: refused if it was evicted or predates a reset."""
        h = self.handles[i % len(self.handles)]
        if h.node.evicted or h.epoch != self.epoch:
            event("pin of a gone handle refused")
            self.refused(LockError, self.cache.pin, h.node)
            return
        assert node_path(h.node) == h.path, "a handle no longer ends where it did"
        self.cache.pin(h.node)
        self.pins.append(h)

    @precondition(lambda self: self.pins)
    @rule(i=INDEX)
    def release(self, i: int) -> None:
        self.cache.release(self.pins.pop(i % len(self.pins)).node)
        self.sync(dict(self.entries), may_evict=False)

    @rule(kind=st.integers(0, 7), i=INDEX)
    def bad_call(self, kind: int, i: int) -> None:
        """One refused call: it must raise and change nothing."""
        if kind == 0:
            self._bad_release(i)
        elif kind <= 5:
            self._bad_insert(kind - 1, i)
        elif kind == 6:
            self._bad_free(i)
        else:
            self._bad_copy(i, bool(i % 2))

    def _bad_release(self, i: int) -> None:
        if not self.handles:
            return
        h = self.handles[i % len(self.handles)]
        mine = [
            p for p in self.pins + [p for r in self.requests for p in r.pins] if p.node is h.node
        ]
        if mine and h.epoch == self.epoch:
            return
        event("unbalanced release refused")
        self.refused(LockError, self.cache.release, h.node)

    @rule(num=st.integers(0, 12))
    def evict(self, num: int) -> None:
        evictable = self.cache.evictable_size()
        got = self.cache.evict(num)
        assert got >= num or self.cache.evictable_size() == 0
        assert got <= evictable
        self.sync(dict(self.entries), may_evict=True, evicted=got)

    def _bad_insert(self, kind: int, i: int) -> None:
        """Stale, never-written, out-of-pool, too long or contradicting: all refused."""
        used = [s for s in range(SLOTS) if self.alloc.version(s)]
        tokens, ns = [1, 2], None
        if kind == 0 and used:
            s = used[i % len(used)]
            self.refused(
                StaleSlotError,
                self.cache.insert,
                tokens,
                s,
                self.alloc.version(s) + 1 + i % 2 * -2 * (self.alloc.version(s) > 1),
            )
        elif kind == 1 and len(used) < SLOTS:
            s = next(s for s in range(SLOTS) if not self.alloc.version(s))
            self.refused(StaleSlotError, self.cache.insert, tokens, s, 0)
        elif kind == 2:
            self.refused(SlotIndexError, self.cache.insert, tokens, SLOTS + i, 1)
        elif kind == 3 and used:
            s = used[i % len(used)]
            self.refused(
                InvalidInputError, self.cache.insert, [0] * (MAX_LEN + 1), s, self.alloc.version(s)
            )
        else:
            current = [e for e in set(self.entries.values()) if self.alloc.is_current(*e)]
            if not current:
                return
            s, v = current[i % len(current)]
            ns, width, tokens = max(
                (k for k, e in self.entries.items() if e == (s, v)), key=lambda k: len(k[2])
            )
            if i % 2:
                ns = "other"  # the same tokens in another namespace contradict too
            else:
                first = tokens[0]
                tokens = ((first + 1) % 4 if width == 1 else (first[0], 1 - first[1]), *tokens[1:])
            event("contradicting insert refused")
            self.refused(InvalidInputError, self.cache.insert, list(tokens), s, v, extra_key=ns)

    def _bad_free(self, i: int) -> None:
        free = [s for s in range(SLOTS) if self.alloc.is_free(s)]
        if free:
            self.refused(DoubleFreeError, self.alloc.free, free[i % len(free)])

    def _bad_copy(self, i: int, into_free: bool) -> None:
        """A copy into a free slot, or over a request's KV already cached, is refused."""
        if not self.requests:
            return
        req = self.requests[i % len(self.requests)]
        free = [s for s in range(SLOTS) if self.alloc.is_free(s)]
        if into_free and free:
            target = free[i % len(free)]
        elif req.slot in {e[0] for k, e in self.entries.items() if e == (req.slot, req.version)}:
            target = req.slot
            if self.expected_find(req.seq).slot == target:
                return  # a copy from the slot into itself is allowed (and a no-op)
        else:
            return
        self.refused(
            InvalidInputError,
            self.cache.copy_kv,
            list(req.seq.tokens),
            target,
            (self.k, self.v),
            extra_key=req.seq.ns,
        )

    @rule(go=st.integers(0, 49))
    def reset(self, go: int) -> None:
        """Admin reset (rarely): the tree is forgotten; slots and their KV stay."""
        if go != 37:
            return
        self.cache.reset()
        self.entries.clear()
        self.pins.clear()
        for req in self.requests:
            req.pins.clear()
        self.epoch += 1
        event("reset")

    # -- invariants --------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        cache, alloc = self.cache, self.alloc
        cache.check_integrity()
        alloc.check_integrity()
        assert cache.total_size() == len(self.entries) <= self.CAPACITY
        assert cache.evictable_size() + cache.protected_size() == cache.total_size()
        assert cache.protected_size() == len(self.pinned_positions())
        pins = self.pins + [p for r in self.requests for p in r.pins]
        assert cache.num_pins() == len(pins)
        for h in pins:
            assert not h.node.evicted and node_path(h.node) == h.path
        # No slot leaked or owned twice; every request still owns its version.
        slots = [r.slot for r in self.requests]
        assert len(set(slots)) == len(slots)
        assert alloc.free_count() + len(slots) == SLOTS
        for r in self.requests:
            assert not alloc.is_free(r.slot) and alloc.version(r.slot) == r.version
        # Every usable entry is sound: its slot holds the whole path.
        for (ns, width, tokens), (s, v) in self.entries.items():
            if alloc.is_current(s, v):
                want = [self.codes.get((ns, width, t)) for t in tokens]
                assert self.held[s][: len(tokens)] == want, f"slot {s} does not hold {tokens}"
        values = torch.tensor(self.held, dtype=torch.float32)[:, :, None]
        values = (values * 10 + torch.arange(1, LAYERS + 1)) * (values > 0)
        assert torch.equal(self.k[..., 0], values) and torch.equal(self.v[..., 0], -values)


def _walk(cache: SlotPrefixCache) -> list[tuple[SlotNode, int]]:
    from prefixcache.cache.inspection import walk

    return list(walk(cache.root_node))


class AllocatorMachine(RuleBasedStateMachine):
    """SlotAllocator alone against a model: free set in FIFO order, versions."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = SlotAllocator(SLOTS)
        self.queue = list(range(SLOTS))
        self.versions = [0] * SLOTS

    @rule()
    def alloc_one(self) -> None:
        slot = self.alloc.alloc()
        if not self.queue:
            assert slot is None
            return
        assert slot == self.queue.pop(0)
        self.versions[slot] += 1

    @rule(slot=st.integers(-1, SLOTS))
    def free(self, slot: int) -> None:
        if not 0 <= slot < SLOTS:
            with pytest.raises(SlotIndexError):
                self.alloc.free(slot)
        elif slot in self.queue:
            with pytest.raises(DoubleFreeError):
                self.alloc.free(slot)
        else:
            self.alloc.free(slot)
            self.queue.append(slot)

    @rule(slot=st.integers(0, SLOTS - 1), back=st.integers(0, 2))
    def occupy(self, slot: int, back: int) -> None:
        version = max(0, self.versions[slot] - back)
        got = self.alloc.occupy(slot, version)
        if slot in self.queue and version and version == self.versions[slot]:
            self.queue.remove(slot)
            self.versions[slot] += 1
            assert got == self.versions[slot]
        else:
            assert got is None

    @rule()
    def clear(self) -> None:
        self.alloc.clear()
        self.queue += [s for s in range(SLOTS) if s not in self.queue]

    @invariant()
    def matches_model(self) -> None:
        self.alloc.check_integrity()
        assert list(self.alloc._free) == self.queue
        assert [self.alloc.version(s) for s in range(SLOTS)] == self.versions
        assert self.alloc.free_count() == len(self.queue)


class SmallSlotMachine(SlotMachine):
    """Capacity below a slot's length: inserts are cut, evictions are constant."""

    CAPACITY = 10


MACHINES = {"roomy": SlotMachine, "small": SmallSlotMachine}


@pytest.mark.parametrize("kind", sorted(MACHINES))
def test_slot_machine(kind: str) -> None:
    run_state_machine_as_test(MACHINES[kind], settings=machine_settings(60, 50))


def test_allocator_machine() -> None:
    run_state_machine_as_test(AllocatorMachine, settings=machine_settings(30, 30))


@pytest.mark.slow
@LONG
@pytest.mark.parametrize("kind", sorted(MACHINES))
def test_slot_machine_long(kind: str) -> None:
    run_state_machine_as_test(MACHINES[kind], settings=machine_settings(500, 100))
