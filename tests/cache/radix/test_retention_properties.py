"""Stateful property tests of retention in ``RadixCache`` against a model of its rules.

The machine drives a cache on a fake clock: inserts, matches, retain hints (with
owners, priorities and per-owner limits), releases, locks, evictions, the clock moving
on and lapses processed. Next to the cache it keeps its own record of every retention
(node id -> priority, seconds, expiry, owner) and applies the rules of retention.py to
it without the cache's timers or counters:

* a hint covers the path from the namespace root, nearest the root first; a node not
  yet retained is taken while the owner's tokens stay within its limit, and the first
  one that does not fit ends the hint (clipped, or rejected if nothing was covered),
  after the cache split off its part that fits (the room left is then under a page);
  the owner's own node takes the new hint, another owner's the larger of both;
* every touch (the nodes a match or an insert walks through) renews a retention in
  force for its seconds;
* a retention is in force until its expiry, and counted while in force or while a
  child of its node is counted; a node that leaves the tree takes its retention along.

After every step: ``check_integrity()`` (whose retention part recomputes the owners'
counts, the retained-children counts, closure towards the root and the timers), and
the cache's retained nodes include the model's counted ones (the cache may hold a
lapsed one until its timer is processed). After a lapse, an eviction or a hint the
two agree exactly, owners' token counts included. Every eviction is compared with a
brute-force one: among the unlocked leaves, repeatedly the lowest ``(priority in
force, base rank)``, a parent becoming a leaf when its last child goes, until enough
tokens are freed; the cache must free exactly those nodes (checked when the ranks
are distinct, which they almost always are).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from cache_model import LONG, POLICIES, machine_settings
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixcache.cache import EVICTION_POLICIES, RadixCache, RadixKey, TokenToKVPoolAllocator
from prefixcache.cache.retention import ACCEPTED, CLIPPED, REJECTED

PAGE = 2
POOL = 48
OWNERS = [None, "a", "b"]
# Short sequences over a tiny alphabet, often extending a recent one, so prefixes are
# shared and nodes split.
SEQS = st.tuples(
    st.lists(st.integers(0, 2), min_size=1, max_size=10),
    st.none() | st.tuples(st.integers(0, 7), st.integers(0, 8)),
)
# A prefix of a recently inserted sequence: (which, pages), or any sequence.
TARGETS = st.tuples(st.integers(0, 7), st.integers(1, 8)) | SEQS


@dataclasses.dataclass
class Rec:
    priority: int
    seconds: float
    until: float
    owner: Any


class RetentionMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(POLICIES))
    def configure(self, policy: str) -> None:
        self.now = 0.0
        self.alloc = TokenToKVPoolAllocator(POOL, "cpu", PAGE)
        self.evicted: list[int] = []
        self.cache = RadixCache(
            PAGE,
            None,
            self.alloc,
            self.evicted.append,
            eviction_policy=policy,
            clock=lambda: self.now,
        )
        self.base = EVICTION_POLICIES[policy]
        self.recs: dict[int, Rec] = {}
        self.nodes: dict[int, Any] = {}  # every node the model has seen, by id
        self.history: list[list[int]] = []
        self.inserted: list[list[int]] = []
        self.locks: list[Any] = []

    # ----------------------------------------------------------------- model

    def tokens(self, spec: Any) -> list[int]:
        fresh, reuse = spec
        head: list[int] = []
        if reuse is not None and self.history:
            base = self.history[reuse[0] % len(self.history)]
            head = base[: reuse[1] * PAGE]
        seq = (head + fresh)[:16]
        self.history.append(seq)
        del self.history[:-8]
        return seq

    def target(self, spec: Any) -> list[int]:
        if isinstance(spec[0], int):
            if not self.inserted:
                return [0]
            which, pages = spec
            return self.inserted[which % len(self.inserted)][: pages * PAGE]
        return self.tokens(spec)

    def tree_nodes(self) -> list[Any]:
        out, stack = [], list(self.cache.root_node.children.values())
        while stack:
            node = stack.pop()
            if node.key_len:
                out.append(node)
            stack.extend(node.children.values())
        return out

    def sync_structure(self) -> None:
        """Take in the nodes the last call made: a split's upper part has the lower
        part's retention, a new leaf none; forget the nodes that left the tree."""
        live = self.tree_nodes()
        ids = {n.id for n in live}
        for gone in [i for i in self.nodes if i not in ids]:
            del self.nodes[gone]
            self.recs.pop(gone, None)
        fresh = [n for n in live if n.id not in self.nodes]
        fresh.sort(key=self.depth, reverse=True)  # lower parts first
        for node in fresh:
            known = [c for c in node.children.values() if c.id in self.nodes]
            if known and known[0].id in self.recs:
                self.recs[node.id] = dataclasses.replace(self.recs[known[0].id])
            self.nodes[node.id] = node

    @staticmethod
    def depth(node: Any) -> int:
        d = 0
        while node.key_len:
            d, node = d + 1, node.parent
        return d

    @staticmethod
    def path(node: Any) -> list[Any]:
        out = []
        while node.key_len:
            out.append(node)
            node = node.parent
        return out[::-1]

    def counted(self) -> set[int]:
        """Nodes whose retention counts now: in force, or a counted child below."""
        out: set[int] = set()

        def visit(node: Any) -> bool:
            below = [visit(c) for c in list(node.children.values())]
            if (
                node.key_len
                and node.id in self.recs
                and (self.recs[node.id].until > self.now or any(below))
            ):
                out.add(node.id)
                return True
            return False

        visit(self.cache.root_node)
        return out

    def lapse_model(self) -> None:
        keep = self.counted()
        for i in [i for i in self.recs if i not in keep]:
            del self.recs[i]

    def owner_tokens(self) -> dict[Any, int]:
        out: dict[Any, int] = {}
        for i, rec in self.recs.items():
            out[rec.owner] = out.get(rec.owner, 0) + self.nodes[i].key_len
        return out

    def renew(self, nodes: list[Any]) -> None:
        for node in nodes:
            rec = self.recs.get(node.id)
            if rec is not None and rec.until > self.now:
                rec.until = max(rec.until, self.now + rec.seconds)

    def touched(self, last: Any) -> list[Any]:
        """The nodes a walk that ended at ``last`` touched: its path, and the lower
        part of a node it split on the way (a new node with a known child)."""
        nodes = self.path(last) if last.key_len else []
        return nodes + [
            c
            for n in nodes
            if n.id not in self.nodes
            for c in n.children.values()
            if c.id in self.nodes
        ]

    def rank(self, node: Any) -> tuple[Any, ...]:
        rec = self.recs.get(node.id)
        held = rec.priority if rec is not None and rec.until > self.now else 0
        base = self.base(node)
        return (held, *base) if isinstance(base, tuple) else (held, base)

    # ----------------------------------------------------------------- rules

    @rule(spec=SEQS)
    def insert(self, spec: Any) -> None:
        seq = self.tokens(spec)
        aligned = len(seq) - len(seq) % PAGE
        if not aligned:
            return
        self.cache.evict(max(0, aligned - self.alloc.available_size()))
        self.after_lapse_and_evict()
        slots = self.alloc.alloc(aligned)
        if slots is None:
            event("pool full")
            return
        result = self.cache.insert(RadixKey(seq[:aligned]), slots)
        self.inserted.append(seq[:aligned])
        del self.inserted[:-8]
        if result.prefix_len:
            self.alloc.free(slots[: result.prefix_len])
        touched = self.touched(result.last_node)
        self.sync_structure()
        self.renew(touched)

    @rule(spec=SEQS)
    def match(self, spec: Any) -> None:
        result = self.cache.match_prefix(RadixKey(self.tokens(spec)))
        touched = self.touched(result.last_node)
        self.sync_structure()
        self.renew(touched)

    @rule(
        spec=TARGETS,
        seconds=st.sampled_from([1.0, 3.0, 10.0]),
        priority=st.integers(1, 3),
        owner=st.sampled_from(OWNERS),
        limit=st.none() | st.integers(0, 24),
    )
    def retain(
        self, spec: Any, seconds: float, priority: int, owner: Any, limit: int | None
    ) -> None:
        result = self.cache.match_prefix(RadixKey(self.target(spec)))
        touched = self.touched(result.last_node)
        self.sync_structure()
        self.renew(touched)
        if not result.prefix_len:
            return
        node = result.last_node
        got = self.cache.retain(node, seconds, priority, owner, limit)
        # A clipped hint may have split the node that did not fit: the model takes the
        # new upper part (unretained, as the lower part was) and applies its rules to
        # the path as it is now.
        self.sync_structure()
        self.lapse_model()
        used = self.owner_tokens().get(owner, 0)
        covered, clipped = 0, False
        for n in self.path(node):
            rec = self.recs.get(n.id)
            if rec is not None:
                if rec.owner == owner:
                    rec.priority, rec.seconds, rec.until = priority, seconds, self.now + seconds
                else:
                    rec.priority = max(rec.priority, priority)
                    rec.seconds = max(rec.seconds, seconds)
                    rec.until = max(rec.until, self.now + seconds)
            elif limit is not None and used + n.key_len > limit:
                clipped = True
                break
            else:
                used += n.key_len
                self.recs[n.id] = Rec(priority, seconds, self.now + seconds, owner)
            covered += n.key_len
        outcome = ACCEPTED if not clipped else CLIPPED if covered else REJECTED
        assert (got.outcome, got.tokens) == (outcome, covered)
        if clipped:  # the room left is used up, to less than a page
            assert limit is not None and limit - used < PAGE
        event(f"retain {outcome}")
        self.agree()

    @rule(spec=TARGETS, owner=st.sampled_from(OWNERS))
    def release(self, spec: Any, owner: Any) -> None:
        result = self.cache.match_prefix(RadixKey(self.target(spec)))
        touched = self.touched(result.last_node)
        self.sync_structure()
        self.renew(touched)
        if not result.prefix_len:
            return
        got = self.cache.retain(result.last_node, 0, 1, owner)
        for n in self.path(result.last_node):
            rec = self.recs.get(n.id)
            if rec is not None and rec.owner == owner:
                rec.until = min(rec.until, self.now)
        keep = self.counted()
        # A release ends only what it can now; the lapses due wait for their timers.
        assert got.tokens == sum(
            n.key_len for n in self.path(result.last_node) if n.id in keep or n.retain_priority
        )

    @rule(spec=TARGETS)
    def lock(self, spec: Any) -> None:
        result = self.cache.match_prefix(RadixKey(self.target(spec)))
        touched = self.touched(result.last_node)
        self.sync_structure()
        self.renew(touched)
        if result.prefix_len and len(self.locks) < 4:
            self.cache.inc_lock_ref(result.last_node)
            self.locks.append(result.last_node)

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 3))
    def unlock(self, i: int) -> None:
        self.cache.dec_lock_ref(self.locks.pop(i % len(self.locks)))

    @rule(dt=st.sampled_from([0.5, 1.0, 2.0, 5.0]))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule()
    def lapse(self) -> None:
        assert self.cache.retention is not None
        self.cache.retention.lapse_due()
        self.after_lapse_and_evict()

    @rule(tokens=st.integers(1, 20))
    def evict(self, tokens: int) -> None:
        expected, distinct = self.brute_force_evict(tokens)
        self.evicted.clear()
        self.cache.evict(tokens)
        if distinct:
            assert set(self.evicted) == expected, "evicted other nodes than the ranks say"
        else:
            event("tied ranks")
        if any(i in self.recs for i in self.evicted):
            event("evicted a retained node")
        elif self.recs and self.evicted:
            event("evicted around retained nodes")
        self.after_lapse_and_evict()

    def brute_force_evict(self, want: int) -> tuple[set[int], bool]:
        self.lapse_model()
        recs = {i: dataclasses.replace(r) for i, r in self.recs.items()}
        children = {n.id: {c.id for c in n.children.values()} for n in self.tree_nodes()}
        candidates = {n.id for n in self.tree_nodes() if not n.children and not n.lock_ref}
        gone: set[int] = set()
        freed, distinct = 0, True
        try:
            while freed < want and candidates:
                ranked = sorted((self.rank(self.nodes[i]), i) for i in candidates)
                if len(ranked) > 1 and ranked[0][0] == ranked[1][0]:
                    distinct = False
                victim = self.nodes[ranked[0][1]]
                candidates.discard(victim.id)
                gone.add(victim.id)
                self.recs.pop(victim.id, None)
                freed += victim.key_len
                parent = victim.parent
                if parent.key_len:
                    children[parent.id].discard(victim.id)
                    if not children[parent.id] and not parent.lock_ref:
                        candidates.add(parent.id)
                # A parent kept counted only by this child lapses with it.
                self.lapse_removed(gone)
        finally:
            self.recs = recs
        return gone, distinct

    def lapse_removed(self, gone: set[int]) -> None:
        def counted(node: Any) -> bool:
            below = [counted(c) for c in node.children.values() if c.id not in gone]
            keep = node.id in self.recs and (self.recs[node.id].until > self.now or any(below))
            if not keep:
                self.recs.pop(node.id, None)
            return keep

        for ns_root in self.cache.root_node.children.values():
            for child in ns_root.children.values():
                if child.id not in gone:
                    counted(child)

    def after_lapse_and_evict(self) -> None:
        self.sync_structure()
        self.lapse_model()
        self.agree()

    def agree(self) -> None:
        """The cache's retentions are the model's, exactly."""
        tree = {n.id: n for n in self.tree_nodes() if n.retain_priority}
        assert set(tree) == set(self.recs), (sorted(tree), sorted(self.recs))
        for i, node in tree.items():
            rec = self.recs[i]
            assert (node.retain_priority, node.retain_seconds, node.retain_owner) == (
                rec.priority,
                rec.seconds,
                rec.owner,
            )
            assert node.retain_until == rec.until
        assert self.cache.retention is not None
        assert self.cache.retention.tokens == self.owner_tokens()

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.cache.check_integrity()
        assert self.cache.evictable_size() + self.cache.protected_size() == self.cache.total_size()
        retained = {n.id for n in self.tree_nodes() if n.retain_priority}
        assert self.counted() <= retained, "a retention in force was dropped"
        assert self.cache.retained_tokens() == sum(
            n.key_len for n in self.tree_nodes() if n.retain_priority
        )


