"""The tree parts of MambaRadixCache: its node, the intrusive LRU lists, the integrity check."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from ..errors import IntegrityError
from ..inspection import RadixView, _check_node, _check_slots, _nodes, walk
from ..node import Namespace, TreeNode
from ..slot_values import owned_slots


class MambaTreeNode(TreeNode):
    """A tree node that may also own one Mamba state slot, ``mamba_value``.

    The state is the recurrent state after this node's last token. A node without one
    is a *Mamba tombstone*: its KV is cached, but a request cannot resume there.
    ``mamba_lock_ref`` counts the locks protecting the state; it equals
    ``own_lock_ref`` while the node has state and is 0 otherwise.
    """

    __slots__ = (
        "full_next",
        "full_prev",
        "mamba_access_time",
        "mamba_lock_ref",
        "mamba_next",
        "mamba_prev",
        "mamba_value",
    )

    def __init__(
        self,
        namespace: Namespace | None = None,
        key_bytes: bytes = b"",
        value: torch.Tensor | None = None,
        parent: MambaTreeNode | None = None,
        last_access_time: int = 0,
    ) -> None:
        super().__init__(namespace, key_bytes, value, parent, last_access_time)
        self.mamba_value: torch.Tensor | None = None
        self.mamba_lock_ref = 0
        # The two lists' links (LRUList): a neighbour, a list's end, or None outside it.
        self.full_prev: object = None
        self.full_next: object = None
        self.mamba_prev: object = None
        self.mamba_next: object = None
        # The Mamba list's own recency: a match refreshes the whole path in the full
        # list but only the matched node's state (see MambaRadixCache), so the two lists
        # keep two clocks' stamps.
        self.mamba_access_time = self.last_access_time

    @property
    def full_lock_ref(self) -> int:
        """SGLang's name for ``lock_ref``: locks on this node or below it."""
        return self.lock_ref

    def __repr__(self) -> str:
        state = "tombstone" if self.mamba_value is None else f"state={self.mamba_value.tolist()}"
        return (
            f"MambaTreeNode(id={self.id}, len={self.key_len}, lock_ref={self.lock_ref}, "
            f"mamba_lock_ref={self.mamba_lock_ref}, {state}, "
            f"children={len(self.children)}{', evicted' if self.evicted else ''})"
        )


def as_mamba(node: TreeNode) -> MambaTreeNode:
    """``node``, which in a Mamba cache's tree is always a ``MambaTreeNode``; any other
    node is a broken tree (IntegrityError)."""
    if not isinstance(node, MambaTreeNode):
        raise IntegrityError(f"node {node.id} is not a MambaTreeNode")
    return node


def new_root(
    namespace: Namespace | None, parent: MambaTreeNode | None, value: torch.Tensor, clock: int
) -> MambaTreeNode:
    """A root (or namespace root): locked for good, with the empty state of position 0."""
    root = MambaTreeNode(namespace, b"", value, parent, clock)
    root.lock_ref = root.swa_lock_ref = root.mamba_lock_ref = 1
    root.mamba_value = torch.empty((0,), dtype=torch.int64)
    return root


def split_node(child: MambaTreeNode, split_len: int, page_size: int, clock: int) -> MambaTreeNode:
    """Put a new node holding ``child``'s first ``split_len`` tokens above it.

    The new node takes its part of the key, KV and page hashes and the full lock
    count (every lock through the child also covers it), but no state and no Mamba
    lock: the child's state is the one after its last token and stays there. The
    caller ranks both nodes in its LRU lists.
    """
    ns = child.require_namespace()
    cut = split_len * ns.token_bytes
    parent = child.parent
    upper = MambaTreeNode(
        ns, child.key_bytes[:cut], owned_slots(child.value, 0, split_len), parent, clock
    )
    upper.lock_ref = child.lock_ref
    upper.hit_count = child.hit_count
    if child.hash_values is not None:
        pages = split_len // page_size
        upper.hash_values, child.hash_values = child.hash_values[:pages], child.hash_values[pages:]
    child.key_bytes = child.key_bytes[cut:]
    child.key_len -= split_len
    child.value = owned_slots(child.value, split_len, child.value.shape[0])
    parent.children[upper.key_bytes[: ns.page_bytes]] = upper
    upper.children[child.key_bytes[: ns.page_bytes]] = child
    child.parent = upper
    return upper


