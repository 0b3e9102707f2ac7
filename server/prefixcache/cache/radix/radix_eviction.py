"""Lock references and eviction of a RadixCache: which nodes may go, and taking them out.

A lock on a node protects it and every ancestor; the lock counts move tokens between
the evictable and protected sizes and nodes in and out of the eviction queue.
Eviction takes unlocked leaves from that queue, shows each to ``before_free`` (its
slots still hold its KV), frees their slots and tells the listener and
``on_node_evict``. ``RadixCache`` (radix_cache.py) mixes this in; the
SWA and Mamba caches override parts of it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..base import EvictResult, SlotFreer
from ..errors import CacheError, IntegrityError, LockError, check_count
from ..eviction import EvictionQueue
from ..index.change_log import PageListener
from ..node import NO_SLOTS, TreeNode
from ..retention import RetentionBook


class RadixEviction:
    """Mixin of ``RadixCache``: ``evict``, ``inc_lock_ref`` and ``dec_lock_ref``."""

    # Set by RadixCache.__init__ and reset before any of these run.
    root_node: TreeNode
    token_to_kv_pool_allocator: SlotFreer | None
    on_node_evict: Callable[[int], None] | None
    listener: PageListener | None
    _leaves: EvictionQueue[TreeNode]
    _evictable: int
    _protected: int
    _gone_nodes: list[TreeNode]
    retention: RetentionBook | None
    # Told of each node as it leaves the tree (its key and parents still readable), to
    # remember evicted pages (page_ids.EvictionRecorder); must be cheap and not raise.
    eviction_observer: Callable[[TreeNode], None] | None = None
    # Told of each node that eviction takes, with its slots, while it is still in the
    # tree (its namespace, key and hash_values readable) and before the slots go back
    # to the allocator, so their rows still hold the node's KV: a write-back tier
    # copies them out here. Runs inside the eviction, so it must be quick; whatever it
    # raises is counted in ``before_free_errors`` and the eviction goes on.
    before_free: Callable[[TreeNode, torch.Tensor], None] | None = None
    before_free_errors = 0

    def evict(self, num_tokens: int, swa_num_tokens: int = 0) -> EvictResult:
        """Free at least ``num_tokens`` tokens (whole leaves, so possibly more) if possible.

        ``swa_evicted`` mirrors ``full_evicted`` here, as in the reference.

        Raises:
            CacheError: the allocator refused some slots (ones it never handed out or
                the caller freed behind the tree). The evicted nodes stay evicted, the
                other slots are freed and ``on_node_evict`` fires for every node, so
                cache and allocator still agree (as in every cache kind's ``evict``).
        """
        if type(num_tokens) is not int or num_tokens < 0:  # plain ints skip the coercion
            check_count(num_tokens, "num_tokens")
        if type(swa_num_tokens) is not int or swa_num_tokens < 0:
            check_count(swa_num_tokens, "swa_num_tokens")
        if self.retention is not None:  # a lapsed retention ranks its node anew first
            self.retention.lapse_due()
        evicted, freed, gone = 0, [], []
        before_free = self.before_free
        while evicted < num_tokens:
            node = self._leaves.pop()
            if node is None:
                break
            if before_free is not None:
                try:
                    before_free(node, node.value)
                except Exception:  # a hook's failure must not leave the tree half evicted
                    self.before_free_errors += 1
            freed.append(node.value)
            gone.append(node.id)
            evicted += node.key_len
            parent = node.parent
            self._delete_leaf(node)
            if parent.key_len and not parent.children and not parent.lock_ref:
                self._leaves.push(parent)
        try:
            self._free(freed)
        finally:  # the nodes are out of the tree even if the allocator refused
            self._notify_evicted(gone)
        return EvictResult(full_evicted=evicted, swa_evicted=evicted)

    def inc_lock_ref(self, node: TreeNode | None) -> int | None:
        """Protect ``node`` and its ancestors from eviction until ``dec_lock_ref(node)``."""
        if node is not None:
            path = self._path_to_root(node)
            if path:
                self._lock_path(path)
        return None

    def dec_lock_ref(self, node: TreeNode | None, swa_boundary_id: int | None = None) -> None:
        """Release one ``inc_lock_ref(node)``.

        Raises:
            LockError: ``node`` holds no lock of its own, was evicted, or is not in this
                cache. Nothing changes in that case.
        """
        if node is not None:
            path = self._path_to_root(node)
            if path:
                self._check_unlock(path)
                self._unlock_path(path)

    def _lock_path(self, path: list[TreeNode]) -> None:
        path[0].own_lock_ref += 1
        for n in path:
            if n.lock_ref == 0:
                self._evictable -= n.key_len
                self._protected += n.key_len
                self._leaves.discard(n)
            n.lock_ref += 1

    def _check_unlock(self, path: list[TreeNode]) -> None:
        if path[0].own_lock_ref <= 0:
            raise LockError(f"unlock of node {path[0].id}, which holds no lock of its own")

    def _unlock_path(self, path: list[TreeNode]) -> None:
        path[0].own_lock_ref -= 1
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._evictable += n.key_len
                self._protected -= n.key_len
                if not n.children:
                    self._leaves.push(n)

    def _delete_leaf(self, node: TreeNode) -> None:
        """Detach an unlocked leaf (its slots are the caller's to free)."""
        ns = node.namespace
        if ns is None or node.children or node.lock_ref:  # only an unlocked leaf may go
            raise IntegrityError(f"node {node.id} is not an unlocked leaf; it cannot be deleted")
        if node.retain_priority and self.retention is not None:
            self.retention.forget(node)
        parent = node.parent
        del parent.children[node.key_bytes[: ns.page_bytes]]
        self._evictable -= node.key_len
        node.evicted = True
        node.value = NO_SLOTS
        if self.listener is not None:  # told in _notify_evicted, with on_node_evict
            self._gone_nodes.append(node)
        if self.eviction_observer is not None:
            self.eviction_observer(node)
        if parent.key_len == 0 and not parent.children:
            self._drop_namespace(parent)

    def _drop_namespace(self, ns_root: TreeNode) -> None:
        """Forget an empty namespace, so a flood of one-off extra keys costs nothing."""
        ns = ns_root.namespace
        if ns is not None:
            del self.root_node.children[(ns.extra_key, ns.token_width)]
            ns_root.evicted = True

    def _free(
        self, values: list[torch.Tensor], free: Callable[[torch.Tensor], None] | None = None
    ) -> None:
        """Give the allocator (``free``, by default its ``free``) the slots of ``values``.

        One call frees them all: the allocator's ``free_parts`` where it has one (no
        joined copy of the slots), else ``free`` of their concatenation. If the
        allocator refuses it (a ``CacheError``: slots it does not count as handed out,
        which only a caller that freed or never allocated the tree's slots can cause),
        each part is freed on its own, so only the refused parts are not, and the
        first refusal is raised. A refused free changes nothing in our allocators, so
        retrying the rest frees no slot twice.
        """
        allocator = self.token_to_kv_pool_allocator
        if allocator is None or not values:
            return
        free_parts = getattr(allocator, "free_parts", None) if free is None else None
        free = free or allocator.free
        try:
            if len(values) == 1:
                free(values[0])
            elif free_parts is not None:
                free_parts(values)
            else:
                free(torch.cat(values))
            return
        except CacheError:
            if len(values) == 1:
                raise
        refused: CacheError | None = None
        for part in values:
            try:
                free(part)
            except CacheError as exc:
                refused = refused or exc
        if refused is not None:
            raise refused

    def _notify_evicted(self, node_ids: list[int]) -> None:
        listener = self.listener
        if self._gone_nodes and listener is not None:  # only a listener collects them
            gone, self._gone_nodes = self._gone_nodes, []
            for node in gone:
                listener.pages_removed(node)
        if self.on_node_evict is not None:
            for node_id in node_ids:
                self.on_node_evict(node_id)

    def _path_to_root(self, node: TreeNode) -> list[TreeNode]:
        """``node`` and its ancestors below the root, after checking it belongs here."""
        if node.evicted:
            raise LockError(f"node {node.id} has been evicted")
        path = []
        while node.key_len:
            path.append(node)
            node = node.parent
        if node is not self.root_node and (node.evicted or node.parent is not self.root_node):
            raise LockError("node does not belong to this cache (or predates a reset)")
        return path
