"""Eviction policies (chosen by name), retention on top of them, and the
lazily-invalidated queue that orders candidates."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from itertools import count
from typing import Any, Generic, Protocol, TypeVar

from .errors import InvalidInputError
from .node import TreeNode

# What a policy ranks a node by: lower evicts first.
Rank = int | tuple[int, ...]
Priority = Callable[[TreeNode], Rank]


class Candidate(Protocol):
    """What the queue needs of a node: an id unique among live candidates."""

    @property
    def id(self) -> int: ...


N = TypeVar("N", bound=Candidate)


def lru(node: TreeNode) -> Rank:
    """Least recently used first."""
    return node.last_access_time


def lfu(node: TreeNode) -> Rank:
    """Least frequently matched first; recency breaks ties."""
    return (node.hit_count, node.last_access_time)


def fifo(node: TreeNode) -> Rank:
    """Oldest node first (ids grow with creation)."""
    return node.id


def mru(node: TreeNode) -> Rank:
    """Most recently used first."""
    return -node.last_access_time


def filo(node: TreeNode) -> Rank:
    """Newest node first."""
    return -node.id


EVICTION_POLICIES: dict[str, Priority] = {
    "lru": lru,
    "lfu": lfu,
    "fifo": fifo,
    "mru": mru,
    "filo": filo,
}


def get_eviction_policy(name: str) -> Priority:
    """The priority function registered under ``name`` (lower evicts first)."""
    try:
        return EVICTION_POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(EVICTION_POLICIES))
        raise InvalidInputError(f"unknown eviction policy {name!r} (known: {known})") from None


def held_priority(priority: Any, until: Any, now: Any) -> Any:
    """The retention priority in force at ``now``: ``priority`` while ``until`` is
    later, else 0. Arithmetic only, so it works on numbers and on numpy arrays alike."""
    return priority * (until > now)


class Retaining:
    """The policy ``base`` with retention on top (retention.py).

    A node whose retention is in force ranks after every node without one, a lower
    priority before a higher one, and ``base`` orders nodes of one priority: the rank
    is ``(held priority, *base rank)``. A retention that lapses lowers the rank without
    a touch, so whoever keeps ranks must re-rank a node when it lapses (the cache does:
    its retention book tells it).

    ``rank(entries, now)`` reads only ``retain_priority`` and ``retain_until`` besides
    what ``base`` reads, with arithmetic only, so a tier that keeps those fields as
    arrays ranks all its entries with one call, and orders them with the pool: lowest
    first, the tuple's fields in order (``numpy.lexsort`` of the fields reversed). Such
    a tier takes a node's two fields with its pages when the pool evicts them (the
    cache's ``before_free`` hook runs while they are still set), moved to its own
    clock (``retain_until`` is on this one's), and keeps them per page.

    Args:
        base: the policy without retention (``EVICTION_POLICIES``).
        clock: seconds, on the clock that set ``retain_until``.
    """

    __slots__ = ("base", "clock")

    def __init__(self, base: Priority, clock: Callable[[], float]) -> None:
        self.base = base
        self.clock = clock

    def __call__(self, node: TreeNode) -> Rank:
        if not node.retain_priority:  # the usual case, with no clock read
            base = self.base(node)
            return (0, *base) if isinstance(base, tuple) else (0, base)
        return self.rank(node, self.clock())  # type: ignore[no-any-return]

    def rank(self, entries: Any, now: Any) -> Any:
        """The rank of ``entries`` (a node, or arrays of nodes' fields) at ``now``."""
        held = held_priority(entries.retain_priority, entries.retain_until, now)
        base = self.base(entries)
        return (held, *base) if isinstance(base, tuple) else (held, base)


class EvictionQueue(Generic[N]):
    """Candidates for eviction in priority order, O(log n) per change.

    A node's priority moves whenever it is touched, so instead of re-sorting, ``push``
    adds a fresh entry and remembers it as the node's live one; older entries of the
    same node are skipped when popped. The heap is rebuilt from the live entries when
    stale ones outnumber them, so memory stays proportional to the candidates.
    """

    __slots__ = ("_heap", "_live", "_priority", "_seq")

    def __init__(self, priority: Callable[[N], Rank]) -> None:
        self._priority = priority
        # (rank, sequence number, node): the sequence breaks ties, so nodes never compare.
        self._heap: list[tuple[Rank, int, N]] = []
        self._live: dict[int, tuple[Rank, int, N]] = {}
        self._seq = count()

    def push(self, node: N) -> None:
        """Make ``node`` a candidate at its current priority (replacing an older entry)."""
        entry = (self._priority(node), next(self._seq), node)
        self._live[node.id] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._live) + 1024:
            self._compact()

    def discard(self, node: N) -> None:
        """Stop considering ``node`` (no-op if it is not a candidate)."""
        self._live.pop(node.id, None)

    def refresh(self, node: N) -> None:
        """Re-rank ``node`` after a touch, if it is a candidate."""
        if node.id in self._live:
            self.push(node)

    def pop(self) -> N | None:
        """Remove and return the candidate to evict first, or None if there is none."""
        heap, live = self._heap, self._live
        while heap:
            entry = heapq.heappop(heap)
            node = entry[2]
            if live.get(node.id) is entry:
                del live[node.id]
                return node
        return None

    def clear(self) -> None:
        self._heap.clear()
        self._live.clear()

    def __contains__(self, node: N) -> bool:
        return node.id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def node_ids(self) -> set[int]:
        return set(self._live)

    def _compact(self) -> None:
        live = self._live
        self._heap = [e for e in self._heap if live.get(e[2].id) is e]
        heapq.heapify(self._heap)
