"""``alloc_host``: the same slots as ``alloc``, as a host array with their runs."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.cache import TokenToKVPoolAllocator

ops = st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=40)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 4, 16]), ops)
def test_alloc_host_matches_alloc(page: int, steps: list[tuple[bool, int]]) -> None:
    a = TokenToKVPoolAllocator(200, "cpu", page)
    b = TokenToKVPoolAllocator(200, "cpu", page)
    held: list[np.ndarray] = []
    for take, n in steps:
        if take or not held:
            want = a.alloc(n)
            got = b.alloc_host(n)
            assert (want is None) == (got is None)
            if got is None:
                continue
            slots, runs = got
            assert slots.dtype == np.int64 and slots.tolist() == want.tolist()
            if runs is not None:
                spans = [np.arange(lo, end) for lo, end in runs]
                joined = np.concatenate(spans) if spans else np.zeros(0, np.int64)
                assert joined.tolist() == slots.tolist()
            held.append(slots)
        else:
            slots = held.pop(n % len(held))
            a.free(slots)
            b.free(slots)
        assert a.available_size() == b.available_size()
        assert (
            a.is_allocated(np.arange(a.num_rows)).tolist()
            == b.is_allocated(np.arange(b.num_rows)).tolist()
        )
