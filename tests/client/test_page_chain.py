"""The worker's page chain (RequestHashes) is byte for byte the service's (hash_pages)."""

from __future__ import annotations

import hashlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.cache import RadixCache, RadixKey
from prefixcache.cache.hashing import hash_pages, hash_token_ids
from prefixcache.client import InvalidArgument, RequestHashes
from prefixcache.client.page_chain import page_key

ids = st.integers(0, 2**32 - 1)


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(ids, max_size=40), page_size=st.integers(1, 6), split=st.integers(0, 40))
def test_chain_equals_hash_pages(tokens: list[int], page_size: int, split: int) -> None:
    """Whole pages only, chained from nothing; extending later changes nothing."""
    packed = RadixKey(tokens).packed()[0]
    expected = hash_pages(packed, 4 * page_size, None)[: len(tokens) // page_size]
    whole = RequestHashes(tokens, page_size=page_size)
    assert whole.hex_hashes() == expected
    grown = RequestHashes(tokens[:split], page_size=page_size)
    grown.keys()  # hash what is there, then add the rest
    grown.extend(tokens[split:])
    assert grown.hex_hashes() == expected
    assert grown.keys() == [page_key(bytes.fromhex(h)) for h in expected]


@settings(max_examples=30, deadline=None)
@given(pairs=st.lists(st.tuples(ids, ids), min_size=1, max_size=20), page_size=st.integers(1, 4))
def test_tuple_tokens_chain_like_the_tree(pairs: list[tuple[int, int]], page_size: int) -> None:
    """Bigram keys: the tree's node hashes, root-down, are the request's chain."""
    cache = RadixCache(page_size, None, None, eager_page_hashes=True)
    key = RadixKey(pairs, extra_key="ns")
    result = cache.insert(key, torch.arange(len(pairs)))
    node, tree = result.last_node, []
    while node is not None and node.key_len:
        tree = list(node.hash_values) + tree
        node = node.parent
    request = RequestHashes(pairs, page_size=page_size, extra_key="ns")
    assert request.namespace == ("ns", 2)
    assert request.hex_hashes() == tree


def test_first_page_is_sglangs_block_hash() -> None:
    request = RequestHashes([1, 2, 3, 4], page_size=2)
    first, second = request.hex_hashes()
    assert first == hash_token_ids([1, 2])
    assert second == hash_token_ids([3, 4], first)
    assert request.digests(1) == [hashlib.sha256(bytes([1, 0, 0, 0, 2, 0, 0, 0])).digest()]


def test_lazy_and_partial() -> None:
    request = RequestHashes(range(10), page_size=4)
    assert (len(request), request.num_pages) == (10, 2)
    assert len(request.keys(1)) == 1
    assert "1/2 pages hashed" in repr(request)
    assert len(request.keys()) == 2


@pytest.mark.parametrize(
    "kwargs", [{"page_size": 0}, {"page_size": True}, {"page_size": 1, "extra_key": 5}]
)
def test_bad_arguments(kwargs: dict) -> None:
    with pytest.raises(InvalidArgument):
        RequestHashes([1], **kwargs)


def test_extend_refuses_another_width() -> None:
    request = RequestHashes([(1, 2)], page_size=1)
    with pytest.raises(InvalidArgument):
        request.extend([(1, 2, 3)])
    with pytest.raises(InvalidArgument):
        request.extend([-1, 2])


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 9), max_size=30),
    page_size=st.integers(1, 4),
    split=st.integers(0, 30),
    other=st.lists(st.integers(0, 9), max_size=30),
)
def test_grow_to_takes_an_extension_only(
    tokens: list[int], page_size: int, split: int, other: list[int]
) -> None:
    """grow_to hashes as a fresh request would when the tokens extend the old ones, and
    refuses (unchanged) when they do not."""
    grown = RequestHashes(tokens[:split], page_size=page_size)
    grown.keys()
    assert grown.grow_to(RadixKey(tokens).packed()[0], 1)
    assert grown.keys() == RequestHashes(tokens, page_size=page_size).keys()
    before = grown.keys()[:]
    extends = other[: len(tokens)] == tokens
    assert grown.grow_to(RadixKey(other).packed()[0], 1) == extends
    if not extends:
        assert grown.keys() == before and len(grown) == len(tokens)
    assert not grown.grow_to(RadixKey(tokens).packed()[0] * 2, 2)  # another width


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 9), max_size=30),
    page_size=st.integers(1, 4),
    split=st.integers(0, 30),
    cut=st.integers(0, 30),
    hashed=st.integers(0, 10),
)
def test_extended_and_prefix_share_hashes_and_hash_as_fresh(
    tokens: list[int], page_size: int, split: int, cut: int, hashed: int
) -> None:
    """A chain grown by ``extended`` or cut by ``prefix`` keys its pages as a fresh
    request of the same tokens, whatever was hashed before; the original is unchanged."""
    base = RequestHashes(tokens[:split], page_size=page_size)
    base.keys(hashed)
    before = base.keys()[:]
    grown = base.extended(tokens[split:])
    assert grown.keys() == RequestHashes(tokens, page_size=page_size).keys()
    assert base.keys() == before and len(base) == len(tokens[:split])
    assert grown.prefix(cut).keys() == RequestHashes(tokens[:cut], page_size=page_size).keys()