TestRetention = RetentionMachine.TestCase
TestRetention.settings = machine_settings(150, 50)


@LONG
class TestRetentionLong(RetentionMachine.TestCase):  # type: ignore[misc]
    settings = machine_settings(1500, 80)


def _cache(clock: list[float]) -> tuple[RadixCache, TokenToKVPoolAllocator]:
    alloc = TokenToKVPoolAllocator(64, "cpu", 1)
    return RadixCache(1, None, alloc, clock=lambda: clock[0]), alloc


def _put(cache: RadixCache, alloc: TokenToKVPoolAllocator, tokens: list[int]) -> Any:
    slots = alloc.alloc(len(tokens))
    assert slots is not None
    result = cache.insert(RadixKey(tokens), slots)
    if result.prefix_len:
        alloc.free(slots[: result.prefix_len])
    return result.last_node


def test_retained_prefix_outlives_newer_unretained_ones() -> None:
    now = [0.0]
    cache, alloc = _cache(now)
    kept = _put(cache, alloc, [1, 2, 3, 4])
    assert cache.retain(kept, 60, 50).outcome == ACCEPTED
    _put(cache, alloc, [5, 6, 7, 8])
    _put(cache, alloc, [9, 10, 11, 12])
    cache.evict(8)  # LRU alone would take the oldest, the retained one
    assert cache.match_prefix(RadixKey([1, 2, 3, 4])).prefix_len == 4
    assert cache.match_prefix(RadixKey([5, 6, 7, 8])).prefix_len == 0
    cache.check_integrity()


