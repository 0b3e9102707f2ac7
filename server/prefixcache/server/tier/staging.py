"""Write-back staging (``tier.write: on_evict``): evicted pages' bytes, copied out of
the pool before eviction frees their slots, on their way to the store.

Eviction hands a node's slots back to the allocator at once, and the next allocation
may overwrite their rows, so a put cannot read them later. ``copy`` runs inside the
eviction (the cache's ``before_free`` hook, on the loop): it copies the node's rows
into free pages of a bounded buffer registered with the store, one gather per K and V
buffer, and never waits on the store. The put job then reads the staging pages
(zero-copy, like a write-through put from the pool) and gives them back when answered.
No room, no copy: the caller counts a drop.

Each staging page has one contiguous part per K and V buffer, in the layout's order,
so an object's bytes are those a write-through put of the same page stores.
"""

from __future__ import annotations

import numpy as np
import torch

from .backend import Parts
from .layout import PageLayout

# Staging bytes per model at most (and at most a quarter of the pool's pages).
MAX_STAGING_BYTES = 256 << 20


class Staging:
    """``pages`` page-sized staging slots for one model's layout."""

    def __init__(self, layout: PageLayout, pages: int) -> None:
        self.layout = layout
        self.pages = pages
        ps = layout.page_size
        # Rows of every pool buffer as bytes, (rows, row bytes), as numpy arrays: its
        # take is a memcpy per row (torch's index_copy_ of bytes is 15x slower).
        self._src = [b.view(b.shape[0], -1).view(torch.uint8).numpy() for b in layout.buffers]
        # One region per buffer: page i's part is row i of it (ps rows of the buffer).
        self._dst = [np.empty((pages, ps * rb), dtype=np.uint8) for rb in layout.row_bytes]
        self.bases = [int(d.ctypes.data) for d in self._dst]
        self.part_bytes = [ps * rb for rb in layout.row_bytes]
        self._free = list(range(pages - 1, -1, -1))

    @classmethod
    def for_pool(cls, layout: PageLayout, pool_tokens: int) -> Staging:
        pages = min(pool_tokens // 4 // layout.page_size,
                    MAX_STAGING_BYTES // max(layout.page_bytes, 1))
        return cls(layout, max(pages, 1))

    @property
    def available(self) -> int:
        return len(self._free)

    def regions(self) -> list[tuple[int, int]]:
        """``(pointer, bytes)`` of every staging region, to register with the store."""
        return [(base, int(d.nbytes)) for base, d in zip(self.bases, self._dst, strict=True)]

    def copy(self, slots: np.ndarray) -> list[int] | None:
        """Copy the rows of ``slots`` (whole pages, host indices) into free staging
        pages; returns them, or None (nothing copied) when too few are free."""
        ps = self.layout.page_size
        n = len(slots) // ps
        if n == 0 or n > len(self._free):
            return None
        taken = [self._free.pop() for _ in range(n)]
        first = taken[0]
        if taken[-1] - first == n - 1 and taken == list(range(first, first + n)):
            # Consecutive staging pages (the usual case): gather straight into them.
            for src, dst in zip(self._src, self._dst, strict=True):
                np.take(src, slots, axis=0, out=dst[first:first + n].reshape(n * ps, -1))
        else:
            for src, dst in zip(self._src, self._dst, strict=True):
                dst[taken] = np.take(src, slots, axis=0).reshape(n, -1)
        return taken

    def parts(self, taken: list[int]) -> tuple[Parts, Parts]:
        """The store-object parts of staging pages ``taken``."""
        ptrs = [[base + i * pb for base, pb in zip(self.bases, self.part_bytes, strict=True)]
                for i in taken]
        return ptrs, [list(self.part_bytes) for _ in taken]

    def release(self, taken: list[int]) -> None:
        self._free.extend(taken)
