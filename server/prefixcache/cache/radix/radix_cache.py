"""RadixCache: an SGLang-style radix tree from namespaced token prefixes to KV-pool slots."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import ClassVar

import torch

from ..base import BasePrefixCache, InsertResult, MatchResult, SlotFreer
from ..errors import CacheError, IntegrityError, InvalidInputError
from ..eviction import EvictionQueue, Priority, Retaining, get_eviction_policy
from ..hashing import hash_pages
from ..index.change_log import PageListener
from ..inspection import check_radix_cache, format_tree, walk
from ..key import RadixKey
from ..node import Namespace, TreeNode
from ..retention import RetainResult, RetentionBook
from ..slot_values import empty_slots, joined_slots, owned_slots
from .radix_eviction import RadixEviction

_INT_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})


def common_prefix(key: bytes, query: bytes, pos: int, end: int, page_bytes: int) -> int:
    """Bytes of ``key`` equal to ``query[pos:end]``, in whole pages.

    The caller has already matched the first page (it found ``key``'s node by it), so the
    answer is at least one page. Pages are compared with memcmp, halving the range.
    """
    limit = min(len(key), end - pos)
    if query.startswith(key[:limit], pos):
        return limit
    lo, hi = page_bytes, limit  # key[:lo] matches, key[:hi] does not
    while hi - lo > page_bytes:
        mid = lo + (hi - lo) // page_bytes // 2 * page_bytes
        if query.startswith(key[lo:mid], pos + lo):
            lo = mid
        else:
            hi = mid
    return lo


class RadixCache(RadixEviction, BasePrefixCache):
    """Prefix cache over a token-slot allocator, with the reference's ``RadixCache`` API.

    Keys are page-aligned on both match and insert: the unaligned tail of an inserted
    key is not cached and its slots stay the caller's. Each ``(extra_key, token width)``
    pair is its own subtree under the root, so namespaces never alias.

    Insert does not free the slots it did not need (the part of ``value`` already in the
    tree, ``value[cache_protected_len:prefix_len]``); the caller frees them, as with
    SGLang's RadixCache. SWA mode frees them itself (see ``SWARadixCache``).

    Eviction takes whole unlocked leaves in policy order (``"lru"`` by default) from a
    queue kept up to date on every change, so ``evict`` never scans the tree; a parent
    left childless and unlocked is a candidate in the same call (locks and eviction:
    radix_eviction.py). ``last_access_time`` is a logical clock: every touch gets the
    next tick, parents before children.

    With ``sliding_window_size`` set, constructing a ``RadixCache`` gives an
    ``SWARadixCache``, which keeps this signature.

    Retention (``retain``; retention.py): a retained prefix is evicted after unretained
    ones while its retention lasts, and every touch renews it. This class alone keeps
    retentions; its SWA and Mamba subclasses evict by their own rules and refuse them.

    Args:
        page_size: tokens per page; matches, inserts and splits are page-aligned.
        sliding_window_size: SWA window in tokens, or None for full attention.
        token_to_kv_pool_allocator: receives ``free`` (and ``free_swa``) for evicted
            slots; may be None for a tree without a pool.
        on_node_evict: called with the id of each node removed from the tree.
        eviction_policy: name from ``EVICTION_POLICIES``.
        eager_page_hashes: compute each new node's chained SHA-256 page hashes at insert
            (needed for KV events). Off by default because it costs about a microsecond
            a page; ``compute_node_hash`` still hashes on demand, root-down, either way.
        listener: told of every change to the cached page set (a ``ChangeLog``; see
            change_log.py for the protocol). Attaching one turns on eager hashes.
        clock: seconds (monotonic) for retentions.
    """

    # The class a RadixCache with a sliding window is built as: SWARadixCache, which
    # names itself with ``class SWARadixCache(RadixCache, windowed=True)``. It subclasses
    # this class, so this module cannot import it; the package's __init__ loads it.
    _windowed: ClassVar[type[RadixCache] | None] = None
    # Whether this kind keeps retentions (its eviction ranks them).
    _retains: ClassVar[bool] = True

    def __init_subclass__(cls, *, windowed: bool = False, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if windowed:
            RadixCache._windowed = cls

    def __new__(
        cls,
        page_size: int = 1,
        sliding_window_size: int | None = None,
        *args: object,
        **kwargs: object,
    ) -> RadixCache:
        if cls is RadixCache and sliding_window_size is not None:
            if RadixCache._windowed is None:  # prefixcache.cache is still loading
                raise CacheError("SWARadixCache is not loaded yet: import prefixcache.cache")
            return super().__new__(RadixCache._windowed)
        return super().__new__(cls)

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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(page_size, int) or page_size < 1:
            raise InvalidInputError(f"page_size must be an int >= 1, got {page_size!r}")
        self.page_size = page_size
        self.sliding_window_size = sliding_window_size
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.on_node_evict = on_node_evict
        self.device = torch.device(getattr(token_to_kv_pool_allocator, "device", None) or "cpu")
        # A listener reports page hashes as nodes come and go, so they must exist then.
        self.listener = listener
        self.eager_page_hashes = eager_page_hashes or listener is not None
        self.eviction_policy = eviction_policy
        policy: Priority = get_eviction_policy(eviction_policy)
        if self._retains:
            policy = Retaining(policy, clock)
        self._leaves = EvictionQueue(policy)
        self.retention = RetentionBook(clock, self._leaves.refresh) if self._retains else None
        self.reset()

    def reset(self) -> None:
        """Forget every node. Slots are not freed: clear the allocator alongside."""
        self.root_node = TreeNode(value=self._empty())
        self.root_node.lock_ref = self.root_node.swa_lock_ref = 1
        self._clock = 0
        self._evictable = 0
        self._protected = 0
        self._leaves.clear()
        if self.retention is not None:
            self.retention.clear()
        self._gone_nodes: list[TreeNode] = []  # deleted, not yet told to the listener
        if self.listener is not None:
            self.listener.cleared(self)

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def match_prefix(self, key: RadixKey) -> MatchResult:
        """Longest cached page-aligned prefix of ``key`` in its namespace.

        Splits the last node if the match ends inside it (the split stays). Touches the
        matched path for eviction order and counts a hit on each node.
        """
        packed, width, token_bytes, page_bytes, end = self._aligned(key)
        ns_root = self.root_node.children.get((key.extra_key, width))
        if ns_root is None or end == 0:
            return MatchResult(self._empty(), self.root_node, 0)

        self._touch_roots(ns_root)
        node, pos, values = ns_root, 0, []
        while pos < end:
            step = self._descend(node, packed, pos, end, page_bytes, hit=True)
            if step is None:
                break
            child, covered = step
            values.append(covered.value)
            pos += len(covered.key_bytes)
            node = covered
            if covered is not child:
                break
        if not pos:  # a namespace root is internal; a miss ends at the real root
            return MatchResult(self._empty(), self.root_node, 0)
        return MatchResult(joined_slots(values, self.device), node, pos // token_bytes)

    def peek_prefix(self, key: RadixKey) -> torch.Tensor:
        """Full-KV slots of the longest cached page-aligned prefix of ``key``, read-only.

        Unlike ``match_prefix`` it neither splits, touches nor counts a hit, and it
        ignores the SWA window: it answers "which slots would ``insert`` find already in
        the tree", so a caller can validate an insert before making it.
        """
        packed, width, token_bytes, page_bytes, end = self._aligned(key)
        node = self.root_node.children.get((key.extra_key, width))
        pos, values = 0, []
        while node is not None and pos < end:
            child = node.children.get(packed[pos : pos + page_bytes])
            if child is None:
                break
            if packed.startswith(child.key_bytes, pos):
                values.append(child.value)
                pos += len(child.key_bytes)
            else:
                matched = common_prefix(child.key_bytes, packed, pos, end, page_bytes)
                values.append(child.value[: matched // token_bytes])
                break
            node = child
        return joined_slots(values, self.device)

    def peek_node(self, key: RadixKey) -> tuple[TreeNode, int]:
        """The deepest node whose whole path is a prefix of ``key``, and that path's
        length in tokens (the root and 0 when there is none), read-only as
        ``peek_prefix``: no split, touch or hit."""
        packed, width, token_bytes, page_bytes, end = self._aligned(key)
        node = self.root_node.children.get((key.extra_key, width))
        pos, last = 0, self.root_node
        while node is not None and pos < end:
            child = node.children.get(packed[pos : pos + page_bytes])
            if (
                child is None
                or len(child.key_bytes) > end - pos
                or not packed.startswith(child.key_bytes, pos)
            ):
                break
            pos += len(child.key_bytes)
            node = last = child
        return last, pos // token_bytes

    def insert(
        self,
        key: RadixKey,
        value: torch.Tensor | None = None,
        *,
        prev_prefix_len: int = 0,
        swa_evicted_seqlen: int = 0,
    ) -> InsertResult:
        """Cache ``key``'s page-aligned part with slots ``value``.

        Nodes already in the tree keep their slots; ``prefix_len`` says how many tokens
        were there, and the caller still owns (and frees) ``value`` for those and for
        the unaligned tail. ``prev_prefix_len`` and ``swa_evicted_seqlen`` only matter
        in SWA mode. ``last_node`` is the node where the key ends. ``value=None``
        stores the token ids as slots, which only a cache without an allocator allows.
        """
        packed, width, token_bytes, page_bytes, end = self._aligned(key)
        value = self._checked_value(key, value, end // token_bytes)
        if end == 0:
            return InsertResult(0, self.root_node)

        ns_root = self._namespace_root(key.extra_key, width)
        self._touch_roots(ns_root)
        node, pos = ns_root, 0
        while pos < end:
            step = self._descend(node, packed, pos, end, page_bytes)
            if step is None:
                break
            child, covered = step
            pos += len(covered.key_bytes)
            node = covered
            if covered is not child:
                break
        prefix_len = pos // token_bytes
        if pos < end:
            self._leaves.discard(node)
            stop = end // token_bytes
            # The whole value when it is exactly the new part (a miss): no slice view.
            run = value if prefix_len == 0 and value.shape[0] == stop else value[prefix_len:stop]
            node = self._add_leaf(node, packed[pos:end], run)
        return InsertResult(prefix_len, node)

    def retain(
        self,
        node: TreeNode,
        seconds: float,
        priority: int,
        owner: Hashable = None,
        limit: int | None = None,
    ) -> RetainResult:
        """Retain the prefix ending at ``node`` for ``seconds`` (renewed by every touch)
        at ``priority`` (1 to 99), counted against ``owner``, whose retained tokens may
        not pass ``limit``; ``seconds`` 0 ends ``owner``'s retention of it. The rules,
        and what is clipped past the limit, are retention.py's.

        Raises:
            InvalidInputError: a bad hint, or a cache kind that keeps no retentions.
            LockError: ``node`` is evicted or not in this cache.
        """
        if self.retention is None:
            raise InvalidInputError(f"{type(self).__name__} keeps no retentions")
        path = self._path_to_root(node)
        path.reverse()
        return self.retention.retain(path, seconds, priority, owner, limit, self._cut)

    def _cut(self, node: TreeNode, tokens: int) -> TreeNode | None:
        """The upper part of ``node`` with the whole pages of ``tokens``, split off for
        a clipped retention; the lower part keeps its recency (a hint is no use)."""
        keep = tokens - tokens % self.page_size
        if keep <= 0:
            return None
        when = node.last_access_time
        upper = self._split(node, keep)
        node.last_access_time = when
        self._leaves.refresh(node)
        return upper

    def retained_tokens(self) -> int:
        """Tokens whose retention has not been found lapsed (all owners)."""
        return self.retention.retained_tokens() if self.retention is not None else 0

    def compute_node_hash(self, node: TreeNode) -> list[str]:
        """The node's chained page hashes, computing any missing ones root-down first."""
        if node.key_len == 0:
            return []
        pending = []
        top = node
        while top.key_len and top.hash_values is None:
            pending.append(top)
            top = top.parent
        prior = bytes.fromhex(top.hash_values[-1]) if top.key_len and top.hash_values else None
        for n in reversed(pending):
            n.hash_values = hash_pages(n.key_bytes, n.require_namespace().page_bytes, prior)
            prior = bytes.fromhex(n.hash_values[-1])
        return node.hash_values or []

    def pretty_print(self) -> None:
        """Print the tree, one node a line, with lengths, locks and the first tokens."""
        print(format_tree(self))

    def check_integrity(self) -> None:
        """Recompute sizes, locks, eviction candidates and slot ownership from the tree.

        Raises:
            IntegrityError: naming every disagreement found.
        """
        check_radix_cache(self)
        if self.retention is not None:
            problems = self.retention.problems(
                node for ns_root in self.root_node.children.values() for node, _ in walk(ns_root)
            )
            if problems:
                raise IntegrityError("; ".join(problems[:12]))

    def _aligned(self, key: RadixKey) -> tuple[bytes, int, int, int, int]:
        """``key`` packed: its bytes, token width, bytes per token and per page, and the
        end of its last whole page (in bytes)."""
        packed, width = key.packed()
        token_bytes = 4 * width
        page_bytes = token_bytes * self.page_size
        return packed, width, token_bytes, page_bytes, len(packed) - len(packed) % page_bytes

    def _descend(
        self,
        node: TreeNode,
        packed: bytes,
        pos: int,
        end: int,
        page_bytes: int,
        touch: bool = True,
        hit: bool = False,
    ) -> tuple[TreeNode, TreeNode] | None:
        """Follow ``packed[pos:end]`` one edge down from ``node``.

        Returns ``(child, covered)``, or None if no child starts with the next page: the
        child the key enters and the node covering the part that matched, which is the
        child itself, or its new upper part when the key parts from it inside (split at
        a page boundary). ``hit`` counts a hit on ``covered``, before the touch ranks
        it anew (a policy may rank by hits).
        """
        child = node.children.get(packed[pos : pos + page_bytes])
        if child is None:
            return None
        if packed.startswith(child.key_bytes, pos):
            if hit:
                child.hit_count += 1
            if touch:
                self._touch(child)
            return child, child
        if touch:
            self._touch(child)
        matched = common_prefix(child.key_bytes, packed, pos, end, page_bytes)
        upper = self._split(child, matched // child.require_namespace().token_bytes)
        if hit:
            upper.hit_count += 1
        return child, upper

    def _touch(self, node: TreeNode) -> None:
        """Make ``node`` the most recently used (the next clock tick)."""
        self._clock += 1
        node.last_access_time = self._clock
        if node.retain_priority and self.retention is not None:
            self.retention.renew(node)
        self._leaves.refresh(node)

    def _touch_roots(self, ns_root: TreeNode) -> None:
        self._clock += 1
        self.root_node.last_access_time = ns_root.last_access_time = self._clock

    def _empty(self) -> torch.Tensor:
        return empty_slots(self.device)

    def _namespace_root(self, extra_key: str | None, width: int) -> TreeNode:
        ns_root = self.root_node.children.get((extra_key, width))
        if ns_root is None:
            ns = Namespace(extra_key, width, self.page_size)
            ns_root = TreeNode(ns, b"", self._empty(), self.root_node, self._clock)
            ns_root.lock_ref = ns_root.swa_lock_ref = 1
            self.root_node.children[(extra_key, width)] = ns_root
        return ns_root

    def _checked_value(self, key: RadixKey, value: object, num_tokens: int) -> torch.Tensor:
        """``value`` (a tensor, or any sequence of slots) as a 1-D integer tensor with a
        slot for each of ``num_tokens`` tokens."""
        if value is None:
            if self.token_to_kv_pool_allocator is not None:
                # The token ids would be stored as slots the allocator never handed
                # out, and a later eviction would free them.
                raise InvalidInputError(
                    "value=None is only for a cache without an "
                    "allocator: pass the slots of the key's tokens"
                )
            if key.token_width != 1:
                raise InvalidInputError("value=None needs int tokens; pass slots for tuple keys")
            return torch.tensor(list(key.token_ids[:num_tokens]), dtype=torch.int64)
        slots = (
            value if isinstance(value, torch.Tensor) else torch.as_tensor(value, dtype=torch.int64)
        )
        # A set lookup settles the usual dtypes; the tensor queries cost ~0.3 µs each.
        if slots.dim() != 1 or (
            slots.dtype not in _INT_DTYPES
            and (slots.is_floating_point() or slots.is_complex() or slots.dtype == torch.bool)
        ):
            raise InvalidInputError(
                f"value must be a 1-D integer tensor, got {slots.dtype} "
                f"of shape {tuple(slots.shape)}"
            )
        if slots.shape[0] < num_tokens:
            raise InvalidInputError(f"value has {len(slots)} slots for {num_tokens} tokens")
        return slots

    def _add_leaf(self, parent: TreeNode, key_bytes: bytes, value: torch.Tensor) -> TreeNode:
        ns = parent.require_namespace()
        self._clock += 1
        leaf = TreeNode(ns, key_bytes, owned_slots(value, 0, value.shape[0]), parent, self._clock)
        parent.children[key_bytes[: ns.page_bytes]] = leaf
        self._evictable += leaf.key_len
        self._leaves.push(leaf)
        if self.eager_page_hashes:
            self.compute_node_hash(leaf)
        if self.listener is not None:
            self.listener.pages_stored(leaf)
        return leaf

    def _split(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut ``child`` after ``split_len`` tokens; the new upper node is returned.

        The lower part keeps the node object and id (so a handle to the sequence end
        stays valid); the upper part copies the lock counts, since every lock through
        the child also covers it, and takes the SWA boundary so an unlock walking up
        still passes it. The hit count is copied too: the upper part was hit as often.
        """
        ns = child.require_namespace()
        cut = split_len * ns.token_bytes
        parent = child.parent
        upper = TreeNode(
            ns,
            child.key_bytes[:cut],
            owned_slots(child.value, 0, split_len),
            parent,
            child.last_access_time,
        )
        upper.lock_ref = child.lock_ref
        upper.swa_lock_ref = child.swa_lock_ref
        upper.swa_tombstone = child.swa_tombstone
        upper.hit_count = child.hit_count
        if child.retain_priority and self.retention is not None:
            self.retention.split(upper, child)
        upper.swa_boundary_id, child.swa_boundary_id = child.swa_boundary_id, None
        if child.hash_values is not None:
            pages = split_len // self.page_size
            upper.hash_values, child.hash_values = (
                child.hash_values[:pages],
                child.hash_values[pages:],
            )
        child.key_bytes = child.key_bytes[cut:]
        child.key_len -= split_len
        child.value = owned_slots(child.value, split_len, child.value.shape[0])
        parent.children[upper.key_bytes[: ns.page_bytes]] = upper
        upper.children[child.key_bytes[: ns.page_bytes]] = child
        child.parent = upper
        # The lower part ranks as more recent than the upper part, so a policy that may
        # take inner nodes (SWA tombstoning) frees the older end of a sequence first.
        self._clock += 1
        child.last_access_time = self._clock
        self._leaves.refresh(child)
        self._after_split(upper, child)
        return upper

    def _after_split(self, upper: TreeNode, lower: TreeNode) -> None:
        """Hook for subclasses that rank internal nodes too."""