class _End:
    """A sentinel at either end of a list; takes whatever link attributes the list uses."""

    def __repr__(self) -> str:
        return "<end>"


class LRUList:
    """Nodes from most (head) to least (tail) recently used.

    The links live on the nodes themselves, in the two attributes named at construction
    (so one node can sit in several lists at once), and a node is in the list exactly
    when its ``prev`` link is set. Touching or removing a node is O(1) and allocates
    nothing; finding the least recently used node that satisfies a condition walks from
    the tail, skipping the nodes that do not.

    The list does not keep time itself: the owner stamps the node's ``time_attr``
    (``last_access_time`` unless told otherwise) and moves nodes to the head in the same
    order, so the list stays sorted by that field, which ``check`` verifies.
    """

    __slots__ = ("_head", "_len", "_next", "_prev", "_tail", "_time")

    def __init__(self, prev_attr: str, next_attr: str, time_attr: str = "last_access_time") -> None:
        self._prev = prev_attr
        self._next = next_attr
        self._time = time_attr
        # Sentinels at both ends mean linking never has to test for an empty list.
        self._head: object = _End()
        self._tail: object = _End()
        setattr(self._head, next_attr, self._tail)
        setattr(self._head, prev_attr, None)
        setattr(self._tail, prev_attr, self._head)
        setattr(self._tail, next_attr, None)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, node: object) -> bool:
        return getattr(node, self._prev, None) is not None

    def push_mru(self, node: MambaTreeNode) -> None:
        """Add a node that is not in the list as the most recently used."""
        if node in self:  # linking it twice would corrupt both neighbours
            raise IntegrityError(f"node {node.id} is already in the list")
        self._link_after(self._head, node)
        self._len += 1

    def remove(self, node: MambaTreeNode) -> None:
        """Take a node out of the list."""
        if node not in self:
            raise IntegrityError(f"node {node.id} is not in the list")
        self._unlink(node)
        setattr(node, self._prev, None)
        setattr(node, self._next, None)
        self._len -= 1

    def move_to_mru(self, node: MambaTreeNode) -> None:
        """Make a node in the list the most recently used."""
        self._unlink(node)
        self._link_after(self._head, node)

    def touch_node_and_parents_mru(self, node: MambaTreeNode) -> None:
        """Move ``node`` and its ancestors to the head, ``node`` first.

        Each child then ranks more recent than its parent, so eviction reaches the
        deeper end of a path first. Ancestors not in this list (and the roots, which
        have empty keys) are passed over.
        """
        anchor: object = self._head
        while node.key_len:
            if node in self:
                self._unlink(node)
                self._link_after(anchor, node)
                anchor = node
            node = node.parent

    def lru(
        self, accept: Callable[[MambaTreeNode], bool], newer_than: MambaTreeNode | None = None
    ) -> MambaTreeNode | None:
        """The least recently used node that ``accept`` takes, or None.

        With ``newer_than`` (a node in the list) the search starts just above it, so a
        caller can step through candidates while removing the ones it has taken.
        """
        prev = self._prev
        # A node, until the walk reaches the head sentinel (compared by identity only).
        node: MambaTreeNode = getattr(self._tail if newer_than is None else newer_than, prev)
        while node is not self._head:
            if accept(node):
                return node
            node = getattr(node, prev)
        return None

    def take_lru(
        self,
        accept: Callable[[MambaTreeNode], bool],
        take: Callable[[MambaTreeNode], MambaTreeNode | None],
        want_more: Callable[[], bool],
    ) -> None:
        """Hand ``take`` the nodes that ``accept`` takes, least recent first, while
        ``want_more()``.

        ``take`` may remove its node, and nodes that ``accept`` rejects, from the list.
        It returns a node it made acceptable (a parent left a leaf), or None; such a
        node joins in recency order even if the scan has passed it.
        """
        # One scan from the tail. A node made acceptable behind the scan is older than
        # everything ahead, so it waits in a heap that is served first.
        if not want_more():
            return
        behind: list[tuple[int, int, MambaTreeNode]] = []
        ahead = self.lru(accept)
        while want_more():
            if behind:
                node = heapq.heappop(behind)[2]
            elif ahead is not None:
                # Found before ``take`` runs: it removes only the node and nodes that
                # ``accept`` rejects, so ``ahead`` stays in the list.
                node, ahead = ahead, self.lru(accept, newer_than=ahead)
            else:
                return
            new = take(node)
            if (
                new is not None
                and accept(new)
                and (ahead is None or getattr(new, self._time) < getattr(ahead, self._time))
            ):
                heapq.heappush(behind, (getattr(new, self._time), new.id, new))

    def __iter__(self) -> Iterator[MambaTreeNode]:
        """Nodes from the most to the least recently used."""
        node: MambaTreeNode = getattr(self._head, self._next)  # until the tail sentinel
        while node is not self._tail:
            yield node
            node = getattr(node, self._next)

    def check(self, expected: dict[int, MambaTreeNode], name: str) -> list[str]:
        """Problems with the links, the membership (``expected``: id -> node) or the order."""
        problems: list[str] = []
        seen: set[int] = set()
        prev, node = self._head, getattr(self._head, self._next)
        last_time = None
        while node is not self._tail:
            if node is None or len(seen) > len(expected) or node.id in seen:
                problems.append(f"{name} LRU list is broken or cyclic")
                return problems
            if getattr(node, self._prev) is not prev:
                problems.append(f"{name} LRU list: node {node.id}'s back link is wrong")
            stamp = getattr(node, self._time)
            if last_time is not None and stamp >= last_time:
                problems.append(f"{name} LRU list: node {node.id} is out of recency order")
            last_time = stamp
            seen.add(node.id)
            prev, node = node, getattr(node, self._next)
        if getattr(self._tail, self._prev) is not prev:
            problems.append(f"{name} LRU list: the tail's back link is wrong")
        if len(seen) != self._len:
            problems.append(f"{name} LRU list counts {self._len} nodes but links {len(seen)}")
        if seen != set(expected):
            missing = sorted(set(expected) - seen)[:8]
            extra = sorted(seen - set(expected))[:8]
            problems.append(f"{name} LRU list lacks nodes {missing} and has stray nodes {extra}")
        return problems

    def _unlink(self, node: MambaTreeNode) -> None:
        before, after = getattr(node, self._prev), getattr(node, self._next)
        setattr(before, self._next, after)
        setattr(after, self._prev, before)

    def _link_after(self, anchor: object, node: MambaTreeNode) -> None:
        after = getattr(anchor, self._next)
        setattr(node, self._prev, anchor)
        setattr(node, self._next, after)
        setattr(anchor, self._next, node)
        setattr(after, self._prev, node)


