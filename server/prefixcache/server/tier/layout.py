"""A page's bytes in the pool: the parts of one store object.

One object per page holds the page's rows of every K and V buffer of every layer, in
buffer order (K0, K1, ..., V0, V1, ...). In each buffer a page is one run of rows when
its slots are consecutive (every page the allocator hands out, so every page fetched
and nearly every page written), else one run per stretch of consecutive slots. The
object's bytes never depend on where its rows lie, so two pools with the same layout
exchange pages whatever their slots.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .backend import Parts


class PageLayout:
    """The store-object parts of a model's pages (``kv_pool``: a ``KVPool``)."""

    def __init__(self, kv_pool: Any, page_size: int) -> None:
        self.buffers = [*kv_pool.k_buffer, *kv_pool.v_buffer]
        self.bases = [int(b.data_ptr()) for b in self.buffers]
        self.row_bytes = [int(b[0].numel() * b.element_size()) for b in self.buffers]
        self.page_size = page_size
        self.page_bytes = page_size * sum(self.row_bytes)
        self._bases = np.array(self.bases, dtype=np.int64)
        self._rows = np.array(self.row_bytes, dtype=np.int64)
        self._page_parts = [page_size * rb for rb in self.row_bytes]

    def regions(self) -> list[tuple[int, int]]:
        """``(pointer, bytes)`` of every buffer, to register with the store."""
        return [
            (base, int(b.numel() * b.element_size()))
            for base, b in zip(self.bases, self.buffers, strict=True)
        ]

    def parts(self, slots: np.ndarray) -> tuple[Parts, Parts]:
        """The parts (pointers, sizes) of each page of ``slots`` (whole pages).

        Vectorized (it runs on the loop, for up to thousands of pages a lookup): every
        page's pointers in one array op; pages whose slots are not one run are redone
        one by one. Pages share one sizes list (read only)."""
        ps = self.page_size
        pages = slots.reshape(-1, ps)
        firsts = pages[:, 0].astype(np.int64)
        ptrs: Parts = (self._bases[None, :] + firsts[:, None] * self._rows[None, :]).tolist()
        sizes: Parts = [self._page_parts] * len(pages)
        if ps > 1:
            for i in np.flatnonzero((np.diff(pages, axis=1) != 1).any(axis=1)).tolist():
                ptrs[i], sizes[i] = self._scattered(pages[i])
        return ptrs, sizes

    def _scattered(self, page: np.ndarray) -> tuple[list[int], list[int]]:
        """Parts of a page whose slots are not one run: a part per run per buffer."""
        cuts = np.flatnonzero(np.diff(page) != 1) + 1
        runs = [(int(r[0]), len(r)) for r in np.split(page, cuts)]
        ptrs: list[int] = []
        sizes: list[int] = []
        for base, rb in zip(self.bases, self.row_bytes, strict=True):
            for first, count in runs:
                ptrs.append(base + first * rb)
                sizes.append(count * rb)
        return ptrs, sizes
