"""The change log: what a tree holds, as a stream of sequence-numbered records.

Under random workloads on every tree kind (radix, SWA with tombstones, Mamba with state
eviction), the page set rebuilt from the log (pushed through ``watch`` and pulled
through ``since``) and the log's ``snapshot`` both equal the page set walked from the
tree with hashes computed independently by ``hash_token_ids``, after every operation.
Splits record nothing; a reader that falls behind the buffer is told so and converges
from a snapshot.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.cache import MambaRadixCache, RadixCache, RadixKey, hash_token_ids
from prefixcache.cache.index.change_log import (
    AllCleared,
    Change,
    ChangeLog,
    PagesRemoved,
    PagesStored,
    Snapshot,
)
from prefixcache.cache.index.snapshot_walk import SnapshotWalk

Page = tuple[str | None, int, str, str | None, tuple[int, ...]]


def tree_pages(cache: Any) -> set[Page]:
    """(extra_key, width, hash, parent hash, tokens) of every cached page, hashed here."""
    out: set[Page] = set()
    for (extra_key, width), ns_root in cache.root_node.children.items():
        stack = [(child, None) for child in ns_root.children.values()]
        while stack:
            node, prior = stack.pop()
            flat = np.frombuffer(node.key_bytes, dtype="<u4").tolist()
            step = width * cache.page_size
            for i in range(0, len(flat), step):
                page = tuple(flat[i : i + step])
                digest = hash_token_ids(list(page), prior)
                out.add((extra_key, width, digest, prior, page))
                prior = digest
            stack.extend((child, prior) for child in node.children.values())
    return out


class Replica:
    """A page set kept from records alone, as a shadow index or a router would."""

    def __init__(self) -> None:
        self.pages: dict[tuple[Any, str], tuple[str | None, tuple[int, ...]]] = {}
        self.seq = -1

    def apply(self, change: Change) -> None:
        if change.seq != self.seq + 1:
            raise AssertionError(f"seq gap: {self.seq} then {change.seq}")
        self.seq = change.seq
        if isinstance(change, AllCleared):
            self.pages.clear()
        elif isinstance(change, PagesStored):
            self._store(change)
        elif isinstance(change, PagesRemoved):
            for page_hash in change.page_hashes:
                del self.pages[(change.namespace, page_hash)]

    def load(self, snapshot: Snapshot) -> None:
        self.pages.clear()
        self.seq = snapshot.seq
        for rec in snapshot.pages:
            self._store(rec)

    def _store(self, rec: PagesStored) -> None:
        prior = rec.parent_hash
        if prior is not None and (rec.namespace, prior) not in self.pages:
            raise AssertionError("a page stored under a parent that is not cached")
        for page_hash, page in rec.pages():
            key = (rec.namespace, page_hash)
            if key in self.pages:
                raise AssertionError("a page stored twice")
            self.pages[key] = (prior, tuple(np.frombuffer(page, dtype="<u4").tolist()))
            prior = page_hash

    def as_set(self) -> set[Page]:
        return {(ns[0], ns[1], h, parent, toks) for (ns, h), (parent, toks) in self.pages.items()}


class Workload:
    """Random inserts, matches (which split), locks, evictions and resets."""

    def __init__(self, kind: str, page: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.kind, self.page = kind, page
        self.log = ChangeLog()
        self.pushed = Replica()
        self.log.watch(self.pushed.apply)
        self.evicted: list[int] = []
        common = {"listener": self.log, "on_node_evict": self.evicted.append}
        if kind == "radix":
            self.cache: Any = RadixCache(page, None, None, **common)
        elif kind == "swa":
            self.cache = RadixCache(page, 3 * page, None, **common)
        else:
            self.cache = MambaRadixCache(page, None, None, **common)
        self.pulled = Replica()
        self.locks: list[tuple[Any, Any]] = []
        self.state_slots = iter(range(1, 10**6))
        self.next_slot = 1
        self.prefixes = [self._tokens(self.rng.randrange(1, 5) * page) for _ in range(3)]

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(4) for _ in range(n)]

    def key(self) -> RadixKey:
        rng = self.rng
        tokens = rng.choice(self.prefixes) + self._tokens(rng.randrange(0, 4 * self.page + 3))
        if self.kind == "mamba":  # a state belongs at a page boundary
            tokens = tokens[: len(tokens) // self.page * self.page]
        namespace = rng.choice([None, None, "a", ""])
        if rng.random() < 0.15:
            pairs = list(zip(tokens[0::2], tokens[1::2], strict=False))
            if self.kind == "mamba":
                pairs = pairs[: len(pairs) // self.page * self.page]
            return RadixKey(pairs, namespace)
        return RadixKey(tokens, namespace)

    def step(self) -> None:
        rng, cache = self.rng, self.cache
        op = rng.random()
        if op < 0.45:
            key = self.key()
            value = torch.arange(self.next_slot, self.next_slot + len(key), dtype=torch.int64)
            self.next_slot += len(key)  # slots stay unique: nothing frees them here
            if self.kind == "swa":
                cut = rng.choice([0, 0, self.page, 2 * self.page])
                cache.insert(key, value, swa_evicted_seqlen=cut)
            elif self.kind == "mamba":
                cache.insert(key, value, mamba_value=next(self.state_slots))
            else:
                cache.insert(key, value)
        elif op < 0.7:
            before = self.log.last_seq
            result = cache.match_prefix(self.key())
            assert self.log.last_seq == before, "a match (and its split) recorded a change"
            if result.prefix_len and rng.random() < 0.5:
                self.locks.append((result.last_node, cache.inc_lock_ref(result.last_node)))
        elif op < 0.8 and self.locks:
            node, boundary = self.locks.pop(rng.randrange(len(self.locks)))
            cache.dec_lock_ref(node, boundary)
        elif op < 0.97:
            amount = rng.randrange(0, 12)
            if self.kind == "swa":
                cache.evict(amount if rng.random() < 0.5 else 0, rng.randrange(0, 12))
            elif self.kind == "mamba":
                cache.evict(amount if rng.random() < 0.5 else 0, rng.randrange(0, 3))
            else:
                cache.evict(amount)
        else:
            cache.reset()
            self.locks.clear()

    def check(self) -> None:
        self.cache.check_integrity()
        expected = tree_pages(self.cache)
        assert self.pushed.as_set() == expected
        changes = self.log.since(self.pulled.seq)
        assert changes is not None
        for change in changes:
            self.pulled.apply(change)
        assert self.pulled.as_set() == expected
        fresh = Replica()
        fresh.load(self.log.snapshot())
        assert fresh.as_set() == expected
        assert fresh.seq == self.log.last_seq


@pytest.mark.parametrize("kind", ["radix", "swa", "mamba"])
@pytest.mark.parametrize("page", [1, 2])
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_the_log_rebuilds_the_tree_after_every_operation(kind: str, page: int, seed: int) -> None:
    work = Workload(kind, page, seed)
    work.check()
    for _ in range(60):
        work.step()
        work.check()


@pytest.mark.parametrize("kind", ["radix", "swa", "mamba"])
@pytest.mark.parametrize("page", [1, 2])
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_a_walk_in_slices_is_exact_while_the_tree_changes(kind: str, page: int, seed: int) -> None:
    # Walks of a node or a few at a time, with inserts (which split nodes the walk has
    # not reached yet), evictions and resets between the slices: each finished walk
    # is exactly the tree at the log's newest change, parents before children.
    work = Workload(kind, page, seed)
    for _ in range(40):  # a tree to walk
        work.step()
    for _ in range(8):
        walk = SnapshotWalk(work.log)
        while not walk.step(nodes=work.rng.randrange(1, 4)):
            for _ in range(work.rng.randrange(0, 3)):
                work.step()
        walked = walk.finish()
        assert walked is not None and walked.seq == work.log.last_seq
        fresh = Replica()
        fresh.load(walked.snapshot())  # refuses a page twice, or one before its parent
        assert fresh.as_set() == tree_pages(work.cache)
        work.cache.check_integrity()


def test_a_walk_the_log_no_longer_reaches_back_to_is_told_to_start_again() -> None:
    log = ChangeLog(capacity=4)
    cache = RadixCache(1, listener=log)
    for i in range(6):
        cache.insert(RadixKey([i, i + 1]), torch.arange(2 * i + 1, 2 * i + 3))
    walk = SnapshotWalk(log)
    walk.step(nodes=1)
    for i in range(6):
        cache.insert(RadixKey([100 + i]), torch.arange(200 + i, 201 + i))
    assert walk.step()
    assert walk.finish() is None
    again = SnapshotWalk(log)
    again.step()
    fresh = Replica()
    walked = again.finish()
    assert walked is not None
    fresh.load(walked.snapshot())
    assert fresh.as_set() == tree_pages(cache)


def test_a_fresh_cache_starts_with_a_clear_and_reset_clears() -> None:
    log = ChangeLog()
    cache = RadixCache(2, listener=log)
    assert cache.eager_page_hashes  # a listener needs the hashes as nodes appear
    cache.insert(RadixKey([1, 2, 3, 4, 5]), torch.arange(5))
    cache.reset()
    records = log.since(-1)
    assert records is not None
    assert [type(r) for r in records] == [AllCleared, PagesStored, AllCleared]
    stored = records[1]
    assert isinstance(stored, PagesStored)
    assert stored.parent_hash is None and stored.token_ids() == [1, 2, 3, 4]  # aligned
    assert stored.page_hashes == (
        hash_token_ids([1, 2]),
        hash_token_ids([3, 4], hash_token_ids([1, 2])),
    )


def test_a_split_records_nothing_and_the_child_chains_on_the_parent() -> None:
    log = ChangeLog()
    cache = RadixCache(2, listener=log)
    cache.insert(RadixKey([1, 2, 3, 4]), torch.arange(4))
    seq = log.last_seq
    cache.insert(RadixKey([1, 2, 5, 6]), torch.arange(4))  # splits [1,2 | 3,4]
    records = log.since(seq)
    assert records is not None and len(records) == 1
    child = records[0]
    assert isinstance(child, PagesStored)
    assert child.parent_hash == hash_token_ids([1, 2])
    assert child.page_hashes == (hash_token_ids([5, 6], hash_token_ids([1, 2])),)


def test_eviction_records_removal_and_on_node_evict_still_fires() -> None:
    log, gone = ChangeLog(), []
    cache = RadixCache(1, None, None, gone.append, listener=log)
    cache.insert(RadixKey([7, 8]), torch.arange(2))
    seq = log.last_seq
    cache.evict(2)
    assert len(gone) == 1
    records = log.since(seq)
    assert records is not None and len(records) == 1
    removed = records[0]
    assert isinstance(removed, PagesRemoved)
    assert removed.page_hashes == (hash_token_ids([7]), hash_token_ids([8], hash_token_ids([7])))


def test_swa_tombstoning_keeps_the_pages_and_their_removal_is_recorded() -> None:
    log = ChangeLog()
    cache = RadixCache(1, 2, None, listener=log)
    cache.insert(RadixKey([1, 2, 3, 4, 5]), torch.arange(5))
    cache.match_prefix(RadixKey([1]))  # split: [1] above [2, 3, 4, 5]
    leaf = cache.match_prefix(RadixKey([1, 2, 3, 4, 5])).last_node
    boundary = cache.inc_lock_ref(leaf)  # the leaf's window stays; [1] has no SWA lock
    seq = log.last_seq
    assert cache.evict(0, 1).swa_evicted == 1  # SWA KV only: [1] becomes a tombstone
    upper = leaf.parent
    assert upper.swa_tombstone and not upper.evicted
    assert log.since(seq) == []  # its full KV, so its page, stays
    assert len(tree_pages(cache)) == 5
    cache.dec_lock_ref(leaf, boundary)
    cache.evict(5)
    records = log.since(seq)
    assert records is not None
    assert sum(len(r.page_hashes) for r in records if isinstance(r, PagesRemoved)) == 5


def test_a_reader_behind_the_buffer_is_told_and_converges_from_a_snapshot() -> None:
    log = ChangeLog(capacity=4)
    cache = RadixCache(1, listener=log)
    reader = Replica()
    for change in log.since(-1) or []:
        reader.apply(change)
    for i in range(10):
        cache.insert(RadixKey([i, i + 1]), torch.arange(2))
    assert log.since(reader.seq) is None  # records it needs are gone: no silent gap
    reader.load(log.snapshot())
    assert reader.as_set() == tree_pages(cache)
    cache.evict(3)
    for change in log.since(reader.seq) or []:
        reader.apply(change)
    assert reader.as_set() == tree_pages(cache)


def test_watch_stops_when_asked() -> None:
    log = ChangeLog()
    seen: list[Change] = []
    stop = log.watch(seen.append)
    RadixCache(1, listener=log)
    stop()
    stop()  # twice is harmless
    log.cleared(None)
    assert len(seen) == 1


def test_bad_capacity_is_refused() -> None:
    with pytest.raises(ValueError):
        ChangeLog(capacity=0)


def test_the_buffer_is_bounded_in_bytes_and_a_reader_past_it_gets_a_snapshot() -> None:
    log = ChangeLog(capacity=1 << 20, max_bytes=64 << 10)
    cache = RadixCache(1, listener=log)
    for i in range(200):  # 200 prompts of 256 pages: far more than 64 KiB of records
        cache.insert(RadixKey([i, *range(1000, 1255)]), torch.arange(256))
    assert log.bytes <= log.max_bytes
    assert log.since(log.last_seq - 1) is not None
    assert log.since(0) is None  # the early records are gone: start from a snapshot
    assert len(log.snapshot().pages) > 0


def test_the_newest_record_is_kept_even_when_alone_it_is_over_the_budget() -> None:
    log = ChangeLog(max_bytes=1)
    cache = RadixCache(1, listener=log)
    cache.insert(RadixKey(list(range(50))), torch.arange(50))
    records = log.since(log.last_seq - 1)
    assert records is not None and len(records) == 1 and isinstance(records[0], PagesStored)
    with pytest.raises(ValueError, match="max_bytes"):
        ChangeLog(max_bytes=0)
