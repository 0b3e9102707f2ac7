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
change silently (``snapshot_walk.SnapshotWalk`` walks it in slices, for a caller that
must not hold its thread for a whole large tree). ``watch`` gives push delivery
instead: a callback per record, as the record is made (inside the cache operation, so
it must be cheap and must not raise).

Single-threaded like the caches: call it only from the thread that drives the cache.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any, Protocol

from ..key import unpack_tokens
from ..node import TreeNode
from .page_index import is_hash_namespace

DEFAULT_CAPACITY = 65536
# The buffer is bounded in bytes too: a record holds its pages' tokens and hex hashes
# (about 120 bytes a page), so 65536 records of long prompts at page size 1 once grew a
# server by gigabytes under load.
DEFAULT_MAX_BYTES = 64 << 20
_HASH_COST = 120
_RECORD_COST = 200


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

    def __init__(
        self, capacity: int = DEFAULT_CAPACITY, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
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
        self._append(
            PagesStored(
                self._next_seq,
                ns.extra_key,
                ns.token_width,
                ns.page_size,
                last_hash(node.parent),
                tuple(node.hash_values),
                node.key_bytes,
            )
        )

    def pages_removed(self, node: TreeNode) -> None:
        """``node`` left the tree (its ``hash_values`` are still there)."""
        ns = node.namespace
        if ns is None or node.hash_values is None:
            raise ValueError(f"node {node.id} has no namespace or no page hashes")
        self._append(
            PagesRemoved(self._next_seq, ns.extra_key, ns.token_width, tuple(node.hash_values))
        )

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
        """The tree's current page set, stamped with ``last_seq``."""
        seq = self.last_seq
        cache = self._cache
        if cache is None:
            return Snapshot(seq, ())
        pages = []
        for ns_root in list(cache.root_node.children.values()):
            if is_hash_namespace(ns_root.namespace.extra_key):
                continue  # pages stored by hash alone are no token pages (page_index.py)
            stack = list(ns_root.children.values())
            while stack:
                node = stack.pop()
                ns = node.namespace
                hashes = node.hash_values
                if hashes is None:  # only if the cache was built without eager hashes
                    hashes = cache.compute_node_hash(node)
                pages.append(
                    PagesStored(
                        seq,
                        ns.extra_key,
                        ns.token_width,
                        ns.page_size,
                        last_hash(node.parent),
                        tuple(hashes),
                        node.key_bytes,
                    )
                )
                stack.extend(node.children.values())
        return Snapshot(seq, tuple(pages))

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
        while len(self._records) > 1 and (
            len(self._records) > self._capacity or self.bytes > self.max_bytes
        ):
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


def last_hash(parent: TreeNode | None) -> str | None:
    """The hash a child's first page chains on: the parent's last page (None at a root)."""
    if parent is None or not parent.key_len or not parent.hash_values:
        return None
    return parent.hash_values[-1]
