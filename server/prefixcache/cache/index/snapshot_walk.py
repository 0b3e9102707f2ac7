"""SnapshotWalk: a change log's tree walked a slice at a time, exact once finished.

``ChangeLog.snapshot`` walks the tree in one pass; on the server's event loop a 100k-
node tree holds every other call up for a third of a second or more. This
walk goes a few milliseconds at a time, and the cache may change between its slices.
Single-threaded like the caches: call it from the thread that drives the cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from ..node import TreeNode
from .change_log import AllCleared, Change, ChangeLog, PagesStored, Snapshot, last_hash
from .page_index import is_hash_namespace

# Nodes a walk visits between two looks at the clock.
_WALK_CHUNK = 64
_HEX = 64  # a page hash's hex digits


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

    def add(
        self, ns: tuple[str | None, int, int], parent: str | None, hashes: str, key_bytes: bytes
    ) -> None:
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
        return tuple(joined[k : k + _HEX] for k in range(0, len(joined), _HEX))

    def record(self, i: int, seq: int) -> PagesStored:
        extra_key, width, page_size = self.namespaces[self.ns[i]]
        return PagesStored(
            seq, extra_key, width, page_size, self.parents[i], self.page_hashes(i), self.keys[i]
        )


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
                if hit is None or (
                    joined not in hit if len(joined) == _HEX else hit.isdisjoint(rec.page_hashes)
                ):
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
        self._pages.add(
            (ns.extra_key, ns.token_width, ns.page_size),
            last_hash(node.parent),
            "".join(hashes),
            node.key_bytes,
        )
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


def _kept(
    rec: PagesStored, keep: Callable[[tuple[tuple[str | None, int], str]], bool]
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
            yield PagesStored(
                rec.seq,
                rec.extra_key,
                rec.token_width,
                rec.page_size,
                parent,
                hashes[start:i],
                rec.key_bytes[start * size : i * size],
            )
            start = None
