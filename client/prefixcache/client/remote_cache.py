"""RemoteRadixCache: the in-process ``BasePrefixCache`` API over the service.

Serving code written for ``prefixcache.cache.RadixCache`` and its
``TokenToKVPoolAllocator`` runs against one model of the sidecar unchanged::

    cache = RemoteRadixCache(client, "llama")
    allocator = cache.token_to_kv_pool_allocator        # a RemoteAllocator
    hit = cache.match_prefix(key)
    cache.inc_lock_ref(hit.last_node)
    slots = torch.cat([hit.indices, allocator.alloc(need)])
    done = cache.insert(key, slots)
    allocator.free(slots[hit.prefix_len:done.prefix_len])   # see RemoteAllocator.free
    cache.dec_lock_ref(hit.last_node)

torch and ``prefixcache.cache`` are imported inside the methods that need them, never
when this module loads. The class is registered as a virtual subclass of
``BasePrefixCache`` on first use, so ``isinstance(cache, BasePrefixCache)`` holds.

Differences from the in-process cache, all forced by the cache living elsewhere:

* Slots come from the service: the allocator is a ``RemoteAllocator`` backed by
  Alloc / Free in the cache's session, and ``insert`` needs a ``value``.
* The tree is shared with other workers: sizes are the service's, and another
  worker may cache or evict entries between two calls.
* ``on_node_evict`` is not called (the service does not stream evictions yet).
* The service may restart: a node handle from before is dropped (locking and
  unlocking it do nothing; ``stale_dropped`` counts them), and the session is
  replaced on the next ``match_prefix`` (see ``ClientSession``). Slots handed out
  before the restart are gone with the old pool: use ``client.on_restart`` to
  recompute the requests that were in flight.
* Errors with an in-process counterpart are raised as that class (``LockError``,
  ``DoubleFreeError``, ``InvalidInputError``), chained from the client error; the
  rest (Unavailable, ...) are the client's typed errors.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._wire import as_tensor, pack_slots, pack_tokens
from .errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from .results import ModelStats
from .session import ClientSession
from .sync import PrefixCacheClient

_registered = False


def register_base() -> None:
    """Make RemoteRadixCache a virtual subclass of ``BasePrefixCache`` (imports it)."""
    global _registered
    if not _registered:
        from prefixcache.cache import BasePrefixCache

        BasePrefixCache.register(RemoteRadixCache)
        _registered = True


def _cache_errors() -> Any:
    import prefixcache.cache as cache

    return cache


@dataclass(frozen=True, slots=True)
class RemoteNode:
    """A handle to a node of the service's tree (0 is the root: nothing matched), and
    the epoch of the service that handed it out (0: not known)."""

    node_id: int
    server_epoch: int = 0

    @property
    def id(self) -> int:
        return self.node_id


class RemoteRadixCache:
    """``BasePrefixCache`` over one radix model of a prefix-cache service.

    Args:
        client: a ``PrefixCacheClient``, or a target to make one (with ``client_kwargs``).
        model: the hosted model; its cache kind must be ``radix``.
        session: the session that holds this cache's locks and slots; by default the
            cache opens its own (leased, renewed in the background) and closes it in
            ``close()``.
        ttl: the lease of that session.
        device: where ``match_prefix`` indices and allocated slots are put.
    """

    def __init__(self, client: PrefixCacheClient | str | Path, model: str, *,
                 session: ClientSession | None = None, ttl: float | None = None,
                 device: Any = "cpu", **client_kwargs: Any) -> None:
        register_base()
        self._owns_client = not isinstance(client, PrefixCacheClient)
        self.client = PrefixCacheClient(client, **client_kwargs) \
            if not isinstance(client, PrefixCacheClient) else client
        self.model = model
        try:
            info = self.client.list_models()[model]
        except KeyError:
            raise NotFound(f"model {model!r} is not hosted by {self.client.target}") from None
        if info.cache_kind != "radix":
            raise InvalidArgument(f"RemoteRadixCache needs a radix model; {model!r} is "
                                  f"{info.cache_kind} (use PrefixCacheClient directly)")
        self.page_size = info.page_size
        self.sliding_window_size = None
        self.on_node_evict = None
        self.pool_size = info.pool_size
        import torch

        self.device = torch.device(device)
        self._owns_session = session is None
        self.session = session if session is not None else self.client.session(
            ttl, name=f"RemoteRadixCache:{model}")
        self.root_node = RemoteNode(0)
        # node id -> lock ids this cache took on it, most recent last.
        self._locks: dict[int, list[int]] = {}
        # Node handles from before a restart that lock calls dropped.
        self.stale_dropped = 0
        self.token_to_kv_pool_allocator = RemoteAllocator(self)

    def __repr__(self) -> str:
        return f"RemoteRadixCache({self.client.target!r}, {self.model!r})"

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close the session this cache opened (releasing its locks and slots)."""
        if self._owns_session:
            self.session.close()
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> RemoteRadixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reset(self) -> None:
        """Drop the model's whole cache on the service (admin token needed): every
        entry, and every lock and allocation of every session."""
        self.client.reset(self.model)
        self._locks.clear()
        self.token_to_kv_pool_allocator._server_freed.clear()

    # ---------------------------------------------------------- the contract

    def match_prefix(self, key: Any) -> Any:
        """Longest cached page-aligned prefix of ``key`` (a RadixKey, or token ids)."""
        from prefixcache.cache import MatchResult

        reply = self.session.match(self.model, key)
        node = RemoteNode(reply.node_id, reply.server_epoch) if reply.node_id \
            else self.root_node
        return MatchResult(as_tensor(reply.slots, self.device), node, reply.prefix_len,
                           reply.mamba_branching_seqlen)

    def insert(self, key: Any, value: Any = None, **kwargs: Any) -> Any:
        """Cache ``key``'s page-aligned part with slots ``value``.

        As in-process, ``prefix_len`` says how many tokens were cached already and the
        caller frees ``value[hit_len:prefix_len]`` and the unaligned tail. The service
        has in fact freed the former itself (it owns the pool); the cache's
        ``RemoteAllocator`` remembers them and skips them when the caller frees them.
        ``prev_prefix_len`` and other SWA keywords are accepted and ignored.
        """
        from prefixcache.cache import InsertResult

        errors = _cache_errors()
        if value is None:
            raise errors.InvalidInputError(
                "RemoteRadixCache.insert needs value: slots come from the service's pool")
        data, width = pack_tokens(key)
        n = len(data) // (4 * width)
        slots = pack_slots(value)
        have = len(slots) // 8
        aligned = n - n % self.page_size
        if have < aligned:
            raise errors.InvalidInputError(f"value has {have} slots for {aligned} tokens")
        if have < n:  # in-process only reads the aligned part; the service wants 1:1
            n = have
            data = data[: n * 4 * width]
        slots = slots[: n * 8]
        try:
            reply = self.session.insert(self.model, data, slots, token_width=width,
                                        extra_key=getattr(key, "extra_key", None))
        except (InvalidArgument, FailedPrecondition) as err:
            raise errors.InvalidInputError(str(err)) from err
        self.token_to_kv_pool_allocator._server_freed.update(reply.freed)
        node = RemoteNode(reply.node_id, reply.server_epoch) if reply.node_id \
            else self.root_node
        return InsertResult(reply.prefix_len, node, reply.state_exist)

    def evict(self, num_tokens: int, swa_num_tokens: int = 0) -> Any:
        """Free at least ``num_tokens`` unlocked tokens on the service (whole leaves)."""
        from prefixcache.cache import EvictResult

        n, swa = _count(num_tokens, "num_tokens"), _count(swa_num_tokens, "swa_num_tokens")
        reply = self.client.evict(self.model, n, swa_num_tokens=swa)
        return EvictResult(reply.evicted_tokens, reply.swa_evicted_tokens, reply.mamba_evicted)

    def inc_lock_ref(self, node: RemoteNode | None) -> None:
        """Lock ``node`` (and its ancestors) on the service for this cache's session."""
        if node is None or not node.node_id or self._stale(node):
            return None
        try:
            reply = self.session.lock(self.model, node.node_id,
                                      server_epoch=node.server_epoch or None)
        except NotFound as err:
            raise _cache_errors().LockError(f"node {node.node_id} has been evicted") from err
        if reply.skipped:  # failed open: nothing is locked
            return None
        self._locks.setdefault(node.node_id, []).append(reply.lock_id)
        return None

    def dec_lock_ref(self, node: RemoteNode | None, *args: Any, **kwargs: Any) -> None:
        """Release one ``inc_lock_ref(node)`` of this cache.

        Raises:
            LockError: this cache holds no lock on ``node``, or the service no longer
                has it (reset, session lost).
        """
        if node is None or not node.node_id or self._stale(node):
            return
        held = self._locks.get(node.node_id)
        if not held and self._failing_open():
            return  # its lock was skipped when the service did not answer
        if not held:
            raise _cache_errors().LockError(
                f"unlock of node {node.node_id}, which holds no lock of this cache")
        try:
            self.session.unlock(held[-1])
        except (FailedPrecondition, NotFound) as err:
            self._pop_lock(node.node_id)
            raise _cache_errors().LockError(str(err)) from err
        self._pop_lock(node.node_id)

    def _stale(self, node: RemoteNode) -> bool:
        """Whether ``node`` comes from before a restart (then its locks are gone too)."""
        if node.server_epoch and node.server_epoch != self.client.server_epoch:
            self._locks.pop(node.node_id, None)
            self.stale_dropped += 1
            return True
        return False

    def _failing_open(self) -> bool:
        allowed = self.session.fail_open
        return self.client.fail_open if allowed is None else allowed

    def _pop_lock(self, node_id: int) -> None:
        held = self._locks[node_id]
        held.pop()
        if not held:
            del self._locks[node_id]

    # ---------------------------------------------------------------- sizes

    def stats(self) -> ModelStats:
        """The model's counters on the service (one Stats call)."""
        return self.client.stats(self.model)[self.model]

    def evictable_size(self) -> int:
        return self.stats().evictable_tokens

    def protected_size(self) -> int:
        return self.stats().protected_tokens

    def total_size(self) -> int:
        return self.stats().cached_tokens

    def swa_evictable_size(self) -> int:
        return 0

    def swa_protected_size(self) -> int:
        return 0

    def check_integrity(self) -> None:
        """Nothing to check here: the tree lives in the service, which checks itself."""


