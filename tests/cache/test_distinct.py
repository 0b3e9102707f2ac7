"""cache/distinct.py: the same answers as ``np.unique``, at a sort's cost whatever the
NumPy version, and the only place product code asks for distinct values.

The cost guard is a ratio within one run (each function against ``np.sort`` of the
same array, best of three), not a wall-clock limit: NumPy 2.3+'s hash-based
``np.unique`` is ~65x a sort at 1 M values, the sort-based answers 2-6x.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from prefixcache.cache.distinct import (
    count_distinct,
    distinct,
    distinct_counts,
    distinct_first,
    has_repeats,
)

ROOT = Path(__file__).resolve().parents[2]
VALUES = arrays(np.int64, st.integers(0, 200), elements=st.integers(0, 63))


@settings(max_examples=200, deadline=None)
@given(VALUES)
def test_answers_are_np_unique_s(values: np.ndarray) -> None:
    assert np.array_equal(distinct(values), np.unique(values))
    got, counts = distinct_counts(values)
    want, want_counts = np.unique(values, return_counts=True)
    assert np.array_equal(got, want) and np.array_equal(counts, want_counts)
    got, first = distinct_first(values)
    want, want_first = np.unique(values, return_index=True)
    assert np.array_equal(got, want) and np.array_equal(first, want_first)
    n = len(np.unique(values))
    assert count_distinct(values) == count_distinct(values, 64) == n
    assert has_repeats(values) == has_repeats(values, 64) == (n != len(values))


def _best(fn: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@pytest.mark.parametrize(
    ("name", "fn", "limit"),
    [
        ("distinct", distinct, 8.0),
        ("distinct_counts", distinct_counts, 8.0),
        ("has_repeats", has_repeats, 8.0),
        ("count_distinct (marks)", lambda v: count_distinct(v, 1 << 21), 8.0),
        ("distinct_first", distinct_first, 20.0),
    ],
)
def test_cost_stays_a_sort_s(name: str, fn: Callable[[np.ndarray], object], limit: float) -> None:
    values = np.random.default_rng(7).integers(0, 1 << 21, 1 << 20)
    sort = _best(lambda: np.sort(values))
    ratio = _best(lambda: fn(values)) / sort
    assert ratio < limit, f"{name}: {ratio:.1f}x a sort of the same 1 M values"


def test_product_code_asks_no_one_else() -> None:
    """No ``np.unique`` / ``unique_values`` outside cache/distinct.py: a new call would
    take NumPy's hash path again."""
    pattern = re.compile(r"\bnp\.unique(?:_values|_all|_counts|_inverse)?\(|\bnumpy\.unique\(")
    offenders = []
    for root in (ROOT / "server", ROOT / "client"):
        for path in root.rglob("*.py"):
            if path.name == "distinct.py" or "/v1/" in path.as_posix():
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if pattern.search(code) and "``" not in code:
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
