"""The page index: every page of the tree found by its hash, token pages and hash pages,
through splits and evictions; hash pages never reach the change log it forwards to."""

from __future__ import annotations

import hashlib
from itertools import count

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.cache import RadixCache, RadixKey, hash_token_ids
from prefixcache.cache.index.change_log import ChangeLog, PagesRemoved, PagesStored
from prefixcache.cache.index.page_index import (
    PageIndex,
    encode_hash_pages,
    hash_namespace,
    hash_page_width,
    is_hash_namespace,
)

PAGE = 2
_slots = count(1)


def slots(n: int) -> torch.Tensor:
    return torch.tensor([next(_slots) for _ in range(n)], dtype=torch.int64)


def make() -> tuple[RadixCache, PageIndex, ChangeLog]:
    log = ChangeLog()
    index = PageIndex(log)
    return RadixCache(PAGE, listener=index), index, log


def insert_tokens(cache: RadixCache, tokens: list[int], extra_key: str | None = None) -> None:
    cache.insert(RadixKey(tokens, extra_key), slots(len(tokens)))


def insert_hashes(
    cache: RadixCache, hashes: list[str], base: bytes = b"", extra_key: str | None = None
) -> None:
    width = hash_page_width(PAGE)
    packed = base + encode_hash_pages(hashes, PAGE)
    key = RadixKey.from_bytes(packed, width, hash_namespace(extra_key))
    cache.insert(key, slots(len(packed) // (4 * width)))


def digests(seed: int, n: int) -> list[str]:
    out, prior = [], b""
    for i in range(n):
        prior = hashlib.sha256(prior + bytes([seed, i])).digest()
        out.append(prior.hex())
    return out


def test_helpers() -> None:
    names = {hash_namespace(k, w) for k in (None, "", "a", "=a") for w in (1, 2)}
    assert len(names) == 8 and all(is_hash_namespace(n) for n in names)
    assert not is_hash_namespace(None) and not is_hash_namespace("lora")
    assert [hash_page_width(p) for p in (1, 2, 3, 8, 64)] == [8, 4, 3, 1, 1]
    page = encode_hash_pages(["ab" * 32], 64)
    assert len(page) == 256 and page[:32] == b"\xab" * 32 and not page[32:].strip(b"\0")


def test_token_pages_are_found_by_their_chain() -> None:
    cache, index, _ = make()
    insert_tokens(cache, [1, 2, 3, 4, 5, 6])
    insert_tokens(cache, [1, 2, 3, 4, 9, 9])  # splits the first node after two pages
    h12 = hash_token_ids([1, 2])
    h34 = hash_token_ids([3, 4], h12)
    h99 = hash_token_ids([9, 9], h34)
    ns = (None, 1)
    assert index.find(ns, h34).parent == h12 and index.find(ns, h99).parent == h34
    packed, pages = index.path(ns, h99)
    assert (RadixKey.from_bytes(packed).token_ids, pages) == ([1, 2, 3, 4, 9, 9], 3)
    assert index.find((None, 1), hash_token_ids([9, 9])) is None  # not chained: no page
    assert index.find(("x", 1), h12) is None
    index.check()
    cache.evict(2)  # the oldest leaf, [5, 6]
    assert index.find(ns, hash_token_ids([5, 6], h34)) is None and len(index) == 3
    index.check()


def test_hash_pages_are_indexed_but_not_forwarded() -> None:
    cache, index, log = make()
    insert_tokens(cache, [7, 8])
    chain = digests(1, 3)
    insert_hashes(cache, chain[:2])
    base, _ = index.path((hash_namespace(None), hash_page_width(PAGE)), chain[1])
    insert_hashes(cache, chain[2:], base)  # continues the chain on its path
    hidden = (hash_namespace(None), hash_page_width(PAGE))
    assert index.find(hidden, chain[2]).parent == chain[1]
    assert index.path(hidden, chain[2])[1] == 3
    index.check()
    stored = [r for r in log.since(-1) if isinstance(r, PagesStored)]
    assert [r.extra_key for r in stored] == [None]  # only the token page
    assert [p.extra_key for p in log.snapshot().pages] == [None]
    cache.evict(100)
    removed = [r for r in log.since(-1) if isinstance(r, PagesRemoved)]
    assert [r.extra_key for r in removed] == [None] and len(index) == 0
    index.check()


def test_reset_clears_the_index() -> None:
    cache, index, _ = make()
    insert_tokens(cache, [1, 2])
    insert_hashes(cache, digests(2, 1))
    cache.reset()
    assert len(index) == 0
    index.check()


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["tokens", "hashes", "evict"]), st.integers(0, 3), st.integers(1, 4)
        ),
        max_size=25,
    )
)
def test_index_follows_any_workload(ops: list[tuple[str, int, int]]) -> None:
    """After every insert (splitting or not), hash-chain continuation and eviction, the
    index equals the tree's pages, and the forwarded log never names a hash page."""
    cache, index, log = make()
    hidden = (hash_namespace(None), hash_page_width(PAGE))
    for op, seed, n in ops:
        if op == "tokens":
            insert_tokens(
                cache, [seed % 2, 1, seed, 2, seed, 3, 0, 0][: 2 * n], None if seed < 3 else "x"
            )
        elif op == "hashes":
            chain = digests(seed % 2, n)
            # Continue on the longest stored prefix of the chain, as SetPages does.
            held = 0
            while held < n and index.find(hidden, chain[held]) is not None:
                held += 1
            if held < n:
                base = index.path(hidden, chain[held - 1])[0] if held else b""
                insert_hashes(cache, chain[held:], base)
        else:
            cache.evict(2 * n)
        index.check()
    for record in log.since(-1) or []:
        assert not is_hash_namespace(getattr(record, "extra_key", None))


def test_a_missing_parent_is_a_bookkeeping_error() -> None:
    cache, index, _ = make()
    insert_tokens(cache, [1, 2, 3, 4])
    h12 = hash_token_ids([1, 2])
    del index._parents[(None, 1)][h12], index._tokens[(None, 1)][h12]
    with pytest.raises(AssertionError, match="missing"):  # IntegrityError
        index.path((None, 1), hash_token_ids([3, 4], h12))
    with pytest.raises(AssertionError, match="out of step"):
        index.check()


def test_a_looping_path_is_refused_not_followed() -> None:
    """Two pages of one digest on one path (only a repeated hash in one call could do it,
    and SetPages refuses that) make the walk loop: refused instead of hanging."""
    cache, index, _ = make()
    page = digests(5, 1)[0]
    insert_hashes(cache, [page, page])
    with pytest.raises(AssertionError, match="loops"):
        index.path((hash_namespace(None), hash_page_width(PAGE)), page)
