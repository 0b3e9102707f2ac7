"""Runs of consecutive slot (or page) indices: finding them, with buffers kept for reuse.

Slots come back to the allocator as a few runs (each tree node's value is one or a few),
so a free checks and clears runs as slices rather than slot by slot. The temporaries of
that search live in a ``Scratch``: a fresh array per call is a malloc, and on a
fragmented heap a malloc of tens of kilobytes can cost more than the pass that fills it.
"""

from __future__ import annotations

import numpy as np

# Buffers grow to this many elements; a longer vector gets fresh temporaries.
SCRATCH_MAX = 1 << 20


class Scratch:
    """Reusable int64 and bool buffers, and a cached ``arange``."""

    __slots__ = ("_flags", "_ints", "_iota")

    def __init__(self) -> None:
        self._ints = np.zeros(0, dtype=np.int64)
        self._flags = np.zeros(0, dtype=np.bool_)
        self._iota = np.zeros(0, dtype=np.int64)

    def get(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """An int64 and a bool buffer of ``n`` elements (contents undefined)."""
        if self._ints.size < n:
            if n > SCRATCH_MAX:
                return np.empty(n, dtype=np.int64), np.empty(n, dtype=np.bool_)
            size = min(max(n, 2 * self._ints.size), SCRATCH_MAX)
            self._ints, self._flags = np.empty(size, dtype=np.int64), np.empty(size, np.bool_)
        return self._ints[:n], self._flags[:n]

    def iota(self, n: int) -> np.ndarray:
        """``arange(n)`` as a read-only view of one array (it grows to the largest n)."""
        if self._iota.size < n:
            self._iota = np.arange(max(n, min(2 * self._iota.size, SCRATCH_MAX)), dtype=np.int64)
            self._iota.flags.writeable = False
        return self._iota[:n]


def breaks(a: np.ndarray, scratch: Scratch) -> np.ndarray:
    """Positions ``i`` where ``a[i + 1] != a[i] + 1`` (``a`` 1-D int64)."""
    diff, flags = scratch.get(max(a.size - 1, 0))
    np.subtract(a[1:], a[:-1], out=diff)
    return np.flatnonzero(np.not_equal(diff, 1, out=flags))


def runs_in(given: np.ndarray, limit: int, scratch: Scratch) -> list[tuple[int, int]] | None:
    """``(first, last)`` of each run of consecutive ascending values in non-empty int64
    ``given``, in order; None when there are more than ``limit`` runs.

    A run's ``last`` may lie below its ``first`` only where int64 wrapped around, and
    such a run holds values near ``±2**63`` (a caller's range check must see that).
    """
    n = given.size
    first, last = int(given[0]), int(given[-1])
    if n == 1:
        return [(first, last)]
    # Strictly ascending with last - first == n - 1 leaves every step exactly 1: one
    # run, proven by one compare pass instead of a subtract, a compare and a nonzero.
    if last - first == n - 1:
        _, flags = scratch.get(n - 1)
        if np.count_nonzero(np.greater(given[1:], given[:-1], out=flags)) == n - 1:
            return [(first, last)]
    ends = breaks(given, scratch)
    if ends.size >= limit:
        return None
    firsts = given[[0, *(ends + 1).tolist()]].tolist()
    return list(zip(firsts, given[[*ends.tolist(), n - 1]].tolist(), strict=True))