class StatePool(Protocol):
    """What a Mamba cache needs of its state pool: taking a state slot back. A
    ``MambaPool`` is one; its ``is_track_slot_allocated`` is used where present."""

    def free_track_slot(self, slot: int | torch.Tensor) -> None: ...


class MambaCacheView(RadixView, Protocol):
    """What the check and the printed tree read of a ``MambaRadixCache``. That class
    imports this module (its node and lists live here), so they name its shape instead."""

    mamba_pool: StatePool | None
    full_lru_list: LRUList
    mamba_lru_list: LRUList
    _state_owner: dict[int, MambaTreeNode]

    def mamba_total_size(self) -> int: ...

    def mamba_evictable_size(self) -> int: ...

    def mamba_protected_size(self) -> int: ...


def check_mamba_cache(cache: MambaCacheView) -> None:
    """Recompute a Mamba cache's bookkeeping from its tree; raise IntegrityError on any mismatch.

    On top of the tree's shape, locks, page hashes and KV slots (as for ``RadixCache``):
    the full and Mamba sizes, ``full_lock_ref >= mamba_lock_ref`` (with the Mamba locks
    exactly the node's own locks while it has state), one registered state slot per
    node with state, no tombstone left an unlocked leaf, both LRU lists holding exactly
    their nodes in recency order, and every state slot allocated in the pool.
    """
    problems: list[str] = []
    evictable = protected = 0
    nodes: dict[int, MambaTreeNode] = {}
    stateful: dict[int, MambaTreeNode] = {}
    for node in _nodes(cache, problems):
        _check_node(cache, node, problems)
        if not isinstance(node, MambaTreeNode):
            problems.append(f"node {node.id} is not a MambaTreeNode")
            continue
        nodes[node.id] = node
        if node.lock_ref:
            protected += node.key_len
        else:
            evictable += node.key_len
        _check_state(cache, node, stateful, problems)
    counted = (cache.evictable_size(), cache.protected_size())
    if counted != (evictable, protected):
        problems.append(
            f"sizes: counted evictable/protected {counted}, tree has {(evictable, protected)}"
        )
    locked = sum(1 for n in stateful.values() if n.mamba_lock_ref)
    counted = (cache.mamba_evictable_size(), cache.mamba_protected_size())
    if counted != (len(stateful) - locked, locked):
        problems.append(
            f"Mamba sizes: counted {counted}, tree has {(len(stateful) - locked, locked)}"
        )
    owners = cache._state_owner
    if len(owners) != len(stateful):
        problems.append(
            f"{len(owners)} state slots are registered, {len(stateful)} nodes have state"
        )
    problems += cache.full_lru_list.check(nodes, "full")
    problems += cache.mamba_lru_list.check(stateful, "Mamba")
    _check_slots(cache, [n.value for n in nodes.values()], problems)
    is_allocated = getattr(cache.mamba_pool, "is_track_slot_allocated", None)
    if is_allocated is not None and not all(map(is_allocated, owners)):
        problems.append("a state slot in the tree is free in the Mamba pool")
    if problems:
        raise IntegrityError("; ".join(problems[:12]))