def _count(value: Any, name: str) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        number = -1
    if isinstance(value, bool) or number < 0:
        raise _cache_errors().InvalidInputError(f"{name} must be an int >= 0, got {value!r}")
    return number


class RemoteAllocator:
    """``TokenToKVPoolAllocator``'s surface over Alloc / Free in a cache's session.

    ``alloc`` returns None when the pool cannot supply the slots even after eviction,
    as in-process. ``free`` skips slots the service already freed during an insert
    (the duplicates of tokens someone else cached first), so the in-process calling
    code, which frees them itself, runs unchanged. A slot the service hands out again
    stops being skipped.
    """

    def __init__(self, cache: RemoteRadixCache) -> None:
        self._cache = cache
        self.page_size = cache.page_size
        self.size = cache.pool_size
        self.device = cache.device
        self._server_freed: set[int] = set()
        self._group_depth = 0
        self._group: list[int] = []

    def __repr__(self) -> str:
        return f"RemoteAllocator({self._cache.model!r}, size={self.size})"

    def available_size(self) -> int:
        """Free slots in the service's pool (one Stats call)."""
        return self._cache.stats().free_slots

    def alloc(self, need_size: int) -> Any:
        """``need_size`` slots held by the cache's session, or None if the pool is short."""
        n = _count(need_size, "need_size")
        try:
            reply = self._cache.session.alloc(self._cache.model, n)
        except ResourceExhausted:
            return None
        if self._server_freed:
            self._server_freed.difference_update(reply.slots)
        return as_tensor(reply.slots, self.device)

    def free(self, indices: Any) -> None:
        """Give slots back to the service's pool (skipping those it already freed).

        Raises:
            DoubleFreeError: a slot the session does not hold (nothing is freed).
        """
        if not self._server_freed and not self._group_depth:
            self._free(pack_slots(indices))
            return
        values = _int_list(indices)
        if self._server_freed:
            keep = [s for s in values if s not in self._server_freed]
            self._server_freed.difference_update(values)
            values = keep
        if self._group_depth:
            self._group.extend(values)
        else:
            self._free(pack_slots(values))

    def free_group_begin(self) -> None:
        """Batch frees into one Free call at the matching ``free_group_end``."""
        self._group_depth += 1

    def free_group_end(self) -> None:
        if self._group_depth == 0:
            raise _cache_errors().InvalidInputError("free_group_end() without "
                                                    "free_group_begin()")
        self._group_depth -= 1
        if self._group_depth == 0:
            batch, self._group = self._group, []
            self._free(pack_slots(batch))

    def _free(self, packed: bytes) -> None:
        if not packed:
            return
        try:
            self._cache.session.free(self._cache.model, packed)
        except FailedPrecondition as err:
            raise _cache_errors().DoubleFreeError(str(err)) from err
        except InvalidArgument as err:
            raise _cache_errors().SlotIndexError(str(err)) from err


def _int_list(indices: Any) -> list[int]:
    if hasattr(indices, "reshape") and hasattr(indices, "tolist"):
        return [int(x) for x in indices.reshape(-1).tolist()]
    return [int(x) for x in indices]
