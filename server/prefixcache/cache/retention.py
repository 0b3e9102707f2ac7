"""Retention: a client's word that a prefix matters for a while, kept as a soft priority.

A retained node has a priority (1 to ``MAX_PRIORITY``), the seconds it lasts and an
owner it counts against. While it is in force the node ranks after every unretained
node in eviction order (``eviction.Retaining``), so an agent's context outlives one-off
prompts; nothing is pinned: once only retained nodes are left they go too, the lowest
priority first. Every touch of the node (a match or an insert walking through it) renews
it for its seconds; without one it lapses, and the node ranks as any other.

Retention is closed towards the root: a retained node's parent is retained too. A hint
covers the whole path from the namespace root, and a node lapses only once none of its
children is retained (its lapse waits for theirs). A retained leaf keeps its whole path
in the tree, so the tokens counted against its owner are all that its retention keeps:
a page of quota cannot hold a long prefix above it.

Owners are counted: ``tokens[owner]`` is the length of the nodes it retains. A hint past
the caller's ``limit`` retains the part of the path nearest the root that fits
(``CLIPPED``): the cache splits the first node that does not fit where the room ends (in
whole pages), so less than a page of the limit is left; with less than a page left,
nothing new is retained (``REJECTED`` if nothing of the path was retained already). A
hint on a node another owner retains raises the node's priority, seconds and expiry to
the larger of both, and the node stays counted against the first owner.

Lapses are found with a heap of timers, lazily invalidated as the eviction queue is: a
retained node without retained children has a live timer at (or before) its expiry; a
node whose last retained child goes gets one then. The cache re-ranks each node whose
retention changes (``on_change``), and calls ``lapse_due`` before it evicts.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from itertools import count
from typing import Protocol

from .errors import InvalidInputError
from .node import TreeNode

ACCEPTED = "accepted"
CLIPPED = "clipped"
REJECTED = "rejected"
MAX_PRIORITY = 99


@dataclass(frozen=True, slots=True)
class RetainResult:
    """What a hint did: its outcome, and how many tokens of its path are retained now
    (by any owner; with a clipped hint, the part nearest the root)."""

    outcome: str
    tokens: int


def check_hint(seconds: float, priority: int) -> None:
    """Refuse a retention that is not one: seconds must be finite and >= 0, the
    priority an int in [1, MAX_PRIORITY]."""
    if not isinstance(seconds, int | float) or not math.isfinite(seconds) or seconds < 0:
        raise InvalidInputError(f"retain seconds must be a finite number >= 0, got {seconds!r}")
    if type(priority) is not int or not 1 <= priority <= MAX_PRIORITY:
        raise InvalidInputError(
            f"retain priority must be an int in [1, {MAX_PRIORITY}], got {priority!r}"
        )


class Splitter(Protocol):
    """Cuts a node: the upper part of ``node`` with at most ``tokens`` of its tokens
    (whole pages), None when that is not even a page."""

    def __call__(self, node: TreeNode, tokens: int) -> TreeNode | None: ...


class RetentionBook:
    """The retentions of one cache's nodes: owners' counts, timers, and the rules above.

    Args:
        clock: seconds (monotonic), the clock ``retain_until`` is on.
        on_change: told of each node whose rank changed (re-rank it if queued).
    """

    __slots__ = ("_armed", "_heap", "_seq", "clock", "evicted", "on_change", "tokens", "total")

    def __init__(self, clock: Callable[[], float], on_change: Callable[[TreeNode], None]) -> None:
        self.clock = clock
        self.on_change = on_change
        self.tokens: dict[Hashable, int] = {}
        # All owners' tokens together (a plain int: another thread may read it).
        self.total = 0
        # Tokens eviction took while their retention was in force (too little room).
        self.evicted = 0
        self._heap: list[tuple[float, int, TreeNode]] = []
        self._armed: dict[int, tuple[float, int, TreeNode]] = {}
        self._seq = count()

    def retained_tokens(self) -> int:
        """Tokens retained, all owners together (lapses not yet found still count)."""
        return self.total

    def retain(
        self,
        path: Sequence[TreeNode],
        seconds: float,
        priority: int,
        owner: Hashable = None,
        limit: int | None = None,
        split: Splitter | None = None,
    ) -> RetainResult:
        """Retain ``path`` (nodes from the namespace root's child down, in that order)
        for ``seconds`` at ``priority`` on behalf of ``owner``, whose retained tokens
        may not pass ``limit`` (None: no limit); ``split`` cuts the node that does not
        fit (None: it is left out whole). ``seconds`` 0 releases instead
        (``release``).

        Raises:
            InvalidInputError: a bad hint (``check_hint``) or limit; nothing changes.
        """
        check_hint(seconds, priority)
        if limit is not None and (type(limit) is not int or limit < 0):
            raise InvalidInputError(f"retain limit must be an int >= 0, got {limit!r}")
        if seconds == 0:
            return self.release(path, owner)
        now = self.clock()
        self.lapse_due(now)
        until = now + seconds
        used = self.tokens.get(owner, 0)
        covered, clipped = 0, False
        for node in path:
            if node.retain_priority:
                if node.retain_owner == owner:  # its own hint again: the new one holds
                    node.retain_priority, node.retain_seconds = priority, seconds
                    node.retain_until = until
                else:
                    node.retain_priority = max(node.retain_priority, priority)
                    node.retain_seconds = max(node.retain_seconds, seconds)
                    node.retain_until = max(node.retain_until, until)
                if not node.retained_children:
                    self._arm(node)  # an earlier expiry than its live timer's, maybe
            else:
                # Closed towards the root: every node below this one is unretained too.
                if limit is not None and used + node.key_len > limit:
                    clipped = True
                    upper = split(node, limit - used) if split is not None else None
                    if upper is None:
                        break
                    node = upper
                used += node.key_len
                node.retain_priority, node.retain_seconds = priority, seconds
                node.retain_until, node.retain_owner = until, owner
                parent = node.parent
                if parent.key_len:
                    parent.retained_children += 1
                self._arm(node)
            covered += node.key_len
            self.on_change(node)
            if clipped:
                break
        if used:
            self.total += used - self.tokens.get(owner, 0)
            self.tokens[owner] = used
        if not clipped:
            return RetainResult(ACCEPTED, covered)
        return RetainResult(CLIPPED if covered else REJECTED, covered)

    def release(self, path: Sequence[TreeNode], owner: Hashable = None) -> RetainResult:
        """End ``owner``'s retention of ``path`` now. A node another owner retains, or
        one a retained child still needs, stays retained (the latter until that child
        lapses); ``tokens`` says how much of the path that is."""
        now = self.clock()
        mine = [n for n in path if n.retain_priority and n.retain_owner == owner]
        for node in mine:
            node.retain_until = min(node.retain_until, now)
        for node in reversed(mine):  # deepest first, so parents follow their children
            if node.retain_priority and not node.retained_children:
                self._end(node, now)
        return RetainResult(ACCEPTED, sum(n.key_len for n in path if n.retain_priority))

    def renew(self, node: TreeNode) -> None:
        """A touch of a retained ``node``: a retention in force lasts its seconds from
        now. One that has run out stays out (its lapse may not be processed yet)."""
        now = self.clock()
        if node.retain_until > now:
            node.retain_until = max(node.retain_until, now + node.retain_seconds)

    def lapse_due(self, now: float | None = None, limit: int | None = None) -> int:
        """End every retention whose time has passed (with ``limit``, stop once about
        that many ended); how many ended."""
        heap, armed = self._heap, self._armed
        if not heap:
            return 0
        if now is None:
            now = self.clock()
        ended = 0
        while heap and heap[0][0] <= now and (limit is None or ended < limit):
            entry = heapq.heappop(heap)
            node = entry[2]
            if armed.get(node.id) is not entry:
                continue
            del armed[node.id]
            if not node.retain_priority or node.retained_children:
                continue  # a parent's timer starts again when its last child lapses
            if node.retain_until > now:  # renewed since its timer was set
                self._arm(node)
                continue
            ended += self._end(node, now)
        return ended

    def forget(self, node: TreeNode) -> None:
        """``node``, a retained leaf, leaves the tree."""
        now = self.clock()
        if node.retain_until > now:
            self.evicted += node.key_len
        self._end(node, now)

    def split(self, upper: TreeNode, lower: TreeNode) -> None:
        """``upper`` was cut off the top of ``lower``: it takes the same retention
        (counted once: the two together are as long as ``lower`` was)."""
        if not lower.retain_priority:
            return
        upper.retain_priority, upper.retain_seconds = lower.retain_priority, lower.retain_seconds
        upper.retain_until, upper.retain_owner = lower.retain_until, lower.retain_owner
        upper.retained_children = 1

    def clear(self) -> None:
        """Forget every retention (the tree was reset)."""
        self.tokens.clear()
        self.total = 0
        self._heap.clear()
        self._armed.clear()

    def problems(self, nodes: Iterable[TreeNode]) -> list[str]:
        """Disagreements between the tree's retentions and this book's counts."""
        problems: list[str] = []
        counted: dict[Hashable, int] = {}
        retained: set[int] = set()
        for node in nodes:
            children = sum(1 for c in node.children.values() if c.retain_priority)
            if node.retained_children != children:
                problems.append(
                    f"node {node.id}: retained_children {node.retained_children}"
                    f", {children} children retained"
                )
            if not node.retain_priority:
                if node.retain_owner is not None:
                    problems.append(f"node {node.id} has an owner but no retention")
                continue
            retained.add(node.id)
            counted[node.retain_owner] = counted.get(node.retain_owner, 0) + node.key_len
            if not 1 <= node.retain_priority <= MAX_PRIORITY or not node.retain_seconds > 0:
                problems.append(
                    f"node {node.id}: retention priority {node.retain_priority}"
                    f", {node.retain_seconds} s is not one"
                )
            if node.parent.key_len and not node.parent.retain_priority:
                problems.append(f"node {node.id} is retained, its parent is not")
            if not node.retained_children:
                entry = self._armed.get(node.id)
                if entry is None or entry[0] > node.retain_until:
                    problems.append(f"node {node.id} is retained with no timer by its expiry")
        if counted != self.tokens or self.total != sum(counted.values()):
            problems.append(
                f"retained tokens by owner {self.tokens} ({self.total} in all), "
                f"the tree has {counted}"
            )
        stray = set(self._armed) - retained
        if stray:
            problems.append(f"timers of nodes not retained: {sorted(stray)[:8]}")
        return problems

    def _arm(self, node: TreeNode) -> None:
        entry = (node.retain_until, next(self._seq), node)
        self._armed[node.id] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._armed) + 1024:
            armed = self._armed
            self._heap = [e for e in self._heap if armed.get(e[2].id) is e]
            heapq.heapify(self._heap)

    def _end(self, node: TreeNode, now: float) -> int:
        """End ``node``'s retention (it has no retained child), and then its parent's
        if that one was only waiting for it; how many ended."""
        ended = 0
        while True:
            self._armed.pop(node.id, None)
            owner = node.retain_owner
            left = self.tokens.get(owner, 0) - node.key_len
            self.total -= node.key_len
            if left > 0:
                self.tokens[owner] = left
            else:
                self.tokens.pop(owner, None)
            node.retain_priority, node.retain_seconds = 0, 0.0
            node.retain_until, node.retain_owner = 0.0, None
            ended += 1
            self.on_change(node)
            parent = node.parent
            if not parent.key_len:
                return ended
            parent.retained_children -= 1
            if parent.retained_children or not parent.retain_priority:
                return ended
            if parent.retain_until > now:
                self._arm(parent)
                return ended
            node = parent
