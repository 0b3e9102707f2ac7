"""Read-only views of a ``RadixTrie``: MAX's printed form and the integrity check."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from ..errors import IntegrityError
from ..eviction import EvictionQueue


class TrieNode(Protocol):
    """What these views read of a ``radix_trie.TrieNode`` (which imports this module, so
    it is named by its shape)."""

    id: int
    key_bytes: bytes
    blocks: list[Any]
    children: dict[bytes, Any]
    parent: Any
    active_seqs: set[Any]
    last_access_time: int
    evicted: bool
    trie_tag: int


class RadixTrie(Protocol):
    """What the check reads of a ``radix_trie.RadixTrie``."""

    root: Any
    page_size: int
    _page_bytes: int
    _tag: int
    _clock: int
    _owner: dict[Any, Any]
    _evictable: dict[Any, None]
    _leaves: EvictionQueue[Any]


def preorder(root: TrieNode) -> Iterator[tuple[TrieNode, int]]:
    """Every node below ``root``, depth first, children in the order they were added,
    with its depth (1 for the root's children)."""
    stack = [(child, 1) for child in reversed(root.children.values())]
    while stack:
        node, depth = stack.pop()
        yield node, depth
        stack.extend((child, depth + 1) for child in reversed(node.children.values()))


def format_trie(root: TrieNode, print_blocks: bool) -> list[str]:
    """MAX's lines: ``'-' * (2 * (depth - 1))``, the node's tokens as a list, and with
    ``print_blocks`` ``' : '`` and its blocks."""
    lines = []
    for node, depth in preorder(root):
        tokens = np.frombuffer(node.key_bytes, dtype="<u4").tolist()
        line = f"{'-' * (2 * (depth - 1))}{tokens}"
        lines.append(f"{line} : {node.blocks}" if print_blocks else line)
    return lines


def check_radix_trie(trie: RadixTrie) -> None:
    """Recompute what the trie keeps incrementally and compare.

    Checked: every node below the root holds whole pages, one block per page, under
    the key of its first page, with a parent pointer back, not evicted, and no more
    users than its parent (a mark covers the path to the root); each block is stored
    once and the owner map is exactly the stored blocks; the evictable blocks are
    exactly those of unmarked nodes; the eviction candidates are exactly the unmarked
    leaves; the clock is ahead of every node's recency.
    """
    problems: list[str] = []
    pb, ps = trie._page_bytes, trie.page_size
    root = trie.root
    if root.key_bytes or root.blocks or root.active_seqs or root.parent is not None:
        problems.append("the root holds tokens, blocks or users, or has a parent")
    owner: dict[Any, Any] = {}
    evictable: set[Any] = set()
    leaves: set[int] = set()
    for node, _ in preorder(root):
        parent = node.parent
        if node.evicted or node.trie_tag != trie._tag:
            problems.append(f"node {node.id} is reachable but evicted or another trie's")
        if not node.key_bytes or len(node.key_bytes) % pb:
            problems.append(
                f"node {node.id} holds {len(node.key_bytes) // 4} tokens, not whole pages of {ps}"
            )
        if len(node.blocks) != len(node.key_bytes) // pb:
            problems.append(
                f"node {node.id} has {len(node.blocks)} blocks for "
                f"{len(node.key_bytes) // pb} pages"
            )
        if parent is None or parent.children.get(node.key_bytes[:pb]) is not node:
            problems.append(f"node {node.id} is not its parent's child under its first page")
        elif parent is not root and not node.active_seqs <= parent.active_seqs:
            problems.append(
                f"node {node.id} is used by {node.active_seqs - parent.active_seqs}"
                f" that its parent {parent.id} is not"
            )
        if node.last_access_time > trie._clock:
            problems.append(f"node {node.id} is more recent than the clock")
        for block in node.blocks:
            if block in owner:
                problems.append(
                    f"block {block!r} is stored at nodes {owner[block].id} and {node.id}"
                )
            owner[block] = node
            if not node.active_seqs:
                evictable.add(block)
        if not node.children and not node.active_seqs:
            leaves.add(node.id)
    if {b: n.id for b, n in owner.items()} != {b: n.id for b, n in trie._owner.items()}:
        problems.append("the block owners disagree with the nodes")
    if evictable != set(trie._evictable):
        problems.append(
            f"evictable blocks: {len(trie._evictable)} kept, {len(evictable)} recomputed"
        )
    if leaves != trie._leaves.node_ids():
        problems.append(
            f"eviction candidates: {sorted(trie._leaves.node_ids())} kept, "
            f"{sorted(leaves)} recomputed"
        )
    if problems:
        raise IntegrityError("; ".join(problems))
