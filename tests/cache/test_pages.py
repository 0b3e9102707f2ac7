"""Page form of slots (pages.py), the paged allocator's whole-page guarantee, and the
MLA / fp8 KV pool."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.cache import InvalidInputError, KVPool, TokenToKVPoolAllocator
from prefixcache.cache.pages import to_page_ids, to_slots, whole_pages


def test_page_form_round_trips() -> None:
    slots = np.array([8, 9, 10, 11, 4, 5, 6], dtype=np.int64)
    assert whole_pages(slots, 4) == 2
    assert to_page_ids(slots, 4).tolist() == [2, 1]
    assert to_slots([2, 1], 4, 7).tolist() == slots.tolist()
    assert to_page_ids(np.zeros(0, dtype=np.int64), 4).size == 0
    # page_size 1: every slot is its own page
    assert to_page_ids(np.array([5, 3, 9]), 1).tolist() == [5, 3, 9]


@pytest.mark.parametrize(
    "slots, good",
    [
        ([8, 9, 11, 10], 0),  # out of order inside the page
        ([9, 10, 11, 12], 0),  # not aligned
        ([4, 5, 6, 7, 9, 10], 1),  # short tail that does not start a page
        ([4, 5, 6, 7, 12, 13, 14, 16], 1),
    ],
)
def test_broken_pages_are_found(slots: list[int], good: int) -> None:
    array = np.array(slots, dtype=np.int64)
    assert whole_pages(array, 4) == good
    with pytest.raises(InvalidInputError, match=f"page {good}"):
        to_page_ids(array, 4)


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4, 16]),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=30),
)
def test_paged_allocator_hands_out_whole_pages(page_size: int, ops: list[tuple[bool, int]]) -> None:
    """Whatever the alloc / free history, every allocation has a page form."""
    alloc = TokenToKVPoolAllocator(128, page_size=page_size)
    held: list[np.ndarray] = []
    for do_alloc, n in ops:
        if do_alloc or not held:
            got = alloc.alloc_host(n)
            if got is None:
                continue
            pages = to_page_ids(got[0], page_size)  # raises if not whole pages
            assert pages.size == -(-n // page_size) and (pages >= 1).all()
            assert to_slots(pages, page_size, n).tolist() == got[0].tolist()
            held.append(got[0])
        else:
            alloc.free(held.pop(n % len(held)))


def test_mla_pool_has_no_v() -> None:
    pool = KVPool(16, page_size=4, layer_num=2, k_head_num=1, k_head_dim=8, mla=True)
    assert pool.v_buffer == [] and (pool.v_head_num, pool.v_head_dim) == (0, 0)
    assert pool.nbytes() == 2 * 20 * 8 * 2
    rows = torch.randn(3, 1, 8).half()
    pool.set_kv_buffer(1, [4, 5, 6], rows, None)
    k, v = pool.read_kv(1, [4, 5, 6])
    assert v is None and torch.equal(k, rows)
    with pytest.raises(InvalidInputError, match="no V"):
        pool.set_kv_buffer(1, [4], rows[:1], rows[:1])
    with pytest.raises(InvalidInputError, match="no V"):
        pool.get_value_buffer(0)
    with pytest.raises(InvalidInputError, match="no V"):
        KVPool(16, k_head_dim=8, v_head_dim=8, mla=True)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("mla", [False, True])
def test_fp8_pool_copies_bytes(dtype: torch.dtype, mla: bool) -> None:
    pool = KVPool(8, dtype=dtype, k_head_num=2, k_head_dim=4, mla=mla)
    # Every byte value, NaN patterns included: a numeric cast would not keep them.
    raw = torch.arange(64, dtype=torch.uint8).view(4, 2, 8)[..., :4].contiguous()
    rows = raw.view(dtype)
    pool.set_kv_buffer(0, [1, 2, 3, 4], rows, None if mla else rows)
    k, v = pool.read_kv(0, [1, 2, 3, 4])
    assert torch.equal(k.view(torch.uint8), raw)
    if not mla:
        assert torch.equal(v.view(torch.uint8), raw)
