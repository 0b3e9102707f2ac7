"""RemoteRadixCache: a prefix cache's scheduler-facing API over the service.

It speaks two dialects. Serving code written for ``prefixcache.cache.RadixCache`` and
its ``TokenToKVPoolAllocator`` (the in-process cache library's API) runs against one
model of the sidecar unchanged::

    cache = RemoteRadixCache(client, "llama")
    allocator = cache.token_to_kv_pool_allocator        # a RemoteAllocator
    hit = cache.match_prefix(key)
    cache.inc_lock_ref(hit.last_node)
    slots = torch.cat([hit.indices, allocator.alloc(need)])
    done = cache.insert(key, slots)
    allocator.free(slots[hit.prefix_len:done.prefix_len])   # see RemoteAllocator.free
    cache.dec_lock_ref(hit.last_node)

SGLang's current ``BasePrefixCache`` API (``MatchPrefixParams`` -> ``MatchResult``,
``InsertParams``, ``EvictParams``, ``IncLockRefResult`` receipts, ``cache_finished_req``
/ ``cache_unfinished_req``, ``init_load_back``) is answered too, the call telling which
by its argument; sglang_remote.py says how (ranking from a local shadow index,
admissions in batches) and where the answers differ from an in-process tree.

Either way the calls go out as ``Step`` items (step_buffer.py): those whose answer is
not needed (unlocks, SGLang's finishes) wait for the next call made anyway, and every
reply brings the model's counters, so ``evictable_size()`` and ``available_size()``
cost no call of their own. A seed-API call that needs an answer (``match_prefix``,
``insert``, ``alloc``, ``free``) is one call.

torch and ``prefixcache.cache`` are imported inside the methods that need them, never
when this module loads. The class is registered as a virtual subclass of
``BasePrefixCache`` on first use, so ``isinstance(cache, BasePrefixCache)`` holds.

Differences from the in-process cache, all forced by the cache living elsewhere:

* Slots come from the service: the allocator is a ``RemoteAllocator`` (remote_alloc.py)
  backed by the cache's session, and ``insert`` needs a ``value``.
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
  rest (Unavailable, ...) are the client's typed errors. A queued unlock's error is
  logged and kept in ``errors`` (no caller waits for it).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._wire import as_tensor, pack_slots, pack_tokens
from ..errors import FailedPrecondition, InvalidArgument, NotFound, PrefixCacheError
from ..results import ModelStats
from ..sessions.session import ClientSession
from ..step import Admit, Finish
from ..sync import PrefixCacheClient
from . import sglang_api as api
from .admission import AdmissionWindow, Candidate
from .own_pages import OwnPages
from .remote_alloc import RemoteAllocator, cache_errors, count_arg
from .sglang_remote import PendingNode, SGLangCalls, _receipt
from .step_buffer import StepBuffer

__all__ = ["RemoteAllocator", "RemoteNode", "RemoteRadixCache", "register_base"]

_registered = False


def register_base() -> None:
    """Make RemoteRadixCache a virtual subclass of ``BasePrefixCache`` (imports it)."""
    global _registered
    if not _registered:
        from prefixcache.cache import BasePrefixCache

        BasePrefixCache.register(RemoteRadixCache)
        _registered = True


@dataclass(frozen=True, slots=True)
class RemoteNode:
    """A handle to a node of the service's tree (0 is the root: nothing matched), and
    the epoch of the service that handed it out (0: not known)."""

    node_id: int
    server_epoch: int = 0

    @property
    def id(self) -> int:
        return self.node_id


class RemoteRadixCache(SGLangCalls):
    """``BasePrefixCache`` over one radix model of a prefix-cache service.

    Args:
        client: a ``PrefixCacheClient``, or a target to make one (with ``client_kwargs``).
        model: the hosted model; its cache kind must be ``radix``.
        session: the session that holds this cache's locks and slots; by default the
            cache opens its own (leased, renewed in the background) and closes it in
            ``close()``.
        ttl: the lease of that session.
        device: where ``match_prefix`` indices and allocated slots are put.
        req_to_token_pool: SGLang's ``ReqToTokenPool``, for ``cache_finished_req`` /
            ``cache_unfinished_req`` (may be set later as an attribute).
        shadow_wait: seconds the first SGLang-style match waits for the shadow index's
            first snapshot (until then every estimate is a miss).
        reserve: once serving SGLang, keep a reserve of pages so that allocations
            rarely cost a call of their own (remote_alloc.SlotReserve).
    """

    _kinds: tuple[str, ...] = ("radix",)  # the cache kinds this class serves

    def __init__(
        self,
        client: PrefixCacheClient | str | Path,
        model: str,
        *,
        session: ClientSession | None = None,
        ttl: float | None = None,
        device: Any = "cpu",
        req_to_token_pool: Any = None,
        shadow_wait: float = 5.0,
        reserve: bool = True,
        **client_kwargs: Any,
    ) -> None:
        register_base()
        self._owns_client = not isinstance(client, PrefixCacheClient)
        self.client = (
            PrefixCacheClient(client, **client_kwargs)
            if not isinstance(client, PrefixCacheClient)
            else client
        )
        self.model = model
        try:
            info = self.client.list_models()[model]
        except KeyError:
            raise NotFound(f"model {model!r} is not hosted by {self.client.target}") from None
        if info.cache_kind not in self._kinds:
            raise InvalidArgument(
                f"{type(self).__name__} needs a {' or '.join(self._kinds)} "
                f"model; {model!r} is {info.cache_kind}"
            )
        self.page_size = info.page_size
        self.sliding_window_size = None
        self.on_node_evict = None
        self.pool_size = info.pool_size
        self.disable = False
        self.req_to_token_pool = req_to_token_pool
        import torch

        self.device = torch.device(device)
        self._owns_session = session is None
        self.session = (
            session
            if session is not None
            else self.client.session(ttl, name=f"RemoteRadixCache:{model}")
        )
        self.root_node = RemoteNode(0)
        # node id -> lock ids this cache took on it, most recent last.
        self._locks: dict[int, list[int]] = {}
        # Node handles from before a restart that lock calls dropped.
        self.stale_dropped = 0
        self._buffer = StepBuffer(self.session, model)
        self._window_: AdmissionWindow | None = None
        self._own_pages: OwnPages | None = None  # with the window
        self._shadow_wait = shadow_wait
        self._pinned = 0  # see SGLangCalls._pin
        self._reserve = reserve
        self.token_to_kv_pool_allocator = RemoteAllocator(self)

    def __repr__(self) -> str:
        return f"RemoteRadixCache({self.client.target!r}, {self.model!r})"

    @property
    def calls(self) -> int:
        """Step and Stats calls this cache made (Lock and Evict not counted)."""
        return self._buffer.calls

    @property
    def errors(self) -> list[tuple[str, PrefixCacheError]]:
        """The last errors of queued items (an unlock, a finished request's insert)."""
        return list(self._buffer.errors)

    # ------------------------------------------------------------ lifecycle

    def flush(self) -> None:
        """Send what is queued now (the next call that needs an answer would)."""
        if self._buffer.pending:
            self._buffer.flush()

    def close(self) -> None:
        """Send what is queued, then close the session this cache opened (releasing
        its locks and slots)."""
        # Closing the session releases what the queued items would have, if need be.
        with contextlib.suppress(PrefixCacheError):
            self.token_to_kv_pool_allocator.drop_reserve()
            self.flush()
        if self._window_ is not None:
            self._window_.shadow.close()
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
        self._buffer.clear()
        if self._window_ is not None:
            self._window_.close()
        self._locks.clear()
        alloc = self.token_to_kv_pool_allocator
        alloc.clear_pages()
        if alloc.reserve is not None:
            alloc.reserve.slots = []

    # ---------------------------------------------------------- the contract

    def match_prefix(self, key: Any) -> Any:
        """Longest cached page-aligned prefix of ``key`` (a RadixKey, or token ids): one
        call. With SGLang's ``MatchPrefixParams``: the shadow index's estimate, no call
        (see sglang_remote.py)."""
        if api.is_match_params(key):
            return self._sglang_match(key)
        from prefixcache.cache import MatchResult

        (reply,) = self._buffer.flush(admits=[Admit(key, lock=False, allocate=False)]).admits
        if isinstance(reply, PrefixCacheError):
            raise reply
        node = self._node(reply.node_id, reply.server_epoch)
        return MatchResult(
            as_tensor(reply.slots, self.device),
            node,
            reply.prefix_len,
            reply.mamba_branching_seqlen,
        )

    def insert(self, key: Any, value: Any = None, **kwargs: Any) -> Any:
        """Cache ``key``'s page-aligned part with slots ``value`` (or SGLang's
        ``InsertParams``).

        As in-process, ``prefix_len`` says how many tokens were cached already and the
        caller frees ``value[hit_len:prefix_len]`` and the unaligned tail. The service
        has in fact freed the former itself (it owns the pool); the cache's
        ``RemoteAllocator`` remembers them and skips them when the caller frees them.
        ``prev_prefix_len`` and other SWA keywords are accepted and ignored.
        """
        if api.is_insert_params(key):
            tokens, extra = api.key_parts(key.key)
            done = self._insert(tokens, key.value, extra)
            return api.InsertResult(done.prefix_len, len(tokens), done.last_node)
        return self._insert(key, value, getattr(key, "extra_key", None))

    def _insert(self, key: Any, value: Any, extra_key: str | None) -> Any:
        from prefixcache.cache import InsertResult

        errors = cache_errors()
        if value is None:
            raise errors.InvalidInputError(
                "RemoteRadixCache.insert needs value: slots come from the service's pool"
            )
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
        box: list[Any] = []
        self._buffer.finish(
            Finish(data, slots[: n * 8], extra_key=extra_key, token_width=width, keep_tail=True),
            box.append,
        )
        self._buffer.flush()
        (reply,) = box
        if isinstance(reply, (InvalidArgument, FailedPrecondition)):
            raise errors.InvalidInputError(str(reply)) from reply
        if isinstance(reply, PrefixCacheError):
            raise reply
        self.token_to_kv_pool_allocator._server_freed.update(reply.freed)
        return InsertResult(
            reply.prefix_len, self._node(reply.node_id, reply.server_epoch), reply.state_exist
        )

    def evict(self, num_tokens: Any, swa_num_tokens: int = 0) -> Any:
        """Free at least ``num_tokens`` unlocked tokens on the service (whole leaves),
        after what is queued. With SGLang's ``EvictParams``: its ``EvictResult``."""
        sglang = api.is_evict_params(num_tokens)
        if sglang:
            num_tokens, swa_num_tokens = num_tokens.num_tokens, num_tokens.swa_num_tokens
        n = count_arg(num_tokens, "num_tokens")
        swa = count_arg(swa_num_tokens, "swa_num_tokens")
        self.flush()
        reply = self.session.evict(self.model, n, swa_num_tokens=swa)
        self._buffer.changed()
        if sglang:
            return api.EvictResult(
                reply.evicted_tokens, reply.swa_evicted_tokens, reply.mamba_evicted
            )
        from prefixcache.cache import EvictResult

        return EvictResult(reply.evicted_tokens, reply.swa_evicted_tokens, reply.mamba_evicted)

    def inc_lock_ref(self, node: Any) -> api.IncLockRefResult:
        """Lock ``node`` (and its ancestors) on the service for this cache's session.
        A node an admission locked already (``init_load_back``) costs no call: that lock
        becomes the caller's. The result's ``to_dec_params()`` is the receipt for
        ``dec_lock_ref``."""
        if isinstance(node, Candidate):
            return self._pin(node)
        if isinstance(node, PendingNode) and not node.resolved:
            self.flush()  # its insert is queued: send it to learn the node
        node_id = getattr(node, "node_id", 0)
        if not node_id or self._stale(node):
            return api.IncLockRefResult(delta=0)
        claimed = self._claim(node)
        if claimed is not None:
            return claimed
        try:
            reply = self.session.lock(self.model, node_id, server_epoch=node.server_epoch or None)
        except NotFound as err:
            raise cache_errors().LockError(f"node {node_id} has been evicted") from err
        self._buffer.changed()
        if reply.skipped:  # failed open: nothing is locked
            return api.IncLockRefResult(delta=0)
        self._locks.setdefault(node_id, []).append(reply.lock_id)
        return _receipt(node_id, reply.lock_id)

    def dec_lock_ref(
        self, node: Any, params: Any = None, *args: Any, **kwargs: Any
    ) -> api.DecLockRefResult:
        """Release one ``inc_lock_ref(node)`` of this cache (the one ``params``, its
        receipt, names; else the latest). The release goes with the next call.

        Raises:
            LockError: this cache holds no lock on ``node``.
        """
        if isinstance(node, Candidate):
            return self._unpin(params)
        if node is None or not getattr(node, "node_id", 1) or self._stale(node):
            return api.DecLockRefResult(0)  # the root, or a node from before a restart
        lock_id = self._lock_to_release(node, params)
        if not lock_id:
            if not getattr(node, "node_id", 0) or self._failing_open():
                return api.DecLockRefResult(0)  # its lock failed open
            raise cache_errors().LockError(
                f"unlock of node {node.node_id}, which holds no lock of this cache"
            )
        self._buffer.unlock(lock_id)
        return api.DecLockRefResult()

    def _node(self, node_id: int, epoch: int) -> Any:
        return RemoteNode(node_id, epoch) if node_id else self.root_node

    def _stale(self, node: Any) -> bool:
        """Whether ``node`` comes from before a restart (then its locks are gone too)."""
        epoch = getattr(node, "server_epoch", 0)
        if epoch and epoch != self.client.server_epoch:
            self._locks.pop(node.node_id, None)
            self.stale_dropped += 1
            return True
        return False

    def _failing_open(self) -> bool:
        allowed = self.session.fail_open
        return self.client.fail_open if allowed is None else allowed

    # ---------------------------------------------------------------- sizes

    def stats(self) -> ModelStats:
        """The model's counters on the service, after what is queued (one Stats call)."""
        self.flush()
        return self.client.stats(self.model)[self.model]

    def evictable_size(self) -> int:
        return max(self._counters().evictable_tokens - self._pinned, 0)

    def protected_size(self) -> int:
        return self._counters().protected_tokens

    def total_size(self) -> int:
        return self._counters().cached_tokens

    def check_integrity(self) -> None:
        """Nothing to check here: the tree lives in the service, which checks itself."""
