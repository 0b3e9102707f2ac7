"""Page identities for lookup outcomes: cheap 64-bit ids of token prefixes, and the
bounded record of evicted pages they key.

A page is named by everything up to its end (its namespace and every token from the
namespace root), as a radix tree holds it: the same page after another prefix is
another page. SHA-256 page hashes (``hashing.hash_pages``) name pages so too, but cost
about a microsecond a page in a Python loop; these ids are one vectorised pass over
the key instead (a position-weighted polynomial over the token words, modulo 2**64,
mixed with the namespace and the length), a few nanoseconds a token. They are hints
for operators (why a lookup missed, how many distinct pages were asked for), never a
cache key: a collision only misnames a miss.

``EvictedPages`` is the record: a fixed number of page ids, least recently added
dropped first. The cache feeds it from its eviction path (``RadixEviction``'s
``eviction_observer``): a page that left the tree is "evicted", one never seen is
"cold". Pages known only by their SHA-256 page hash (SGLang's, ``page_index``) are
recorded under ``sha_page_id`` so that a lookup by hash finds them too.

Single-threaded like the caches.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from functools import lru_cache

import numpy as np

from ..node import TreeNode
from .page_index import DIGEST_BYTES, hash_namespace, is_hash_namespace

_U64 = np.uint64
_MULT = _U64(0x9E3779B97F4A7C15)  # odd, so its powers never vanish modulo 2**64
_LEN = _U64(0xD6E8FEB86659FD93)
# Powers kept between calls, at most (8 MiB): a longer key computes its own.
_MAX_KEPT = 1 << 20
DEFAULT_RECORD_PAGES = 1 << 16
# Pages are named in blocks of at least this many tokens: at page size 1 a page per
# token made a long prompt's eviction and cold lookup cost milliseconds of per-page
# Python work; a block of 16 keeps it to a few hundred microseconds.
BLOCK_TOKENS = 16


def block_pages(page_size: int) -> int:
    """Pages per block: the unit the record and the distinct-page count name."""
    return max(1, BLOCK_TOKENS // page_size)


@lru_cache(maxsize=4096)
def namespace_salt(extra_key: str | None, token_width: int) -> int:
    """A stable 64-bit salt per namespace (None and "" differ), the same in every
    process, so ids of one namespace never equal another's."""
    tag = f"{token_width}:" + ("\x00none" if extra_key is None else "=" + extra_key)
    return int.from_bytes(hashlib.blake2b(tag.encode(), digest_size=8).digest(), "little")


