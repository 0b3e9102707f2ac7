"""RadixKey packing from every integer container: the same bytes as the list path, and the
same refusals (with vectorized conversion, no per-element Python)."""

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
# Ids near the edges of every width the containers come in.
_EDGES = [0, 1, 127, 128, 255, 256, 2**15, 2**16 - 1, 2**16, 2**31 - 1, 2**31, U32 - 1]
valid_ids = st.lists(st.one_of(st.sampled_from(_EDGES), st.integers(0, U32 - 1)), max_size=40)
bad_ids = st.sampled_from([-1, -(2**31), -(2**63), U32, U32 + 1, 2**40, 2**63 - 1])


def containers(ids: list[int]) -> list[Any]:
    """``ids`` in every container that can hold them exactly."""
    out: list[Any] = [
        tuple(ids),
        array("I", ids),
        array("q", ids),
        array("l", ids),
        array("L", ids),
        array("Q", ids),
        np.array(ids, dtype=np.int64),
        np.array(ids, dtype=np.uint32),
        np.array(ids, dtype=np.uint64),
        np.array(ids, dtype=">i8"),
        np.array(ids, dtype=np.int64)[::-1][::-1],
        np.array(ids, dtype=object),
        torch.tensor(ids, dtype=torch.int64),
    ]
    top = max(ids, default=0)
    for bits, codes, np_type, torch_type in (
        (31, "i", np.int32, torch.int32),
        (15, "h", np.int16, torch.int16),
        (7, "b", np.int8, torch.int8),
    ):
        if top < 2**bits:
            out += [
                array(codes, ids),
                np.array(ids, dtype=np_type),
                torch.tensor(ids, dtype=torch_type),
            ]
    for bits, codes, np_type in ((16, "H", np.uint16), (8, "B", np.uint8)):
        if top < 2**bits:
            out += [array(codes, ids), np.array(ids, dtype=np_type)]
    return out


@settings(max_examples=60, deadline=None)
@given(valid_ids)
def test_every_container_packs_like_the_list(ids: list[int]) -> None:
    want = pack_tokens(ids)
    for given_ids in containers(ids):
        assert pack_tokens(given_ids) == want, type(given_ids)
        assert RadixKey(given_ids).packed() == want and len(RadixKey(given_ids)) == len(ids)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, U32 - 1), min_size=1, max_size=12), st.integers(1, 4))
def test_two_dimensional_arrays_are_tuple_tokens(flat: list[int], width: int) -> None:
    flat = flat * width
    rows = [tuple(flat[i : i + width]) for i in range(0, len(flat), width)]
    want = pack_tokens(rows)
    assert want[1] == width
    for given_ids in (
        np.array(rows, dtype=np.int64),
        np.array(rows, dtype=np.uint32),
        np.asfortranarray(np.array(rows, dtype=np.int64)),
        torch.tensor(rows, dtype=torch.int64),
    ):
        assert pack_tokens(given_ids) == want
        assert len(RadixKey(given_ids)) == len(rows)


@settings(max_examples=60, deadline=None)
@given(valid_ids, bad_ids, st.integers(0, 40))
def test_out_of_range_ids_are_refused_alike(ids: list[int], bad: int, where: int) -> None:
    ids = [*ids[:where], bad, *ids[where:]]
    with pytest.raises(TokenRangeError):
        pack_tokens(ids)
    holders: list[Any] = [
        array("q", ids),
        np.array(ids, dtype=np.int64),
        torch.tensor(ids, dtype=torch.int64),
        np.array(ids, dtype=">i8"),
    ]
    if bad >= 0:
        holders += [array("Q", ids), np.array(ids, dtype=np.uint64)]
    if all(-(2**31) <= i < 2**31 for i in ids):
        holders += [
            array("i", ids),
            np.array(ids, dtype=np.int32),
            torch.tensor(ids, dtype=torch.int32),
        ]
    for holder in holders:
        with pytest.raises(TokenRangeError, match=r"\[0, 2\*\*32\)"):
            pack_tokens(holder)


@pytest.mark.parametrize(
    "bad",
    [
        [1.0, 2.0],
        np.array([1.0, 2.0]),
        torch.tensor([1.0, 2.0]),
        array("d", [1.0]),
        array("f", [1.0]),
        np.array([True, False]),
        torch.tensor([True, False]),
        np.array([1 + 0j]),
        np.array(["1"]),
        np.zeros((2, 2, 2), dtype=np.int64),
        np.zeros((2, 0), dtype=np.int64),
        np.int64(3),
        array("u", "ab"),
    ],
)
def test_non_integer_containers_are_refused(bad: Any) -> None:
    """Floats and bools are refused, never truncated or read as 0/1."""
    with pytest.raises(InvalidInputError):
        pack_tokens(bad)


def test_empty_containers_pack_empty() -> None:
    for empty in (
        [],
        (),
        array("q"),
        np.zeros(0, np.int64),
        np.zeros((0, 2), np.int64),
        torch.zeros(0, dtype=torch.int64),
    ):
        assert pack_tokens(empty) == (b"", 1)
