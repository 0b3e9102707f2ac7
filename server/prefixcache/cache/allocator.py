"""TokenToKVPoolAllocator: hands out KV-pool slots in whole pages, refusing bad frees."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .errors import DoubleFreeError, InvalidInputError, SlotIndexError

IndexLike = torch.Tensor | Sequence[int]

# Shown in error messages; enough to identify the problem without flooding logs.
_MAX_SHOWN = 8


def _as_count(value: object, name: str, minimum: int) -> int:
    """Returns ``value`` as an int >= ``minimum``, or raises InvalidInputError."""
    if isinstance(value, bool):
        raise InvalidInputError(f"{name} must be an int, got bool")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError as exc:
        raise InvalidInputError(f"{name} must be an int, got {type(value).__name__}") from exc
    if number < minimum:
        raise InvalidInputError(f"{name} must be >= {minimum}, got {number}")
    return number


def _to_index_tensor(indices: IndexLike, device: torch.device) -> torch.Tensor:
    """Converts an integer tensor or list to a flat int64 tensor on ``device``."""
    if isinstance(indices, torch.Tensor):
        tensor = indices
    else:
        try:
            tensor = torch.as_tensor(list(indices))
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidInputError(f"indices must be integers: {exc}") from exc
        if tensor.numel() == 0:
            tensor = tensor.to(torch.int64)
    if tensor.dtype == torch.bool or tensor.is_floating_point() or tensor.is_complex():
        raise InvalidInputError(f"indices must be an integer tensor, got dtype {tensor.dtype}")
    return tensor.reshape(-1).to(device=device, dtype=torch.int64)


class TokenToKVPoolAllocator:
    """Hands out KV-pool slots in whole pages and takes them back with full validation.

    Slot 0 (and, when paged, all of page 0) is padding and never handed out. Usable
    pages are ``1..size // page_size``; slot ``s`` lies in page ``s // page_size``.
    Allocation state is tracked per slot, so freeing part of a page never releases
    slots that are still live: a page goes back to the free list only once every slot
    of it that was handed out has been freed. Freed pages wait in a release list and
    are merged into the free list (sorted when ``need_sort``) only when an allocation
    needs them, so recently freed slots are not reused at once.

    Attributes:
        size: Requested pool size in tokens.
        page_size: Tokens per page.
        device: Device of every tensor the allocator keeps or returns.
    """

    def __init__(
        self,
        size: int,
        device: str | torch.device = "cpu",
        page_size: int = 1,
        need_sort: bool = True,
    ) -> None:
        """Creates an allocator with every usable page free.

        Args:
            size: Pool size in tokens; the KV pool must have ``size + page_size`` rows.
            device: Device for the bookkeeping tensors and the returned indices.
            page_size: Tokens per page (>= 1).
            need_sort: Sort the free list when merging released pages into it.

        Raises:
            InvalidInputError: ``page_size < 1`` or ``size`` smaller than one page.
        """
        self.page_size = _as_count(page_size, "page_size", 1)
        self.size = _as_count(size, "size", self.page_size)
        self.device = torch.device(device)
        self.need_sort = bool(need_sort)
        ps = self.page_size
        self.num_pages = self.size // ps
        # Rows of the matching KV pool; every index below this is a valid buffer row.
        self.num_rows = self.size + ps
        # First slot past the last usable page (<= num_rows).
        self._slot_end = (self.num_pages + 1) * ps
        # One byte per slot (uint8: its reductions are much faster than bool's on
        # CPU). Two spare pages keep it reshapeable to [pages, page_size] while still
        # covering every buffer row.
        self._table_len = (self.num_pages + 2) * ps
        self._allocated = torch.zeros(self._table_len, dtype=torch.uint8, device=self.device)
        # Whole pages read as one wide integer each, to test "any slot live" cheaply.
        width = next(w for w in (8, 4, 2, 1) if ps % w == 0)
        wide = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[width]
        self._page_rows = self._allocated.view(wide).view(-1, ps // width)
        self._page_offsets = torch.arange(ps, dtype=torch.int64, device=self.device)
        # Test hook: False forces the general page-release path.
        self._use_window = True
        self._page_shift = ps.bit_length() - 1 if ps & (ps - 1) == 0 else None
        # Created on first use: constant scatter sources and dedupe scratch tables.
        self._ones = torch.ones(0, dtype=torch.uint8, device=self.device)
        self._zeros = torch.zeros(0, dtype=torch.uint8, device=self.device)
        self._slot_stamp: torch.Tensor | None = None
        self._page_stamp: torch.Tensor | None = None
        self.clear()

    # ------------------------------------------------------------------ state

    def clear(self) -> None:
        """Frees every slot, drops any open free group and resets the free list."""
        self._free_pages = torch.arange(
            1, self.num_pages + 1, dtype=torch.int64, device=self.device
        )
        self._release_pages: list[torch.Tensor] = []
        self._release_count = 0
        self._allocated.zero_()
        self._num_allocated = 0
        self._group_depth = 0
        self._group_pending: list[torch.Tensor] = []

    def available_size(self) -> int:
        """Returns how many slots ``alloc`` could hand out now (free pages * page_size)."""
        return (self._free_pages.numel() + self._release_count) * self.page_size

    def num_allocated(self) -> int:
        """Returns the number of slots currently handed out."""
        return self._num_allocated

    def is_allocated(self, indices: IndexLike) -> torch.Tensor:
        """Returns a bool tensor: whether each index is currently handed out.

        Raises:
            SlotIndexError: An index lies outside ``[0, size + page_size)``.
        """
        idx = _to_index_tensor(indices, self.device)
        if idx.numel() == 0:
            return torch.zeros(0, dtype=torch.bool, device=self.device)
        _check_range(idx, 0, self.num_rows)
        return self._allocated.index_select(0, idx).bool()

    # ------------------------------------------------------------- allocation

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Allocates ``need_size`` distinct slots in whole pages.

        Takes ``ceil(need_size / page_size)`` free pages and returns their first
        ``need_size`` slots; the unused tail of the last page stays reserved until
        the page comes back.

        Args:
            need_size: Number of slots wanted (>= 0).

        Returns:
            An int64 1-D tensor on ``device``, or None (state unchanged) when there
            are not enough free pages.

        Raises:
            InvalidInputError: ``need_size`` is negative or not an int.
        """
        n = _as_count(need_size, "need_size", 0)
        if n == 0:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        ps = self.page_size
        num = -(-n // ps)
        if num > self._free_pages.numel():
            if num > self._free_pages.numel() + self._release_count:
                return None
            self._merge_release()
        pages = self._free_pages[:num]
        self._free_pages = self._free_pages[num:]
        first = int(pages[0])
        if num == 1 or (self.need_sort and int(pages[-1]) - first == num - 1):
            # A sorted free list holds distinct ascending pages, so this span means
            # consecutive pages: build the run instead of per-slot arithmetic.
            start = first * ps
            slots = self._arange(start, start + n)
            self._allocated[start : start + n].fill_(1)
        else:
            if ps == 1:
                # Clone so callers never keep the whole free-list storage alive.
                slots = pages.clone()
            else:
                slots = (pages.unsqueeze(1) * ps + self._page_offsets).reshape(-1)[:n]
            self._allocated.scatter_(0, slots, self._const(1, n))
        self._num_allocated += n
        return slots

    def _merge_release(self) -> None:
        """Moves released pages into the free list (sorted when ``need_sort``)."""
        if not self._release_pages:
            return
        merged = torch.cat([self._free_pages, *self._release_pages])
        if self.need_sort:
            merged = self._sorted_pages(merged)
        self._free_pages = merged
        self._release_pages = []
        self._release_count = 0

    def _sorted_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """Returns the distinct page numbers ``pages`` in ascending order."""
        # torch.sort is slow on CPU; once the list is a sizeable share of the pool a
        # linear bucket pass over all pages is cheaper.
        if pages.numel() * 16 < self.num_pages:
            return torch.sort(pages).values
        bucket = torch.zeros(self.num_pages + 1, dtype=torch.uint8, device=self.device)
        bucket.scatter_(0, pages, self._const(1, pages.numel()))
        return bucket.nonzero().squeeze(1)

    # ------------------------------------------------------------------- free

    def free(self, indices: IndexLike) -> None:
        """Frees previously allocated slots; all-or-nothing.

        Every index is validated before any state changes. A page goes back (via
        the release list) once none of its handed-out slots is live any more.

        Args:
            indices: Integer tensor (any device) or list of slot indices.

        Raises:
            InvalidInputError: ``indices`` is not integer-valued.
            SlotIndexError: An index is out of range, slot 0, or in reserved page 0.
            DoubleFreeError: An index is not currently allocated, or repeats.
        """
        checked = self._validate_free(indices)
        if checked.idx.numel():
            self._apply_free(checked)

    def free_group_begin(self) -> None:
        """Starts batching frees; their pages come back only at the matching end.

        Frees inside the group are validated and mark their slots free at once, so
        a double free across the group is still caught. Groups may nest.
        """
        self._group_depth += 1

    def free_group_end(self) -> None:
        """Ends a free group, releasing every page the group emptied.

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
        """Normalises ``indices`` and raises if any of them may not be freed."""
        idx = _to_index_tensor(indices, self.device)
        n = idx.numel()
        if n == 0:
            return _Checked(idx, 0, 0, True, True)
        lo, hi = int(idx[0]), int(idx[-1])
        if (
            hi - lo == n - 1
            and self.page_size <= lo
            and hi < self._slot_end
            and torch.equal(idx, self._arange(lo, hi + 1))
        ):
            # A contiguous run (what one allocation usually is): check by slicing.
            if int(self._allocated[lo : hi + 1].min()) == 0:
                live = self._allocated[lo : hi + 1]
                bad = idx[live == 0][:_MAX_SHOWN].tolist()
                raise DoubleFreeError(f"slots not currently allocated: {bad}")
            return _Checked(idx, lo, hi, True, True)
        lo, hi = _check_range(idx, self.page_size, self._slot_end)
        # Ascending order rules out repeats far more cheaply than a general check.
        ascending = n == 1 or int(torch.diff(idx).min()) > 0
        live = self._allocated.index_select(0, idx)
        if int(live.min()) == 0:
            bad = idx[live == 0][:_MAX_SHOWN].tolist()
            raise DoubleFreeError(f"slots not currently allocated: {bad}")
        if not ascending:
            if self._slot_stamp is None:
                self._slot_stamp = torch.zeros(
                    self._table_len, dtype=torch.int32, device=self.device
                )
            dups = _find_duplicates(idx, self._slot_stamp)
            if dups is not None:
                raise DoubleFreeError(f"slots freed twice in one call: {dups}")
        return _Checked(idx, lo, hi, ascending, False)

    def _apply_free(self, checked: _Checked) -> None:
        """Marks validated, non-empty slots free and releases the pages that emptied."""
        idx = checked.idx
        n = idx.numel()
        ps = self.page_size
        lo, hi = checked.lo, checked.hi
        first, last = lo // ps, hi // ps
        if checked.contiguous:
            self._allocated[lo : hi + 1].zero_()
            # Pages strictly inside the run are now empty; an edge page only if the
            # run covered all its live slots.
            if lo % ps and int(self._page_rows[first].amax()):
                first += 1
            if first <= last and (hi + 1) % ps and int(self._page_rows[last].amax()):
                last -= 1
            emptied = self._arange(first, last + 1)
        elif ps == 1:
            self._clear_slots(checked)
            # Distinct slots are their own pages; copy so the caller's tensor is free
            # to change.
            emptied = idx.clone()
        else:
            if self._use_window and last - first < 4 * (n // ps) + 8:
                # Pages that held live slots before and none after are exactly the
                # pages this free emptied: two slice reductions, no gather or dedupe.
                window = self._page_rows[first : last + 1]
                before = window.amax(dim=1) != 0
                self._clear_slots(checked)
                after = window.amax(dim=1) != 0
                emptied = (before & ~after).nonzero().squeeze(1) + first
            else:
                self._clear_slots(checked)
                emptied = self._emptied_pages(idx, checked.ascending)
        self._num_allocated -= n
        if emptied.numel() == 0:
            return
        if self._group_depth:
            self._group_pending.append(emptied)
        else:
            self._release(emptied)

    def _clear_slots(self, checked: _Checked) -> None:
        """Marks the validated, non-contiguous slots not allocated."""
        self._allocated.scatter_(0, checked.idx, self._const(0, checked.idx.numel()))

    def _arange(self, start: int, end: int) -> torch.Tensor:
        """Returns int64 ``[start, end)`` on the allocator's device."""
        return torch.arange(start, end, dtype=torch.int64, device=self.device)

    def _emptied_pages(self, idx: torch.Tensor, ascending: bool) -> torch.Tensor:
        """Returns the distinct pages of just-freed ``idx`` that have no live slot left."""
        if self._page_shift is not None:
            pages = idx >> self._page_shift
        else:
            pages = torch.div(idx, self.page_size, rounding_mode="floor")
        if ascending:
            pages = torch.unique_consecutive(pages)
        else:
            if self._page_stamp is None:
                self._page_stamp = torch.zeros(
                    self.num_pages + 2, dtype=torch.int32, device=self.device
                )
            pages = _unique_unsorted(pages, self._page_stamp)
        still_live = self._page_rows.index_select(0, pages).amax(dim=1) != 0
        return pages[~still_live]

    def _release(self, pages: torch.Tensor) -> None:
        """Puts emptied pages on the release list."""
        self._release_pages.append(pages)
        self._release_count += pages.numel()

    def _const(self, value: int, n: int) -> torch.Tensor:
        """Returns ``n`` uint8 copies of ``value`` (0 or 1) as a scatter source."""
        # scatter_ with a tensor source is several times faster than index_fill_ or
        # index_put_ on CPU; the sources are cached and grown geometrically.
        src = self._ones if value else self._zeros
        if src.numel() < n:
            length = min(max(n, 2 * src.numel(), 1024), max(n, self._table_len))
            src = torch.full((length,), value, dtype=torch.uint8, device=self.device)
            if value:
                self._ones = src
            else:
                self._zeros = src
        return src[:n]


class _Checked(NamedTuple):
    """Indices that passed free validation, with facts the free path reuses."""

    idx: torch.Tensor
    lo: int
    hi: int
    ascending: bool
    contiguous: bool


def _check_range(idx: torch.Tensor, low: int, high: int) -> tuple[int, int]:
    """Returns ``(min, max)`` of non-empty ``idx``; SlotIndexError unless in ``[low, high)``."""
    lo_t, hi_t = torch.aminmax(idx)
    lo, hi = int(lo_t), int(hi_t)
    if lo < low or hi >= high:
        bad = idx[(idx < low) | (idx >= high)][:_MAX_SHOWN].tolist()
        raise SlotIndexError(f"slot indices outside [{low}, {high}): {bad}")
    return lo, hi


def _find_duplicates(idx: torch.Tensor, stamp: torch.Tensor) -> list[int] | None:
    """Returns some repeated values of in-range ``idx``, or None if all are distinct.

    ``stamp`` is a scratch table indexed by value; it needs no reset because every
    entry read is written first.
    """
    if idx.numel() > stamp.numel():
        return idx[:_MAX_SHOWN].tolist()  # pigeonhole: something repeats
    pos = torch.arange(idx.numel(), dtype=torch.int32, device=idx.device)
    # With a repeat only one position's write survives, so another reads back a
    # different position.
    stamp.scatter_(0, idx, pos)
    lost = stamp.index_select(0, idx) != pos
    if not bool(lost.any()):
        return None
    return idx[lost][:_MAX_SHOWN].tolist()


def _unique_unsorted(values: torch.Tensor, stamp: torch.Tensor) -> torch.Tensor:
    """Returns one occurrence of each value, in O(n) (torch.unique sorts)."""
    pos = torch.arange(values.numel(), dtype=torch.int32, device=values.device)
    # Exactly one writer wins per value; keeping the winners dedupes.
    stamp.scatter_(0, values, pos)
    return values[stamp.index_select(0, values) == pos]
