"""RemoteMambaRadixCache: the in-process ``MambaRadixCache`` API over a mamba model.

Serving code written for ``MambaRadixCache`` with its ``TokenToKVPoolAllocator`` and
``MambaPool`` runs against the sidecar unchanged::

    cache = RemoteMambaRadixCache(client, "hybrid")       # was: MambaRadixCache(...)
    allocator, states = cache.token_to_kv_pool_allocator, cache.mamba_pool
    hit = cache.match_prefix(key)                        # KV slots and the state slot
    cache.inc_lock_ref(hit.last_node)                    # no call: the match locked it
    track = states.alloc_track_slot()                    # None when none is free
    slots = torch.cat([hit.indices, allocator.alloc(need)])
    done = cache.insert(key, slots, mamba_value=track)
    allocator.free(slots[hit.prefix_len:done.prefix_len])
    if done.mamba_exist:
        states.free_track_slot(track)
    cache.dec_lock_ref(hit.last_node)

Both values of a node are tracked as in process: ``match_prefix`` answers the KV slots
of the longest prefix that ends at a node with a state snapshot, that node's state slot
(``last_node.mamba_value``) and ``mamba_branching_seqlen``; ``insert`` stores the state
slot at the key's end (``mamba_exist``: the tree had one there, and the caller frees
its own); ``evict(num_tokens, mamba_num)`` runs the service's ``MambaRadixCache``
eviction, leaves first (KV and state), then snapshots of inner nodes. The service hosts
the same class, so a worker alone on a model gets the in-process answers op for op.

Calls: ``match_prefix`` is one Step admission that also locks the answer, which the
``inc_lock_ref`` that follows takes over (the lock is released with the next call if
no ``inc_lock_ref`` comes first); ``dec_lock_ref`` and the state frees the service did
itself are queued or skipped; ``insert``, allocations and frees are a call each, as for
``RemoteRadixCache``. Allocations never evict here unless asked (``alloc`` returns
None when the pool is short even after the service's eviction, as ``RemoteAllocator``
does; ``alloc_track_slot`` answers None when no state slot is free).

Where it differs from the in-process cache (besides what ``RemoteRadixCache`` lists):

* The state data lives in the service's ``MambaPool``: a worker reads and writes it
  through the mapped pool (``client.attach_pool(model)``: ``conv_state``,
  ``temporal_state``), so ``mamba_pool`` here only hands out and frees slots.
* When ``insert`` finds a state at the key's end (``mamba_exist``), the service frees
  the caller's state slot itself; ``mamba_pool.free_track_slot`` then skips it, so the
  in-process calling code runs unchanged.
* ``insert``'s ``last_node.mamba_value`` is the slot the tree took, or None when it
  kept its own (a match names that one).
* SGLang's scheduler API (``MatchPrefixParams`` ...) is served for radix models only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .._wire import as_tensor, pack_slots, pack_tokens
from ..errors import FailedPrecondition, InvalidArgument, PrefixCacheError
from ..step import Admit, Finish, Free
from . import sglang_api as api
from .remote_alloc import cache_errors, count_arg
from .remote_cache import RemoteNode, RemoteRadixCache

__all__ = ["RemoteMambaNode", "RemoteMambaPool", "RemoteMambaRadixCache"]


@dataclass(frozen=True, slots=True)
class RemoteMambaNode(RemoteNode):
    """A node handle with the state slot the service named for it (``mamba_value``: a
    one-element int64 tensor, or None)."""

    mamba_value: Any = None


class RemoteMambaPool:
    """``MambaPool``'s slot calls over the cache's session (the state data is the
    mapped pool's, see the module docstring)."""

    def __init__(self, cache: RemoteMambaRadixCache, size: int) -> None:
        self._cache = cache
        self.max_track_slots = size
        self._server_freed: set[int] = set()  # slots the service freed in an insert

    def __repr__(self) -> str:
        return f"RemoteMambaPool({self._cache.model!r}, {self.max_track_slots} slots)"

    def available_track_slots(self) -> int:
        return int(self._cache._counters().free_state_slots)

    def alloc_track_slot(self) -> int | None:
        """A state slot held by the cache's session, or None when none is free (no
        snapshot is evicted for it: ``cache.evict(0, mamba_num=1)`` does that)."""
        if self.available_track_slots() <= 0:
            return None
        cache = self._cache
        cache._close_window()
        reply = cache.session.alloc(cache.model, 0, num_state_slots=1)
        buffer = cache._buffer
        counters = buffer.counters
        if buffer.fresh and counters is not None:  # a free slot was there: nothing evicted
            buffer.counters = replace(
                counters,
                free_state_slots=counters.free_state_slots - 1,
                session_state_slots=counters.session_state_slots + 1,
            )
        else:
            buffer.changed()
        (slot,) = reply.state_slots
        self._server_freed.discard(slot)
        return int(slot)

    def free_track_slot(self, slot: Any) -> None:
        """Give a state slot back (one the service freed already is skipped).

        Raises:
            DoubleFreeError: the session does not hold ``slot``.
        """
        index = _slot(slot, "slot")
        if index in self._server_freed:
            self._server_freed.discard(index)
            return
        (result,) = self._cache._buffer.flush(frees=[Free((), pack_slots([index]))]).frees
        if isinstance(result, FailedPrecondition):
            raise cache_errors().DoubleFreeError(str(result)) from result
        if isinstance(result, InvalidArgument):
            raise cache_errors().SlotIndexError(str(result)) from result
        if isinstance(result, PrefixCacheError):
            raise result


class RemoteMambaRadixCache(RemoteRadixCache):
    """``MambaRadixCache`` over one mamba model of a prefix-cache service.

    Args: as ``RemoteRadixCache`` (``model`` must be a mamba model).
    """

    _kinds = ("mamba",)

    def __init__(self, client: Any, model: str, **kwargs: Any) -> None:
        super().__init__(client, model, reserve=False, **kwargs)
        # As in process, the root's state is an empty tensor: no state to resume from.
        self.root_node = RemoteMambaNode(0, 0, self._state_tensor(None))
        info = self.client.list_models()[model]
        self.mamba_pool = RemoteMambaPool(self, info.state_pool_size)
        self._spec: dict[int, int] = {}  # node id -> a match's lock no inc_lock_ref took

    def __repr__(self) -> str:
        return f"RemoteMambaRadixCache({self.client.target!r}, {self.model!r})"

    # ------------------------------------------------------------ the contract

    def match_prefix(self, key: Any) -> Any:
        """Longest cached page-aligned prefix of ``key`` that ends at a node with a
        state snapshot: one call, which also locks it for the ``inc_lock_ref`` that
        usually follows."""
        if api.is_match_params(key):
            raise _sglang_refused()
        from prefixcache.cache import MatchResult

        self._close_window()
        (reply,) = self._buffer.flush(admits=[Admit(key, lock=True, allocate=False)]).admits
        if isinstance(reply, PrefixCacheError):
            raise reply
        node: Any = self.root_node
        if reply.node_id:
            state = None if reply.state_slot is None else self._state_tensor(reply.state_slot)
            node = RemoteMambaNode(reply.node_id, reply.server_epoch, state)
            if reply.lock_id:
                self._spec[reply.node_id] = reply.lock_id
        return MatchResult(
            as_tensor(reply.slots, self.device),
            node,
            reply.prefix_len,
            reply.mamba_branching_seqlen,
        )

    def insert(self, key: Any, value: Any = None, *, mamba_value: Any = None, **kwargs: Any) -> Any:
        """Cache ``key`` with KV slots ``value`` and the state slot ``mamba_value`` at its
        end; ``mamba_exist``: the tree had a state there (the service freed the caller's,
        which ``mamba_pool.free_track_slot`` then skips).

        Raises:
            InvalidInputError: as in process (no ``value``; a state for an unaligned key;
                a state slot the session does not hold; no state for uncached tokens).
        """
        if api.is_insert_params(key):
            raise _sglang_refused()
        from prefixcache.cache import InsertResult

        errors = cache_errors()
        self._close_window()
        if value is None:
            raise errors.InvalidInputError(
                "RemoteMambaRadixCache.insert needs value: slots come from the service's pool"
            )
        state = None if mamba_value is None else _slot(mamba_value, "mamba_value")
        data, width = pack_tokens(key)
        n = len(data) // (4 * width)
        slots = pack_slots(value)
        have = len(slots) // 8
        aligned = n - n % self.page_size
        if have < aligned:
            raise errors.InvalidInputError(f"value has {have} slots for {aligned} tokens")
        if have < n:
            n, data = have, data[: have * 4 * width]
        box: list[Any] = []
        self._buffer.finish(
            Finish(
                data,
                slots[: n * 8],
                extra_key=getattr(key, "extra_key", None),
                token_width=width,
                keep_tail=True,
                state_slot=state,
            ),
            box.append,
        )
        self._buffer.flush()
        (reply,) = box
        if isinstance(reply, (InvalidArgument, FailedPrecondition)):
            raise errors.InvalidInputError(str(reply)) from reply
        if isinstance(reply, PrefixCacheError):
            raise reply
        self.token_to_kv_pool_allocator._server_freed.update(reply.freed)
        if reply.state_exist and state is not None:
            self.mamba_pool._server_freed.add(state)
        node: Any = self.root_node
        if reply.node_id:
            taken = None if reply.state_exist or state is None else self._state_tensor(state)
            node = RemoteMambaNode(reply.node_id, reply.server_epoch, taken)
        return InsertResult(reply.prefix_len, node, reply.state_exist)

    # MambaRadixCache's signature: its second positional argument is mamba_num.
    def evict(  # type: ignore[override]
        self, num_tokens: Any, mamba_num: Any = 0, *, swa_num_tokens: int = 0
    ) -> Any:
        """Free at least ``num_tokens`` KV tokens (unlocked leaves, their states too),
        then state snapshots up to ``mamba_num`` in all, as the in-process cache does."""
        from prefixcache.cache import EvictResult

        n = count_arg(num_tokens, "num_tokens")
        m = count_arg(mamba_num, "mamba_num")
        self._close_window()
        self.flush()
        reply = self.session.evict(self.model, n, mamba_num=m)
        self._buffer.changed()
        return EvictResult(reply.evicted_tokens, reply.swa_evicted_tokens, reply.mamba_evicted)

    def inc_lock_ref(self, node: Any) -> api.IncLockRefResult:
        """Lock ``node`` (KV to the root, its own state): the lock of the match that
        answered it, when no other call came between, else one call."""
        lock_id = self._spec.pop(getattr(node, "node_id", 0), 0)
        if lock_id and not self._stale(node):
            self._locks.setdefault(node.node_id, []).append(lock_id)
            return api.IncLockRefResult(
                node_id=node.node_id, receipt=api.DecLockRefParams(node.node_id, lock_id=lock_id)
            )
        self._close_window()
        return super().inc_lock_ref(node)

    def dec_lock_ref(
        self, node: Any, params: Any = None, *args: Any, **kwargs: Any
    ) -> api.DecLockRefResult:
        self._close_window()
        return super().dec_lock_ref(node, params, *args, **kwargs)

    def _state_tensor(self, slot: int | None) -> Any:
        """A node's ``mamba_value``: the slot as a one-element int64 tensor (empty for
        None)."""
        import torch

        return torch.tensor([] if slot is None else [slot], dtype=torch.int64, device=self.device)

    # ------------------------------------------------------------------ sizes

    def _close_window(self) -> None:
        """Release the locks of matches no ``inc_lock_ref`` took (queued: the next
        call sends them, before its allocations)."""
        for lock_id in self._spec.values():
            self._buffer.unlock(lock_id)
        self._spec.clear()

    def _counters(self) -> Any:
        self._close_window()
        return self._buffer.sizes()

    def full_evictable_size(self) -> int:  # SGLang's name
        return self.evictable_size()

    def full_protected_size(self) -> int:
        return self.protected_size()

    def mamba_evictable_size(self) -> int:
        """State slots held by nodes without a Mamba lock."""
        return int(self._counters().mamba_evictable_slots)

    def mamba_protected_size(self) -> int:
        return int(self._counters().mamba_protected_slots)

    def mamba_total_size(self) -> int:
        counters = self._counters()
        return int(counters.mamba_evictable_slots + counters.mamba_protected_slots)

    # ------------------------------------------------- SGLang's API: not here

    def cache_finished_req(self, req: Any, *args: Any, **kwargs: Any) -> None:
        raise _sglang_refused()

    def cache_unfinished_req(self, req: Any, *args: Any, **kwargs: Any) -> None:
        raise _sglang_refused()

    def init_load_back(self, *args: Any, **kwargs: Any) -> Any:
        raise _sglang_refused()


def _slot(value: Any, name: str) -> int:
    """A state slot given as an int or a one-element integer tensor."""
    if isinstance(value, bool):
        raise cache_errors().InvalidInputError(f"{name} must be an int, got bool")
    numel = getattr(value, "numel", None)
    if callable(numel):
        if numel() != 1:
            raise cache_errors().InvalidInputError(f"{name} must be one state slot")
        value = value.reshape(-1)[0].item()
    try:
        return int(value.__index__())
    except (AttributeError, TypeError):
        raise cache_errors().InvalidInputError(
            f"{name} must be an int, not {type(value).__name__}"
        ) from None


def _sglang_refused() -> Exception:
    refused: Exception = cache_errors().InvalidInputError(
        "RemoteMambaRadixCache serves the in-process MambaRadixCache API; SGLang's "
        "scheduler API is served for radix models only (RemoteRadixCache)"
    )
    return refused