def _check_state(
    cache: MambaCacheView,
    node: MambaTreeNode,
    stateful: dict[int, MambaTreeNode],
    problems: list[str],
) -> None:
    if node.mamba_lock_ref > node.lock_ref:
        problems.append(
            f"node {node.id}: mamba_lock_ref {node.mamba_lock_ref} > full_lock_ref {node.lock_ref}"
        )
    if node.mamba_value is None:
        if node.mamba_lock_ref:
            problems.append(f"tombstone {node.id} holds a Mamba lock")
        if not node.children and not node.lock_ref:
            problems.append(f"tombstone {node.id} is an unlocked leaf")
        return
    stateful[node.id] = node
    if (
        tuple(node.mamba_value.shape) != (1,)
        or cache._state_owner.get(int(node.mamba_value[0])) is not node
    ):
        problems.append(
            f"node {node.id}: state {node.mamba_value.tolist()} is not one registered slot"
        )
    if node.mamba_lock_ref != node.own_lock_ref:
        problems.append(
            f"node {node.id}: mamba_lock_ref {node.mamba_lock_ref} != its own "
            f"locks {node.own_lock_ref}"
        )


def format_mamba_tree(cache: MambaCacheView) -> str:
    """The tree, one node a line: length, both locks, state slot (or tombstone), tokens."""
    lines = [
        f"root  total={cache.total_size()} evictable={cache.evictable_size()} "
        f"states={cache.mamba_total_size()} "
        f"state_evictable={cache.mamba_evictable_size()}"
    ]
    for tree_node, depth in walk(cache.root_node):
        node = as_mamba(tree_node)
        if not node.key_len:
            ns = node.require_namespace()
            lines.append(f"  [extra_key={ns.extra_key!r} width={ns.token_width}]")
            continue
        state = "tombstone" if node.mamba_value is None else f"state={int(node.mamba_value[0])}"
        more = "..." if node.key_len > 6 else ""
        lines.append(
            f"{'  ' * (depth + 1)}#{node.id} len={node.key_len} lock={node.lock_ref} "
            f"mamba_lock={node.mamba_lock_ref} {state} "
            f"{node.key.token_ids[:6]}{more}"
        )
    return "\n".join(lines)
