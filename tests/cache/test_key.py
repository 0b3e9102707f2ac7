"""RadixKey: packing, slicing and namespaces."""

from __future__ import annotations

from array import array

import pytest
import torch

from prefixcache.cache import InvalidInputError, RadixKey, TokenRangeError


def test_len_counts_tuple_tokens_once() -> None:
    """len() counts tokens; a tuple token is one token."""
    assert len(RadixKey([1, 2, 3])) == 3
    assert len(RadixKey([(1, 2), (3, 4)])) == 2


def test_slicing_keeps_the_namespace() -> None:
    """Slices and integer indices return keys in the same namespace (int -> 1 token)."""
    key = RadixKey([1, 2, 3, 4], "ns")
    assert key[1:3].token_ids == [2, 3] and key[1:3].extra_key == "ns"
    assert key[-1].token_ids == [4] and len(key[0]) == 1
    with pytest.raises(IndexError):
        key[4]


def test_packed_form_is_uint32_little_endian() -> None:
    """Keys pack to the bytes the reference hashes: 4 bytes per id, little-endian."""
    assert RadixKey([1, 2, 3]).packed() == (bytes.fromhex("010000000200000003000000"), 1)
    assert RadixKey([(1, 2)]).packed() == (bytes.fromhex("0100000002000000"), 2)


@pytest.mark.parametrize(
    "ids", [[1, 2, 3], array("I", [1, 2, 3]), array("q", [1, 2, 3]), torch.tensor([1, 2, 3])]
)
def test_every_input_type_packs_the_same(ids: object) -> None:
    """Lists, arrays and tensors of the same ids give the same key bytes."""
    assert RadixKey(ids).packed() == RadixKey([1, 2, 3]).packed()


def test_from_bytes_round_trips() -> None:
    """A key built from wire bytes decodes to the same tokens and slices without decoding."""
    packed, _ = RadixKey([(5, 6), (7, 8), (9, 10)]).packed()
    key = RadixKey.from_bytes(packed, token_width=2, extra_key="x")
    assert key.token_ids == [(5, 6), (7, 8), (9, 10)] and len(key) == 3
    assert key[1:].token_ids == [(7, 8), (9, 10)] and key[1:].extra_key == "x"
    assert key.page_aligned(2).token_ids == [(5, 6), (7, 8)]
    with pytest.raises(InvalidInputError):
        RadixKey.from_bytes(b"\x00" * 6)


@pytest.mark.parametrize(
    ("ids", "error"),
    [
        ([-1], TokenRangeError),
        ([2**32], TokenRangeError),
        ([(1, 2), (3,)], InvalidInputError),
        ([1.5], InvalidInputError),
        ([1, (2, 3)], InvalidInputError),
    ],
)
def test_malformed_ids_raise_clear_errors(ids: list, error: type) -> None:
    """Bad token ids are refused with a specific error when the key is first used."""
    with pytest.raises(error):
        RadixKey(ids).packed()


def test_repr_is_short() -> None:
    """repr shows the namespace and the first tokens only."""
    text = repr(RadixKey(list(range(100)), "a"))
    assert "extra_key='a'" in text and "len=100" in text and "99" not in text
