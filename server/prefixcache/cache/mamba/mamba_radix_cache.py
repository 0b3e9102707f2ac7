"""MambaRadixCache: a radix tree whose nodes hold full-attention KV and Mamba state slots."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..base import InsertResult, MatchResult, SlotFreer
from ..errors import InvalidInputError, check_count
from ..index.change_log import PageListener
from ..key import RadixKey
from ..node import Namespace, TreeNode
from ..pools.mamba_pool import to_index
from ..radix.radix_cache import RadixCache
from ..slot_values import joined_slots, owned_slots
from .mamba_eviction import MambaEviction
from .mamba_tree import (
    LRUList,
    MambaTreeNode,
    StatePool,
    as_mamba,
    check_mamba_cache,
    format_mamba_tree,
    new_root,
    split_node,
)


# evict's second positional argument is the state target (MambaEviction.evict).
class MambaRadixCache(MambaEviction, RadixCache):  # type: ignore[misc]
    """Prefix cache for hybrid (attention + Mamba) models, with the reference's API.

    Every node holds the full-attention KV of its tokens and may own one ``MambaPool``
    state slot: the recurrent state after its last token. A request can only resume
    where a state exists, so:

    * ``match_prefix`` answers the longest cached prefix that ends at a node with state,
      and ``mamba_branching_seqlen`` says how far the KV alone would have reached.
    * ``insert(key, value, mamba_value=slot)`` stores ``slot`` at the key's end.
      ``mamba_exist`` means the tree already had a state there and did not take
      ``slot``: the caller frees it. KV is as with ``RadixCache``: the tree keeps the
      slots of new tokens and the caller frees ``value[cache_protected_len:prefix_len]``.
    * ``inc_lock_ref`` locks full KV from the node to the root and the node's own state.
    * ``evict(num_tokens, mamba_num)`` first deletes unlocked leaves (freeing KV and
      state), then frees the state of unlocked nodes: an inner node becomes a tombstone,
      a leaf goes entirely.

    Eviction order comes from two intrusive LRU lists (``full_lru_list``: every node;
    ``mamba_lru_list``: nodes with state), in the order of a logical clock; the Mamba
    list is ordered by its own stamps. Recency follows SGLang's MambaRadixCache
    exactly (checked op for op against it on random traces):

    * insert makes each node it walks into the most recent as it reaches it, so
      deeper ranks newer, and a node that the insert splits ranks newer than the
      path above it; then a new leaf, an adopted state or the existing state at the
      key's end is the most recent of all. (Touching the whole path again at the end
      would rank a shared prefix's state above the deeper state that the split node
      keeps, so state pressure would tombstone the deeper one, KV included.)
    * match makes the node with the answered state and its ancestors the most
      recent in the full list, children ahead of parents, but in the Mamba list only
      the answered node itself; a node it splits ranks just below them. This follows
      SGLang as of 2026-07 (upstream ``8905cbd4``, ``mamba_radix_cache.py``,
      ``_match_post_processor``), not the reference (and SGLang before it), where match
      touches the node and its ancestors in both lists: a request resumes from one
      state, so only that state is used; the ancestors' states stay
      where they were and go first under state pressure, while their KV, which the
      match did use, stays recent. The Mamba list therefore keeps its own stamps
      (``mamba_access_time``) rather than being the full list less the tombstones.

    Where the reference differs we follow SGLang's MambaRadixCache (docs/semantics.md,
    departure 12):

    * a split leaves the state on the lower part and makes the upper part a tombstone
      with no Mamba lock (the reference slices one slot across both halves and copies
      the lock, which then never unlocks);
    * Mamba sizes and ``EvictResult.mamba_evicted`` count state slots only;
    * ``mamba_exist`` means "the final node already had state", not "any node did";
    * the Mamba phase deletes an unlocked leaf (and the tombstones above it) rather
      than leaving a tombstone leaf; tombstones never stay unlocked leaves;
    * match stops at the deepest node with state instead of answering KV past it.

    Beyond SGLang: a tombstone that gains state while locked takes a Mamba lock for
    each of its own locks (SGLang would fail the later unlock), and unlocking a
    tombstone left without children deletes it at once. (Locks and eviction:
    mamba_eviction.py.)

    Args:
        page_size: tokens per page; matches, inserts and splits are page-aligned.
        token_to_kv_pool_allocator: receives ``free`` for evicted KV slots, or None.
        mamba_pool: receives ``free_track_slot`` for evicted state slots (a
            ``MambaPool``), or None. A pool with ``is_track_slot_allocated`` also
            vets the slots that ``insert`` is given.
        on_node_evict: called with the id of each node removed from the tree.
        mamba_cache_chunk_size: ``mamba_branching_seqlen`` is rounded down to it.
        eviction_policy: only ``"lru"`` (the lists are the order).
        eager_page_hashes: as for ``RadixCache``.
        listener: as for ``RadixCache``; it hears of KV pages only (a Mamba tombstone
            keeps its KV, so dropping a state reports nothing unless the node goes).
    """

    _retains = False  # its eviction has rules of its own

    def __init__(
        self,
        page_size: int = 1,
        token_to_kv_pool_allocator: SlotFreer | None = None,
        mamba_pool: StatePool | None = None,
        on_node_evict: Callable[[int], None] | None = None,
        *,
        mamba_cache_chunk_size: int = 1,
        eviction_policy: str = "lru",
        eager_page_hashes: bool = False,
        listener: PageListener | None = None,
    ) -> None:
        if eviction_policy != "lru":
            raise InvalidInputError(
                f"MambaRadixCache evicts in LRU order only, not {eviction_policy!r}"
            )
        if mamba_pool is not None and not callable(getattr(mamba_pool, "free_track_slot", None)):
            raise InvalidInputError("mamba_pool needs free_track_slot (e.g. a MambaPool)")
        self.mamba_pool = mamba_pool
        self.mamba_cache_chunk_size = check_count(
            mamba_cache_chunk_size, "mamba_cache_chunk_size", 1
        )
        super().__init__(
            page_size,
            None,
            token_to_kv_pool_allocator,
            on_node_evict,
            eager_page_hashes=eager_page_hashes,
            listener=listener,
        )

    def reset(self) -> None:
        """Forget every node. No slot is freed: clear the allocator and pool alongside."""
        super().reset()  # its eviction queue (``_leaves``) stays empty: the lists rule here
        self.root_node = new_root(None, None, self._empty(), self._clock)
        self._mamba_evictable = 0
        self._mamba_protected = 0
        self._state_owner: dict[int, MambaTreeNode] = {}
        self.full_lru_list = LRUList("full_prev", "full_next")
        self.mamba_lru_list = LRUList("mamba_prev", "mamba_next", "mamba_access_time")

    def full_evictable_size(self) -> int:  # SGLang's name
        return self._evictable

    def full_protected_size(self) -> int:  # SGLang's name
        return self._protected

    def mamba_evictable_size(self) -> int:
        """State slots held by nodes without a Mamba lock."""
        return self._mamba_evictable

    def mamba_protected_size(self) -> int:
        """State slots held by Mamba-locked nodes."""
        return self._mamba_protected

    def mamba_total_size(self) -> int:
        return self._mamba_evictable + self._mamba_protected

    def match_prefix(self, key: RadixKey) -> MatchResult:
        """Longest cached page-aligned prefix of ``key`` that ends at a node with state.

        The walk goes as far as the KV reaches (splitting the node it stops inside, as
        ``RadixCache`` does) and the answer is cut back to the deepest node with state;
        ``mamba_branching_seqlen`` is then the walked length rounded down to
        ``mamba_cache_chunk_size``, where a state snapshot would have saved recomputing,
        or None when the walk went no further than the answer. Only the answered path
        is touched and counted as a hit.
        """
        packed, width, token_bytes, page_bytes, end = self._aligned(key)
        ns_root = self.root_node.children.get((key.extra_key, width))
        if ns_root is None or end == 0:
            return MatchResult(self._empty(), self.root_node, 0)

        node, pos = ns_root, 0
        values: list[torch.Tensor] = []
        best = (0, 0, ns_root)  # values kept, bytes matched, last node
        while pos < end:
            step = self._descend(node, packed, pos, end, page_bytes, touch=False)
            if step is None:
                break
            child, covered = step[0], as_mamba(step[1])
            values.append(covered.value)
            pos += len(covered.key_bytes)
            node = covered
            if covered.mamba_value is not None:
                best = (len(values), pos, covered)
            if covered is not child:
                break

        kept, best_pos, best_node = best
        chunk = self.mamba_cache_chunk_size
        branch = pos // token_bytes // chunk * chunk
        branching = branch if branch * token_bytes > best_pos else None
        if best_pos == 0:
            return MatchResult(self._empty(), self.root_node, 0, branching)
        self._touch_path(best_node, hit=True)
        return MatchResult(
            joined_slots(values[:kept], self.device), best_node, best_pos // token_bytes, branching
        )

    # Takes the state slot where RadixCache.insert takes the SWA options (which a
    # hybrid cache has no use for).
    def insert(  # type: ignore[override]
        self,
        key: RadixKey,
        value: torch.Tensor | None = None,
        *,
        mamba_value: int | torch.Tensor | None = None,
    ) -> InsertResult:
        """Cache ``key``'s KV slots ``value`` and the state slot ``mamba_value`` at its end.

        ``prefix_len`` tokens were already cached: their slots in ``value``, like the
        unaligned tail, stay the caller's. ``last_node`` is the node where the key ends.
        If the tree already had a state there, ``mamba_exist`` is True and the caller
        keeps (and frees) ``mamba_value``; otherwise the tree owns it now (a tombstone
        there adopts it). An empty key answers ``mamba_exist=True`` at the root.

        Raises:
            InvalidInputError: bad ``value`` or ``mamba_value``; ``mamba_value`` for a
                key with an unaligned tail (the state would not belong to any node); a
                state slot the tree already holds, or that ``mamba_pool`` has not handed
                out; or no ``mamba_value`` although part of the key is not cached yet (a
                leaf without state could never be matched). Nothing changes then.
        """
        packed, width, token_bytes, page_bytes, end = self._aligned(key)
        num_tokens = end // token_bytes
        value = self._checked_value(key, value, num_tokens)
        slot = self._checked_state(mamba_value, end != len(packed))
        if slot is None and len(self.peek_prefix(key)) < num_tokens:
            raise InvalidInputError(
                "insert of tokens that are not cached yet needs the "
                "state after them: pass mamba_value"
            )
        if end == 0:
            return InsertResult(0, self.root_node, mamba_exist=True)

        node, pos = self._namespace_root(key.extra_key, width), 0
        while pos < end:
            # Each node walked into becomes the most recent as the walk reaches it (so a
            # child ranks newer than its parent, and a node split here newer than the
            # path above it), as SGLang's insert does; see the class docstring.
            step = self._descend(node, packed, pos, end, page_bytes)
            if step is None:
                break
            child, covered = step[0], as_mamba(step[1])
            pos += len(covered.key_bytes)
            node = covered
            if covered is not child:
                break
        prefix_len = pos // token_bytes
        mamba_exist = False
        if pos < end:
            node = self._add_leaf(node, packed[pos:end], value[prefix_len:num_tokens], slot)
        elif node.mamba_value is not None:
            mamba_exist = True  # the last node walked: already the most recent
        elif slot is not None:
            self._touch(node)
            self._give_state(node, slot)
        return InsertResult(prefix_len, node, mamba_exist)

    def pretty_print(self) -> None:
        """Print the tree, one node a line, with locks, state slots and first tokens."""
        print(format_mamba_tree(self))

    def check_integrity(self) -> None:
        """Recompute everything from the tree; ``IntegrityError`` names any mismatch."""
        check_mamba_cache(self)

    def _checked_state(self, mamba_value: int | torch.Tensor | None, unaligned: bool) -> int | None:
        """The state slot in ``mamba_value``, vetted, or None."""
        if mamba_value is None:
            return None
        slot = to_index(mamba_value, "mamba_value")
        if unaligned:
            raise InvalidInputError(
                f"mamba_value is the state after the whole key, so the "
                f"key must be whole pages of {self.page_size} tokens"
            )
        owner = self._state_owner.get(slot)
        if owner is not None:
            raise InvalidInputError(f"state slot {slot} already belongs to node {owner.id}")
        is_allocated = getattr(self.mamba_pool, "is_track_slot_allocated", None)
        if is_allocated is not None and not is_allocated(slot):
            raise InvalidInputError(
                f"state slot {slot} is not a track slot handed out by the Mamba pool"
            )
        return slot

    def _give_state(self, node: MambaTreeNode, slot: int) -> None:
        """Attach ``slot`` to ``node``, which must be the most recently used node."""
        node.mamba_value = torch.tensor([slot], dtype=torch.int64)
        # Every lock the node holds on itself covers its state too, so each later
        # unlock finds the Mamba lock it releases.
        node.mamba_lock_ref = node.own_lock_ref
        if node.mamba_lock_ref:
            self._mamba_protected += 1
        else:
            self._mamba_evictable += 1
        self._state_owner[slot] = node
        node.mamba_access_time = self._clock
        self.mamba_lru_list.push_mru(node)

    def _touch(self, tree_node: TreeNode) -> None:
        """Make ``node`` alone the most recently used."""
        node = as_mamba(tree_node)
        self._clock += 1
        node.last_access_time = node.mamba_access_time = self._clock
        for lru in (self.full_lru_list, self.mamba_lru_list):
            if node in lru:
                lru.move_to_mru(node)

    def _touch_path(self, node: MambaTreeNode, hit: bool = False) -> None:
        """A match's refresh: ``node`` and its ancestors become the most recently used
        in the full list (ancestors older), ``node`` alone in the Mamba list (SGLang's
        ``_match_post_processor``; see the class docstring)."""
        path = []
        n = node
        while n.key_len:
            path.append(n)
            n = n.parent
        for n in reversed(path):
            self._clock += 1
            n.last_access_time = self._clock
            if hit:
                n.hit_count += 1
        self.full_lru_list.touch_node_and_parents_mru(node)
        if node in self.mamba_lru_list:
            node.mamba_access_time = node.last_access_time
            self.mamba_lru_list.move_to_mru(node)

    def _namespace_root(self, extra_key: str | None, width: int) -> MambaTreeNode:
        ns_root = self.root_node.children.get((extra_key, width))
        if ns_root is None:
            ns = Namespace(extra_key, width, self.page_size)
            ns_root = new_root(ns, self.root_node, self._empty(), self._clock)
            self.root_node.children[(extra_key, width)] = ns_root
        return ns_root

    def _add_leaf(
        self, parent: TreeNode, key_bytes: bytes, value: torch.Tensor, slot: int | None = None
    ) -> MambaTreeNode:
        parent = as_mamba(parent)
        ns = parent.require_namespace()
        if slot is None:  # insert refuses this first; a leaf without state is unmatchable
            raise InvalidInputError("a new leaf needs the state after it: pass mamba_value")
        self._clock += 1
        leaf = MambaTreeNode(
            ns, key_bytes, owned_slots(value, 0, value.shape[0]), parent, self._clock
        )
        parent.children[key_bytes[: ns.page_bytes]] = leaf
        self._evictable += leaf.key_len
        self.full_lru_list.push_mru(leaf)
        self._give_state(leaf, slot)
        if self.eager_page_hashes:
            self.compute_node_hash(leaf)
        if self.listener is not None:
            self.listener.pages_stored(leaf)
        return leaf

    def _split(self, child: TreeNode, split_len: int) -> MambaTreeNode:
        """Cut ``child`` after ``split_len`` tokens; the new upper node is returned.

        The lower part keeps the node object, id, own locks and state (the state after
        its last token, which did not move); the upper part is a tombstone, since a
        slot cannot be shared, with no Mamba lock (see ``split_node``).
        """
        self._clock += 1
        upper = split_node(as_mamba(child), split_len, self.page_size, self._clock)
        self.full_lru_list.push_mru(upper)
        self._touch(child)  # the lower part ranks more recent, as a child should
        return upper
