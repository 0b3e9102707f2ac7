"""Lookup outcomes: why each part of a looked-up key did or did not hit.

Every lookup ends in one outcome per token range:

* ``hit``: cached, and answered;
* ``miss_namespace``: not in the key's namespace, but cached under another namespace of
  the same model and token width (a wrong or missing ``extra_key``);
* ``miss_evicted``: cached once and evicted since (the record of evicted pages has it),
  or, for SWA and Mamba models, cached KV a match could not use because its window KV
  or its state was evicted;
* ``miss_cold``: never cached (as far as the bounded record knows);
* ``below_page``: the unaligned tail, shorter than a page, which is never cached.

Three more are counted by the service where they happen, not by classifying a key:
``capacity`` (a lookup refused for lack of slots), ``lease_expired`` (a lookup's lock
released unused because its lease lapsed) and ``load_failed`` (a connector could not
load the hit it was given).

Only the part beyond the hit is classified, and only when there is one: a lookup that
hits every whole page costs nothing here. The miss part follows the tree's shape: a
page can be cached only under its whole prefix, so after the first page that was never
cached nothing was, and the record is walked only while it knows the pages.

Single-threaded like the caches; reads the tree and never changes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..index.page_ids import EvictedPages, PrefixIds, namespace_salt
from ..index.page_index import is_hash_namespace
from ..key import RadixKey
from ..node import TreeNode
from .radix_cache import common_prefix

HIT = "hit"
MISS_COLD = "miss_cold"
MISS_EVICTED = "miss_evicted"
MISS_NAMESPACE = "miss_namespace"
BELOW_PAGE = "below_page"
LOAD_FAILED = "load_failed"
LEASE_EXPIRED = "lease_expired"
CAPACITY = "capacity"
OUTCOMES = (
    HIT,
    MISS_COLD,
    MISS_EVICTED,
    MISS_NAMESPACE,
    BELOW_PAGE,
    LOAD_FAILED,
    LEASE_EXPIRED,
    CAPACITY,
)
# Other namespaces looked into for a miss, at most, and namespaces examined to find
# them: bounds a lookup's cost where a model has many (one per LoRA adapter, tenant or
# salt), the oldest first.
MAX_OTHER_NAMESPACES = 8
MAX_EXAMINED = 64


@dataclass(slots=True)
class Classified:
    """A key's ranges ``(outcome, start, end)`` in tokens, in order and adjacent, from
    0 to the key's length; ``namespace``: the other namespace that holds the
    ``miss_namespace`` range; ``page_ids``: the ids of the whole pages from the first
    miss on (for the distinct-page count), None when every whole page hit."""

    ranges: list[tuple[str, int, int]] = field(default_factory=list)
    namespace: str | None = None
    page_ids: np.ndarray | None = None

    def add(self, outcome: str, start: int, end: int) -> None:
        if end <= start:
            return
        if self.ranges and self.ranges[-1][0] == outcome and self.ranges[-1][2] == start:
            self.ranges[-1] = (outcome, self.ranges[-1][1], end)
        else:
            self.ranges.append((outcome, start, end))

    def tokens(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for outcome, start, end in self.ranges:
            out[outcome] = out.get(outcome, 0) + end - start
        return out


def cached_bytes(ns_root: TreeNode | None, packed: bytes, end: int, page_bytes: int) -> int:
    """Bytes of ``packed[:end]`` the subtree ``ns_root`` caches, in whole pages; reads
    only (no split, no touch), like ``RadixCache.peek_prefix`` without the slots."""
    node, pos = ns_root, 0
    while node is not None and pos < end:
        child = node.children.get(packed[pos : pos + page_bytes])
        if child is None:
            break
        if packed.startswith(child.key_bytes, pos):
            pos += len(child.key_bytes)
            node = child
        else:
            pos += common_prefix(child.key_bytes, packed, pos, end, page_bytes)
            break
    return pos


def classify(
    cache: Any,
    key: RadixKey,
    hit: int,
    record: EvictedPages | None,
    ids: PrefixIds,
    *,
    check_same: bool = False,
    namespaces: Any = None,
    block: int = 1,
) -> Classified:
    """The outcome of each range of ``key``, which a lookup hit for ``hit`` tokens.

    Args:
        cache: The radix cache (any tree kind) the lookup ran on.
        record: The model's evicted pages (None: none kept).
        ids: Computes page ids (its power table is kept between calls).
        check_same: Also look for KV cached in the key's own namespace beyond the hit
            (SWA and Mamba: cached, but not usable by a match).
        namespaces: Which other namespaces may be named (a predicate on an
            ``extra_key``); None: any.
        block: Pages per id, as the record was fed (``page_ids.block_pages``): an
            evicted range then ends at a block's end, and ``page_ids`` are blocks'.
    """
    out = Classified()
    n = len(key)
    page = cache.page_size
    end = n - n % page
    out.add(HIT, 0, hit)
    if hit < end:
        packed, width = key.packed()
        token_bytes = 4 * width
        page_bytes = token_bytes * page
        pos = hit
        roots = cache.root_node.children
        if check_same:
            same = (
                cached_bytes(
                    roots.get((key.extra_key, width)), packed, end * token_bytes, page_bytes
                )
                // token_bytes
            )
            if same > pos:
                out.add(MISS_EVICTED, pos, same)
                pos = same
        if pos < end and roots:
            best, looked = pos, 0
            for examined, ((extra_key, token_width), root) in enumerate(roots.items()):
                if examined >= MAX_EXAMINED:
                    break
                if (
                    token_width != width
                    or extra_key == key.extra_key
                    or is_hash_namespace(extra_key)
                    or (namespaces is not None and not namespaces(extra_key))
                ):
                    continue
                looked += 1
                other = cached_bytes(root, packed, end * token_bytes, page_bytes) // token_bytes
                if other > best:
                    best, out.namespace = other, extra_key
                if looked >= MAX_OTHER_NAMESPACES:
                    break
            out.add(MISS_NAMESPACE, pos, best)
            pos = best
        size = page * block  # tokens per id
        first = hit // size
        out.page_ids = ids.pages(packed, size * width, namespace_salt(key.extra_key, width), first)
        if pos < end and record is not None and len(record):
            start = pos // size  # the first block that ends beyond pos
            known = out.page_ids[start - first :].tolist()
            run = 0
            while run < len(known) and known[run] in record:
                run += 1
            if run:
                out.add(MISS_EVICTED, pos, (start + run) * size)
                pos = (start + run) * size
        out.add(MISS_COLD, pos, end)
    out.add(BELOW_PAGE, end, n)
    return out
