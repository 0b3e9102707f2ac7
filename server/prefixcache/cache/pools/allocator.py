"""TokenToKVPoolAllocator: hands out KV-pool slots in whole pages, refusing bad frees."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import NamedTuple

import numpy as np
import torch

from ..distinct import distinct, distinct_first
from ..errors import (
    DoubleFreeError,
    IntegrityError,
    InvalidInputError,
    SlotIndexError,
    check_count,
)
from .free_pages import FreePages, Pages
from .slot_runs import Scratch, breaks, runs_in

IndexLike = torch.Tensor | np.ndarray | Sequence[int]

# Shown in error messages; enough to identify the problem without flooding logs.
_MAX_SHOWN = 8
_NO_ENDS = np.zeros(0, dtype=np.int64)


def host_indices(indices: IndexLike) -> np.ndarray:
    """Slot indices as a flat int64 host array (shared with a CPU int64 tensor's memory)."""
    if isinstance(indices, torch.Tensor):
        # is_cpu, not device.type: a tenth of the cost, on every free and insert.
        if indices.dtype == torch.int64 and indices.dim() == 1 and indices.is_cpu:
            return indices.numpy()  # the common case: one call, no copy
        if indices.dtype == torch.bool or indices.is_floating_point() or indices.is_complex():
            raise InvalidInputError(f"indices must be integers, got dtype {indices.dtype}")
        return indices.detach().reshape(-1).to("cpu", torch.int64).numpy()
    array = np.asarray(indices)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
        raise InvalidInputError(f"indices must be integers, got {array.dtype}")
    return array.reshape(-1).astype(np.int64, copy=False)


def _kept(slots: np.ndarray | None) -> np.ndarray:
    """Slots a ``_Checked`` keeps for the free that needs them (see there)."""
    if slots is None:
        raise IntegrityError("a checked free lacks the slots it needs")
    return slots


class _Checked(NamedTuple):
    """Slots validated for freeing and not yet freed.

    ``given`` is in the caller's order; ``runs`` lists the ``(first, last)`` slots of
    each contiguous run, ascending, when there are few of them; otherwise ``runs`` is
    None and ``idx`` holds the slots sorted. A ``free_parts`` check with runs leaves
    ``idx`` and ``given`` None: only a one-slot page or an unsorted free list reads
    ``given`` there, and ``free_parts`` joins its parts for those.
    """

    idx: np.ndarray | None
    given: np.ndarray | None
    runs: list[tuple[int, int]] | None


# Below this many contiguous runs a free works on slices, one run at a time; above it,
# one vector pass over every slot is cheaper than the Python loop.
_MAX_RUNS = 32


def _check_range(idx: np.ndarray, low: int, high: int) -> None:
    """Raise SlotIndexError unless every index lies in ``[low, high)``."""
    if idx.size and (int(idx.min()) < low or int(idx.max()) >= high):
        bad = idx[(idx < low) | (idx >= high)][:_MAX_SHOWN].tolist()
        raise SlotIndexError(f"slot indices outside [{low}, {high}): {bad}")


class TokenToKVPoolAllocator:
    """Hands out KV-pool slots in whole pages and takes them back with full validation.

    Slot 0 (and, when paged, all of page 0) is padding and never handed out. Usable
    pages are ``1..size // page_size``; slot ``s`` lies in page ``s // page_size``, so
    the KV pool needs ``size + page_size`` rows. Allocation is tracked per slot, so
    freeing part of a page never releases slots that are still live: a page goes back
    once every slot of it that was handed out has been freed. Freed pages wait in a
    release list and are merged into the free list (sorted when ``need_sort``) only
    when an allocation needs them, so recently freed slots are not reused at once.

    The bookkeeping lives in host (numpy) arrays whatever the device: a free is a
    handful of vector operations over the freed slots, mostly over whole pages, and
    numpy's per-call cost is a fraction of torch's. Returned indices are int64 tensors
    on ``device``.

    Attributes:
        size: Pool size in tokens.
        page_size: Tokens per page.
        device: Device of the returned index tensors.
        num_pages: Usable pages.
        num_rows: Rows the matching KV pool needs (``size + page_size``).
    """

    def __init__(
        self,
        size: int,
        device: str | torch.device = "cpu",
        page_size: int = 1,
        need_sort: bool = True,
    ) -> None:
        """Create an allocator with every usable page free.

        Raises:
            InvalidInputError: ``page_size < 1`` or ``size`` smaller than one page.
        """
        self.page_size = check_count(page_size, "page_size", 1)
        self.size = check_count(size, "size", self.page_size)
        self.device = torch.device(device)
        self.need_sort = bool(need_sort)
        ps = self.page_size
        self.num_pages = self.size // ps
        self.num_rows = self.size + ps
        self._slot_end = (self.num_pages + 1) * ps  # first slot past the last page
        # One byte per slot, over whole pages so it reshapes to [pages, page_size]. A
        # bytearray underneath: bytearray.find (memchr) asks "is any slot of this run
        # free / live?" without a temporary, several times faster than numpy's all().
        self._live_bytes = bytearray((self.num_pages + 1) * ps)
        self._live = np.frombuffer(self._live_bytes, dtype=np.uint8)
        # The same bytes read as the widest words that tile a page, so marking or
        # testing a whole page touches one or two words rather than page_size bytes.
        word = next(w for w in (8, 4, 2, 1) if ps % w == 0)
        self._page_words = self._live.view(f"<u{word}").reshape(-1, ps // word)
        self._word_ones = np.frombuffer(b"\x01" * word, dtype=f"<u{word}")[0]
        self._page_shift = ps.bit_length() - 1 if ps & (ps - 1) == 0 else None
        self._offsets = np.arange(ps, dtype=np.int64)
        self._scratch = Scratch()
        self.clear()

    def clear(self) -> None:
        """Free every slot, drop any open free group and reset the free list."""
        self._pages = FreePages(self.num_pages, self.need_sort, self._scratch)
        self._live[:] = 0
        self._num_allocated = 0
        self._group_depth = 0
        self._group_pending: list[Sequence[Pages]] = []

    def claim(self, slots: np.ndarray) -> None:
        """Hand out exactly ``slots`` (distinct, each on a page of this pool) from an
        empty allocator, as if each had been allocated and the rest of its page freed:
        a page with any of them leaves the free list, every other page stays on it in
        order (a warm restart's tree; one pass, no temporary the size of the pool).

        Raises:
            InvalidInputError: the allocator has slots handed out, or a slot lies
                outside its pages.
        """
        if self._num_allocated or self._pages.available() != self.num_pages:
            raise InvalidInputError("claim needs an empty allocator")
        idx = host_indices(slots)
        if idx.size:
            _check_range(idx, self.page_size, self._slot_end)
        self._live[idx] = 1
        used = np.asarray(self._page_words.any(axis=1))
        self._pages.only(np.flatnonzero(~used[1:]) + 1)
        self._num_allocated = int(np.count_nonzero(self._live))

    def available_size(self) -> int:
        """How many slots ``alloc`` could hand out now (free pages * page_size)."""
        return self._pages.available() * self.page_size

    def ready_size(self) -> int:
        """How many slots ``alloc`` hands out before freed pages join the free list:
        allocations within it take the same slots whether made at once or in parts."""
        return self._pages.ready() * self.page_size

    def num_allocated(self) -> int:
        """Slots currently handed out."""
        return self._num_allocated

    def is_allocated(self, indices: IndexLike) -> torch.Tensor:
        """Whether each index is currently handed out (bool tensor on the CPU).

        Raises:
            SlotIndexError: An index lies outside ``[0, size + page_size)``.
        """
        idx = host_indices(indices)
        _check_range(idx, 0, self.num_rows)
        if idx.size and int(idx.max()) < self._slot_end:  # the usual case: no mask, no copy
            return torch.from_numpy(self._live[idx] != 0)
        live = np.zeros(idx.size, dtype=np.bool_)
        inside = idx < self._slot_end
        live[inside] = self._live[idx[inside]] != 0
        return torch.from_numpy(live)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Allocate ``need_size`` distinct slots in whole pages.

        Takes ``ceil(need_size / page_size)`` free pages and returns their first
        ``need_size`` slots; the unused tail of the last page stays reserved until the
        page comes back.

        Returns:
            An int64 1-D tensor on ``device``, or None (state unchanged) when there are
            not enough free pages.

        Raises:
            InvalidInputError: ``need_size`` is negative or not an int.
        """
        got = self.alloc_host(need_size)
        return None if got is None else self._to_device(got[0])

    def alloc_host(self, need_size: int) -> tuple[np.ndarray, list[tuple[int, int]] | None] | None:
        """As ``alloc``, but the slots stay a host int64 array, given with the
        ``[first, end)`` bounds of their runs of consecutive slots (None where they
        are too many to list), so a caller can work on them slice by slice."""
        # A plain non-negative int skips check_count's general coercion.
        n = (
            need_size
            if type(need_size) is int and need_size >= 0
            else check_count(need_size, "need_size", 0)
        )
        if n == 0:
            return np.zeros(0, dtype=np.int64), []
        ps = self.page_size
        num = -(-n // ps)
        pages = self._pages.take(num)
        if pages is None:
            return None
        # Pages taken from the front of the free list are mostly runs of consecutive
        # pages: build and mark each run as a slice; many runs take one vector pass.
        # A sorted free list holds distinct pages in ascending order, so its slice is
        # one run exactly when its ends lie num - 1 apart: no pass over it.
        if self.need_sort and int(pages[-1]) - int(pages[0]) == num - 1:
            ends = _NO_ENDS
        else:
            ends = breaks(pages, self._scratch)
        runs: list[tuple[int, int]] | None = None
        if ends.size == 0:
            start = int(pages[0]) * ps
            slots = np.arange(start, start + n, dtype=np.int64)
            self._live[start : start + n] = 1
            runs = [(start, start + n)]
        elif ends.size < _MAX_RUNS:
            slots, runs, done = np.empty(n, dtype=np.int64), [], 0
            for a, b in zip([0, *(ends + 1).tolist()], [*ends.tolist(), num - 1], strict=True):
                start = int(pages[a]) * ps
                length = min((b - a + 1) * ps, n - done)  # the last page's tail stays unmarked
                np.add(self._scratch.iota(length), start, out=slots[done : done + length])
                self._live[start : start + length] = 1
                runs.append((start, start + length))
                done += length
        elif ps == 1:
            slots = pages.copy()
            self._live[slots] = 1
        else:
            slots = (pages[:, None] * ps + self._offsets).reshape(-1)[:n]
            self._page_words[pages] = self._word_ones
            if n % ps:  # the last page's tail is reserved, not handed out
                self._live[int(slots[-1]) + 1 : (int(pages[-1]) + 1) * ps] = 0
        self._num_allocated += n
        return slots, runs

    def free(self, indices: IndexLike) -> None:
        """Free previously allocated slots, all or nothing.

        Every index is validated before anything changes. A page goes back (via the
        release list) once none of its handed-out slots is live any more.

        Raises:
            InvalidInputError: ``indices`` is not integer-valued.
            SlotIndexError: An index is out of range, slot 0, or in reserved page 0.
            DoubleFreeError: An index is not currently allocated, or repeats.
        """
        checked = self._validate_free(indices)
        if checked.idx is not None and checked.idx.size:
            self._apply_free(checked)

    def free_group_begin(self) -> None:
        """Start batching frees; their pages come back only at the matching end.

        Frees inside the group are validated and mark their slots free at once, so a
        double free across the group is still caught. Groups may nest.
        """
        self._group_depth += 1

    def free_group_end(self) -> None:
        """End a free group, releasing every page the group emptied.

        Raises:
            InvalidInputError: No free group is open.
        """
        if self._group_depth == 0:
            raise InvalidInputError("free_group_end() without free_group_begin()")
        self._group_depth -= 1
        if self._group_depth == 0:
            pending, self._group_pending = self._group_pending, []
            for pieces in pending:
                self._pages.release(pieces)

    def free_parts(self, parts: Sequence[IndexLike]) -> None:
        """``free`` of the parts joined end to end, without building the joined array.

        It checks, raises and frees as ``free(concatenation)`` does, all or nothing
        over every part (a slot in two parts is freed twice in one call). An eviction
        frees several nodes' slots this way, each node one or a few runs.

        Raises:
            The errors ``free`` raises.
        """
        arrays = [a for a in map(host_indices, parts) if a.size]
        if not arrays:
            return
        # The joined array is needed for one-slot pages and an unsorted free list (they
        # release pages in free order).
        runs: list[tuple[int, int]] | None = None
        if len(arrays) > 1 and self.page_size > 1 and self.need_sort:
            runs = []
            for a in arrays:
                found = runs_in(a, _MAX_RUNS - len(runs), self._scratch)
                if found is None:
                    runs = None
                    break
                runs += found
        if runs is None:
            TokenToKVPoolAllocator.free(
                self, arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
            )
            return
        self._check_runs(runs, arrays)
        self._apply_free(_Checked(None, None, runs))

    def _validate_free(self, indices: IndexLike) -> _Checked:
        """Normalise ``indices`` and raise if any of them may not be freed."""
        given = host_indices(indices)
        if given.size == 0:
            return _Checked(given, given, [])
        # Slots come back as a few contiguous runs (one or more per node). With few
        # runs, every check works on the runs' bounds and slices: no sort, no gather.
        runs = runs_in(given, _MAX_RUNS, self._scratch)
        if runs is not None:
            self._check_runs(runs, [given])
            return _Checked(given, given, runs)
        idx = np.sort(given, kind="stable")
        _check_range(idx, self.page_size, self._slot_end)
        repeated = idx[1:] == idx[:-1]
        if repeated.any():
            bad = distinct(idx[1:][repeated])[:_MAX_SHOWN].tolist()
            raise DoubleFreeError(f"slots freed twice in one call: {bad}")
        if not self._live[idx].all():
            self._refuse_not_live(idx)
        return _Checked(idx, given, None)

    def _check_runs(self, runs: list[tuple[int, int]], given: list[np.ndarray]) -> None:
        """Raise unless the slots of ``runs`` (found in ``given``, the arrays freed in
        one call) may all be freed; sorts ``runs`` ascending."""
        runs.sort()
        # max of both ends: a run ending below its start wrapped around int64 and so
        # starts near 2**63, out of range.
        if runs[0][0] < self.page_size or max(map(max, runs)) >= self._slot_end:
            _check_range(np.concatenate(given), self.page_size, self._slot_end)
        for (_, hi), (lo, last) in pairwise(runs):
            if lo <= hi:
                bad = list(range(lo, min(hi, last) + 1))[:_MAX_SHOWN]
                raise DoubleFreeError(f"slots freed twice in one call: {bad}")
        live = self._live_bytes
        for lo, hi in runs:
            if live.find(0, lo, hi + 1) != -1:  # memchr for a slot that is not live
                self._refuse_not_live(np.concatenate(given))

    def _refuse_not_live(self, idx: np.ndarray) -> None:
        bad = idx[self._live[idx] == 0][:_MAX_SHOWN].tolist()
        raise DoubleFreeError(f"slots not currently allocated: {bad}")

    def _apply_free(self, checked: _Checked) -> None:
        """Mark validated, non-empty slots free and release the pages that emptied."""
        runs = checked.runs
        if runs is not None:
            for lo, hi in runs:
                self._live[lo : hi + 1] = 0
                self._num_allocated -= hi - lo + 1
        else:
            idx = _kept(checked.idx)
            self._live[idx] = 0
            self._num_allocated -= idx.size
        emptied: Sequence[Pages]
        if self.page_size == 1:
            emptied = [_kept(checked.given).copy()]  # in free order, for need_sort=False
        elif runs is not None:
            emptied = self._emptied_in_runs(runs)
        else:
            emptied = [self._emptied_among(_kept(checked.idx))]
        if not self.need_sort and self.page_size > 1 and emptied:
            pages = np.concatenate(
                [
                    np.arange(p[0], p[1] + 1, dtype=np.int64) if isinstance(p, tuple) else p
                    for p in emptied
                ]
            )
            emptied = [
                self._in_given_order(pages, _kept(checked.given)) if pages.size > 1 else pages
            ]
        if self._group_depth:
            self._group_pending.append(emptied)
        else:
            self._pages.release(emptied)

    def _page_of(self, slots: np.ndarray) -> np.ndarray:
        shift = self._page_shift
        return slots >> shift if shift is not None else slots // self.page_size

    def _no_live_slot(self, words: np.ndarray) -> np.ndarray:
        if words.shape[1] == 1:
            free: np.ndarray = words[:, 0] == 0
            return free
        return np.logical_not(words.any(axis=1))

    def _emptied_in_runs(self, runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Pages spanned by freshly freed runs (ascending) that hold no live slot now.

        A page the run covers whole was all live and is now all free; only a page
        the run covers in part needs its other slots looked at (memchr for a live
        one). They come out as ``(first, last)`` spans, adjacent ones joined.
        """
        ps, live, done = self.page_size, self._live_bytes, -1
        spans: list[tuple[int, int]] = []
        for lo, hi in runs:
            first, last = max(lo // ps, done + 1), hi // ps
            if first > last:
                continue
            done = last
            if first * ps < lo and live.find(1, first * ps, first * ps + ps) != -1:
                first += 1
            if (
                first <= last
                and hi < last * ps + ps - 1
                and live.find(1, last * ps, last * ps + ps) != -1
            ):
                last -= 1
            if first > last:
                continue
            if spans and spans[-1][1] == first - 1:
                spans[-1] = (spans[-1][0], last)
            else:
                spans.append((first, last))
        return spans

    def _emptied_among(self, idx: np.ndarray) -> np.ndarray:
        """Pages of freshly freed ascending slots that hold no live slot now."""
        pages = self._page_of(idx)
        first = np.empty(pages.size, dtype=np.bool_)
        first[0] = True
        np.not_equal(pages[1:], pages[:-1], out=first[1:])
        pages = pages[first]
        emptied: np.ndarray = pages[self._no_live_slot(self._page_words[pages])]
        return emptied

    def _in_given_order(self, pages: np.ndarray, given: np.ndarray) -> np.ndarray:
        """``pages`` ordered by where their first slot appears in ``given``.

        Only for ``need_sort=False``, where the free list keeps free order.
        """
        unique, first = distinct_first(given // self.page_size)
        first = first[np.isin(unique, pages)]
        ordered: np.ndarray = given[np.sort(first)] // self.page_size
        return ordered

    def _to_device(self, slots: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(slots)
        return tensor if self.device.type == "cpu" else tensor.to(self.device)