def test_retention_lapses_without_a_hit_and_a_hit_renews_it() -> None:
    now = [0.0]
    cache, alloc = _cache(now)
    kept = _put(cache, alloc, [1, 2])
    cache.retain(kept, 10, 50)
    now[0] = 9.0
    assert cache.match_prefix(RadixKey([1, 2])).prefix_len == 2  # renewed until 19
    _put(cache, alloc, [3, 4])
    now[0] = 18.0
    cache.evict(2)
    assert cache.match_prefix(RadixKey([1, 2])).prefix_len == 2  # still retained
    assert cache.retained_tokens() == 2
    _put(cache, alloc, [5, 6])
    now[0] = 40.0  # 22 s without a hit: lapsed, and the oldest again
    cache.evict(2)
    assert cache.match_prefix(RadixKey([1, 2])).prefix_len == 0
    assert cache.retained_tokens() == 0
    cache.check_integrity()


def test_not_a_pin_retained_nodes_go_when_nothing_else_is_left() -> None:
    now = [0.0]
    cache, alloc = _cache(now)
    low, high = _put(cache, alloc, [1, 2]), _put(cache, alloc, [3, 4])
    cache.retain(high, 60, 90)
    cache.retain(low, 60, 10)
    cache.evict(2)
    assert cache.match_prefix(RadixKey([1, 2])).prefix_len == 0  # the lower priority
    cache.evict(2)
    assert cache.total_size() == 0
    assert cache.retained_tokens() == 0
    assert cache.retention is not None and cache.retention.evicted == 4
    cache.check_integrity()


