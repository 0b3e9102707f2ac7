"""SGLang's current ``BasePrefixCache`` calls for ``RemoteRadixCache``.

SGLang's scheduler, per step: ``match_prefix(MatchPrefixParams)`` for every waiting
request (ranking), budget reads (``available_size() + evictable_size()``) as
``PrefillAdder`` admits, ``inc_lock_ref`` per admitted request (the receipt goes back to
``dec_lock_ref``), allocation, then ``cache_finished_req`` / ``cache_unfinished_req``.
Here that costs a few ``Step`` calls per step, not one call per request:

* **Ranking answers locally.** ``match_prefix`` with a ``MatchPrefixParams`` answers
  from the shadow index (the model's cached pages, followed over Subscribe): no call.
  Its estimate is reported as a *host hit* (``host_hit_length``, ``best_match_node``),
  the form SGLang already uses for KV held outside the device tree: the scheduler ranks
  and budgets with it, and at admission calls ``init_load_back``, which takes the
  service's answer (match and lock) from the ``AdmissionWindow``.
* **Admission is the service's.** ``init_load_back`` returns the real slots and node,
  all the promised tokens or more (never fewer): when the service holds less than the
  estimate (pages evicted since the shadow's view), it returns None, which SGLang's
  adder treats as "not this step"; the request is ranked again next step with the
  service's number as its ceiling. The admission's lock becomes the request's through
  its ``inc_lock_ref`` (no second call).
* **What needs no answer waits.** Unlocks, ``cache_finished_req`` (insert, release,
  free the tail) and ``cache_unfinished_req`` are queued (``StepBuffer``) and go with
  the next call made anyway. ``cache_unfinished_req`` moves the request onto the tree's
  slots when that call returns, before any slot it gave up can be used again.
* **Sizes come with replies.** Every Step reply carries the model's counters; a size
  read sends what is queued first (with the step's speculative admissions), so it
  reads what the in-process cache would.
* **Allocations come from a reserve** of whole pages the allocator tops up with calls
  made anyway (remote_alloc.SlotReserve), so a step usually costs one call.

Where the remote answers differ from an in-process tree, and why that is safe:

* The estimate lags the service by the Subscribe stream's delay. It only ranks and
  budgets; slots come from the admission reply, which is current, under a lock taken
  in the same call. A stale estimate costs order (a request ranked too high or low) or
  one step of delay (a shortfall), never a wrong slot.
* Speculative admissions lock their prefixes before the scheduler asks for them, so
  until the window closes (the next allocation) ``evictable_size()`` is lower by those
  prefixes: the budget errs small, never large.
* A lock of a ranking match's stand-in node (PrefillAdder's temporary lock) holds
  its estimate back from ``evictable_size()``, whether or not the service counted
  those tokens as evictable: again the budget errs small.
* Ranking matches do not touch the service's LRU order (admissions do).
* What this worker inserts is noted in its shadow index's local overlay as the insert
  is queued (own_pages.py), so the next step ranks on it as in-process would, although
  the insert goes with that step's first call and the stream tells of it after that.
  A reply that caches less takes the rest back; the stream's changes end the notes.
* The tree is shared: another worker may cache or evict between two calls, so sizes
  and hits are the service's, not only this worker's doing.
* A queued item's error surfaces in ``errors`` and the log, not in the call that
  queued it (nothing in SGLang reads those calls' results).
* EAGLE bigram keys are taken as given (tuple tokens), not converted.
"""

from __future__ import annotations

from typing import Any

from .._wire import as_tensor, pack_slots, pack_tokens
from ..errors import PrefixCacheError
from ..results import ModelStats
from ..step import Admit, Finish
from ..sync import PrefixCacheClient
from . import sglang_api as api
from .admission import AdmissionWindow, Candidate
from .own_pages import OwnPages
from .step_buffer import StepBuffer


