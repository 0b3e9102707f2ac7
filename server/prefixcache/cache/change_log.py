"""ChangeLog: the sequence-numbered record of which pages a model's tree holds.

One log per model is the single source for everything outside the service that keeps a
copy of the cached page set: the router-facing KV-event publisher and the workers'
shadow indexes. Neither walks the tree to find out what changed; they read this log.

What it records (every record has the next ``seq``, from 0):

* ``AllCleared``: the tree is empty, at construction and on ``reset``.
* ``PagesStored``: a node's pages entered the tree, root-down, with their chained page
  hashes (``hash_pages``/``hash_token_ids``, chained within the namespace from its
  root, exactly ``TreeNode.hash_values``), their packed tokens, the hash of the page
  before them (None at the namespace root) and the namespace (``extra_key``, token
  width). A node is only ever whole pages, so every record is page-aligned.
* ``PagesRemoved``: a node's pages left the tree (eviction, and the SWA and Mamba paths
  that delete nodes), with their hashes and namespace.

A node split changes no page and records nothing. What counts as "cached pages":

* ``RadixCache``: every page of every node.
* ``SWARadixCache``: the full-attention KV pages. A tombstoned node has lost its
  sliding-window KV but keeps its full KV, so its pages stay cached; a router reading
  these pages over-estimates SWA hits (a match also needs a window of live SWA KV
  after the last tombstone), never under-estimates them.
* ``MambaRadixCache``: the KV pages. A Mamba tombstone (a node without state) keeps
  its KV, so its pages stay; a match ends at the deepest node with state, so again
  readers over-estimate hits. State slots are not pages and are not recorded.
* ``ChunkCache`` caches nothing and ``SlotPrefixCache`` (the slot kind) keeps whole
  sequences in per-sequence slots rather than pages: neither has a log.

The buffer is bounded. A reader that has fallen further behind than the buffer reaches
gets ``None`` from ``since`` and must start again from ``snapshot()`` (the current page
set, walked from the tree, stamped with the seq it reflects), so it never misses a
change silently. ``SnapshotWalk`` is the same walk in slices, for a caller that must
not hold its thread for a whole large tree (the server's event loop): the tree may
change between slices, and the walk is made exact from the log when it finishes.
``watch`` gives push delivery instead: a callback per record, as the record is made
(inside the cache operation, so it must be cheap and must not raise).

Single-threaded like the caches: call it only from the thread that drives the cache.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any, Protocol

from .key import unpack_tokens
from .node import TreeNode
from .page_index import is_hash_namespace

DEFAULT_CAPACITY = 65536
# The buffer is bounded in bytes too: a record holds its pages' tokens and hex hashes
# (about 120 bytes a page), so 65536 records of long prompts at page size 1 once grew a
# server by gigabytes under load.
DEFAULT_MAX_BYTES = 64 << 20
_HASH_COST = 120
_RECORD_COST = 200
# Nodes a walk visits between two looks at the clock.
_WALK_CHUNK = 64
_HEX = 64  # a page hash's hex digits


@dataclass(frozen=True, slots=True)
class AllCleared:
    """Every page left the tree (construction or reset)."""

    seq: int


@dataclass(frozen=True, slots=True)
class PagesStored:
    """Pages that entered the tree: one node's worth, chained after ``parent_hash``.

    ``page_hashes[i]`` is the hex SHA-256 of page ``i`` chained on the page before it
    (``parent_hash`` for the first), as ``hash_pages`` computes it; ``key_bytes`` holds
    the pages' tokens packed (uint32 little-endian, ``token_width`` per token).
    """

    seq: int
    extra_key: str | None
    token_width: int
    page_size: int
    parent_hash: str | None
    page_hashes: tuple[str, ...]
    key_bytes: bytes

    @property
    def namespace(self) -> tuple[str | None, int]:
        return (self.extra_key, self.token_width)

    @property
    def page_bytes(self) -> int:
        return 4 * self.token_width * self.page_size

    def pages(self) -> Iterator[tuple[str, bytes]]:
        """Each page's hash with its packed tokens."""
        size = self.page_bytes
        for i, page_hash in enumerate(self.page_hashes):
            yield page_hash, self.key_bytes[i * size : (i + 1) * size]

    def token_ids(self) -> list[int]:
        """The pages' tokens as flat uint32 values (a tuple token gives its elements)."""
        return unpack_tokens(self.key_bytes, 1)


