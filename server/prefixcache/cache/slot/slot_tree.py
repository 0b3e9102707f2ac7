"""The shape of a ``SlotPrefixCache``'s tree: its nodes, adding and splitting them, and
evicting whole unpinned leaves (a mixin; ``slot_cache.py`` holds the cache's API)."""

from __future__ import annotations

from ..errors import IntegrityError
from ..eviction import EvictionQueue
from ..node import Namespace, TreeNode
from ..pools.slot_allocator import SlotAllocator


class SlotNode(TreeNode):
    """A tree node whose path, from its namespace root to its end, lies in positions
    ``[0, depth)`` of ``slot`` as written under ``version``.

    ``depth`` never changes: a split keeps the node object on the deeper part, so a
    handle always ends where it did. Namespace roots and the root hold no entry
    (``slot == -1``, ``version == 0``, which is never current).
    """

    __slots__ = ("depth", "slot", "version")

    depth: int
    slot: int
    version: int

    def __init__(
        self,
        namespace: Namespace | None,
        key_bytes: bytes,
        parent: SlotNode | None,
        slot: int,
        version: int,
        last_access_time: int,
    ) -> None:
        super().__init__(namespace, key_bytes, None, parent, last_access_time)
        self.slot = slot
        self.version = version
        self.depth = (parent.depth if parent is not None else 0) + self.key_len


class SlotTree:
    """Mixin of ``SlotPrefixCache``: the tree's nodes and the counts kept over them."""

    # Set by SlotPrefixCache.__init__.
    allocator: SlotAllocator
    capacity: int
    max_seq_len: int | None
    # Set by SlotPrefixCache.reset.
    root_node: SlotNode
    _clock: int
    _evictable: int
    _protected: int
    _nodes: int
    _pins: int
    _leaves: EvictionQueue[SlotNode]
    _tips: dict[tuple[int, int], SlotNode]

    def _namespace_root(self, extra_key: str | None, width: int) -> SlotNode:
        ns_root = self.root_node.children.get((extra_key, width))
        if ns_root is None:
            ns = Namespace(extra_key, width, 1)
            ns_root = SlotNode(ns, b"", self.root_node, -1, 0, self._clock)
            self.root_node.children[(extra_key, width)] = ns_root
        return ns_root

    def _add_leaf(self, parent: SlotNode, key_bytes: bytes, slot: int, version: int) -> SlotNode:
        ns = parent.require_namespace()
        leaf = SlotNode(ns, key_bytes, parent, slot, version, self._clock)
        parent.children[key_bytes[: ns.token_bytes]] = leaf
        self._evictable += leaf.key_len
        self._nodes += 1
        self._leaves.push(leaf)
        return leaf

    def _split(self, child: SlotNode, split_len: int) -> SlotNode:
        """Cut ``child`` after ``split_len`` tokens and return the new upper part, which
        takes the child's entry, pins and recency; the child keeps its object and id."""
        ns, parent = child.require_namespace(), child.parent
        if parent is None:
            raise IntegrityError(f"node {child.id} has no parent to split under")
        cut = split_len * ns.token_bytes
        upper = SlotNode(
            ns, child.key_bytes[:cut], parent, child.slot, child.version, child.last_access_time
        )
        upper.lock_ref = child.lock_ref
        upper.hit_count = child.hit_count
        child.key_bytes = child.key_bytes[cut:]
        child.key_len -= split_len
        parent.children[upper.key_bytes[: ns.token_bytes]] = upper
        upper.children[child.key_bytes[: ns.token_bytes]] = child
        child.parent = upper
        self._nodes += 1
        return upper

    def _evict(self, wanted: int) -> int:
        evicted = 0
        while evicted < wanted:
            leaf = self._leaves.pop()
            if leaf is None:
                break
            evicted += self._evict_leaf(leaf)
        return evicted

    def _evict_leaf(self, leaf: SlotNode) -> int:
        ns, parent = leaf.require_namespace(), leaf.parent
        if parent is None or leaf.children:
            raise IntegrityError(f"node {leaf.id} is not a leaf under a parent")
        del parent.children[leaf.key_bytes[: ns.token_bytes]]
        self._evictable -= leaf.key_len
        self._nodes -= 1
        pair = (leaf.slot, leaf.version)
        if self._tips.get(pair) is leaf:
            if parent.key_len and (parent.slot, parent.version) == pair:
                self._tips[pair] = parent
            else:
                del self._tips[pair]
        leaf.evicted = True
        if parent.key_len:
            if not parent.children and not parent.lock_ref:
                self._leaves.push(parent)
        elif not parent.children:  # forget an empty namespace
            del self.root_node.children[(ns.extra_key, ns.token_width)]
            parent.evicted = True
        return leaf.key_len