class PendingNode:
    """The node a queued ``cache_unfinished_req`` insert ends at; its id is known once
    the queued call has been answered (``resolved``)."""

    __slots__ = ("node_id", "resolved", "server_epoch")

    def __init__(self) -> None:
        self.node_id = 0
        self.server_epoch = 0
        self.resolved = False

    @property
    def id(self) -> int:
        return self.node_id

    def __repr__(self) -> str:
        return f"PendingNode({self.node_id if self.resolved else '?'})"


class SGLangCalls(api.FullTreeCapabilities):
    """The SGLang half of ``RemoteRadixCache`` (see the module docstring). The host
    class provides the session, buffer, lock bookkeeping and allocator."""

    client: PrefixCacheClient
    model: str
    page_size: int
    device: Any
    root_node: Any
    req_to_token_pool: Any
    token_to_kv_pool_allocator: Any
    _buffer: StepBuffer
    _locks: dict[int, list[int]]
    _window_: AdmissionWindow | None
    _own_pages: OwnPages | None
    _shadow_wait: float
    _pinned: int
    _reserve: bool

    # Defined by the host class, RemoteRadixCache.
    def _stale(self, node: Any) -> bool:
        raise NotImplementedError

    def _failing_open(self) -> bool:
        raise NotImplementedError

    def _node(self, node_id: int, epoch: int) -> Any:
        raise NotImplementedError

    # ------------------------------------------------------------ capabilities

    def is_root(self, node: Any) -> bool:
        return not getattr(node, "node_id", 0)

    def root_node_handle(self, extra_key: str | None = None) -> Any:
        return self.root_node

    # ------------------------------------------------------------- matching

    def supports_fast_match_prefix(self) -> bool:
        return True  # ranking matches are local

    @property
    def window(self) -> AdmissionWindow:
        """The admission window; the shadow index is followed from the first use."""
        if self._window_ is None:
            follower = self.client.shadow(self.model)
            follower.wait_ready(self._shadow_wait)
            self._window_ = AdmissionWindow(follower, self.page_size)
            self._own_pages = OwnPages(follower, self.page_size)
            if self._reserve:
                self.token_to_kv_pool_allocator.keep_reserve()
        return self._window_

    def _sglang_match(self, params: Any) -> api.MatchResult:
        cand = self.window.rank(params.key, params.req)
        empty = self._empty()
        if not cand.estimate:
            root = self.root_node
            return api.MatchResult(empty, root, root, root)
        # The candidate stands in for the node: PrefillAdder's temporary lock of it
        # takes its estimate out of evictable_size(), as a lock of the node would.
        return api.MatchResult(
            empty, cand, cand, cand, host_hit_length=cand.estimate, full_kv_hit_length=cand.estimate
        )

    def init_load_back(
        self, params: Any, host_hit_length: int | None = None, *args: Any, **kwargs: Any
    ) -> tuple[Any, Any] | None:
        """Admit the request of a ranking match: ``(slots, node)`` of at least the
        promised tokens, locked at the service; None when the service holds fewer now.
        Takes ``InitLoadBackParams`` or, as older SGLang, ``(node, host_hit_length)``."""
        if host_hit_length is None:
            cand, promised = params.best_match_node, params.host_hit_length
        else:
            cand, promised = params, host_hit_length
        if not isinstance(cand, Candidate):
            raise _errors().InvalidInputError(
                f"init_load_back needs the best_match_node of a match_prefix, not {cand!r}"
            )
        window = self.window
        if cand.reply is None and cand.state == "ranked":
            self._admit(window.on_demand(cand))
        reply = window.take(cand, int(promised))
        if reply is None:
            return None
        return as_tensor(reply.slots, self.device), self._node(reply.node_id, reply.server_epoch)

    def _admit(self, cands: list[Candidate]) -> None:
        admits = [
            Admit(c.packed, c.extra_key, c.width, lock=True, allocate=False, hint=c.estimate)
            for c in cands
        ]
        results = self._buffer.flush(admits=admits).admits
        self.window.admitted(cands, results)

    def _counters(self) -> ModelStats:
        """Current counters; a call that must be made sends the step's speculative
        admissions too."""
        window = self._window_
        if window is not None and (self._buffer.pending or window.expected):
            chosen = window.speculative()
            if chosen:
                self._admit(chosen)
        return self._buffer.sizes()

    def _close_window(self) -> None:
        """Before an allocation: release the admissions the scheduler left."""
        if self._window_ is not None:
            for lock_id in self._window_.close():
                self._buffer.unlock(lock_id)

    # --------------------------------------------------------------- locks

    def _pin(self, cand: Candidate) -> api.IncLockRefResult:
        """A lock of a ranking match's stand-in node: its estimate leaves the local
        evictable size until the matching release (the budget errs small)."""
        self._pinned += cand.estimate
        return api.IncLockRefResult(
            -cand.estimate, receipt=api.DecLockRefParams(pinned=cand.estimate)
        )

    def _unpin(self, receipt: Any) -> api.DecLockRefResult:
        pinned = getattr(receipt, "pinned", 0)
        self._pinned = max(self._pinned - pinned, 0)
        return api.DecLockRefResult(pinned)

    def _claim(self, node: Any) -> api.IncLockRefResult | None:
        """The admission lock of ``node`` as the caller's, if one is waiting."""
        if self._window_ is None:
            return None
        lock_id = self._window_.claim(node.node_id)
        if not lock_id:
            return None
        self._locks.setdefault(node.node_id, []).append(lock_id)
        return _receipt(node.node_id, lock_id)

    def _lock_to_release(self, node: Any, receipt: Any) -> int:
        """The lock ``dec_lock_ref(node, receipt)`` gives back (0: none held)."""
        if node is None:
            return 0
        if isinstance(node, PendingNode) and not node.resolved:
            self._buffer.flush()  # its insert is queued: send it to learn the lock
        node_id = getattr(node, "node_id", 0)
        if not node_id or self._stale(node):
            return 0
        lock_id = int(getattr(receipt, "lock_id", 0) or 0)
        held = self._locks.get(node_id)
        if not held or (lock_id and lock_id not in held):
            return 0  # released already (a receipt used twice), or never taken here
        if lock_id:
            held.remove(lock_id)
        else:
            lock_id = held.pop()
        if not held:
            del self._locks[node_id]
        return lock_id

    # ------------------------------------------------------------- requests

    def cache_finished_req(self, req: Any, is_insert: bool = True, **kwargs: Any) -> None:
        """Queue the request's insert, lock release and tail free (one Finish)."""
        n = api.committed_len(req)
        kv, _, protected = api.req_rows(self.req_to_token_pool, req, n, self.page_size)
        lock_id = self._lock_to_release(req.last_node, getattr(req, "lock_receipt", None))
        alloc = self.token_to_kv_pool_allocator
        spare = alloc.release_pages(kv[protected:])
        buffer = self._buffer
        if is_insert:
            data, width = pack_tokens(api.all_tokens(req, n))
            ns = api.namespace(req)
            buffer.finish(
                Finish(
                    data, pack_slots(kv), release_lock_id=lock_id, extra_key=ns, token_width=width
                ),
                self._noted(req, data, width, ns, last=True),
            )
        else:
            buffer.free(pack_slots(kv[protected:]))
            buffer.unlock(lock_id)
            if self._own_pages is not None:
                self._own_pages.forget(req)
        buffer.free(spare)
        if self._window_ is not None:
            self._window_.expected += 1

    def cache_unfinished_req(self, req: Any, chunked: bool = False, **kwargs: Any) -> None:
        """Queue the insert of what the request computed so far, locked, with a match
        of it; when they are answered the request moves onto the tree's slots and its
        new node and receipt are filled in."""
        tokens = req.fill_ids
        kv, aligned, protected = api.req_rows(
            self.req_to_token_pool, req, len(tokens), self.page_size
        )
        old = self._lock_to_release(req.last_node, getattr(req, "lock_receipt", None))
        self.token_to_kv_pool_allocator.forget_pages(kv[protected:aligned])
        data, width = pack_tokens(tokens)
        ns = api.namespace(req)
        prefix = kv.clone()
        node, receipt = PendingNode(), api.DecLockRefParams()
        fix = _Fixup(self, req, prefix, protected, aligned, node, receipt)
        self._buffer.finish(
            Finish(
                data,
                pack_slots(kv),
                release_lock_id=old,
                extra_key=ns,
                token_width=width,
                lock=True,
                keep_tail=True,
            ),
            self._noted(req, data, width, ns, last=False, then=fix.inserted),
        )
        self._buffer.admit(
            Admit(data[: aligned * 4 * width], ns, width, lock=False, allocate=False), fix.matched
        )
        api.set_protected_len(req, aligned)
        req.prefix_indices, req.last_node, req.lock_receipt = prefix, node, receipt

    def _noted(
        self,
        req: Any,
        data: bytes,
        width: int,
        extra_key: str | None,
        *,
        last: bool,
        then: Any = None,
    ) -> Any:
        """The reply callback of a queued insert, its pages noted in the shadow index
        now (``then`` gets the reply too; without it an error is logged, as for any
        queued item)."""
        own = self._own_pages
        if own is None:  # no SGLang-style match yet: no shadow index to note in
            return then
        answered = own.queued(req, data, width, extra_key, last=last)
        buffer = self._buffer

        def done(result: Any) -> None:
            answered(result)
            if then is not None:
                then(result)
            elif isinstance(result, PrefixCacheError):
                buffer._failed("finishes", result)

        return done

    def _empty(self) -> Any:
        """An empty slot tensor (one, shared: nothing writes into it)."""
        empty = self.__dict__.get("_empty_slots")
        if empty is None:
            import torch

            empty = self.__dict__["_empty_slots"] = torch.empty(
                (0,), dtype=torch.int64, device=self.device
            )
        return empty