@dataclass(frozen=True, slots=True)
class PagesRemoved:
    """Pages that left the tree, one node's worth (a namespace's pages, by hash)."""

    seq: int
    extra_key: str | None
    token_width: int
    page_hashes: tuple[str, ...]

    @property
    def namespace(self) -> tuple[str | None, int]:
        return (self.extra_key, self.token_width)


Change = AllCleared | PagesStored | PagesRemoved


class PageListener(Protocol):
    """What a cache tells its ``listener`` (a ``ChangeLog``, or anything alike).

    ``cleared(cache)`` at construction and on reset; ``pages_stored(node)`` when a node
    joins the tree (its ``hash_values`` computed); ``pages_removed(node)`` once a node
    has left it (where ``on_node_evict`` hears of it). Splits are not reported.
    """

    def cleared(self, cache: Any) -> None: ...

    def pages_stored(self, node: TreeNode) -> None: ...

    def pages_removed(self, node: TreeNode) -> None: ...


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The page set after change ``seq``: every node's pages, parents before children."""

    seq: int
    pages: tuple[PagesStored, ...]


class ChangeLog:
    """Listener for one cache (pass it as ``listener=``) and the bounded log it keeps.

    The cache calls ``cleared``, ``pages_stored`` and ``pages_removed``; readers use
    ``since``/``snapshot`` (pull) or ``watch`` (push).

    Args:
        capacity: records kept for ``since``; older ones are dropped.
        max_bytes: the records' estimated memory beyond which older ones are dropped
            too (the newest record is always kept).
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        if not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be an int >= 1, got {max_bytes!r}")
        self._capacity = capacity
        self.max_bytes = max_bytes
        self._records: deque[Change] = deque()
        self._costs: deque[int] = deque()
        self.bytes = 0
        self._next_seq = 0
        self._watchers: list[Callable[[Change], None]] = []
        self._cache: Any = None

    # ------------------------------------------------------ the cache's side

    def cleared(self, cache: Any) -> None:
        """``cache`` is empty now; it is also the tree ``snapshot`` walks from now on."""
        self._cache = cache
        self._append(AllCleared(self._next_seq))

    def pages_stored(self, node: TreeNode) -> None:
        """``node`` joined the tree with its page hashes computed (eager hashing)."""
        ns = node.namespace
        if ns is None or node.hash_values is None:
            raise ValueError(f"node {node.id} has no namespace or no page hashes")
        self._append(PagesStored(self._next_seq, ns.extra_key, ns.token_width, ns.page_size,
                                 _last_hash(node.parent), tuple(node.hash_values),
                                 node.key_bytes))

    def pages_removed(self, node: TreeNode) -> None:
        """``node`` left the tree (its ``hash_values`` are still there)."""
        ns = node.namespace
        if ns is None or node.hash_values is None:
            raise ValueError(f"node {node.id} has no namespace or no page hashes")
        self._append(PagesRemoved(self._next_seq, ns.extra_key, ns.token_width,
                                  tuple(node.hash_values)))

    # ------------------------------------------------------- readers' side

    @property
    def capacity(self) -> int:
        """How many records ``since`` can reach back (the buffer's bound)."""
        return self._capacity

    @property
    def last_seq(self) -> int:
        """The seq of the newest record (-1 before the first)."""
        return self._next_seq - 1

    @property
    def first_seq(self) -> int:
        """The seq of the oldest record still held (``last_seq + 1`` when none are)."""
        return self._records[0].seq if self._records else self._next_seq

    def since(self, seq: int) -> list[Change] | None:
        """The records after ``seq``, oldest first; None if some are gone (snapshot)."""
        if seq >= self.last_seq:
            return []
        first = self.first_seq
        if seq + 1 < first:
            return None
        return list(islice(self._records, seq + 1 - first, None))

    @property
    def tree(self) -> Any:
        """The cache this log records (None before its first ``cleared``)."""
        return self._cache

    def snapshot(self) -> Snapshot:
        """The tree's current page set, stamped with ``last_seq`` (one pass; a walk
        that must leave the caller's thread free between slices: ``SnapshotWalk``)."""
        walk = SnapshotWalk(self)
        walk.step()
        walked = walk.finish()
        if walked is None:  # cannot happen: nothing changed since the walk began
            raise RuntimeError("the change log moved during a one-pass snapshot")
        return walked.snapshot()

    def watch(self, callback: Callable[[Change], None]) -> Callable[[], None]:
        """Call ``callback`` with every new record; returns the function that stops it.

        The callback runs inside the cache operation that made the record: keep it
        cheap (append to a list, schedule work) and never raise.
        """
        self._watchers.append(callback)

        def unwatch() -> None:
            if callback in self._watchers:
                self._watchers.remove(callback)

        return unwatch

    def _append(self, record: Change) -> None:
        self._next_seq += 1
        self._records.append(record)
        cost = _cost(record)
        self._costs.append(cost)
        self.bytes += cost
        while len(self._records) > 1 and (len(self._records) > self._capacity
                                          or self.bytes > self.max_bytes):
            self._records.popleft()
            self.bytes -= self._costs.popleft()
        for callback in self._watchers:
            callback(record)


def _cost(record: Change) -> int:
    """A record's memory, roughly: its tokens, its hex hashes and the object itself."""
    if isinstance(record, PagesStored):
        return _RECORD_COST + len(record.key_bytes) + _HASH_COST * len(record.page_hashes)
    if isinstance(record, PagesRemoved):
        return _RECORD_COST + _HASH_COST * len(record.page_hashes)
    return _RECORD_COST


def _last_hash(parent: TreeNode | None) -> str | None:
    """The hash a child's first page chains on: the parent's last page (None at a root)."""
    if parent is None or not parent.key_len or not parent.hash_values:
        return None
    return parent.hash_values[-1]


class WalkedPages:
    """Node records held compact: a walk of a large tree makes no object per node, so
    it gives the garbage collector nothing more to trace (with a 50k-node tree, each
    full collection its records triggered held the loop for 0.1-0.3 s)."""

    def __init__(self) -> None:
        self.namespaces: list[tuple[str | None, int, int]] = []  # (extra_key, width, page)
        self._ns_index: dict[tuple[str | None, int, int], int] = {}
        self.ns: list[int] = []
        self.parents: list[str | None] = []
        self.hashes: list[str] = []  # the pages' hex hashes, end to end
        self.keys: list[bytes] = []

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, ns: tuple[str | None, int, int], parent: str | None, hashes: str,
            key_bytes: bytes) -> None:
        index = self._ns_index.get(ns)
        if index is None:
            index = self._ns_index[ns] = len(self.namespaces)
            self.namespaces.append(ns)
        self.ns.append(index)
        self.parents.append(parent)
        self.hashes.append(hashes)
        self.keys.append(key_bytes)

    def page_hashes(self, i: int) -> tuple[str, ...]:
        joined = self.hashes[i]
        return tuple(joined[k:k + _HEX] for k in range(0, len(joined), _HEX))

    def record(self, i: int, seq: int) -> PagesStored:
        extra_key, width, page_size = self.namespaces[self.ns[i]]
        return PagesStored(seq, extra_key, width, page_size, self.parents[i],
                           self.page_hashes(i), self.keys[i])


