"""SWATokenToKVPoolAllocator: a full-attention and a sliding-window slot pool, paired."""

from __future__ import annotations

import torch

from .allocator import (
    _MAX_SHOWN,
    IndexLike,
    TokenToKVPoolAllocator,
    _as_count,
    _check_range,
    _Checked,
    _to_index_tensor,
)
from .errors import DoubleFreeError, InvalidInputError


class SWATokenToKVPoolAllocator:
    """Pairs a full-attention allocator with a sliding-window one, slot for slot.

    Every allocation takes the same number of slots from both pools and records the
    full→SWA mapping; callers only ever see full slot indices. ``free_swa`` lets a
    caller drop the window slots of tokens that slid out of the window while keeping
    their full slots.

    Attributes:
        size: Full-attention pool size in tokens.
        size_swa: Sliding-window pool size in tokens.
        page_size: Tokens per page (shared by both pools).
        device: Device of every tensor kept or returned.
        full_attn_allocator: The full-attention allocator.
        swa_attn_allocator: The sliding-window allocator.
        full_to_swa_index_mapping: int64 tensor, one entry per full buffer row;
            0 means the full slot has no SWA slot.
    """

    def __init__(
        self,
        size: int,
        size_swa: int,
        device: str | torch.device = "cpu",
        page_size: int = 1,
        need_sort: bool = True,
    ) -> None:
        """Creates both allocators with everything free.

        Raises:
            InvalidInputError: A size is smaller than one page, or ``page_size < 1``.
        """
        self.full_attn_allocator = TokenToKVPoolAllocator(size, device, page_size, need_sort)
        self.swa_attn_allocator = TokenToKVPoolAllocator(size_swa, device, page_size, need_sort)
        self.size = self.full_attn_allocator.size
        self.size_swa = self.swa_attn_allocator.size
        self.page_size = self.full_attn_allocator.page_size
        self.device = self.full_attn_allocator.device
        self.full_to_swa_index_mapping = torch.zeros(
            self.full_attn_allocator.num_rows, dtype=torch.int64, device=self.device
        )

    def clear(self) -> None:
        """Frees everything in both pools and drops every mapping."""
        self.full_attn_allocator.clear()
        self.swa_attn_allocator.clear()
        self.full_to_swa_index_mapping.zero_()

    def available_size(self) -> int:
        """Returns how many tokens can be allocated now: min of both pools."""
        return min(self.full_available_size(), self.swa_available_size())

    def full_available_size(self) -> int:
        """Returns the full-attention pool's available slots."""
        return self.full_attn_allocator.available_size()

    def swa_available_size(self) -> int:
        """Returns the sliding-window pool's available slots."""
        return self.swa_attn_allocator.available_size()

    def num_allocated(self) -> int:
        """Returns the number of full slots currently handed out."""
        return self.full_attn_allocator.num_allocated()

    def is_allocated(self, indices: IndexLike) -> torch.Tensor:
        """Returns whether each full slot is handed out (see TokenToKVPoolAllocator)."""
        return self.full_attn_allocator.is_allocated(indices)

    def is_swa_mapped(self, full_indices: IndexLike) -> torch.Tensor:
        """Returns whether each full slot currently owns an SWA slot.

        Raises:
            SlotIndexError: An index lies outside the full pool's buffer rows.
        """
        return self.translate_loc_from_full_to_swa(full_indices) != 0

    def translate_loc_from_full_to_swa(self, full_indices: IndexLike) -> torch.Tensor:
        """Returns the SWA slot of each full slot (0 where unmapped).

        Raises:
            SlotIndexError: An index lies outside the full pool's buffer rows.
        """
        idx = _to_index_tensor(full_indices, self.device)
        if idx.numel() == 0:
            return idx
        _check_range(idx, 0, self.full_to_swa_index_mapping.numel())
        return self.full_to_swa_index_mapping.index_select(0, idx)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Allocates ``need_size`` full slots and as many SWA slots, all or nothing.

        Returns:
            The full slot indices, or None (nothing changed) if either pool is short.

        Raises:
            InvalidInputError: ``need_size`` is negative or not an int.
        """
        n = _as_count(need_size, "need_size", 0)
        if n == 0:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        # Check both sides first: allocating one and undoing it would still have
        # merged its release list and so changed its reuse order.
        needed = -(-n // self.page_size) * self.page_size
        if needed > self.available_size():
            return None
        full = self.full_attn_allocator.alloc(n)
        swa = self.swa_attn_allocator.alloc(n)
        assert full is not None and swa is not None  # guaranteed by the check above
        start = int(full[0])
        if self.full_attn_allocator.need_sort and int(full[-1]) - start == n - 1:
            # Sorted-mode allocations ascend, so this span means one contiguous run.
            self.full_to_swa_index_mapping[start : start + n].copy_(swa)
        else:
            self.full_to_swa_index_mapping.scatter_(0, full, swa)
        return full

    def free(self, full_indices: IndexLike) -> None:
        """Frees full slots and the SWA slots they still map to; all-or-nothing.

        Raises:
            InvalidInputError: ``full_indices`` is not integer-valued.
            SlotIndexError: An index is out of range or in the padding page.
            DoubleFreeError: A full slot is not allocated, or repeats.
        """
        full = self.full_attn_allocator._validate_free(full_indices)
        if full.idx.numel() == 0:
            return
        swa = self.full_to_swa_index_mapping.index_select(0, full.idx)
        if int(swa.min()) == 0:  # some window slots already went with free_swa
            swa = swa[swa != 0]
        swa = self.swa_attn_allocator._validate_free(swa)
        self._unmap(full)
        self.full_attn_allocator._apply_free(full)
        if swa.idx.numel():
            self.swa_attn_allocator._apply_free(swa)

    def free_swa(self, full_indices: IndexLike) -> None:
        """Frees only the SWA slots of these full slots; all-or-nothing.

        Raises:
            InvalidInputError: ``full_indices`` is not integer-valued.
            SlotIndexError: An index is out of range or in the padding page.
            DoubleFreeError: A full slot is not allocated, has no SWA slot any more,
                or repeats.
        """
        full = self.full_attn_allocator._validate_free(full_indices)
        idx = full.idx
        if idx.numel() == 0:
            return
        swa = self.full_to_swa_index_mapping.index_select(0, idx)
        if int(swa.min()) == 0:
            bad = idx[swa == 0][:_MAX_SHOWN].tolist()
            raise DoubleFreeError(f"full slots have no SWA slot (already freed): {bad}")
        checked = self.swa_attn_allocator._validate_free(swa)
        self._unmap(full)
        self.swa_attn_allocator._apply_free(checked)

    def _unmap(self, full: _Checked) -> None:
        """Clears the mapping of validated full slots."""
        if full.contiguous:
            self.full_to_swa_index_mapping[full.lo : full.hi + 1].zero_()
        else:
            zeros = torch.zeros(full.idx.numel(), dtype=torch.int64, device=self.device)
            self.full_to_swa_index_mapping.scatter_(0, full.idx, zeros)

    def free_group_begin(self) -> None:
        """Starts batching frees in both pools (see TokenToKVPoolAllocator)."""
        self.full_attn_allocator.free_group_begin()
        self.swa_attn_allocator.free_group_begin()

    def free_group_end(self) -> None:
        """Ends the free group in both pools.

        Raises:
            InvalidInputError: No free group is open.
        """
        if self.full_attn_allocator._group_depth == 0:
            raise InvalidInputError("free_group_end() without free_group_begin()")
        self.full_attn_allocator.free_group_end()
        self.swa_attn_allocator.free_group_end()
