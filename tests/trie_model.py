"""A plain reference model of Modular MAX's RadixTrie, as docs/clients.md describes it.

Written for clarity, not speed, and independently of ``prefixcache.cache.trie``: tokens
as lists, children keyed by the tuple of their first page, and an eviction that does
what MAX's does literally (a heap of *every* leaf built at each call, marked leaves
skipped, a parent pushed when it becomes a leaf, the last leaf evicted partially from
its tail). Where MAX has bugs the model refuses as the library must (each before any
change): a release of a path not marked, or above a node the same sequence still marks
(``Refused("lock")``), and a release that stops below an ancestor the sequence still
uses through another branch; a start or mark on a node that left the trie; a block stored
twice (``Refused("value")``). Recency is a logical clock: each new node and each node a
release passes takes the next tick; a split copies the tick onto the new upper part.
"""

from __future__ import annotations

import heapq
from itertools import count
from typing import Any

_ids = count(1)


class Refused(Exception):
    """The call is refused: ``kind`` is ``"value"`` (ValueError) or ``"lock"``."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(f"{kind}: {why}")
        self.kind = kind


class MNode:
    def __init__(
        self, tokens: list[int], blocks: list[Any], parent: MNode | None, time: int
    ) -> None:
        self.tokens, self.blocks, self.parent, self.time = tokens, blocks, parent, time
        self.children: dict[tuple[int, ...], MNode] = {}
        self.seqs: set[Any] = set()
        self.gone = False
        self.id = next(_ids)


class ModelTrie:
    def __init__(self, page_size: int) -> None:
        self.ps = page_size
        self.root = MNode([], [], None, 0)
        self.clock = 0

    # ------------------------------------------------------------------ helpers

    def _key(self, tokens: list[int]) -> tuple[int, ...]:
        return tuple(tokens[: self.ps])

    def _common(self, a: list[int], b: list[int]) -> int:
        """Tokens of a and b that agree, in whole pages."""
        n = 0
        while n + self.ps <= min(len(a), len(b)) and a[n : n + self.ps] == b[n : n + self.ps]:
            n += self.ps
        return n

    def _start(self, node: MNode | None, kind: str) -> MNode:
        if node is None:
            return self.root
        if node.gone:
            raise Refused(kind, "the node left the trie")
        return node

    def _split(self, node: MNode, n: int) -> MNode:
        upper = MNode(node.tokens[:n], node.blocks[: n // self.ps], node.parent, node.time)
        upper.seqs = set(node.seqs)
        node.tokens, node.blocks = node.tokens[n:], node.blocks[n // self.ps :]
        upper.parent.children[self._key(upper.tokens)] = upper
        upper.children = {self._key(node.tokens): node}
        node.parent = upper
        return upper

    def nodes(self) -> list[MNode]:
        out, stack = [], list(reversed(self.root.children.values()))
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(reversed(n.children.values()))
        return out

    def all_blocks(self) -> list[Any]:
        return [b for n in self.nodes() for b in n.blocks]

    def evictable_blocks(self) -> set[Any]:
        return {b for n in self.nodes() if not n.seqs for b in n.blocks}

    # ------------------------------------------------------------------ the API

    def insert(self, tokens: list[int], blocks: list[Any], node: MNode | None = None) -> MNode:
        tokens, blocks = list(tokens), list(blocks)
        if len(tokens) % self.ps:
            raise Refused("value", "not whole pages")
        if len(tokens) // self.ps != len(blocks):
            raise Refused("value", "not one block per page")
        if not tokens:
            raise Refused("value", "empty")
        cur = self._start(node, "value")
        # Where the stored part starts (read only), to vet its blocks first.
        probe, at = cur, 0
        while at < len(tokens) and self._key(tokens[at:]) in probe.children:
            child = probe.children[self._key(tokens[at:])]
            n = self._common(child.tokens, tokens[at:])
            at += n
            if n < len(child.tokens):
                break
            probe = child
        new = blocks[at // self.ps :]
        stored = set(self.all_blocks())
        if len(set(new)) != len(new) or stored & set(new):
            raise Refused("value", "a block stored twice")
        while tokens:
            key = self._key(tokens)
            if key not in cur.children:
                self.clock += 1
                leaf = MNode(tokens, blocks, cur, self.clock)
                cur.children[key] = leaf
                return leaf
            child = cur.children[key]
            n = self._common(child.tokens, tokens)
            if n < len(child.tokens):
                child = self._split(child, n)
            tokens, blocks = tokens[n:], blocks[n // self.ps :]
            cur = child
        return cur

    def match(self, tokens: list[int], node: MNode | None = None) -> tuple[MNode, list[Any]]:
        tokens = list(tokens)
        if not tokens:
            raise Refused("value", "empty")
        cur = self._start(node, "value")
        tokens = tokens[: len(tokens) // self.ps * self.ps]
        blocks: list[Any] = []
        while tokens and self._key(tokens) in cur.children:
            child = cur.children[self._key(tokens)]
            n = self._common(child.tokens, tokens)
            if n < len(child.tokens):
                child = self._split(child, n)
                blocks += child.blocks
                return child, blocks
            blocks += child.blocks
            tokens = tokens[n:]
            cur = child
        return cur, blocks

    def mark(self, node: MNode, seq: Any) -> None:
        cur = self._start(node, "lock")
        while cur is not self.root and seq not in cur.seqs:
            cur.seqs.add(seq)
            cur = cur.parent

    def unmark(self, node: MNode, seq: Any) -> None:
        start = self._start(node, "lock")
        path, cur = [], start
        while cur is not self.root:
            if seq not in cur.seqs:
                raise Refused("lock", "not marked")
            path.append(cur)
            cur = cur.parent
        if any(seq in c.seqs for c in start.children.values()):
            raise Refused("lock", "marked below")
        for i in range(1, len(path)):  # an ancestor still used through another branch
            if any(seq in c.seqs for c in path[i].children.values() if c is not path[i - 1]):
                path = path[:i]
                break
        for cur in path:
            self.clock += 1
            cur.time = self.clock
            cur.seqs.discard(seq)

    def evict(self, n: int) -> list[Any]:
        leaves = [m for m in self.nodes() if not m.children]
        times = [m.time for m in leaves]
        assert len(set(times)) == len(times), "two leaves share a recency tick"
        heap = [(m.time, m.id, m) for m in leaves]
        heapq.heapify(heap)
        out: list[Any] = []
        while len(out) < n and heap:
            _, _, leaf = heapq.heappop(heap)
            if leaf.seqs:
                continue
            take = min(n - len(out), len(leaf.blocks))
            out += leaf.blocks[len(leaf.blocks) - take :]
            leaf.blocks = leaf.blocks[: len(leaf.blocks) - take]
            first = self._key(leaf.tokens)
            leaf.tokens = leaf.tokens[: len(leaf.tokens) - take * self.ps]
            if not leaf.tokens:
                parent = leaf.parent
                del parent.children[first]
                leaf.gone = True
                if parent is not self.root and not parent.children:
                    heapq.heappush(heap, (parent.time, parent.id, parent))
        return out

    def pretty_format(self, print_blocks: bool = False) -> list[str]:
        lines: list[str] = []

        def visit(node: MNode, indent: int) -> None:
            for child in node.children.values():
                line = f"{'-' * indent}{child.tokens}"
                lines.append(f"{line} : {child.blocks}" if print_blocks else line)
                visit(child, indent + 2)

        visit(self.root, 0)
        return lines