class Walked:
    """A finished walk: the page set after change ``seq``, parents before children.

    Brought forward lazily: ``records`` yields each walked node's record whole, or the
    runs of its pages no change during the walk touched, then the pages the changes
    left stored, so a caller that takes them in slices never pays for the whole tree
    in one go.
    """

    def __init__(self, seq: int, pages: WalkedPages, changes: list[Change]) -> None:
        self.seq = seq
        self.pages = pages
        self._changes = changes
        # Each page a change touched: the index of the change that stored it last, or
        # -1 if its last change removed it; per namespace, the pages touched.
        self._last: dict[tuple[tuple[str | None, int], str], int] = {}
        self._touched: dict[tuple[str | None, int], set[str]] = {}
        self._cleared = -1  # the last AllCleared among the changes
        for i, change in enumerate(changes):
            if isinstance(change, AllCleared):
                self._last.clear()
                self._touched.clear()
                self._cleared = i
            elif not is_hash_namespace(change.extra_key):
                ns, state = change.namespace, i if isinstance(change, PagesStored) else -1
                self._touched.setdefault(ns, set()).update(change.page_hashes)
                for page_hash in change.page_hashes:
                    self._last[(ns, page_hash)] = state

    def records(self) -> Iterator[PagesStored]:
        pages, seq, last = self.pages, self.seq, self._last
        if self._cleared < 0:
            hits = [self._touched.get(ns[:2]) for ns in pages.namespaces]
            for i in range(len(pages)):
                hit, joined = hits[pages.ns[i]], pages.hashes[i]
                rec = pages.record(i, seq)
                if hit is None or (joined not in hit if len(joined) == _HEX
                                   else hit.isdisjoint(rec.page_hashes)):
                    yield rec
                else:
                    yield from _kept(rec, lambda key: key not in last)
        changes = self._changes
        for i in range(self._cleared + 1, len(changes)):
            rec = changes[i]
            if isinstance(rec, PagesStored) and not is_hash_namespace(rec.extra_key):
                yield from _kept(rec, lambda key, i=i: last.get(key) == i)

    def snapshot(self) -> Snapshot:
        return Snapshot(self.seq, tuple(self.records()))


