"""SWARadixCache: the radix cache for sliding-window attention, with SWA tombstones."""

from __future__ import annotations

from collections.abc import Callable
from itertools import count

import torch

from ..base import EvictResult, InsertResult, MatchResult, SlotFreer
from ..errors import InvalidInputError, LockError, check_count
from ..eviction import EvictionQueue, get_eviction_policy
from ..index.change_log import PageListener
from ..key import RadixKey
from ..node import TreeNode
from ..slot_values import joined_slots, owned_slots
from .radix_cache import RadixCache


class SWARadixCache(RadixCache, windowed=True):
    """Radix cache whose nodes hold full-attention KV and, unless tombstoned, SWA KV.

    Follows SGLang's ``SWARadixCache`` where the reference's SWA mode differs
    (docs/semantics.md, departure 11):

    * insert continues from the upper half after a split (B1), stores nothing for a
      tail whose SWA KV is all gone (B2), revives the fresh part of a partly
      SWA-evicted tombstone by splitting it (B3), and frees only ``value`` from
      ``prev_prefix_len`` on (B4);
    * a deleted leaf takes every childless unlocked tombstone above it along, in both
      eviction phases, and a tombstone counts nothing toward ``swa_evicted``;
    * match refreshes the matched path's recency;
    * the allocator must have ``free_swa`` (no silent fallback to ``free``).

    Insert owns ``value[prev_prefix_len:aligned_len]``: every slot there is either
    stored in the tree or freed. Unlike SGLang, a tombstone that is full-locked is not
    revived (the incoming slots are freed instead), so an unlock always finds the SWA
    locks its lock took. Locking skips tombstones inside the window rather than failing,
    and unlocking a tombstone left without children frees it at once.

    A ``listener`` hears of full-attention KV pages: a tombstone keeps its full KV, so
    tombstoning reports nothing, and reviving one stores no new page either.
    """

    _retains = False  # its eviction has rules of its own

    def __init__(
        self,
        page_size: int = 1,
        sliding_window_size: int | None = None,
        token_to_kv_pool_allocator: SlotFreer | None = None,
        on_node_evict: Callable[[int], None] | None = None,
        *,
        eviction_policy: str = "lru",
        eager_page_hashes: bool = False,
        listener: PageListener | None = None,
    ) -> None:
        if not isinstance(sliding_window_size, int) or sliding_window_size < 1:
            raise InvalidInputError(
                f"sliding_window_size must be an int >= 1, got {sliding_window_size!r}"
            )
        free_swa = getattr(token_to_kv_pool_allocator, "free_swa", None)
        if token_to_kv_pool_allocator is not None and not callable(free_swa):
            raise InvalidInputError(
                "SWA mode needs an allocator with free_swa (e.g. SWATokenToKVPoolAllocator)"
            )
        self._free_swa: Callable[[torch.Tensor], None] | None = free_swa
        self._window = sliding_window_size
        self._windows: EvictionQueue[TreeNode] = EvictionQueue(get_eviction_policy(eviction_policy))
        self._boundary_ids = count(1)
        super().__init__(
            page_size,
            sliding_window_size,
            token_to_kv_pool_allocator,
            on_node_evict,
            eviction_policy=eviction_policy,
            eager_page_hashes=eager_page_hashes,
            listener=listener,
        )

    def reset(self) -> None:
        super().reset()
        self._swa_evictable = 0
        self._swa_protected = 0
        self._windows.clear()

    def swa_evictable_size(self) -> int:
        return self._swa_evictable

    def swa_protected_size(self) -> int:
        return self._swa_protected

    def match_prefix(self, key: RadixKey) -> MatchResult:
        """Longest cached prefix whose last ``sliding_window_size`` tokens have SWA KV.

        The walk goes as deep as the tree allows (splitting as it goes), but the answer
        ends either with no tombstone on the path or at least a window of live tokens
        after the last one. Only the answered path is touched.
        """
        packed, width, token_bytes, page_bytes, end = self._aligned(key)
        ns_root = self.root_node.children.get((key.extra_key, width))
        if ns_root is None or end == 0:
            return MatchResult(self._empty(), self.root_node, 0)

        window = self._window
        node, pos = ns_root, 0
        values: list[torch.Tensor] = []
        since_tombstone = float("inf")
        best = (0, 0, ns_root)  # values kept, bytes matched, last node
        while pos < end:
            step = self._descend(node, packed, pos, end, page_bytes, touch=False)
            if step is None:
                break
            child, covered = step
            if child.swa_tombstone:
                if since_tombstone >= window:
                    best = (len(values), pos, node)
                since_tombstone = 0
            node = covered
            pos += len(covered.key_bytes)
            values.append(covered.value)
            if not covered.swa_tombstone:
                since_tombstone += covered.key_len
            if covered is not child:
                break
        if since_tombstone >= window:
            best = (len(values), pos, node)

        kept, pos, node = best
        self._touch_path(node)
        if pos == 0:
            return MatchResult(self._empty(), self.root_node, 0)
        return MatchResult(joined_slots(values[:kept], self.device), node, pos // token_bytes)

    def insert(
        self,
        key: RadixKey,
        value: torch.Tensor | None = None,
        *,
        prev_prefix_len: int = 0,
        swa_evicted_seqlen: int = 0,
    ) -> InsertResult:
        """Cache ``key`` with full-KV slots ``value``, freeing what the tree does not keep.

        Args:
            prev_prefix_len: tokens of ``value`` that came from the tree (the caller's
                earlier match); they are neither stored again nor freed.
            swa_evicted_seqlen: the request's SWA KV before this position was already
                freed; those tokens enter as tombstones. Page-aligned (or past the
                key's last page), else InvalidInputError.
        """
        check_count(prev_prefix_len, "prev_prefix_len")
        check_count(swa_evicted_seqlen, "swa_evicted_seqlen")
        packed, width, token_bytes, page_bytes, end = self._aligned(key)
        num_tokens = end // token_bytes
        value = self._checked_value(key, value, num_tokens)
        if swa_evicted_seqlen % self.page_size and swa_evicted_seqlen < num_tokens:
            # Rounding either way would tombstone live SWA KV or keep freed KV live.
            raise InvalidInputError(
                f"swa_evicted_seqlen {swa_evicted_seqlen} is not a "
                f"multiple of the page size {self.page_size}"
            )
        if end == 0:
            return InsertResult(0, self.root_node)
        swa_evicted = min(swa_evicted_seqlen, num_tokens)

        ns_root = self._namespace_root(key.extra_key, width)
        self._touch_roots(ns_root)
        node, pos, off = ns_root, 0, 0
        freed: list[torch.Tensor] = []
        while pos < end:
            step = self._descend(node, packed, pos, end, page_bytes)
            if step is None:
                break
            child, covered = step
            node, size = covered, covered.key_len
            if prev_prefix_len < off + size:
                node = self._take_incoming(node, value, off, prev_prefix_len, swa_evicted, freed)
            pos += size * token_bytes
            off += size
            if covered is not child:
                break

        prefix_len = off
        if off < num_tokens:
            if swa_evicted >= num_tokens:
                freed.append(value[off:num_tokens])
            else:
                self._leaves.discard(node)
                if swa_evicted > off:
                    cut = swa_evicted - off
                    node = self._add_leaf(
                        node,
                        packed[pos : pos + cut * token_bytes],
                        value[off:swa_evicted],
                        tombstone=True,
                    )
                    self._leaves.discard(node)
                    pos, off = pos + cut * token_bytes, swa_evicted
                node = self._add_leaf(node, packed[pos:end], value[off:num_tokens])
        if not ns_root.children:  # nothing was stored in a new namespace
            self._drop_namespace(ns_root)
        self._free(freed)
        return InsertResult(prefix_len, node if node.key_len else self.root_node)

    def _take_incoming(
        self,
        node: TreeNode,
        value: torch.Tensor,
        off: int,
        prev_prefix_len: int,
        swa_evicted: int,
        freed: list[torch.Tensor],
    ) -> TreeNode:
        """Settle the incoming slots for a matched node that lies past ``prev_prefix_len``.

        Returns the node covering the end of the matched segment.
        """
        size = node.key_len
        start = max(0, prev_prefix_len - off)
        if not node.swa_tombstone or start or node.lock_ref or swa_evicted >= off + size:
            freed.append(value[off + start : off + size])  # duplicates of live tree KV
            return node
        if swa_evicted > off:  # only the tail is fresh: split, revive the lower part
            cut = swa_evicted - off
            self._split(node, cut)
            freed.append(value[off : off + cut])
            off, size = off + cut, size - cut
        freed.append(node.value)  # the tombstone's stale full KV
        node.value = owned_slots(value, off, off + size)
        node.swa_tombstone = False
        self._swa_evictable += node.key_len
        self._windows.push(node)
        return node

    def evict(self, num_tokens: int, swa_num_tokens: int = 0) -> EvictResult:
        """Free full KV (whole unlocked leaves) and then SWA KV (tombstoning inner nodes).

        Phase 1 runs while fewer than ``num_tokens`` full tokens are freed; phase 2 while
        fewer than ``swa_num_tokens`` SWA tokens are (phase 1's leaves count toward it).
        """
        check_count(num_tokens, "num_tokens")
        check_count(swa_num_tokens, "swa_num_tokens")
        full = swa = 0
        freed_full: list[torch.Tensor] = []
        freed_swa: list[torch.Tensor] = []
        gone: list[int] = []
        while full < num_tokens:
            node = self._leaves.pop()
            if node is None:
                break
            f, s = self._delete_subtree_end(node, freed_full, gone)
            full, swa = full + f, swa + s
        while swa < swa_num_tokens:
            node = self._windows.pop()
            if node is None:
                break
            if node.children or node.lock_ref:
                freed_swa.append(node.value)
                swa += node.key_len
                self._swa_evictable -= node.key_len
                node.swa_tombstone = True
            else:
                self._leaves.discard(node)
                f, s = self._delete_subtree_end(node, freed_full, gone)
                full, swa = full + f, swa + s
        try:
            if self._free_swa is not None and freed_swa:
                self._free(freed_swa, self._free_swa)  # before free: a node may be in both
        finally:  # the nodes are tombstoned or gone even if the allocator refused
            try:
                self._free(freed_full)
            finally:
                self._notify_evicted(gone)
        return EvictResult(full_evicted=full, swa_evicted=swa)

    def _delete_subtree_end(
        self, leaf: TreeNode, freed: list[torch.Tensor], gone: list[int]
    ) -> tuple[int, int]:
        """Delete an unlocked leaf and every childless unlocked tombstone above it."""
        full = swa = 0
        node = leaf
        while True:
            full += node.key_len
            if not node.swa_tombstone:
                swa += node.key_len
                self._swa_evictable -= node.key_len
                self._windows.discard(node)
            freed.append(node.value)
            gone.append(node.id)
            parent = node.parent
            self._delete_leaf(node)
            if not parent.key_len or parent.children or parent.lock_ref:
                break
            if not parent.swa_tombstone:
                self._leaves.push(parent)
                break
            self._leaves.discard(parent)
            node = parent
        return full, swa

    def inc_lock_ref(self, node: TreeNode | None) -> int | None:
        """Lock full KV up to the root and SWA KV over the last window of tokens.

        Returns the boundary id to pass to ``dec_lock_ref``, or None if the path is
        shorter than the window (then SWA is locked all the way up).
        """
        if node is None:
            return None
        path = self._path_to_root(node)
        if not path:
            return None
        self._lock_path(path)
        window, covered, boundary = self._window, 0, None
        for n in path:
            if not n.swa_tombstone:
                if n.swa_lock_ref == 0:
                    self._swa_evictable -= n.key_len
                    self._swa_protected += n.key_len
                    self._windows.discard(n)
                n.swa_lock_ref += 1
            covered += n.key_len
            if covered >= window:
                if n.swa_boundary_id is None:
                    n.swa_boundary_id = next(self._boundary_ids)
                boundary = n.swa_boundary_id
                break
        return boundary

    def dec_lock_ref(self, node: TreeNode | None, swa_boundary_id: int | None = None) -> None:
        """Release one ``inc_lock_ref(node)``, SWA up to the node with ``swa_boundary_id``.

        Raises:
            LockError: unbalanced unlock, unknown boundary, or evicted node; nothing
                changes then.
        """
        if node is None:
            return
        path = self._path_to_root(node)
        if not path:
            return
        self._check_unlock(path)
        windowed = []
        for n in path:
            if not n.swa_tombstone:
                if n.swa_lock_ref <= 0:
                    raise LockError(f"unlock of node {node.id}: node {n.id} holds no SWA lock")
                windowed.append(n)
            if swa_boundary_id is not None and n.swa_boundary_id == swa_boundary_id:
                break
        else:
            if swa_boundary_id is not None:
                raise LockError(f"SWA boundary {swa_boundary_id} is not on node {node.id}'s path")
        self._unlock_path(path)
        for n in windowed:
            n.swa_lock_ref -= 1
            if n.swa_lock_ref == 0:
                self._swa_evictable += n.key_len
                self._swa_protected -= n.key_len
                self._windows.push(n)
        if node.swa_tombstone and not node.children and not node.lock_ref:
            # A tombstone that lost its children while locked is now a leaf whose full
            # KV no match can reach (no window after it): free it rather than keep it.
            freed: list[torch.Tensor] = []
            gone: list[int] = []
            self._leaves.discard(node)
            self._delete_subtree_end(node, freed, gone)
            try:
                self._free(freed)
            finally:
                self._notify_evicted(gone)

    def _touch(self, node: TreeNode) -> None:
        super()._touch(node)
        self._windows.refresh(node)

    def _touch_path(self, node: TreeNode) -> None:
        """Refresh ``node`` and its ancestors, parents ranking older than children."""
        path = []
        while node.key_len:
            path.append(node)
            node = node.parent
        for n in reversed(path):
            n.hit_count += 1
            self._touch(n)

    def _add_leaf(
        self, parent: TreeNode, key_bytes: bytes, value: torch.Tensor, tombstone: bool = False
    ) -> TreeNode:
        leaf = super()._add_leaf(parent, key_bytes, value)
        if tombstone:
            leaf.swa_tombstone = True
        else:
            self._swa_evictable += leaf.key_len
            self._windows.push(leaf)
        return leaf

    def _after_split(self, upper: TreeNode, lower: TreeNode) -> None:
        if not upper.swa_tombstone and not upper.swa_lock_ref:
            self._windows.push(upper)
            self._windows.refresh(lower)
