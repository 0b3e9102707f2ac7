"""The integrity check of a ``SlotPrefixCache``: everything its tree counts, recomputed."""

from __future__ import annotations

from itertools import pairwise

from ..errors import IntegrityError
from ..inspection import walk
from ..node import Namespace
from .slot_tree import SlotNode, SlotTree


def check_slot_cache(cache: SlotTree) -> None:
    """``SlotPrefixCache.check_integrity``: recompute everything from the tree."""
    problems: list[str] = []
    evictable = protected = nodes = pins = 0
    leaves: set[int] = set()
    chains: dict[tuple[int, int], list[SlotNode]] = {}
    for key, ns_root in cache.root_node.children.items():
        ns = ns_root.namespace
        if (
            ns is None
            or (ns.extra_key, ns.token_width) != key
            or ns_root.parent is not cache.root_node
            or ns_root.key_len
            or not ns_root.children
            or ns_root.evicted
        ):
            problems.append(f"namespace root {key!r} is malformed or empty")
            continue
        for node, _ in walk(ns_root):
            nodes += 1
            pins += node.own_lock_ref
            if node.lock_ref:
                protected += node.key_len
            else:
                evictable += node.key_len
                if not node.children:
                    leaves.add(node.id)
            chains.setdefault((node.slot, node.version), []).append(node)
            _check_slot_node(cache, node, ns, problems)
    counted = (cache._evictable, cache._protected, cache._nodes, cache._pins)
    if counted != (evictable, protected, nodes, pins):
        problems.append(
            f"evictable/protected/nodes/pins counted {counted}, tree has "
            f"{(evictable, protected, nodes, pins)}"
        )
    if leaves != cache._leaves.node_ids():
        problems.append("the eviction queue does not hold exactly the unpinned leaves")
    if set(chains) != set(cache._tips):
        problems.append("the tip index does not list exactly the entries in the tree")
    for pair, members in chains.items():
        members.sort(key=lambda n: n.depth)
        if cache._tips.get(pair) is not members[-1] or any(
            b.parent is not a for a, b in pairwise(members)
        ):
            problems.append(f"the nodes holding slot/version {pair} are not one chain")
    if evictable + protected > cache.capacity:
        problems.append(f"{evictable + protected} tokens exceed capacity {cache.capacity}")
    if problems:
        raise IntegrityError("; ".join(problems[:12]))


def _check_slot_node(cache: SlotTree, node: SlotNode, ns: Namespace, problems: list[str]) -> None:
    parent = node.parent
    if (
        node.evicted
        or node.namespace is not ns
        or parent is None
        or parent.children.get(node.key_bytes[: ns.token_bytes]) is not node
    ):
        problems.append(f"node {node.id} is detached or evicted yet in the tree")
        return
    if (
        node.key_len < 1
        or len(node.key_bytes) != node.key_len * ns.token_bytes
        or node.depth != parent.depth + node.key_len
        or (cache.max_seq_len is not None and node.depth > cache.max_seq_len)
    ):
        problems.append(f"node {node.id}: key length or depth is wrong")
    child_locks = sum(c.lock_ref for c in node.children.values())
    if node.own_lock_ref < 0 or node.lock_ref != node.own_lock_ref + child_locks:
        problems.append(
            f"node {node.id}: lock_ref {node.lock_ref} != own "
            f"{node.own_lock_ref} + children {child_locks}"
        )
    if (
        not 0 <= node.slot < cache.allocator.max_slots
        or not 1 <= node.version <= cache.allocator.version(node.slot)
    ):
        problems.append(
            f"node {node.id}: slot/version {node.slot}/{node.version} was never handed out"
        )
