"""Read-only views of the caches: the integrity checks and the printed tree."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from .distinct import has_repeats
from .errors import IntegrityError
from .eviction import EvictionQueue
from .hashing import hash_pages
from .node import TreeNode


class RadixView(Protocol):
    """What the checks and the printed tree read of a ``RadixCache`` (or one of its
    subclasses). Those import this module to check themselves, so they are named here
    by their shape rather than imported."""

    @property
    def root_node(self) -> TreeNode: ...  # read-only here, so a subclass's node type fits

    page_size: int
    sliding_window_size: int | None
    eager_page_hashes: bool
    token_to_kv_pool_allocator: Any
    _leaves: EvictionQueue[TreeNode]

    def total_size(self) -> int: ...

    def evictable_size(self) -> int: ...

    def protected_size(self) -> int: ...

    def swa_evictable_size(self) -> int: ...

    def swa_protected_size(self) -> int: ...


N = TypeVar("N", bound=TreeNode)


def walk(start: N, depth: int = 0) -> Iterator[tuple[N, int]]:
    """Every node below ``start`` (depth-first) with its depth."""
    stack = [(child, depth) for child in start.children.values()]
    while stack:
        node, d = stack.pop()
        yield node, d
        stack.extend((child, d + 1) for child in node.children.values())


def format_tree(cache: RadixView) -> str:
    """The tree, one node a line, with lengths, locks and the first tokens."""
    lines = [
        f"root  total={cache.total_size()} evictable={cache.evictable_size()} "
        f"protected={cache.protected_size()}"
    ]
    for ns_root in cache.root_node.children.values():
        ns = ns_root.require_namespace()
        lines.append(f"  [extra_key={ns.extra_key!r} width={ns.token_width}]")
        for node, depth in walk(ns_root, 2):
            tokens = node.key.token_ids[:6]
            more = "..." if node.key_len > 6 else ""
            flags = " tombstone" if node.swa_tombstone else ""
            lines.append(
                f"{'  ' * depth}#{node.id} len={node.key_len} lock={node.lock_ref}"
                f"{flags} {tokens}{more}"
            )
    return "\n".join(lines)


def check_radix_cache(cache: RadixView) -> None:
    """Recompute a cache's bookkeeping from its tree; raise IntegrityError on any mismatch.

    Checks the tree's shape (parent links, child keys, page-aligned lengths, no empty
    namespace), ``lock_ref == own_lock_ref + sum(children's lock_ref)`` on every node,
    the size counters, that the eviction queue holds exactly the unlocked leaves, page
    hashes where present, that no slot appears twice and that every slot is allocated;
    in SWA mode also the SWA counters, queue and tombstone rules.
    """
    problems: list[str] = []
    evictable = protected = 0
    candidates: set[int] = set()
    slots: list[torch.Tensor] = []
    for node in _nodes(cache, problems):
        if node.lock_ref:
            protected += node.key_len
        else:
            evictable += node.key_len
            if not node.children:
                candidates.add(node.id)
        slots.append(node.value)
        _check_node(cache, node, problems)
    counted = (cache.evictable_size(), cache.protected_size())
    if (evictable, protected) != counted:
        problems.append(
            f"sizes: counted evictable/protected {counted}, tree has {(evictable, protected)}"
        )
    queued = cache._leaves.node_ids()
    if candidates != queued:
        problems.append(
            f"eviction queue holds {sorted(queued)[:8]}, "
            f"expected the unlocked leaves {sorted(candidates)[:8]}"
        )
    _check_slots(cache, slots, problems)
    if cache.sliding_window_size is not None:
        _check_swa(cache, problems)
    if problems:
        raise IntegrityError("; ".join(problems[:12]))


def _nodes(cache: RadixView, problems: list[str]) -> Iterator[TreeNode]:
    root = cache.root_node
    for key, ns_root in root.children.items():
        ns = ns_root.namespace
        if (
            ns is None
            or (ns.extra_key, ns.token_width) != key
            or ns_root.parent is not root
            or not ns_root.children
        ):
            problems.append(f"namespace root {key!r} is malformed or empty")
            continue
        for node, _ in walk(ns_root):
            page = node.key_bytes[: ns.page_bytes]
            if (
                node.evicted
                or node.value is None
                or node.namespace is not ns
                or node.parent.children.get(page) is not node
            ):
                problems.append(f"node {node.id} is detached or evicted yet in the tree")
            yield node


def _check_node(cache: RadixView, node: TreeNode, problems: list[str]) -> None:
    ns = node.namespace
    if ns is None:
        problems.append(f"node {node.id} has no namespace")
        return
    if (
        node.key_len <= 0
        or node.key_len % cache.page_size
        or len(node.key_bytes) != node.key_len * ns.token_bytes
        or node.value is None
        or len(node.value) != node.key_len
    ):
        problems.append(f"node {node.id}: key/value lengths disagree or are not paged")
    child_locks = sum(c.lock_ref for c in node.children.values())
    if node.own_lock_ref < 0 or node.lock_ref != node.own_lock_ref + child_locks:
        problems.append(
            f"node {node.id}: lock_ref {node.lock_ref} != own "
            f"{node.own_lock_ref} + children {child_locks}"
        )
    if cache.eager_page_hashes or node.hash_values is not None:
        parent = node.parent
        above = parent.hash_values if parent.key_len else None
        if parent.key_len and above is None:
            problems.append(f"node {node.id} is hashed but its parent is not")
            return
        prior = bytes.fromhex(above[-1]) if above else None
        if node.hash_values != hash_pages(node.key_bytes, ns.page_bytes, prior):
            problems.append(f"node {node.id}: page hashes do not chain from its parent")


def _check_slots(cache: RadixView, slots: list[torch.Tensor], problems: list[str]) -> None:
    """No slot in two places, every slot allocated: node by node (marks over the
    pool's rows where it has a known size), with no copy of the tree's slots."""
    if not slots:
        return
    allocator = cache.token_to_kv_pool_allocator
    rows = getattr(allocator, "num_rows", None)
    is_allocated = getattr(allocator, "is_allocated", None)
    marks = np.zeros(rows, dtype=np.bool_) if isinstance(rows, int) else None
    seen: list[np.ndarray] = []
    total = 0
    free = False
    for value in slots:
        if not len(value):
            continue
        s = value.cpu().numpy()
        total += s.size
        if marks is not None and int(s.min()) >= 0 and int(s.max()) < marks.size:
            marks[s] = True
        else:
            marks = None
        seen.append(s)
        if is_allocated is not None and not free and not bool(is_allocated(value).numpy().all()):
            free = True
    if marks is not None:
        repeated = int(np.count_nonzero(marks)) != total
    else:
        repeated = has_repeats(np.concatenate(seen).astype(np.int64, copy=False))
    if repeated:
        problems.append("a slot is referenced by two tree positions")
    if free:
        problems.append("a slot in the tree is free in the allocator")


def _check_swa(cache: RadixView, problems: list[str]) -> None:
    evictable = protected = 0
    candidates = set()
    live, dead = [], []
    for node in _nodes(cache, []):
        if node.swa_tombstone:
            dead.append(node.value)
            if node.swa_lock_ref:
                problems.append(f"tombstone {node.id} holds an SWA lock")
            if not node.children and not node.lock_ref:
                problems.append(f"tombstone {node.id} is an unlocked leaf")
            continue
        live.append(node.value)
        if not 0 <= node.swa_lock_ref <= node.lock_ref:
            problems.append(
                f"node {node.id}: swa_lock_ref {node.swa_lock_ref} "
                f"outside [0, lock_ref={node.lock_ref}]"
            )
        if node.swa_lock_ref:
            protected += node.key_len
        else:
            evictable += node.key_len
            candidates.add(node.id)
    counted = (cache.swa_evictable_size(), cache.swa_protected_size())
    if (evictable, protected) != counted:
        problems.append(f"SWA sizes: counted {counted}, tree has {(evictable, protected)}")
    if candidates != cache._windows.node_ids():  # type: ignore[attr-defined]
        problems.append("SWA eviction queue does not hold exactly the SWA-unlocked nodes")
    is_mapped = getattr(cache.token_to_kv_pool_allocator, "is_swa_mapped", None)
    if is_mapped is not None:
        if live and not bool(is_mapped(torch.cat(live)).all()):
            problems.append("a live node's slot has no SWA KV")
        if dead and bool(is_mapped(torch.cat(dead)).any()):
            problems.append("a tombstone's slot still holds SWA KV")
