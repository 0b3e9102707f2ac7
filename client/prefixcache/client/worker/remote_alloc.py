"""RemoteAllocator: ``TokenToKVPoolAllocator``'s surface over a ``RemoteRadixCache``.

Allocations and frees go out as items of the cache's next Step (``StepBuffer``), with
whatever the cache has queued, and ``available_size()`` answers from the counters that
Step replies carry. SGLang's paged ``alloc_extend`` / ``alloc_decode`` come from
``paged_alloc``: one Step for the whole batch.

Once the cache serves SGLang's scheduler, the allocator also keeps a ``SlotReserve``:
whole pages taken ahead, topped up by calls the cache makes anyway, from which
``alloc_extend`` and ``alloc_decode`` are served without a call of their own. Reserved
slots count as available (they are, to this worker); the service sees them as the
session's. The reserve follows recent demand, is capped (``RESERVE_SHARE`` of the pool)
and takes at most a quarter of the pool's free slots, so it never makes the service
evict for it; it is given back on ``close()``.
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Sequence
from typing import Any

from .._wire import as_tensor, pack_slots
from ..errors import FailedPrecondition, InvalidArgument, PrefixCacheError, ResourceExhausted
from ..results import AllocReply
from .paged_alloc import PagedCalls, ints, widen

RESERVE_SHARE = 64  # the reserve holds at most 1/64 of the pool


def cache_errors() -> Any:
    """``prefixcache.cache``, for its error classes (imported when first needed)."""
    import prefixcache.cache as cache

    return cache


def count_arg(value: Any, name: str) -> int:
    """``value`` as an int >= 0, or ``InvalidInputError`` as the in-process cache raises."""
    try:
        number = operator.index(value)
    except TypeError:
        number = -1
    if isinstance(value, bool) or number < 0:
        raise cache_errors().InvalidInputError(f"{name} must be an int >= 0, got {value!r}")
    return number


class SlotReserve:
    """Whole pages held ahead of allocations (see the module docstring). ``StepBuffer``
    asks ``wanted()`` before each call and hands the slots to ``took()``."""

    def __init__(self, cache: Any, cap: int) -> None:
        self._cache = cache
        self.page_size: int = cache.page_size
        self.cap = cap
        self.slots: list[int] = []
        self.epoch = 0
        self.demand = 0.0  # a decaying max of the slots taken between two top-ups
        self._taken = 0
        self.hits = self.misses = 0

    def wanted(self) -> int:
        self.demand = max(self.demand * 0.7, float(self._taken))
        self._taken = 0
        counters = self._cache._buffer.counters
        free: int = counters.free_slots if counters is not None else 0
        target = min(self.cap, int(self.demand * 1.25), free // 4)
        if 2 * len(self.slots) >= target:
            return 0
        ps = self.page_size
        return -(-(target - len(self.slots)) // ps) * ps

    def took(self, result: Any) -> None:
        if isinstance(result, AllocReply):
            if result.server_epoch != self.epoch:
                self.slots.clear()
                self.epoch = result.server_epoch
            self.slots.extend(result.slots)

    def take(self, n: int) -> array[int] | None:
        """``n`` reserved slots (whole pages when ``n`` is), or None if too few."""
        self._taken += n
        if self.epoch and self.epoch != self._cache.session.server_epoch:
            self.slots.clear()  # they went with the old service
        if len(self.slots) < n:
            self.misses += 1
            return None
        self.hits += 1
        out = array("q", self.slots[:n])  # int64, as the slots of a reply are
        del self.slots[:n]
        return out


class RemoteAllocator(PagedCalls):
    """``TokenToKVPoolAllocator``'s surface over Step items in a cache's session, and
    SGLang's paged ``alloc_extend`` / ``alloc_decode`` (paged_alloc.py).

    ``alloc`` returns None when the pool cannot supply the slots even after eviction,
    as in-process. ``free`` skips slots the service already freed during an insert
    (the duplicates of tokens someone else cached first), so the in-process calling
    code, which frees them itself, runs unchanged. A slot the service hands out again
    stops being skipped.
    """

    def __init__(self, cache: Any) -> None:
        super().__init__(cache.page_size, cache.pool_size, cache.device)
        self._cache = cache
        self._group_depth = 0
        self._group: list[int] = []
        self.reserve: SlotReserve | None = None

    def keep_reserve(self) -> None:
        """Start keeping a ``SlotReserve`` (the cache does once it serves SGLang)."""
        if self.reserve is None:
            ps = self.page_size
            self.reserve = SlotReserve(self._cache, self.size // RESERVE_SHARE // ps * ps)
            self._cache._buffer.topup = self.reserve

    def drop_reserve(self) -> None:
        """Stop keeping a reserve, and queue its slots' free (they go with the next
        call)."""
        reserve, self.reserve = self.reserve, None
        if reserve is None:
            return
        self._cache._buffer.topup = None
        if reserve.slots and reserve.epoch == self._cache.session.server_epoch:
            self._cache._buffer.free(pack_slots(reserve.slots))

    def __repr__(self) -> str:
        return f"RemoteAllocator({self._cache.model!r}, size={self.size})"

    def available_size(self) -> int:
        """Free slots in the service's pool, from the last reply's counters (a call
        only when something is queued or they may have changed since), and the
        reserved ones."""
        free: int = self._cache._counters().free_slots
        return free + len(self.reserve.slots) if self.reserve is not None else free

    def alloc(self, need_size: int) -> Any:
        """``need_size`` slots held by the cache's session, or None if the pool is short."""
        n = count_arg(need_size, "need_size")
        slots = None
        if self.reserve is not None and self.page_size == 1:
            self._cache._close_window()
            slots = self.reserve.take(n)
        if slots is None:
            slots = self._slots(n)
        if slots is None:
            return None
        self._handed_out(slots)
        return as_tensor(slots, self.device)

    def alloc_extend(self, prefix_lens: Any, *args: Any) -> Any:
        self._cache._close_window()  # admission is over once the batch allocates
        return super().alloc_extend(prefix_lens, *args)

    def alloc_decode(self, seq_lens: Any, *args: Any) -> Any:
        self._cache._close_window()
        return super().alloc_decode(seq_lens, *args)

    def _slots(self, n: int) -> array[int] | None:
        """``n`` slots from the next Step (sent now, with what is queued)."""
        cache = self._cache
        cache._close_window()
        (result,) = cache._buffer.flush(decodes=[n]).decodes
        if isinstance(result, ResourceExhausted):
            return None
        if isinstance(result, PrefixCacheError):
            raise result
        slots: array[int] = result.slots
        return slots

    def _take(self, n: int) -> Sequence[int] | None:  # PagedCalls' source of pages
        slots = self.reserve.take(n) if self.reserve is not None else None
        if slots is None:
            slots = self._slots(n)
        if slots is None:
            return None
        self._took_pages(slots)
        return slots

    def free(self, indices: Any) -> None:
        """Give slots back to the service's pool (skipping those it already freed).

        Raises:
            DoubleFreeError: a slot the session does not hold (nothing is freed).
        """
        if not self._server_freed and not self._group_depth and not self._whole:
            self._free(pack_slots(indices))
            return
        values = ints(indices)
        if self._whole:
            values = widen(values, self._whole, self.page_size)
        if self._server_freed:
            keep = [s for s in values if s not in self._server_freed]
            self._server_freed.difference_update(values)
            values = keep
        if self._group_depth:
            self._group.extend(values)
        else:
            self._free(pack_slots(values))

    def free_group_begin(self) -> None:
        """Batch frees into one Free item at the matching ``free_group_end``."""
        self._group_depth += 1

    def free_group_end(self) -> None:
        if self._group_depth == 0:
            raise cache_errors().InvalidInputError("free_group_end() without free_group_begin()")
        self._group_depth -= 1
        if self._group_depth == 0:
            batch, self._group = self._group, []
            self._free(pack_slots(batch))

    def _free(self, packed: bytes) -> None:
        if not packed:
            return
        (result,) = self._cache._buffer.flush(frees=[packed]).frees
        if isinstance(result, FailedPrecondition):
            raise cache_errors().DoubleFreeError(str(result)) from result
        if isinstance(result, InvalidArgument):
            raise cache_errors().SlotIndexError(str(result)) from result
        if isinstance(result, PrefixCacheError):
            raise result

    # ------------------------------------------------ for the cache's own frees

    def release_pages(self, own: Any) -> list[int]:
        """The slots of the whole pages ``own`` (a finished request's slots, a tensor)
        touches that ``own`` does not hold: never written, still the session's, to free
        with it. Those pages are no longer freed whole."""
        if not self._whole or not len(own):
            return []
        import torch

        ps = self.page_size
        mine = torch.as_tensor(own, dtype=torch.int64).reshape(-1)
        pages, counts = torch.unique(mine // ps, return_counts=True)
        touched = [p for p in pages.tolist() if p in self._whole]
        if not touched:
            return []
        self._whole.difference_update(touched)
        partial = set(pages[counts < ps].tolist()).intersection(touched)
        if not partial:
            return []
        ids = torch.tensor(sorted(partial), dtype=torch.int64)
        held = set(mine[torch.isin(mine // ps, ids)].tolist())
        return [s for p in sorted(partial) for s in range(p * ps, (p + 1) * ps) if s not in held]
