"""TokenToKVPoolAllocator.claim: an empty allocator hands out exactly the given slots,
in the state that allocating every page and freeing the rest would leave it in."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.cache import InvalidInputError, TokenToKVPoolAllocator


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([1, 2, 4]), st.data())
def test_claim_is_allocate_all_then_free_the_rest(page_size: int, data: st.DataObject) -> None:
    size = 64
    rows = range(page_size, size + page_size)
    slots = np.asarray(data.draw(st.lists(st.sampled_from(rows), unique=True)), dtype=np.int64)
    claimed = TokenToKVPoolAllocator(size, "cpu", page_size)
    claimed.claim(slots)
    model = TokenToKVPoolAllocator(size, "cpu", page_size)
    every = model.alloc(model.available_size()).numpy()
    rest = every[~np.isin(every, slots)]
    if rest.size:
        model.free(rest)
    assert claimed.num_allocated() == model.num_allocated() == slots.size
    assert claimed.available_size() == model.available_size()
    assert claimed.is_allocated(np.arange(size + page_size)).equal(
        model.is_allocated(np.arange(size + page_size))
    )
    # What is left is handed out the same, and never a claimed slot.
    a, b = claimed.alloc(claimed.available_size()), model.alloc(model.available_size())
    assert sorted(a.tolist()) == sorted(b.tolist())
    assert not np.isin(a.numpy(), slots).any()
    claimed.free(slots)
    assert claimed.num_allocated() == a.numel()


def test_claim_refuses_a_busy_allocator_or_a_slot_outside() -> None:
    alloc = TokenToKVPoolAllocator(16, "cpu", 4)
    with pytest.raises(InvalidInputError):
        alloc.claim(np.asarray([2]))  # page 0 is the padding page
    alloc.alloc(4)
    with pytest.raises(InvalidInputError):
        alloc.claim(np.asarray([8]))