def test_peek_node_finds_whole_nodes_without_touching() -> None:
    now = [0.0]
    cache, alloc = _cache(now)
    node = _put(cache, alloc, [1, 2, 3, 4])
    before = node.last_access_time
    assert cache.peek_node(RadixKey([1, 2, 3, 4, 5])) == (node, 4)
    assert cache.peek_node(RadixKey([1, 2, 3])) == (cache.root_node, 0)  # inside the node
    assert cache.peek_node(RadixKey([9])) == (cache.root_node, 0)
    assert node.last_access_time == before and node.hit_count == 0
    cache.check_integrity()


def test_limit_clips_from_the_root_and_rejects_when_nothing_fits() -> None:
    """A clipped hint splits the node that does not fit where the room ends."""
    now = [0.0]
    cache, alloc = _cache(now)
    _put(cache, alloc, [1, 2, 3])
    leaf = _put(cache, alloc, [1, 2, 3, 4, 5, 6])
    got = cache.retain(leaf, 60, 50, owner="t", limit=4)
    assert (got.outcome, got.tokens) == (CLIPPED, 4)  # [4, 5, 6] split after 4
    assert cache.retention is not None and cache.retention.tokens == {"t": 4}
    assert cache.match_prefix(RadixKey([1, 2, 3, 4])).last_node.retain_priority == 50
    assert leaf.retain_priority == 0 and leaf.key_len == 2
    other = _put(cache, alloc, [7, 8])
    assert cache.retain(other, 60, 50, owner="t", limit=4).outcome == REJECTED
    assert cache.retain(other, 60, 50, owner="u", limit=4).outcome == ACCEPTED
    cache.check_integrity()


