"""TokenToKVPoolAllocator: hands out KV-pool slots in whole pages, refusing bad frees."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import NamedTuple

import numpy as np
import torch

from .errors import DoubleFreeError, InvalidInputError, SlotIndexError, check_count

IndexLike = torch.Tensor | np.ndarray | Sequence[int]

# Shown in error messages; enough to identify the problem without flooding logs.
_MAX_SHOWN = 8


def host_indices(indices: IndexLike) -> np.ndarray:
    """Slot indices as a flat int64 host array (shared with a CPU int64 tensor's memory)."""
    if isinstance(indices, torch.Tensor):
        if indices.dtype == torch.int64 and indices.dim() == 1 and indices.device.type == "cpu":
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


class _Checked(NamedTuple):
    """Slots validated for freeing and not yet freed.

    ``given`` is in the caller's order; ``runs`` lists the ``(first, last)`` slots of
    each contiguous run, ascending, when there are few of them; otherwise ``runs`` is
    None and ``idx`` holds the slots sorted.
    """

    idx: np.ndarray
    given: np.ndarray
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
        # One byte per slot, over whole pages so it reshapes to [pages, page_size].
        self._live = np.zeros((self.num_pages + 1) * ps, dtype=np.uint8)
        # The same bytes read as the widest words that tile a page, so marking or
        # testing a whole page touches one or two words rather than page_size bytes.
        word = next(w for w in (8, 4, 2, 1) if ps % w == 0)
        self._page_words = self._live.view(f"<u{word}").reshape(-1, ps // word)
        self._word_ones = np.frombuffer(b"\x01" * word, dtype=f"<u{word}")[0]
        self._page_shift = ps.bit_length() - 1 if ps & (ps - 1) == 0 else None
        self._offsets = np.arange(ps, dtype=np.int64)
        self._iota_cache = np.zeros(0, dtype=np.int64)
        self.clear()

    def clear(self) -> None:
        """Free every slot, drop any open free group and reset the free list."""
        self._free = np.arange(1, self.num_pages + 1, dtype=np.int64)
        self._head = 0  # self._free[self._head:] are the free pages, next first
        self._released: list[np.ndarray] = []
        self._num_released = 0
        self._live[:] = 0
        self._num_allocated = 0
        self._group_depth = 0
        self._group_pending: list[np.ndarray] = []

    def available_size(self) -> int:
        """How many slots ``alloc`` could hand out now (free pages * page_size)."""
        return (self._free.size - self._head + self._num_released) * self.page_size

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
        n = check_count(need_size, "need_size", 0)
        if n == 0:
            return np.zeros(0, dtype=np.int64), []
        ps = self.page_size
        num = -(-n // ps)
        if num > self._free.size - self._head:
            if num > self._free.size - self._head + self._num_released:
                return None
            self._merge_released()
        pages = self._free[self._head : self._head + num]
        self._head += num
        # Pages taken from the front of the free list are mostly runs of consecutive
        # pages: build and mark each run as a slice; many runs take one vector pass.
        ends = np.flatnonzero(pages[1:] - pages[:-1] != 1)
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
                np.add(self._iota(length), start, out=slots[done : done + length])
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

    def _iota(self, n: int) -> np.ndarray:
        """``arange(n)``, from one array kept for reuse (it grows to the largest run)."""
        if self._iota_cache.size < n:
            grown = min(2 * self._iota_cache.size, self._slot_end)
            self._iota_cache = np.arange(max(n, grown), dtype=np.int64)
        return self._iota_cache[:n]

    def _merge_released(self) -> None:
        """Move released pages into the free list (sorted when ``need_sort``)."""
        merged = np.concatenate([self._free[self._head :], *self._released])
        if self.need_sort:
            merged.sort(kind="stable")  # sorted pieces: timsort merges them in linear time
        self._free, self._head = merged, 0
        self._released, self._num_released = [], 0

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
        if checked.idx.size:
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
            for pages in pending:
                self._release(pages)

    def _validate_free(self, indices: IndexLike) -> _Checked:
        """Normalise ``indices`` and raise if any of them may not be freed."""
        given = host_indices(indices)
        if given.size == 0:
            return _Checked(given, given, [])
        # Slots come back as a few contiguous runs (one or more per node). With few
        # runs, every check works on the runs' bounds and slices: no sort, no gather.
        ends = np.flatnonzero(given[1:] - given[:-1] != 1)
        if ends.size < _MAX_RUNS:
            firsts, lasts = [0, *(ends + 1).tolist()], [*ends.tolist(), given.size - 1]
            bounds = zip(firsts, lasts, strict=True)
            runs = sorted((int(given[a]), int(given[b])) for a, b in bounds)
            if runs[0][0] < self.page_size or max(hi for _, hi in runs) >= self._slot_end:
                _check_range(given, self.page_size, self._slot_end)
            for (_, hi), (lo, last) in pairwise(runs):
                if lo <= hi:
                    bad = list(range(lo, min(hi, last) + 1))[:_MAX_SHOWN]
                    raise DoubleFreeError(f"slots freed twice in one call: {bad}")
            if not all(self._live[lo : hi + 1].all() for lo, hi in runs):
                self._refuse_not_live(given)
            return _Checked(given, given, runs)
        idx = np.sort(given, kind="stable")
        _check_range(idx, self.page_size, self._slot_end)
        repeated = idx[1:] == idx[:-1]
        if repeated.any():
            bad = np.unique(idx[1:][repeated])[:_MAX_SHOWN].tolist()
            raise DoubleFreeError(f"slots freed twice in one call: {bad}")
        if not self._live[idx].all():
            self._refuse_not_live(idx)
        return _Checked(idx, given, None)

    def _refuse_not_live(self, idx: np.ndarray) -> None:
        bad = idx[self._live[idx] == 0][:_MAX_SHOWN].tolist()
        raise DoubleFreeError(f"slots not currently allocated: {bad}")

    def _apply_free(self, checked: _Checked) -> None:
        """Mark validated, non-empty slots free and release the pages that emptied."""
        idx = checked.idx
        self._num_allocated -= idx.size
        if checked.runs is not None:
            for lo, hi in checked.runs:
                self._live[lo : hi + 1] = 0
        else:
            self._live[idx] = 0
        if self.page_size == 1:
            emptied = checked.given.copy()  # in free order, for need_sort=False
        elif checked.runs is not None:
            emptied = self._emptied_in_runs(checked.runs)
        else:
            emptied = self._emptied_among(idx)
        if not self.need_sort and emptied.size > 1:
            emptied = self._in_given_order(emptied, checked.given)
        if emptied.size == 0:
            return
        if self._group_depth:
            self._group_pending.append(emptied)
        else:
            self._release(emptied)

    def _page_of(self, slots: np.ndarray) -> np.ndarray:
        shift = self._page_shift
        return slots >> shift if shift is not None else slots // self.page_size

    def _no_live_slot(self, words: np.ndarray) -> np.ndarray:
        return words[:, 0] == 0 if words.shape[1] == 1 else ~words.any(axis=1)

    def _emptied_in_runs(self, runs: list[tuple[int, int]]) -> np.ndarray:
        """Pages spanned by freshly freed runs (ascending) that hold no live slot now.

        A page the run covers whole was all live and is now all free; only a page
        the run covers in part needs its other slots looked at.
        """
        ps, words, spans, done = self.page_size, self._page_words, [], -1
        for lo, hi in runs:
            first, last = max(lo // ps, done + 1), hi // ps
            if first > last:
                continue
            done = last
            whole_from = first if first * ps >= lo else first + 1
            whole_to = last if (last + 1) * ps - 1 <= hi else last - 1
            if whole_from <= whole_to:
                spans.append(np.arange(whole_from, whole_to + 1, dtype=np.int64))
            edges = {page for page in (first, last) if not whole_from <= page <= whole_to}
            spans.extend(np.array([page], dtype=np.int64) for page in edges
                         if not words[page].any())
        return np.concatenate(spans) if spans else np.zeros(0, dtype=np.int64)

    def _emptied_among(self, idx: np.ndarray) -> np.ndarray:
        """Pages of freshly freed ascending slots that hold no live slot now."""
        pages = self._page_of(idx)
        first = np.empty(pages.size, dtype=np.bool_)
        first[0] = True
        np.not_equal(pages[1:], pages[:-1], out=first[1:])
        pages = pages[first]
        return pages[self._no_live_slot(self._page_words[pages])]

    def _in_given_order(self, pages: np.ndarray, given: np.ndarray) -> np.ndarray:
        """``pages`` ordered by where their first slot appears in ``given``.

        Only for ``need_sort=False``, where the free list keeps free order.
        """
        unique, first = np.unique(given // self.page_size, return_index=True)
        first = first[np.isin(unique, pages)]
        return given[np.sort(first)] // self.page_size

    def _release(self, pages: np.ndarray) -> None:
        self._released.append(pages)
        self._num_released += pages.size

    def _to_device(self, slots: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(slots)
        return tensor if self.device.type == "cpu" else tensor.to(self.device)
