"""SlotPrefixCache: a radix tree from token prefixes to the per-sequence KV slot that holds them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ..errors import InvalidInputError, LockError, check_count
from ..eviction import EvictionQueue, get_eviction_policy
from ..key import TOKEN_BYTES, RadixKey
from ..pools.slot_allocator import (
    KVCacheLike,
    SlotAllocator,
    StaleSlotError,
    copy_slot_kv,
    kv_layout,
)
from ..radix.radix_cache import common_prefix
from .slot_inspection import check_slot_cache
from .slot_tree import SlotNode, SlotTree

TokensLike = RadixKey | Sequence[Any] | torch.Tensor


class SlotMatch(NamedTuple):
    """The longest usable cached prefix: positions ``[0, prefix_len)`` of ``slot`` hold its
    KV for as long as the slot stays at ``version``. A miss is ``(0, None, None)``."""

    prefix_len: int
    slot: int | None
    version: int | None


MISS = SlotMatch(0, None, None)


class SlotInsertResult(NamedTuple):
    """``prefix_len`` tokens of the key were in the tree already; ``node`` is where the
    cached key ends (a handle to pin), None if pinned tokens left it no room; ``evicted``
    tokens went to get back within capacity."""

    prefix_len: int
    node: SlotNode | None
    evicted: int


class SlotPrefixCache(SlotTree):
    """Prefix cache for engines that keep one contiguous KV slot per sequence.

    A sequence's KV lives in ``k_cache[slot, position, layer, ...]``, so a cached prefix
    is a slot and a length: every node stores the ``(slot, version)`` whose positions
    ``[0, node.depth)`` hold its path. Slots belong to a ``SlotAllocator``, not to the
    cache: a freed slot's KV, and its entries, stay usable until the slot gets a new
    owner and its version moves on. Nobody tells the entries; every read checks the
    version, so a stale entry is skipped, never returned.

    * ``find`` returns the deepest usable entry on the key's path; a match may end
      inside a node (no split). Only the nodes that served it are touched, so stale
      ones age out of the LRU order.
    * ``insert(tokens, slot, version)`` writes the entry on every node of the path:
      stale ancestors are refreshed (the slot holds the whole path), and live ones
      too: the newest holder is likely freed last, so the FIFO free queue reuses it last.
      The version must be current (``StaleSlotError``); one slot version holds one
      sequence, so a key that contradicts what it holds is refused.
    * Capacity counts tokens in the tree (node key lengths, all namespaces), and the
      tree never holds more: a longer key is cached up to it, and after each insert
      whole unpinned leaves go in policy order (LRU by default), the new ones last. A
      node with pinned descendants is never such a leaf, and the queue is keyed by
      node ids from a process-wide counter, never by reusable ``id()``s.
    * Pins (``pin`` / ``release``, counted) keep a prefix in the tree. They cannot keep
      its KV: only the slot's owner does, by not freeing the slot.
    * ``copy_kv`` copies a cached prefix's K and V into another slot.

    A request: ``find`` -> if that slot is free, ``allocator.occupy`` it and reuse the
    prefix in place, else ``alloc`` a slot and ``copy_kv`` -> prefill the rest ->
    ``insert`` -> ``free`` when done. Keys are a ``RadixKey`` or tokens plus
    ``extra_key=``; each ``(extra_key, token width)`` is its own subtree. Without
    per-token indices this is not a ``BasePrefixCache``. Single-threaded.

    Args:
        allocator: the slot allocator whose versions decide what is usable.
        capacity: the most tokens the tree holds.
        max_seq_len: positions per slot; longer keys are refused (None: no limit).
        eviction_policy: name from ``EVICTION_POLICIES``.
    """

    def __init__(
        self,
        allocator: SlotAllocator,
        capacity: int,
        *,
        max_seq_len: int | None = None,
        eviction_policy: str = "lru",
    ) -> None:
        self.allocator = allocator
        self.capacity = check_count(capacity, "capacity", minimum=1)
        self.max_seq_len = (
            None if max_seq_len is None else check_count(max_seq_len, "max_seq_len", minimum=1)
        )
        self.eviction_policy = eviction_policy
        self._leaves = EvictionQueue(get_eviction_policy(eviction_policy))
        self.reset()

    def reset(self) -> None:
        """Forget every node (old handles become invalid). The allocator is untouched."""
        self.root_node = SlotNode(None, b"", None, -1, 0, 0)
        self._clock = 0
        self._evictable = self._protected = self._nodes = self._pins = 0
        # (slot, version) -> its deepest node. The nodes holding one pair always form a
        # chain ending there, which is what lets insert spot a contradicting key.
        self._tips: dict[tuple[int, int], SlotNode] = {}
        self._leaves.clear()

    def total_size(self) -> int:
        """Tokens in the tree."""
        return self._evictable + self._protected

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        """Tokens on a pinned path."""
        return self._protected

    def num_nodes(self) -> int:
        return self._nodes

    def num_pins(self) -> int:
        """Pins taken and not yet released."""
        return self._pins

    def find(self, tokens: TokensLike, *, extra_key: str | None = None) -> SlotMatch:
        """The longest prefix of ``tokens`` whose KV a current slot version holds."""
        path, match = self._lookup(self._key(tokens, extra_key))
        self._touch(path)
        return match

    def insert(
        self, tokens: TokensLike, slot: int, version: int, *, extra_key: str | None = None
    ) -> SlotInsertResult:
        """Record that ``slot`` at ``version`` holds the KV of ``tokens`` from position 0.

        Raises:
            StaleSlotError: ``version`` is not the slot's current version.
            SlotIndexError: ``slot`` is outside the pool.
            InvalidInputError: bad tokens, a key longer than ``max_seq_len``, or a key
                that contradicts what this slot version already holds. Nothing changes.
        """
        key = self._key(tokens, extra_key)
        slot = self.allocator.checked_slot(slot)
        version = check_count(version, "version")
        if not self.allocator.is_current(slot, version):
            raise StaleSlotError(
                f"slot {slot} is at version {self.allocator.version(slot)}, not {version}"
            )
        if self.max_seq_len is not None and len(key) > self.max_seq_len:
            raise InvalidInputError(
                f"{len(key)} tokens do not fit a slot of {self.max_seq_len} positions"
            )
        packed, width = key.packed()
        token_bytes = TOKEN_BYTES * width
        packed = packed[: self.capacity * token_bytes]
        if not packed:
            return SlotInsertResult(0, None, 0)
        self._check_consistent(key.extra_key, width, packed, slot, version)

        node, pos, path = self._namespace_root(key.extra_key, width), 0, []
        while pos < len(packed):
            child = node.children.get(packed[pos : pos + token_bytes])
            if child is None:
                break
            matched = common_prefix(child.key_bytes, packed, pos, len(packed), token_bytes)
            if matched < len(child.key_bytes):
                child = self._split(child, matched // token_bytes)
            path.append(child)
            pos += matched
            node = child
        prefix_len = pos // token_bytes
        for n in path:
            self._assign(n, slot, version)
        if pos < len(packed):
            self._leaves.discard(node)
            node = self._add_leaf(node, packed[pos:], slot, version)
            path.append(node)
        tip = self._tips.get((slot, version))
        if tip is not None and tip.depth > node.depth:
            # The key is a prefix of what the slot holds, so the slot holds the rest of
            # the way down to the tip as well; writing it there keeps the pair one chain.
            n = tip
            while n is not node:
                self._assign(n, slot, version)
                n = n.parent
        else:
            self._tips[(slot, version)] = node
        self._touch(path)
        evicted = self._shrink()
        return SlotInsertResult(prefix_len, None if node.evicted else node, evicted)

    def pin(
        self, target: SlotNode | TokensLike, *, extra_key: str | None = None
    ) -> SlotNode | None:
        """Keep a prefix in the tree until ``release``; pins on one node add up.

        ``target`` is a node handle, or tokens: then the prefix ``find`` would return is
        pinned (splitting a node so that the pinned one ends exactly there) and its node
        returned, None on a miss (nothing pinned). Read ``slot``, ``version`` and
        ``depth`` from the node.

        Raises:
            LockError: the node was evicted, or is not a node of this cache.
        """
        if isinstance(target, SlotNode):
            if extra_key is not None:
                raise InvalidInputError("extra_key goes with tokens, not with a node handle")
            self._check_member(target)
            node = target
        else:
            path, match = self._lookup(self._key(target, extra_key))
            if not match.prefix_len:
                return None
            self._touch(path)
            node = path[-1]
            if match.prefix_len < node.depth:
                node = self._split(node, node.key_len - (node.depth - match.prefix_len))
        node.own_lock_ref += 1
        self._pins += 1
        n = node
        while n.key_len:
            if n.lock_ref == 0:
                self._evictable -= n.key_len
                self._protected += n.key_len
                self._leaves.discard(n)
            n.lock_ref += 1
            n = n.parent
        return node

    def release(self, node: SlotNode) -> None:
        """Undo one ``pin`` of ``node``.

        Raises:
            LockError: ``node`` holds no pin of its own, was evicted, or is not a node
                of this cache. Nothing changes.
        """
        self._check_member(node)
        if node.own_lock_ref <= 0:
            raise LockError(f"release of node {node.id}, which holds no pin of its own")
        node.own_lock_ref -= 1
        self._pins -= 1
        n = node
        while n.key_len:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._evictable += n.key_len
                self._protected -= n.key_len
                if not n.children:
                    self._leaves.push(n)
            n = n.parent

    def evict(self, num_tokens: int) -> int:
        """Drop at least ``num_tokens`` tokens of unpinned leaves (whole leaves, so maybe
        more) if there are that many, and return how many went. Slots are untouched."""
        return self._evict(check_count(num_tokens, "num_tokens"))

    def copy_kv(
        self,
        tokens: TokensLike,
        target_slot: int,
        kv_cache: KVCacheLike,
        n_layers: int | None = None,
        *,
        extra_key: str | None = None,
    ) -> SlotMatch:
        """Copy the K and V of ``tokens``' longest usable cached prefix into ``target_slot``.

        ``kv_cache`` is one tensor ``[num_slots, max_seq_len, n_layers, ...]`` (K and V
        side by side in the trailing dims) or a ``(k_cache, v_cache)`` pair of them (see
        ``kv_layout``). Returns the source match; nothing is copied on a miss or when
        the source is ``target_slot`` itself.

        Raises:
            InvalidInputError: a bad layout or layer count, a prefix longer than the
                tensors' positions; ``target_slot`` is free (its old KV may still be
                cached) or its current version is cached (the copy would overwrite it).
                Nothing changes.
        """
        key = self._key(tokens, extra_key)
        target = self.allocator.checked_slot(target_slot)
        tensors, layers = kv_layout(kv_cache, self.allocator.max_slots, n_layers)
        if self.allocator.is_free(target):
            raise InvalidInputError(f"target slot {target} is free; allocate it first")
        path, match = self._lookup(key)
        if match.prefix_len > tensors[0].shape[1]:
            raise InvalidInputError(
                f"the cached prefix ({match.prefix_len} tokens) is longer "
                f"than kv_cache's {tensors[0].shape[1]} positions"
            )
        if match.slot != target and (target, self.allocator.version(target)) in self._tips:
            raise InvalidInputError(f"slot {target} holds cached KV that a copy would overwrite")
        self._touch(path)
        if match.slot is not None and match.slot != target:
            copy_slot_kv(tensors, match.slot, target, match.prefix_len, layers)
        return match

    def check_integrity(self) -> None:
        """Recompute sizes, pins, lock counts, depths, the eviction queue and the entry
        chains from the tree, and check the capacity bound.

        Raises:
            IntegrityError: naming every disagreement found.
        """
        check_slot_cache(self)

    def _key(self, tokens: TokensLike, extra_key: str | None) -> RadixKey:
        if isinstance(tokens, RadixKey):
            if extra_key is not None and extra_key != tokens.extra_key:
                raise InvalidInputError(
                    f"extra_key {extra_key!r} contradicts the key's {tokens.extra_key!r}"
                )
            key = tokens
        else:
            try:
                key = RadixKey(tokens, extra_key)
            except TypeError as exc:
                raise InvalidInputError(f"tokens must be a sequence: {exc}") from exc
        key.packed()  # validates every token before anything changes
        return key

    def _lookup(self, key: RadixKey) -> tuple[list[SlotNode], SlotMatch]:
        """The nodes ``key`` passes through down to the deepest usable one, and its match.

        The last node may match only in part (the match then ends inside it).
        """
        packed, width = key.packed()
        node = self.root_node.children.get((key.extra_key, width))
        if node is None:
            return [], MISS
        token_bytes, pos, end = TOKEN_BYTES * width, 0, len(packed)
        path: list[SlotNode] = []
        served, best = 0, MISS
        is_current = self.allocator.is_current
        while pos < end:
            child = node.children.get(packed[pos : pos + token_bytes])
            if child is None:
                break
            matched = common_prefix(child.key_bytes, packed, pos, end, token_bytes)
            pos += matched
            path.append(child)
            # A stale node does not end the walk: a deeper node may name a slot that
            # holds this part of the path as well.
            if is_current(child.slot, child.version):
                served, best = len(path), SlotMatch(pos // token_bytes, child.slot, child.version)
            if matched < len(child.key_bytes):
                break
            node = child
        return path[:served], best

    def _touch(self, path: list[SlotNode]) -> None:
        """Mark ``path`` (root-down) as used: a hit each, and the next clock ticks."""
        for node in path:
            self._clock += 1
            node.last_access_time = self._clock
            node.hit_count += 1
            self._leaves.refresh(node)

    def _check_consistent(
        self, extra_key: str | None, width: int, packed: bytes, slot: int, version: int
    ) -> None:
        """Refuse a key that disagrees with what ``(slot, version)`` is known to hold."""
        tip = self._tips.get((slot, version))
        if tip is None:
            return
        ns = tip.require_namespace()
        parts, n = [], tip
        while n.key_len:
            parts.append(n.key_bytes)
            n = n.parent
        held = b"".join(reversed(parts))
        if (ns.extra_key, ns.token_width) != (extra_key, width) or not (
            held.startswith(packed) or packed.startswith(held)
        ):
            raise InvalidInputError(
                f"slot {slot} at version {version} already holds a different sequence"
            )

    def _assign(self, node: SlotNode, slot: int, version: int) -> None:
        old = (node.slot, node.version)
        if old != (slot, version):
            # The pair's other nodes are this one's ancestors, which the same insert
            # rewrites, so if this was the pair's tip the pair leaves the tree.
            if self._tips.get(old) is node:
                del self._tips[old]
            node.slot, node.version = slot, version

    def _shrink(self) -> int:
        return self._evict(self.total_size() - self.capacity)

    def _check_member(self, node: object) -> None:
        if not isinstance(node, SlotNode):
            raise InvalidInputError(f"expected a SlotNode handle, got {type(node).__name__}")
        if node.evicted:
            raise LockError(f"node {node.id} has been evicted")
        if not node.key_len:
            raise LockError("a root cannot be pinned or released")
        top = node
        while top.key_len:
            top = top.parent
        if top.evicted or top.parent is not self.root_node:
            raise LockError("node does not belong to this cache (or predates a reset)")