def test_a_parent_lapses_only_after_its_retained_children() -> None:
    now = [0.0]
    cache, alloc = _cache(now)
    parent = _put(cache, alloc, [1, 2])
    child = _put(cache, alloc, [1, 2, 3, 4])
    cache.retain(child, 100, 50, owner="t")
    cache.retain(parent, 5, 50, owner="t")  # its own hint is shorter
    now[0] = 50.0
    assert cache.retention is not None
    cache.retention.lapse_due()
    assert parent.retain_priority and cache.retention.tokens == {"t": 4}
    cache.retain(child, 0, 1, owner="t")  # released: the parent goes with it
    assert cache.retention.tokens == {}
    cache.check_integrity()


def test_other_kinds_refuse_retention() -> None:
    import pytest

    from prefixcache.cache import InvalidInputError, SWARadixCache, SWATokenToKVPoolAllocator

    alloc = SWATokenToKVPoolAllocator(32, 32, "cpu", 1)
    cache = SWARadixCache(1, 4, alloc)
    slots = alloc.alloc(2)
    node = cache.insert(RadixKey([1, 2]), slots).last_node
    with pytest.raises(InvalidInputError):
        cache.retain(node, 10, 50)
    assert torch.equal(cache.match_prefix(RadixKey([1, 2])).indices, slots)


def test_the_retaining_policy_ranks_arrays_of_fields_as_it_ranks_nodes() -> None:
    """A tier below the pool keeps the fields as arrays and ranks them with one call
    (eviction.Retaining.rank): the order is the nodes' order, for every base policy."""
    import numpy as np

    from prefixcache.cache.eviction import Retaining
    from prefixcache.cache.node import TreeNode

    rng = np.random.default_rng(7)
    n, now = 64, 100.0
    fields = {
        "last_access_time": rng.integers(0, 50, n),
        "hit_count": rng.integers(0, 4, n),
        "retain_priority": rng.choice([0, 0, 10, 75], n),
        "retain_until": rng.choice([50.0, 150.0], n),
    }
    nodes = []
    for i in range(n):
        node = TreeNode()
        for name, values in fields.items():
            setattr(node, name, values[i].item())
        nodes.append(node)
    ids = np.array([node.id for node in nodes])
    entries = type("Entries", (), {**fields, "id": ids})
    for name, base in EVICTION_POLICIES.items():
        policy = Retaining(base, lambda: now)
        ranks = policy.rank(entries, now)
        order = np.lexsort([np.asarray(r, dtype=np.float64) for r in ranks][::-1])
        expected = sorted(range(n), key=lambda i: (policy(nodes[i]), i))
        assert order.tolist() == expected, name
