"""HyperLogLog: an estimate of how many distinct 64-bit ids were added, in fixed memory.

Used for the hit-rate ceiling: distinct pages asked for against pages asked for says
what hit ratio an infinite pool would reach (1 - distinct / requested). Flajolet et
al.'s estimator with the linear-counting correction for small counts; 2**precision
one-byte registers, standard error about 1.04 / sqrt(2**precision) (1.6% at 12).

The ids must already be well mixed (``page_ids`` gives such ids): the top bits pick a
register, the trailing zeros of the rest give the rank. Adding is vectorised over a numpy array.
"""

from __future__ import annotations

import math

import numpy as np

_U64 = np.uint64


class HyperLogLog:
    """Distinct-count sketch over uint64 ids.

    Args:
        precision: log2 of the register count, 4 to 16.
    """

    def __init__(self, precision: int = 12) -> None:
        if not isinstance(precision, int) or not 4 <= precision <= 16:
            raise ValueError(f"precision must be an int in [4, 16], got {precision!r}")
        self.precision = precision
        self.registers = np.zeros(1 << precision, dtype=np.uint8)
        self._rest_bits = 64 - precision
        self._rest_mask = _U64((1 << self._rest_bits) - 1)

    def add(self, ids: np.ndarray) -> None:
        """Count each id of ``ids`` (uint64) as seen."""
        if not len(ids):
            return
        ids = np.asarray(ids, dtype=_U64)
        index = (ids >> _U64(self._rest_bits)).astype(np.intp)
        # The rank is 1 + the trailing zeros of the other bits (any run of bits of a
        # well-mixed id serves): popcount of the bits below the lowest set one.
        rest = ids | ~self._rest_mask  # a set bit above them caps an all-zero run
        zeros = np.bitwise_count((rest & (~rest + _U64(1))) - _U64(1))
        np.maximum.at(self.registers, index, (zeros + 1).astype(np.uint8))

    def estimate(self) -> float:
        """The estimated number of distinct ids added."""
        m = len(self.registers)
        alpha = 0.7213 / (1 + 1.079 / m)
        raw = alpha * m * m / float(np.sum(np.ldexp(1.0, -self.registers.astype(np.int64))))
        zeros = int(np.count_nonzero(self.registers == 0))
        if raw <= 2.5 * m and zeros:
            return m * math.log(m / zeros)
        return raw

    def clear(self) -> None:
        self.registers[:] = 0
