"""Locks and eviction of a MambaRadixCache: KV and state slots leaving the tree.

Phase 1 of ``evict`` deletes unlocked leaves (KV and state), phase 2 frees states
alone (inner nodes become tombstones); a lock covers the KV path to the root and the
node's own state. ``MambaRadixCache`` (mamba_radix_cache.py) mixes this in ahead of
``RadixCache``, whose lock walk and slot freeing (radix_eviction.py) it reuses.
"""

from __future__ import annotations

import torch

from ..base import EvictResult
from ..errors import CacheError, IntegrityError, check_count
from ..node import TreeNode
from ..radix.radix_eviction import RadixEviction
from .mamba_tree import LRUList, MambaTreeNode, StatePool, as_mamba


class MambaEviction(RadixEviction):
    """Mixin of ``MambaRadixCache``: ``evict``, ``inc_lock_ref`` and ``dec_lock_ref``."""

    # Set by MambaRadixCache.__init__ and reset before any of these run.
    root_node: MambaTreeNode
    mamba_pool: StatePool | None
    full_lru_list: LRUList
    mamba_lru_list: LRUList
    _mamba_evictable: int
    _mamba_protected: int
    _state_owner: dict[int, MambaTreeNode]

    # The second positional argument is the state target here, not the SWA one: the
    # reference's hybrid cache reads it so, and callers of a hybrid cache pass it so.
    def evict(  # type: ignore[override]
        self,
        num_tokens: int,
        mamba_num: int = 0,
        *,
        swa_num_tokens: int = 0,
    ) -> EvictResult:
        """Free at least ``num_tokens`` KV tokens and ``mamba_num`` state slots if possible.

        Phase 1 deletes unlocked leaves in LRU order (with any tombstones left childless
        above them), freeing their KV and state, while fewer than ``num_tokens`` tokens
        are freed. Phase 2 frees the state of nodes without a Mamba lock in LRU order
        while fewer than ``mamba_num`` slots are freed in all (phase 1's count too):
        inner nodes become tombstones, leaves are deleted. Both may overshoot by the
        last node taken. ``swa_num_tokens`` is accepted for the common signature and
        ignored: there is no SWA KV here.
        """
        check_count(num_tokens, "num_tokens")
        check_count(mamba_num, "mamba_num")
        check_count(swa_num_tokens, "swa_num_tokens")
        freed: list[torch.Tensor] = []
        states: list[int] = []
        gone: list[int] = []
        tokens = 0

        def delete(leaf: MambaTreeNode) -> MambaTreeNode:
            nonlocal tokens
            count, parent = self._delete_chain(leaf, freed, states, gone)
            tokens += count
            return parent  # a new leaf, perhaps

        def drop_state(node: MambaTreeNode) -> None:
            # No node becomes a candidate here: the scan passed only Mamba-locked nodes,
            # and deleting a leaf takes no lock away.
            if node.children:
                states.append(self._take_state(node))
            else:
                delete(node)

        if num_tokens:
            self.full_lru_list.take_lru(_unlocked_leaf, delete, lambda: tokens < num_tokens)
        self.mamba_lru_list.take_lru(_no_mamba_lock, drop_state, lambda: len(states) < mamba_num)
        try:
            self._free(freed)
        finally:  # the nodes and states are out of the tree even if a free was refused
            try:
                self._free_states(states)
            finally:
                self._notify_evicted(gone)
        return EvictResult(full_evicted=tokens, mamba_evicted=len(states))

    def _delete_chain(
        self, leaf: MambaTreeNode, freed: list[torch.Tensor], states: list[int], gone: list[int]
    ) -> tuple[int, MambaTreeNode]:
        """Delete an unlocked leaf and every unlocked tombstone it leaves childless.

        Returns the tokens deleted and the first node that stays.
        """
        node, tokens = leaf, 0
        while True:
            if node.mamba_value is not None:
                states.append(self._take_state(node))
            tokens += node.key_len
            freed.append(node.value)
            gone.append(node.id)
            self.full_lru_list.remove(node)
            parent = node.parent
            self._delete_leaf(node)
            if (
                not parent.key_len
                or parent.children
                or parent.lock_ref
                or parent.mamba_value is not None
            ):
                return tokens, parent
            node = parent

    def inc_lock_ref(self, node: TreeNode | None) -> None:
        """Protect ``node``'s KV and its ancestors', and ``node``'s own state, until
        ``dec_lock_ref(node)``. Ancestors' states stay evictable (they become
        tombstones, which keep their KV)."""
        if node is not None:
            path = self._path_to_root(node)
            if path:
                mamba = as_mamba(node)
                self._lock_path(path)
                if mamba.mamba_value is not None:
                    if not mamba.mamba_lock_ref:
                        self._mamba_evictable -= 1
                        self._mamba_protected += 1
                    mamba.mamba_lock_ref += 1
        return None

    def dec_lock_ref(self, node: TreeNode | None, swa_boundary_id: int | None = None) -> None:
        """Release one ``inc_lock_ref(node)`` (``swa_boundary_id`` is ignored).

        Raises:
            LockError: ``node`` holds no lock of its own, was evicted, or is not in this
                cache. Nothing changes in that case.
        """
        if node is None:
            return
        path = self._path_to_root(node)
        if not path:
            return
        mamba = as_mamba(node)
        self._check_unlock(path)
        self._unlock_path(path)
        if mamba.mamba_value is not None:
            mamba.mamba_lock_ref -= 1
            if not mamba.mamba_lock_ref:
                self._mamba_protected -= 1
                self._mamba_evictable += 1
        elif not mamba.children and not mamba.lock_ref:
            # A tombstone whose children went while it was locked: no match can end
            # there (no state) or pass it (no children), so free it now.
            freed: list[torch.Tensor] = []
            gone: list[int] = []
            self._delete_chain(mamba, freed, [], gone)
            try:
                self._free(freed)
            finally:
                self._notify_evicted(gone)

    def _unlock_path(self, path: list[TreeNode]) -> None:
        # As RadixCache's, less its eviction queue: the LRU lists hold every node.
        path[0].own_lock_ref -= 1
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._evictable += n.key_len
                self._protected -= n.key_len

    def _take_state(self, node: MambaTreeNode) -> int:
        """Detach an unlocked node's state slot (for freeing) and return it."""
        if node.mamba_value is None or node.mamba_lock_ref:
            raise IntegrityError(f"node {node.id}'s state is gone or locked; it cannot be taken")
        slot = int(node.mamba_value[0])
        self.mamba_lru_list.remove(node)
        del self._state_owner[slot]
        node.mamba_value = None
        self._mamba_evictable -= 1
        return slot

    def _free_states(self, slots: list[int]) -> None:
        """Free every slot the pool accepts; then raise the first refusal, if any."""
        if self.mamba_pool is None:
            return
        refused: CacheError | None = None
        for slot in slots:
            try:
                self.mamba_pool.free_track_slot(slot)
            except CacheError as exc:
                refused = refused or exc
        if refused is not None:
            raise refused


def _unlocked_leaf(node: MambaTreeNode) -> bool:
    return not node.lock_ref and not node.children


def _no_mamba_lock(node: MambaTreeNode) -> bool:
    return node.mamba_value is not None and not node.mamba_lock_ref
