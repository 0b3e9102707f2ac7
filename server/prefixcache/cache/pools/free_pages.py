"""FreePages: the free list of a paged pool, taken from the front, and the freed pages
waiting to join it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .slot_runs import Scratch

# Freed pages: an array of pages, or a (first, last) span of consecutive pages.
Pages = np.ndarray | tuple[int, int]


class FreePages:
    """Pages ``1..num_pages`` not handed out, in the order they will be handed out.

    ``take`` hands out pages from the front of the free list. Freed pages wait in a
    release list and join the free list (the whole of it sorted when ``need_sort``,
    else appended in free order) only when a ``take`` needs them, so recently freed
    pages are not reused at once. A sorted free list holds each page once, ascending.

    A merge writes the new free list into a spare buffer, which then takes the old
    list's buffer: two buffers reused for good, where a fresh array per merge would
    be a malloc. Released spans are merged without a sort or a temporary.
    """

    __slots__ = (
        "_base",
        "_free",
        "_head",
        "_num_released",
        "_released",
        "_scratch",
        "_spare",
        "need_sort",
        "num_pages",
    )

    def __init__(self, num_pages: int, need_sort: bool, scratch: Scratch) -> None:
        self.num_pages = num_pages
        self.need_sort = need_sort
        self._scratch = scratch
        # Every page free, ascending; nothing released.
        self._free = self._base = np.arange(1, self.num_pages + 1, dtype=np.int64)
        self._head = 0  # self._free[self._head:] are the free pages, next first
        self._spare = np.zeros(0, dtype=np.int64)
        self._released: list[Pages] = []
        self._num_released = 0

    def only(self, pages: np.ndarray) -> None:
        """Make ``pages`` (distinct, ascending, in ``1..num_pages``) the free list."""
        self._free = self._base = pages
        self._head = 0
        self._released, self._num_released = [], 0

    def available(self) -> int:
        """Pages a ``take`` could hand out now, released ones included."""
        return self._free.size - self._head + self._num_released

    def ready(self) -> int:
        """Pages a ``take`` hands out before it must merge the released ones in."""
        return self._free.size - self._head

    def take(self, num: int) -> np.ndarray | None:
        """The next ``num`` pages (a view, valid until the next ``take``), or None and
        no change when fewer are available."""
        if num > self._free.size - self._head:
            if num > self.available():
                return None
            self._merge()
        pages = self._free[self._head : self._head + num]
        self._head += num
        return pages

    def release(self, pieces: Sequence[Pages]) -> None:
        """Queue freed pages (no page twice, none free or queued already)."""
        for piece in pieces:
            size = piece[1] - piece[0] + 1 if isinstance(piece, tuple) else piece.size
            if size:
                self._released.append(piece)
                self._num_released += size

    def _merge(self) -> None:
        rest, pieces = self._free[self._head :], self._released
        total = rest.size + self._num_released
        out = self._spare if self._spare.size >= total else np.empty(total, dtype=np.int64)
        spans = [p for p in pieces if isinstance(p, tuple)] if self.need_sort else []
        if self.need_sort and len(spans) == len(pieces):
            self._merge_spans(rest, spans, out)  # the usual case: no sort, no temporary
        else:
            out[: rest.size] = rest
            pos = rest.size
            for piece in pieces:
                pos = self._put(piece, out, pos)
            if self.need_sort:
                out[:total].sort(kind="stable")  # sorted pieces: timsort merges them
        self._spare, self._base = self._base, out
        self._free, self._head = out[:total], 0
        self._released, self._num_released = [], 0

    def _merge_spans(self, rest: np.ndarray, spans: list[tuple[int, int]], out: np.ndarray) -> None:
        """Write sorted ``rest`` and the spans (disjoint from it and from each other)
        into ``out``, ascending."""
        pos = done = 0
        spans.sort()
        for first, last in spans:
            upto = int(rest.searchsorted(first))  # rest[done:upto] lies below the span
            out[pos : pos + upto - done] = rest[done:upto]
            pos, done = pos + upto - done, upto
            pos = self._put((first, last), out, pos)
        out[pos : pos + rest.size - done] = rest[done:]

    def _put(self, piece: Pages, out: np.ndarray, pos: int) -> int:
        """Write the pages of ``piece`` at ``out[pos:]``; return the position after them."""
        if isinstance(piece, tuple):
            first, last = piece
            size = last - first + 1
            np.add(self._scratch.iota(size), first, out=out[pos : pos + size])
            return pos + size
        out[pos : pos + piece.size] = piece
        return pos + piece.size
