"""A plain pure-Python radix tree (list keys, full-walk LRU eviction): the same-run yardstick."""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

_ids = itertools.count()


class SlotAllocator(Protocol):
    """The slice of TokenToKVPoolAllocator the tree needs: it only ever frees."""

    def free(self, indices: torch.Tensor) -> None: ...


class Node:
    """A tree node; a plain attribute bag, as such trees are usually written."""

    def __init__(self, key: list[int], value: torch.Tensor, parent: Node | None) -> None:
        self.children: dict[Any, Node] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access_time = time.monotonic()
        self.id = next(_ids)


@dataclass
class PlainMatch:
    indices: torch.Tensor
    last_node: Node
    prefix_len: int


@dataclass
class PlainInsert:
    prefix_len: int
    last_node: Node


@dataclass
class PlainEvict:
    full_evicted: int


class PlainRadixCache:
    """SGLang-style radix cache semantics with the usual pure-Python data layout.

    Keys are `list[int]`, prefixes compare element by element (page by page
    with list slices when page_size > 1), node values are int64 tensors joined
    with `torch.cat`, and every evict call rebuilds an LRU heap from a walk of
    the whole tree. Match and insert both align keys down to the page size.
    """

    def __init__(self, page_size: int, token_to_kv_pool_allocator: SlotAllocator) -> None:
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.page_size = page_size
        self.allocator = token_to_kv_pool_allocator
        self.root = Node([], torch.empty(0, dtype=torch.int64), None)
        self.root.lock_ref = 1  # the root is never evictable
        self._evictable = 0
        self._protected = 0

    # -- key helpers -------------------------------------------------------

    def _child_key(self, key: list[int]) -> Any:
        if self.page_size == 1:
            return key[0]
        return tuple(key[: self.page_size])

    def _match_len(self, a: list[int], b: list[int]) -> int:
        ps = self.page_size
        if ps == 1:
            n = 0
            for x, y in zip(a, b, strict=False):
                if x != y:
                    break
                n += 1
            return n
        limit = min(len(a), len(b))
        i = 0
        while i < limit and a[i : i + ps] == b[i : i + ps]:
            i += ps
        return min(i, limit - limit % ps)

    def _split(self, child: Node, at: int) -> Node:
        """Cut `child` at `at`; the new upper node takes the head and the lock count."""
        parent = child.parent
        assert parent is not None
        upper = Node(child.key[:at], child.value[:at].clone(), parent)
        upper.lock_ref = child.lock_ref
        child.key = child.key[at:]
        child.value = child.value[at:].clone()
        child.parent = upper
        upper.children[self._child_key(child.key)] = child
        parent.children[self._child_key(upper.key)] = upper
        return upper

    # -- the cache protocol ------------------------------------------------

    def match_prefix(self, key: list[int]) -> PlainMatch:
        key = key[: len(key) - len(key) % self.page_size]
        now = time.monotonic()
        node = self.root
        node.last_access_time = now
        values: list[torch.Tensor] = []
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access_time = now
            n = self._match_len(child.key, key)
            if n < len(child.key):
                node = self._split(child, n)
                values.append(node.value)
                break
            values.append(child.value)
            node = child
            key = key[n:]
        indices = torch.cat(values) if values else torch.empty(0, dtype=torch.int64)
        return PlainMatch(indices, node, len(indices))

    def insert(self, key: list[int], value: torch.Tensor) -> PlainInsert:
        aligned = len(key) - len(key) % self.page_size
        key, value = key[:aligned], value[:aligned]
        now = time.monotonic()
        node = self.root
        node.last_access_time = now
        done = 0
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access_time = now
            n = self._match_len(child.key, key)
            done += n
            key, value = key[n:], value[n:]
            node = self._split(child, n) if n < len(child.key) else child
        if key:
            leaf = Node(key, value.clone(), node)
            node.children[self._child_key(key)] = leaf
            self._evictable += len(key)
            node = leaf
        return PlainInsert(done, node)

    def inc_lock_ref(self, node: Node) -> None:
        while node is not self.root and node is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def dec_lock_ref(self, node: Node) -> None:
        while node is not self.root and node is not None:
            if node.lock_ref == 1:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node.lock_ref -= 1
            node = node.parent  # type: ignore[assignment]

    def _leaves(self) -> list[Node]:
        out = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root and node.lock_ref == 0:
                out.append(node)
        return out

    def evict(self, num_tokens: int) -> PlainEvict:
        heap = [(n.last_access_time, n.id, n) for n in self._leaves()]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            self.allocator.free(node.value)
            freed += len(node.value)
            parent = node.parent
            assert parent is not None
            del parent.children[self._child_key(node.key)]
            self._evictable -= len(node.key)
            node.value = None  # type: ignore[assignment]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        return PlainEvict(freed)

    # -- sizes -------------------------------------------------------------

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        total = 0
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            total += len(node.value)
            stack.extend(node.children.values())
        return total

    def check_integrity(self) -> None:
        """Recount sizes from the tree and check keys, values and links agree."""
        evictable = protected = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            for ck, child in node.children.items():
                if child.parent is not node or ck != self._child_key(child.key):
                    raise AssertionError(f"node {child.id}: bad parent link or child key")
                stack.append(child)
            if node is self.root:
                continue
            if len(node.key) != len(node.value) or not node.key:
                raise AssertionError(f"node {node.id}: key/value length mismatch")
            if node.lock_ref < 0:
                raise AssertionError(f"node {node.id}: negative lock_ref")
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        if (evictable, protected) != (self._evictable, self._protected):
            raise AssertionError(
                f"sizes: counted evictable={evictable} protected={protected}, "
                f"tracked {self._evictable}/{self._protected}"
            )