class _Fixup:
    """Applies the answers of a queued ``cache_unfinished_req``."""

    def __init__(
        self,
        cache: SGLangCalls,
        req: Any,
        prefix: Any,
        protected: int,
        aligned: int,
        node: PendingNode,
        receipt: api.DecLockRefParams,
    ) -> None:
        self.cache, self.req, self.prefix = cache, req, prefix
        self.protected, self.aligned = protected, aligned
        self.node, self.receipt = node, receipt
        self.insert: Any = None

    def inserted(self, result: Any) -> None:
        self.insert = result

    def matched(self, result: Any) -> None:
        node, insert = self.node, self.insert
        node.resolved = True
        if isinstance(insert, PrefixCacheError) or insert is None or insert.skipped:
            # Nothing changed at the service: the request keeps its own slots.
            if isinstance(insert, PrefixCacheError):
                self.cache._buffer._failed("finishes", insert)
            return
        node.node_id, node.server_epoch = insert.node_id, insert.server_epoch
        self.receipt.node_id, self.receipt.lock_id = insert.node_id, insert.lock_id
        if insert.lock_id:
            self.cache._locks.setdefault(insert.node_id, []).append(insert.lock_id)
        if isinstance(result, PrefixCacheError) or result.skipped:
            self.cache._buffer._failed(
                "admits",
                result
                if isinstance(result, PrefixCacheError)
                else PrefixCacheError("the match failed open"),
            )
            return
        lo, hi = self.protected, self.aligned
        if len(result.slots) < hi or hi <= lo:
            return
        tree = as_tensor(result.slots, self.prefix.device)[lo:hi]
        if bool((self.prefix[lo:hi] != tree).any()):  # duplicates the service freed
            self.prefix[lo:hi] = tree
            pool = self.cache.req_to_token_pool
            pool.write((api.req_pool_idx(self.req), slice(lo, hi)), tree)


def _receipt(node_id: int, lock_id: int) -> api.IncLockRefResult:
    return api.IncLockRefResult(
        node_id=node_id, receipt=api.DecLockRefParams(node_id, lock_id=lock_id)
    )


def _errors() -> Any:
    import prefixcache.cache as cache

    return cache
