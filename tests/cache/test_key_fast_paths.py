"""RadixKey packing's exact-type fast paths and per-dtype range plans: subclasses
still go the general way, one dtype's cached plan never serves another, and the argmax /
argmin range check sees every element of strided and Fortran-ordered arrays."""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.cache import InvalidInputError, RadixKey, TokenRangeError
from prefixcache.cache.key import pack_tokens

U32 = 2**32
IDS = [0, 7, 2**16, 2**31 - 1, 2**31, U32 - 1]
WANT = pack_tokens(IDS)


class IdList(list):  # type: ignore[type-arg]
    pass


class IdArray(array):  # type: ignore[type-arg]
    pass


class IdNdarray(np.ndarray):
    pass


def test_subclasses_pack_like_their_base() -> None:
    for given_ids in (
        IdList(IDS),
        IdArray("q", IDS),
        np.array(IDS).view(IdNdarray),
        torch.nn.Parameter(torch.tensor(IDS), requires_grad=False),
    ):
        assert pack_tokens(given_ids) == WANT, type(given_ids)
    with pytest.raises(TokenRangeError):
        pack_tokens(IdArray("q", [-1]))
    with pytest.raises(TokenRangeError):
        pack_tokens(np.array([U32]).view(IdNdarray))


def test_plans_of_other_byte_orders_and_widths_never_mix() -> None:
    """'<i8' and '>i8' differ only in byte order: each needs its own unsigned view."""
    for _ in range(2):  # the second round runs on cached plans
        for dtype in ("<i8", ">i8", "<u8", ">u8", "<i4", ">i4", "<u4", ">u4", "l", "q"):
            ids = [i for i in IDS if i < 2**31] if "i4" in dtype else IDS
            assert pack_tokens(np.array(ids, dtype=dtype)) == pack_tokens(ids), dtype
            with pytest.raises(TokenRangeError):
                pack_tokens(np.array([3, U32 + 5], dtype=dtype if dtype[-1] == "8" else "q"))
        for dtype in ("<i2", ">i2", "i1", "<i4", ">i4"):
            with pytest.raises(TokenRangeError):
                pack_tokens(np.array([3, -2], dtype=dtype))


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, U32 - 1), min_size=2, max_size=30),
    st.integers(0, 29),
    st.sampled_from([-1, -(2**31), U32, 2**40]),
)
def test_strided_views_check_exactly_their_own_elements(
    ids: list[int], where: int, bad: int
) -> None:
    where %= len(ids)
    full = np.array(ids, dtype=np.int64)
    full[where] = bad
    kept = full[where % 2 :: 2]  # holds the bad id
    skipped = full[1 - where % 2 :: 2]  # does not
    with pytest.raises(TokenRangeError):
        pack_tokens(kept)
    assert pack_tokens(skipped) == pack_tokens(skipped.tolist())
    with pytest.raises(TokenRangeError):
        pack_tokens(torch.from_numpy(full)[where % 2 :: 2])


def test_fortran_and_transposed_2d_ids_pack_in_row_order() -> None:
    rows = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int64)
    want = pack_tokens([(1, 2, 3), (4, 5, 6)])
    for given_ids in (
        np.asfortranarray(rows),
        np.asfortranarray(rows.astype(np.int32)),
        np.ascontiguousarray(rows.T).T,
        torch.from_numpy(rows.T.copy()).T,
    ):
        assert pack_tokens(given_ids) == want, given_ids
    negative = np.asfortranarray(np.array([[1, 2], [3, -4]], dtype=np.int32))
    with pytest.raises(TokenRangeError):
        pack_tokens(negative)
    with pytest.raises(TokenRangeError):
        pack_tokens(np.asfortranarray(np.array([[1, 2], [U32, 4]], dtype=np.uint64)))


@pytest.mark.parametrize(
    "given_ids, error",
    [
        ([1, (2, 3)], InvalidInputError),  # ints then tuples: the array loop stops midway
        ([(1, 2), (3,)], InvalidInputError),
        ([1, 2, -3], TokenRangeError),
        ((1, U32), TokenRangeError),
        ([1, 2.0], InvalidInputError),
        ([1, "2"], InvalidInputError),
    ],
)
def test_lists_the_array_loop_refuses_get_the_general_errors(given_ids: Any, error: type) -> None:
    with pytest.raises(error):
        pack_tokens(given_ids)


def test_lists_of_tuples_and_numpy_scalars_still_pack() -> None:
    assert pack_tokens([(1, 2), (3, 4)]) == pack_tokens(np.array([[1, 2], [3, 4]]))
    assert pack_tokens(((1, 2), (3, 4)))[1] == 2
    assert pack_tokens([np.int64(5), np.uint32(6)]) == pack_tokens([5, 6])
    assert pack_tokens(np.array([5, 6], dtype=object)) == pack_tokens([5, 6])
    assert pack_tokens(range(3)) == pack_tokens([0, 1, 2])


def test_integer_tensors_of_every_width_pack() -> None:
    for dtype in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        assert pack_tokens(torch.tensor([1, 2, 100], dtype=dtype)) == pack_tokens([1, 2, 100])
    with pytest.raises(TokenRangeError):
        pack_tokens(torch.tensor([1, -1], dtype=torch.int8))
    for bad in (torch.tensor([1.0]), torch.tensor([True]), torch.tensor([1 + 1j])):
        with pytest.raises(InvalidInputError):
            pack_tokens(bad)


def test_keys_from_fast_paths_match_keys_from_lists() -> None:
    key = RadixKey(np.array(IDS, dtype=np.int64), extra_key="ns")
    assert key.packed() == WANT and len(key) == len(IDS)
    assert key[1:3].packed() == pack_tokens(IDS[1:3])
