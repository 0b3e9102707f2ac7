"""The client's exact-type dispatch and per-dtype range plans: subclasses and
odd containers still go the general way, cached plans never serve another dtype or wire
width, and the range check sees every element of strided and Fortran-ordered arrays."""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.client import InvalidArgument
from prefixcache.client._wire import pack_slots, pack_tokens

U32 = 2**32
IDS = [0, 7, 2**16, 2**31 - 1, 2**31, U32 - 1]
WANT = pack_tokens(IDS)


class IdList(list):  # type: ignore[type-arg]
    pass


class IdArray(array):  # type: ignore[type-arg]
    pass


class IdNdarray(np.ndarray):
    pass


class Packed:
    """Anything with a packed() method gives its own bytes (RadixKey's protocol)."""

    def packed(self) -> tuple[bytes, int]:
        return b"\x01\0\0\0\x02\0\0\0", 2


def test_subclasses_and_other_containers_pack_like_the_list() -> None:
    for given_ids in (
        IdList(IDS),
        IdArray("q", IDS),
        np.array(IDS).view(IdNdarray),
        torch.nn.Parameter(torch.tensor(IDS), requires_grad=False),
        iter(IDS),
        range(0, 0),
    ):
        want = WANT if not isinstance(given_ids, range) else (b"", 1)
        assert pack_tokens(given_ids) == want, type(given_ids)
    assert pack_tokens(Packed()) == (b"\x01\0\0\0\x02\0\0\0", 2)
    assert pack_tokens(b"\x01\0\0\0", 1) == (b"\x01\0\0\0", 1)
    with pytest.raises(InvalidArgument):
        pack_tokens(IdArray("q", [-1]))
    with pytest.raises(InvalidArgument):
        pack_tokens(np.array([U32]).view(IdNdarray))


def test_plans_of_other_byte_orders_and_wire_widths_never_mix() -> None:
    """A dtype's token plan (uint32 wire) and slot plan (int64 wire) are separate, and
    '<i8' and '>i8' each get their own unsigned view."""
    for _ in range(2):  # the second round runs on cached plans
        for dtype in ("<i8", ">i8", "<u8", ">u8", "<i4", ">i4", "<u4", ">u4", "l", "q"):
            ids = [i for i in IDS if i < 2**31] if "i4" in dtype else IDS
            given = np.array(ids, dtype=dtype)
            assert pack_tokens(given) == pack_tokens(ids), dtype
            assert pack_slots(given) == pack_slots(ids), dtype
        for dtype in ("<i8", ">i8", "<u8", ">u8"):
            with pytest.raises(InvalidArgument):
                pack_tokens(np.array([3, U32 + 5], dtype=dtype))
            assert pack_slots(np.array([3, U32 + 5], dtype=dtype)) == pack_slots([3, U32 + 5])
        for dtype in ("<i2", ">i2", "i1", "<i4", ">i4"):
            with pytest.raises(InvalidArgument):
                pack_tokens(np.array([3, -2], dtype=dtype))
            assert pack_slots(np.array([3, -2], dtype=dtype)) == pack_slots([3, -2])
    with pytest.raises(InvalidArgument):
        pack_slots(np.array([1, 2**63], dtype=">u8"))


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
    with pytest.raises(InvalidArgument):
        pack_tokens(kept)
    assert pack_tokens(skipped) == pack_tokens(skipped.tolist())
    with pytest.raises(InvalidArgument):
        pack_tokens(torch.from_numpy(full)[where % 2 :: 2])


def test_fortran_and_transposed_2d_ids_pack_in_row_order() -> None:
    rows = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int64)
    want = pack_tokens([(1, 2, 3), (4, 5, 6)])
    for given_ids in (
        np.asfortranarray(rows),
        np.asfortranarray(rows.astype(np.int32)),
        torch.from_numpy(rows.T.copy()).T,
    ):
        assert pack_tokens(given_ids) == want
    assert pack_slots(np.asfortranarray(rows)) == pack_slots([1, 2, 3, 4, 5, 6])
    with pytest.raises(InvalidArgument):
        pack_tokens(np.asfortranarray(np.array([[1, 2], [3, -4]], dtype=np.int32)))


@pytest.mark.parametrize(
    "given_ids",
    [
        [1, (2, 3)],  # ints then tuples: the array loop stops midway
        [(1, 2), (3,)],
        [1, 2, -3],
        (1, U32),
        [1, 2.0],
        [1, "2"],
        [np.float64(1.0)],
    ],
)
def test_lists_the_array_loop_refuses_get_the_general_errors(given_ids: Any) -> None:
    with pytest.raises(InvalidArgument):
        pack_tokens(given_ids)


def test_lists_of_tuples_and_numpy_scalars_and_token_width_still_pack() -> None:
    pairs = pack_tokens([(1, 2), (3, 4)])
    assert pairs[1] == 2
    assert pack_tokens(((1, 2), (3, 4))) == pairs
    assert pack_tokens(np.array([[1, 2], [3, 4]], dtype=np.uint32)) == pairs
    for flat in ([1, 2, 3, 4], array("q", [1, 2, 3, 4]), np.arange(1, 5), torch.arange(1, 5)):
        assert pack_tokens(flat, token_width=2) == pairs, type(flat)
        with pytest.raises(InvalidArgument):
            pack_tokens(flat, token_width=3)
    assert pack_tokens([np.int64(5), np.uint32(6)]) == pack_tokens([5, 6])
    assert pack_tokens([torch.tensor(5), 6]) == pack_tokens([5, 6])


def test_integer_tensors_of_every_width_pack() -> None:
    for dtype in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        given = torch.tensor([1, 2, 100], dtype=dtype)
        assert pack_tokens(given) == pack_tokens([1, 2, 100])
        assert pack_slots(given) == pack_slots([1, 2, 100])
    with pytest.raises(InvalidArgument):
        pack_tokens(torch.tensor([1, -1], dtype=torch.int8))
    for bad in (torch.tensor([1.0]), torch.tensor([True]), torch.tensor([1 + 1j])):
        with pytest.raises(InvalidArgument):
            pack_tokens(bad)
        with pytest.raises(InvalidArgument):
            pack_slots(bad)