def sha_page_id(page_hash: str, salt: int) -> int:
    """The record's id of a page known by its hex SHA-256 page hash."""
    return int(page_hash[:16], 16) ^ salt


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, element-wise (spreads every bit over the id)."""
    x = x ^ (x >> _U64(30))
    x = x * _U64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> _U64(27))
    x = x * _U64(0x94D049BB133111EB)
    mixed: np.ndarray = x ^ (x >> _U64(31))
    return mixed


class PrefixIds:
    """Computes page ids; keeps a table of the multiplier's powers, grown on demand
    (8 bytes per token of the longest key seen)."""

    def __init__(self) -> None:
        self._powers = np.ones(1, dtype=_U64)

    def _table(self, n: int) -> np.ndarray:
        if len(self._powers) < n:
            size = max(n, min(2 * len(self._powers), _MAX_KEPT))
            powers = np.empty(size, dtype=_U64)
            powers[0] = 1
            powers[1:] = np.cumprod(np.full(size - 1, _MULT, dtype=_U64), dtype=_U64)
            if size > _MAX_KEPT:  # one long key's: not kept
                return powers[:n]
            self._powers = powers
        return self._powers[:n]

    def pages(
        self, packed: bytes | memoryview, page_words: int, salt: int, first: int = 0
    ) -> np.ndarray:
        """Ids of the whole pages of ``packed`` (uint32 words, from the namespace
        root), from page ``first`` on; ``page_words`` words a page (or a block of
        pages: an id names everything up to its end)."""
        count = len(packed) // 4 // page_words
        if first >= count:
            return np.zeros(0, dtype=_U64)
        n = count * page_words
        words = np.frombuffer(packed, dtype="<u4", count=n).astype(_U64)
        words += _U64(1)  # so leading zero tokens still count
        words *= self._table(n)
        sums = np.cumsum(words, dtype=_U64)[page_words - 1 :: page_words][first:]
        ends = np.arange(first + 1, count + 1, dtype=_U64) * _U64(page_words)
        return _mix(sums ^ (ends * _LEN) ^ _U64(salt))


class EvictedPages:
    """The ids of the last ``capacity`` distinct pages evicted: a ring, oldest out
    first, and a set to look ids up in. A page evicted again while the ring still
    holds it keeps its place (it is not added twice).

    Args:
        capacity: ids kept (about 80 bytes each, set entry included).
    """

    def __init__(self, capacity: int = DEFAULT_RECORD_PAGES) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        self.capacity = capacity
        self._ring = np.zeros(capacity, dtype=_U64)
        self._next = 0  # ids ever added; the ring's write position is this % capacity
        self._ids: set[int] = set()

    def add(self, ids: Iterable[int]) -> None:
        # Bulk set operations and one slice assignment: a Python loop of dict updates
        # per page cost milliseconds for a long prompt's eviction at page size 1.
        # Deduplicate in C first; evicted pages are nearly always new to the record, so
        # the per-id filter (a Python loop) runs only when some id is already known.
        known = self._ids
        fresh = list(dict.fromkeys(ids))
        if not known.isdisjoint(fresh):
            fresh = [i for i in fresh if i not in known]
        if not fresh:
            return
        if len(fresh) > self.capacity:
            fresh = fresh[-self.capacity :]
        n, cap = len(fresh), self.capacity
        at = self._next % cap
        first = min(n, cap - at)
        parts = ((at, fresh[:first]), (0, fresh[first:])) if first < n else ((at, fresh),)
        filled = min(self._next, cap)
        for start, chunk in parts:
            stop = start + len(chunk)
            if start < filled:  # these slots hold older ids: they go
                known.difference_update(self._ring[start : min(stop, filled)].tolist())
            self._ring[start:stop] = chunk
        known.update(fresh)
        self._next += n

    def __contains__(self, page_id: object) -> bool:
        return page_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def clear(self) -> None:
        self._ids.clear()
        self._next = 0


class EvictionRecorder:
    """Feeds an ``EvictedPages`` from a cache's eviction path: set ``observe`` as the
    cache's ``eviction_observer``.

    A token page is recorded by its prefix id and, where the node has SHA-256 page
    hashes (eager hashing: KV events, the page index), by those too; a hash page (stored
    by SetPages) by the digest it holds, under its token namespace's salt.
    """

    def __init__(self, record: EvictedPages, ids: PrefixIds, block: int = 1) -> None:
        self.record = record
        self.ids = ids
        self.block = block  # pages per id (block_pages)
        self.pages = 0
        self.errors = 0

    def observe(self, node: TreeNode) -> None:
        """Record ``node``'s pages. Called inside the cache's eviction, so it never
        raises: a failure here would leave the tree half evicted. Failures are counted
        (``errors``) and the node's pages go unrecorded (they will read as cold)."""
        try:
            self._observe(node)
        except Exception:
            self.errors += 1

    def _observe(self, node: TreeNode) -> None:
        ns = node.namespace
        if ns is None or not node.key_len:
            return
        self.pages += node.key_len // ns.page_size
        if is_hash_namespace(ns.extra_key):
            self.record.add(self._digest_ids(node))
            return
        salt = namespace_salt(ns.extra_key, ns.token_width)
        parts, above = [node.key_bytes], node.parent
        while above is not None and above.key_len:
            parts.append(above.key_bytes)
            above = above.parent
        before = sum(len(p) for p in parts[1:])
        block_bytes = ns.page_bytes * self.block  # the blocks that end in this node
        ids = self.ids.pages(
            b"".join(reversed(parts)), block_bytes // 4, salt, before // block_bytes
        )
        self.record.add(ids.tolist())
        if node.hash_values:
            self.record.add(sha_page_id(h, salt) for h in node.hash_values)

    def _digest_ids(self, node: TreeNode) -> list[int]:
        ns = node.require_namespace()
        owner = token_namespace_of(ns.extra_key)
        if owner is None:
            return []
        salt = namespace_salt(*owner)
        size, data = ns.page_bytes, node.key_bytes
        return [
            sha_page_id(data[i : i + DIGEST_BYTES].hex(), salt)
            for i in range(0, len(data) - size + 1, size)
        ]


@lru_cache(maxsize=1024)
def token_namespace_of(hidden: str | None) -> tuple[str | None, int] | None:
    """The token namespace a hash namespace's pages belong to (hash_namespace's
    inverse): ``PREFIX/w<width>`` for None, ``PREFIX/w<width>=<extra_key>`` otherwise."""
    if hidden is None:
        return None
    rest = hidden[len(hash_namespace(None, 0)) - 1 :]  # after ".../w"
    width, sep, extra_key = rest.partition("=")
    if not width.isdigit():
        return None
    return (extra_key if sep else None), int(width)
