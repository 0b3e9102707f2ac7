"""Write-back staging: evicted pages' bytes, copied out of the pool before eviction
frees their slots, on their way to a store below the pool (Mooncake's ``tier.write:
on_evict``, and every write of the disk tier).

Eviction hands a node's slots back to the allocator at once, and the next allocation
may overwrite their rows, so a write cannot read them later. ``copy`` runs inside the
eviction (the cache's ``before_free`` hook, on the loop): it copies the node's rows
into free pages of a bounded buffer, one gather per K and V buffer, and never waits on
the store. The write then reads the staging pages (zero-copy, like a write-through put
from the pool) and gives them back when answered. No room, no copy: the caller counts
a drop.

The buffer is page-major: staging page ``i`` is ``stride`` bytes at ``base + i *
stride``, the page's part of every K and V buffer one after the other in the layout's
order (so an object's bytes are those a write-through put of the same page stores),
then padding up to the stride. Anonymous memory, so the base is aligned to the OS page:
with a stride that is a multiple of the disk's block, a run of consecutive staging
pages is one aligned buffer, written to a run of disk slots by one O_DIRECT call.
"""

from __future__ import annotations

import itertools
import mmap

import numpy as np
import torch

from .backend import Parts
from .layout import PageLayout

# Staging bytes per model at most (and at most a quarter of the pool's pages).
MAX_STAGING_BYTES = 256 << 20


class Staging:
    """``pages`` staging pages of ``stride`` bytes (default: the page's bytes) for one
    model's layout."""

    def __init__(self, layout: PageLayout, pages: int, stride: int | None = None) -> None:
        stride = layout.page_bytes if stride is None else stride
        if stride < layout.page_bytes:
            raise ValueError(
                f"a staging stride of {stride} bytes is less than a page ({layout.page_bytes})"
            )
        self.layout = layout
        self.pages = pages
        self.stride = stride
        ps = layout.page_size
        # Rows of every pool buffer as bytes, (rows, row bytes), as numpy arrays: its
        # take is a memcpy per row (torch's index_copy_ of bytes is 15x slower).
        self._src = [b.view(b.shape[0], -1).view(torch.uint8).numpy() for b in layout.buffers]
        self._map = mmap.mmap(-1, max(pages * stride, 1))
        self._pages = np.frombuffer(self._map, dtype=np.uint8)[: pages * stride].reshape(
            pages, stride
        )
        self.base = int(self._pages.ctypes.data) if pages else 0
        self.part_bytes = [ps * rb for rb in layout.row_bytes]
        self.offsets = np.cumsum([0, *self.part_bytes[:-1]]).tolist()
        self._free = list(range(pages - 1, -1, -1))

    @classmethod
    def for_pool(cls, layout: PageLayout, pool_tokens: int, stride: int | None = None) -> Staging:
        stride = layout.page_bytes if stride is None else stride
        pages = min(pool_tokens // 4 // layout.page_size, MAX_STAGING_BYTES // max(stride, 1))
        return cls(layout, max(pages, 1), stride)

    @property
    def available(self) -> int:
        return len(self._free)

    def regions(self) -> list[tuple[int, int]]:
        """``(pointer, bytes)`` of the staging memory, to register with the store."""
        return [(self.base, self.pages * self.stride)]

    def copy(self, slots: np.ndarray) -> list[int] | None:
        """Copy the rows of ``slots`` (whole pages, host indices) into free staging
        pages; returns them, or None (nothing copied) when too few are free.

        Pages whose slots are one run, run after run in the pool, and land in
        consecutive staging pages (the usual case: the allocator hands out runs) are
        copied as one block per buffer, at memcpy speed; any other page row by row (a
        gather: measured 4x slower here, 2 KiB rows)."""
        ps = self.layout.page_size
        n = len(slots) // ps
        if n == 0 or n > len(self._free):
            return None
        taken = [self._free.pop() for _ in range(n)]
        pages = slots.reshape(n, ps)
        firsts = pages[:, 0]
        whole = (pages - firsts[:, None] == np.arange(ps)).all(axis=1)
        dest = np.asarray(taken)
        # A page continues the run before it when both it and that page are whole,
        # its first slot follows that page's last, and its staging page follows too.
        joined = np.zeros(n, dtype=bool)
        joined[1:] = (
            whole[1:] & whole[:-1] & (firsts[1:] == firsts[:-1] + ps) & (dest[1:] == dest[:-1] + 1)
        )
        starts = [*np.flatnonzero(~joined).tolist(), n]
        for a, b in itertools.pairwise(starts):
            if not whole[a]:  # a page alone, its slots scattered
                for src, off, part in zip(self._src, self.offsets, self.part_bytes, strict=True):
                    self._pages[taken[a], off : off + part] = np.take(
                        src, pages[a], axis=0
                    ).reshape(-1)
                continue
            first, m = int(firsts[a]), b - a
            dst = self._pages[taken[a] : taken[a] + m]
            for src, off, part in zip(self._src, self.offsets, self.part_bytes, strict=True):
                dst[:, off : off + part] = src[first : first + m * ps].reshape(m, part)
        return taken

    def parts(self, taken: list[int]) -> tuple[Parts, Parts]:
        """The store-object parts of staging pages ``taken``."""
        base, stride = self.base, self.stride
        ptrs = [[base + i * stride + off for off in self.offsets] for i in taken]
        return ptrs, [list(self.part_bytes) for _ in taken]

    def release(self, taken: list[int]) -> None:
        self._free.extend(taken)