class SnapshotWalk:
    """The tree's page set walked a slice at a time, exact once finished.

    The cache may change between slices (the walk's caller lets it): a walk started
    after change ``S`` sees some pages as they were at ``S``, some later, and may miss
    pages stored meanwhile or see pages since removed. ``finish`` makes it exact: it
    brings the walk forward with the log's changes after ``S``, page by page (a page's
    last change decides; a page no change touched was held throughout, and the walk
    saw it). The one change of shape the log does not record, a split, cuts a node the
    walk has not reached yet under a new upper node its parent never listed: a node
    whose parent is no longer the one it was found under has its uppers walked with it.

    Memory: a reference to each node's record (as ``snapshot``), and, at ``finish``,
    a map of the pages changed during the walk (bounded by the log's own bound).
    ``finish`` answers None when the log no longer reaches back to ``S`` (more changed
    during the walk than it keeps): walk again.
    """

    def __init__(self, log: ChangeLog) -> None:
        self.log = log
        self.seq = log.last_seq  # S: the walk reflects the tree from here on
        self.nodes = 0  # nodes visited
        self._cache = log.tree
        self._pages = WalkedPages()
        self._stack: list[tuple[TreeNode, TreeNode]] = []  # (node, the parent it had)
        if self._cache is not None:
            for ns_root in list(self._cache.root_node.children.values()):
                if is_hash_namespace(ns_root.namespace.extra_key):
                    continue  # pages stored by hash alone are no token pages (page_index.py)
                self._stack.extend((child, ns_root) for child in ns_root.children.values())

    @property
    def done(self) -> bool:
        return not self._stack

    def step(self, seconds: float | None = None, nodes: int | None = None) -> bool:
        """Walk for about ``seconds``, or ``nodes`` nodes (neither: to the end); True
        once the tree is walked."""
        stack, visit = self._stack, self._visit
        deadline = None if seconds is None else time.perf_counter() + seconds
        left = nodes
        while stack:
            chunk = min(len(stack), _WALK_CHUNK if left is None else left)
            for _ in range(chunk):
                node, above = stack.pop()
                if node.parent is not above:
                    self._uppers(node, above)
                visit(node)
                stack.extend((child, node) for child in node.children.values())
            if left is not None:
                left -= chunk
                if left <= 0:
                    break
            if deadline is not None and time.perf_counter() > deadline:
                break
        return not stack

    def _visit(self, node: TreeNode) -> None:
        ns = node.namespace
        hashes = node.hash_values
        if hashes is None:  # only if the cache was built without eager hashes
            hashes = self._cache.compute_node_hash(node)
        self._pages.add((ns.extra_key, ns.token_width, ns.page_size),
                        _last_hash(node.parent), "".join(hashes), node.key_bytes)
        self.nodes += 1

    def _uppers(self, node: TreeNode, above: TreeNode) -> None:
        """The nodes a split put between ``node`` and the parent it was found under,
        walked top-down (their other children came later: the log has them)."""
        uppers = []
        upper = node.parent
        while upper is not None and upper is not above and upper.key_len:
            uppers.append(upper)
            upper = upper.parent
        for upper in reversed(uppers):
            self._visit(upper)

    def finish(self) -> Walked | None:
        """The page set after the log's newest change (brought forward as it is read:
        ``Walked``); None if the log no longer reaches back to the walk's start (walk
        again)."""
        if self._stack:
            raise RuntimeError("finish before the walk is done")
        changes = self.log.since(self.seq)
        if changes is None:
            return None
        pages, self._pages = self._pages, WalkedPages()
        return Walked(changes[-1].seq if changes else self.seq, pages, changes)


def _kept(rec: PagesStored, keep: Callable[[tuple[tuple[str | None, int], str]], bool]
          ) -> Iterator[PagesStored]:
    """The runs of ``rec``'s pages that ``keep`` keeps, each chained on the page before."""
    ns, size = rec.namespace, rec.page_bytes
    start = None
    hashes = rec.page_hashes
    for i in range(len(hashes) + 1):
        if i < len(hashes) and keep((ns, hashes[i])):
            if start is None:
                start = i
            continue
        if start is not None:
            parent = rec.parent_hash if start == 0 else hashes[start - 1]
            yield PagesStored(rec.seq, rec.extra_key, rec.token_width, rec.page_size, parent,
                              hashes[start:i], rec.key_bytes[start * size:i * size])
            start = None
