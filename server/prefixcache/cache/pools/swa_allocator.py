"""SWATokenToKVPoolAllocator: a full-attention and a sliding-window slot pool, paired."""

from __future__ import annotations

import numpy as np
import torch

from ..errors import DoubleFreeError, IntegrityError, check_count
from .allocator import (
    _MAX_SHOWN,
    IndexLike,
    TokenToKVPoolAllocator,
    _check_range,
    _kept,
    host_indices,
)


class SWATokenToKVPoolAllocator:
    """Pairs a full-attention allocator with a sliding-window one, slot for slot.

    Every allocation takes the same number of slots from both pools and records the
    full→SWA mapping; callers only ever see full slot indices. ``free_swa`` drops the
    window slots of tokens that slid out of the window while keeping their full
    slots; ``free`` releases both (the window side only where it is still mapped).
    Every operation validates both sides before changing either.

    Attributes:
        size: Full-attention pool size in tokens.
        size_swa: Sliding-window pool size in tokens.
        page_size: Tokens per page (shared by both pools).
        device: Device of the returned index tensors.
        full_attn_allocator: The full-attention allocator.
        swa_attn_allocator: The sliding-window allocator.
    """

    def __init__(
        self,
        size: int,
        size_swa: int,
        device: str | torch.device = "cpu",
        page_size: int = 1,
        need_sort: bool = True,
    ) -> None:
        """Create both allocators with everything free.

        Raises:
            InvalidInputError: A size is smaller than one page, or ``page_size < 1``.
        """
        self.full_attn_allocator = TokenToKVPoolAllocator(size, device, page_size, need_sort)
        self.swa_attn_allocator = TokenToKVPoolAllocator(size_swa, device, page_size, need_sort)
        self.size = self.full_attn_allocator.size
        self.size_swa = self.swa_attn_allocator.size
        self.page_size = self.full_attn_allocator.page_size
        self.device = self.full_attn_allocator.device
        self._full_to_swa = np.zeros(self.full_attn_allocator.num_rows, dtype=np.int64)

    @property
    def full_to_swa_index_mapping(self) -> torch.Tensor:
        """The SWA slot of every full buffer row (0 = none), as a CPU tensor view."""
        return torch.from_numpy(self._full_to_swa)

    def clear(self) -> None:
        """Free everything in both pools and drop every mapping."""
        self.full_attn_allocator.clear()
        self.swa_attn_allocator.clear()
        self._full_to_swa[:] = 0

    def available_size(self) -> int:
        """How many tokens can be allocated now: the smaller pool's free slots."""
        return min(self.full_available_size(), self.swa_available_size())

    def full_available_size(self) -> int:
        return self.full_attn_allocator.available_size()

    def swa_available_size(self) -> int:
        return self.swa_attn_allocator.available_size()

    def num_allocated(self) -> int:
        """Full slots currently handed out."""
        return self.full_attn_allocator.num_allocated()

    def is_allocated(self, indices: IndexLike) -> torch.Tensor:
        """Whether each full slot is handed out (see TokenToKVPoolAllocator)."""
        return self.full_attn_allocator.is_allocated(indices)

    def is_swa_mapped(self, full_indices: IndexLike) -> torch.Tensor:
        """Whether each full slot still owns an SWA slot.

        Raises:
            SlotIndexError: An index lies outside the full pool's buffer rows.
        """
        return self.translate_loc_from_full_to_swa(full_indices) != 0

    def translate_loc_from_full_to_swa(self, full_indices: IndexLike) -> torch.Tensor:
        """The SWA slot of each full slot (0 where unmapped), on ``device``.

        Raises:
            SlotIndexError: An index lies outside the full pool's buffer rows.
        """
        idx = host_indices(full_indices)
        _check_range(idx, 0, self._full_to_swa.size)
        return self.full_attn_allocator._to_device(self._full_to_swa[idx])

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Allocate ``need_size`` full slots and as many SWA slots, all or nothing.

        Returns:
            The full slot indices, or None (nothing changed) if either pool is short.

        Raises:
            InvalidInputError: ``need_size`` is negative or not an int.
        """
        n = check_count(need_size, "need_size", 0)
        # Check both sides first: allocating one and undoing it would still have
        # merged its release list and so changed its reuse order.
        if -(-n // self.page_size) * self.page_size > self.available_size():
            return None
        full = self.full_attn_allocator.alloc(n)
        swa = self.swa_attn_allocator.alloc(n)
        if full is None or swa is None:  # the check above rules this out
            for got, side in ((full, self.full_attn_allocator), (swa, self.swa_attn_allocator)):
                if got is not None:
                    side.free(got)
            raise IntegrityError(
                f"SWA allocator: {n} slots were available, yet one side refused them"
            )
        self._full_to_swa[host_indices(full)] = host_indices(swa)
        return full

    def free(self, full_indices: IndexLike) -> None:
        """Free full slots and the SWA slots they still map to, all or nothing.

        Raises:
            InvalidInputError: ``full_indices`` is not integer-valued.
            SlotIndexError: An index is out of range or in the padding page.
            DoubleFreeError: A full slot is not allocated, or repeats.
        """
        full = self.full_attn_allocator._validate_free(full_indices)
        full_idx = _kept(full.idx)
        if full_idx.size == 0:
            return
        mapped = self._full_to_swa[full_idx]
        swa = self.swa_attn_allocator._validate_free(mapped[mapped != 0])
        self._full_to_swa[full_idx] = 0
        self.full_attn_allocator._apply_free(full)
        if _kept(swa.idx).size:
            self.swa_attn_allocator._apply_free(swa)

    def free_swa(self, full_indices: IndexLike) -> None:
        """Free only the SWA slots of these full slots, all or nothing.

        Raises:
            InvalidInputError: ``full_indices`` is not integer-valued.
            SlotIndexError: An index is out of range or in the padding page.
            DoubleFreeError: A full slot is not allocated, has no SWA slot any more,
                or repeats.
        """
        full_idx = _kept(self.full_attn_allocator._validate_free(full_indices).idx)
        if full_idx.size == 0:
            return
        swa = self._full_to_swa[full_idx]
        if not swa.all():
            bad = full_idx[swa == 0][:_MAX_SHOWN].tolist()
            raise DoubleFreeError(f"full slots have no SWA slot (already freed): {bad}")
        checked = self.swa_attn_allocator._validate_free(swa)
        self._full_to_swa[full_idx] = 0
        self.swa_attn_allocator._apply_free(checked)

    def free_group_begin(self) -> None:
        """Start batching frees in both pools (see TokenToKVPoolAllocator)."""
        self.full_attn_allocator.free_group_begin()
        self.swa_attn_allocator.free_group_begin()

    def free_group_end(self) -> None:
        """End the free group in both pools.

        Raises:
            InvalidInputError: No free group is open.
        """
        self.full_attn_allocator.free_group_end()
        self.swa_attn_allocator.free_group_end()
