"""Snapshot and restore of a RadixCache's tree: what a warm restart keeps of the cache.

The KV itself stays in the pool (the caller keeps the pool's memory); a snapshot holds
the tree's metadata: every node below the namespace roots, parents first, with its
namespace, its own tokens (packed, as the tree keeps them), its slots and its last
access tick. ``take`` collects them in one pass over the nodes without copying a
token or a slot; ``encode_parts`` turns that into buffers written out as they are (no
join), and ``decode`` reads them back from any buffer (a mapped file: no copy). Slots
that lie in whole aligned pages, as the allocator hands them out, are kept as page
numbers.

``restore`` builds the nodes directly, parents first, into an empty cache whose
allocator then holds exactly the tree's slots: a pass over the nodes and vector work
over the tokens, no per-token Python and no re-insert of shared prefixes. Ticks are
kept (so LRU order survives); locks, hit counts and node ids are not: every restored
node is unlocked and evictable. ``prune`` cuts an image down first (the pages a caller
could not vouch for, and everything below them).

Nothing here trusts a snapshot: ``decode`` checks every count, length and parent
link, ``restore`` every slot's range and uniqueness and every node's place among its
siblings, and the restored cache must pass ``check_integrity`` with the allocator
holding exactly the tree's slots; otherwise ``SnapshotError`` is raised and the cache
and allocator are left empty.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, replace
from typing import Any, cast

import numpy as np
import torch

from ..distinct import distinct, has_repeats
from ..errors import CacheError
from ..key import TOKEN_BYTES
from ..node import TreeNode
from ..pools.allocator import TokenToKVPoolAllocator, host_indices
from .radix_cache import RadixCache

FORMAT = "prefixcache-radix-tree"
VERSION = 2
_LEN = struct.Struct("<I")
_I64 = np.dtype("<i8")

Buffer = bytes | bytearray | memoryview


class SnapshotError(CacheError):
    """A snapshot that cannot be taken, decoded or restored as it stands."""


@dataclass(frozen=True, slots=True)
class TreeImage:
    """A radix tree's nodes, parents before children (index order).

    ``parent[i]`` is the index of node i's parent, or -1 for a child of its namespace
    root; ``namespace[i]`` indexes ``namespaces`` (``(extra_key, token_width)``).
    ``key_lens`` are in tokens; ``keys`` and ``slots`` are the nodes' own packed tokens
    and slots end to end. ``node_ids`` are the ids the nodes had when taken (None once
    decoded: a new start gives new ids).
    """

    page_size: int
    namespaces: list[tuple[str | None, int]]
    parent: np.ndarray
    namespace: np.ndarray
    key_lens: np.ndarray
    ticks: np.ndarray
    keys: Buffer
    slots: np.ndarray
    node_ids: np.ndarray | None = None

    @property
    def tokens(self) -> int:
        return int(self.slots.size)

    @property
    def nodes(self) -> int:
        return int(self.parent.size)

    def parts(self) -> TreeParts:
        """The same tree node by node (to encode it again), with no live nodes."""
        keys = memoryview(self.keys).cast("B")
        key_end, slot_end = self.key_ends().tolist(), self.slot_ends().tolist()
        key_start, slot_start = [0, *key_end[:-1]], [0, *slot_end[:-1]]
        return TreeParts(
            self.page_size,
            self.namespaces,
            self.parent,
            self.namespace,
            self.key_lens,
            self.ticks,
            np.zeros(self.nodes, dtype=np.int64) if self.node_ids is None else self.node_ids,
            [bytes(keys[a:b]) for a, b in zip(key_start, key_end, strict=True)],
            [self.slots[a:b] for a, b in zip(slot_start, slot_end, strict=True)],
            [],
        )

    def token_bytes(self) -> np.ndarray:
        """Bytes per token of each node (its namespace's width)."""
        widths = np.asarray([w for _, w in self.namespaces] or [1], dtype=np.int64)
        per_node: np.ndarray = widths[self.namespace] * TOKEN_BYTES
        return per_node

    def slot_ends(self) -> np.ndarray:
        """Where each node's slots end in ``slots`` (its tokens, in ``keys``, end at
        ``key_ends()``)."""
        return np.cumsum(self.key_lens)

    def key_ends(self) -> np.ndarray:
        return np.cumsum(self.key_lens * self.token_bytes())


@dataclass(frozen=True, slots=True)
class TreeParts:
    """A live tree's nodes as ``take`` found them, parents before children: the
    per-node arrays, and each node's own key bytes and slots (the node's own objects,
    not copies: a node's key and slots never change in place) and the node itself.
    Encoding them (``encode_parts``) joins nothing, so it can run off the cache's
    thread."""

    page_size: int
    namespaces: list[tuple[str | None, int]]
    parent: np.ndarray
    namespace: np.ndarray
    key_lens: np.ndarray
    ticks: np.ndarray
    node_ids: np.ndarray
    keys: list[bytes]
    slots: list[np.ndarray]
    nodes: list[TreeNode]

    @property
    def tokens(self) -> int:
        return int(self.key_lens.sum())

    def image(self) -> TreeImage:
        """The same tree as one ``TreeImage`` (its keys and slots joined)."""
        slots = np.concatenate(self.slots) if self.slots else np.zeros(0, dtype=np.int64)
        return TreeImage(
            self.page_size,
            self.namespaces,
            self.parent,
            self.namespace,
            self.key_lens,
            self.ticks,
            b"".join(self.keys),
            slots,
            self.node_ids,
        )


def take(cache: RadixCache) -> TreeParts:
    """The tree of ``cache`` (a plain RadixCache: SWA and Mamba trees keep more state
    per node than this holds): one pass over the nodes, no copy of their tokens or
    slots."""
    if type(cache) is not RadixCache:
        raise SnapshotError(
            f"only a plain RadixCache can be snapshotted, not {type(cache).__name__}"
        )
    namespaces: list[tuple[str | None, int]] = []
    parent: list[int] = []
    ns_of: list[int] = []
    lens: list[int] = []
    ticks: list[int] = []
    ids: list[int] = []
    keys: list[bytes] = []
    slots: list[np.ndarray] = []
    nodes: list[TreeNode] = []
    for ns_key, ns_root in cache.root_node.children.items():
        # The root's children are the namespaces, keyed (extra_key, token width).
        extra_key, width = cast(tuple[str | None, int], ns_key)
        ns = len(namespaces)
        namespaces.append((extra_key, width))
        stack: list[tuple[Any, int]] = [(child, -1) for child in ns_root.children.values()]
        while stack:
            node, up = stack.pop()
            index = len(parent)
            parent.append(up)
            ns_of.append(ns)
            lens.append(node.key_len)
            ticks.append(node.last_access_time)
            ids.append(node.id)
            keys.append(node.key_bytes)
            slots.append(host_indices(node.value))
            nodes.append(node)
            stack.extend((child, index) for child in node.children.values())
    return TreeParts(
        cache.page_size,
        namespaces,
        np.asarray(parent, dtype=np.int64),
        np.asarray(ns_of, dtype=np.int64),
        np.asarray(lens, dtype=np.int64),
        np.asarray(ticks, dtype=np.int64),
        np.asarray(ids, dtype=np.int64),
        keys,
        slots,
        nodes,
    )


_CHUNK_PAGES = 1 << 16


def _pages_of(slots: np.ndarray, page_size: int) -> np.ndarray | None:
    """The page numbers of ``slots`` when they are whole aligned pages, each page's
    slots in order (as the allocator hands them out); None otherwise. Checked a chunk
    at a time, so no temporary grows with the node."""
    if page_size == 1 or slots.size % page_size:
        return None
    rows = slots.reshape(-1, page_size)
    first = rows[:, 0]
    if (first % page_size).any():
        return None
    offsets = np.arange(page_size, dtype=np.int64)
    expect = np.empty((min(_CHUNK_PAGES, rows.shape[0]), page_size), dtype=np.int64)
    for lo in range(0, rows.shape[0], _CHUNK_PAGES):
        part = rows[lo : lo + _CHUNK_PAGES]
        want = expect[: part.shape[0]]
        np.add(first[lo : lo + _CHUNK_PAGES, None], offsets, out=want)
        if not np.array_equal(part, want):
            return None
    return first // page_size


def encode_parts(tree: TreeParts) -> list[Buffer]:
    """``tree`` as buffers to write end to end: a length-prefixed JSON header, the
    per-node arrays (int64 LE), every node's key bytes, then every node's slots (or,
    when all are whole aligned pages, their page numbers)."""
    pages = [_pages_of(s, tree.page_size) for s in tree.slots]
    paged = bool(pages) and all(p is not None for p in pages)
    stored = [p for p in pages if p is not None] if paged else tree.slots
    header = json.dumps(
        {
            "format": FORMAT,
            "version": VERSION,
            "page_size": tree.page_size,
            "namespaces": [list(ns) for ns in tree.namespaces],
            "nodes": len(tree.nodes),
            "key_bytes": sum(len(k) for k in tree.keys),
            "slots": tree.tokens,
            "paged": paged,
        }
    ).encode()
    parts: list[Buffer] = [_LEN.pack(len(header)), header]
    parts += [_le(a) for a in (tree.parent, tree.namespace, tree.key_lens, tree.ticks)]
    parts += tree.keys
    parts += [_le(s) for s in stored]
    return parts


def _le(array: np.ndarray) -> memoryview:
    return np.ascontiguousarray(array, dtype=_I64).data.cast("B")


def encode(tree: TreeParts) -> bytes:
    """``tree`` as one bytes object (``encode_parts`` joined)."""
    return b"".join(encode_parts(tree))


def decode(data: Buffer) -> TreeImage:
    """The image ``encode`` wrote; SnapshotError for anything else. The arrays may be
    views of ``data`` (keep it alive, and unchanged, while the image is in use)."""
    try:
        return _decode(memoryview(data).cast("B"))
    except SnapshotError:
        raise
    except (ValueError, TypeError, KeyError, struct.error, OverflowError) as exc:
        raise SnapshotError(f"not a tree snapshot: {exc}") from exc


def _decode(data: memoryview) -> TreeImage:
    (size,) = _LEN.unpack_from(data, 0)
    header = json.loads(bytes(data[_LEN.size : _LEN.size + size]))
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise SnapshotError(f"not a version-{VERSION} tree snapshot")
    n, nkey, nslot = int(header["nodes"]), int(header["key_bytes"]), int(header["slots"])
    page_size, paged = int(header["page_size"]), header.get("paged") is True
    namespaces = [(ek, int(w)) for ek, w in header["namespaces"]]
    if (
        min(n, nkey, nslot) < 0
        or page_size < 1
        or any(w < 1 or not (ek is None or isinstance(ek, str)) for ek, w in namespaces)
    ):
        raise SnapshotError("negative counts, or a bad page size or namespace")
    if paged and nslot % page_size:
        raise SnapshotError("paged slots that are not whole pages")
    stored = nslot // page_size if paged else nslot
    pos = _LEN.size + size
    if len(data) != pos + 4 * n * 8 + nkey + stored * 8:
        raise SnapshotError(f"{len(data)} bytes, not what the header counts")
    arrays = []
    for _ in range(4):
        arrays.append(np.frombuffer(data, dtype=_I64, count=n, offset=pos).astype(np.int64))
        pos += n * 8
    parent, namespace, key_lens, ticks = arrays
    keys = data[pos : pos + nkey]
    slots = np.frombuffer(data, dtype=_I64, count=stored, offset=pos + nkey)
    if paged:  # one pass into one new array (the page numbers are a 1/page_size of it)
        out = np.empty((stored, page_size), dtype=np.int64)
        np.add((slots * page_size)[:, None], np.arange(page_size), out=out)
        slots = out.reshape(-1)
    index = np.arange(n, dtype=np.int64)
    if n and (
        not ((parent >= -1) & (parent < index)).all()
        or not ((namespace >= 0) & (namespace < len(namespaces))).all()
        or (key_lens < 1).any()
        or (key_lens % page_size).any()
    ):
        raise SnapshotError("a node with a bad parent, namespace or length")
    inner = parent >= 0
    if (namespace[inner] != namespace[parent[inner]]).any():
        raise SnapshotError("a node in another namespace than its parent")
    image = TreeImage(page_size, namespaces, parent, namespace, key_lens, ticks, keys, slots)
    if int(key_lens.sum()) != nslot or int((key_lens * image.token_bytes()).sum()) != nkey:
        raise SnapshotError("the nodes' lengths do not add up to their tokens and slots")
    return image


def prune(image: TreeImage, keep: np.ndarray) -> TreeImage:
    """``image`` with node i cut to its first ``keep[i]`` tokens (whole pages); a node
    cut short loses every node below it, and a node cut to 0 goes."""
    n = image.nodes
    keep = np.minimum(np.asarray(keep, dtype=np.int64), image.key_lens)
    keep -= keep % image.page_size
    if n == 0 or bool((keep == image.key_lens).all()):
        return image
    # Parents come first: a node stays only if its parent stayed whole.
    whole = keep == image.key_lens
    stays = keep > 0
    parent = image.parent.tolist()
    stays_l, whole_l = stays.tolist(), whole.tolist()
    for i in range(n):
        up = parent[i]
        if up >= 0 and not (stays_l[up] and whole_l[up]):
            stays_l[i] = False
    kept = np.flatnonzero(np.asarray(stays_l, dtype=bool))
    new_index = np.full(n, -1, dtype=np.int64)
    new_index[kept] = np.arange(kept.size)
    old_parent = image.parent[kept]
    new_parent = np.where(old_parent >= 0, new_index[np.maximum(old_parent, 0)], -1)
    lens = keep[kept]
    slot_start = image.slot_ends() - image.key_lens
    tb = image.token_bytes()
    key_start = image.key_ends() - image.key_lens * tb
    slots = np.concatenate(
        [
            image.slots[s : s + k]
            for s, k in zip(slot_start[kept].tolist(), lens.tolist(), strict=True)
        ]
        or [np.zeros(0, dtype=np.int64)]
    )
    keys = memoryview(image.keys).cast("B")
    key_bytes = b"".join(
        keys[s : s + k]
        for s, k in zip(key_start[kept].tolist(), (lens * tb[kept]).tolist(), strict=True)
    )
    used = distinct(image.namespace[kept])
    namespace = np.searchsorted(used, image.namespace[kept])
    return replace(
        image,
        namespaces=[image.namespaces[i] for i in used.tolist()],
        parent=new_parent,
        namespace=namespace.astype(np.int64),
        key_lens=lens,
        ticks=image.ticks[kept],
        keys=key_bytes,
        slots=slots,
        node_ids=None if image.node_ids is None else image.node_ids[kept],
    )


def restore(
    cache: RadixCache, allocator: TokenToKVPoolAllocator, image: TreeImage, check: bool = True
) -> list[TreeNode]:
    """Rebuild ``image`` in the empty ``cache``, its slots taken from the empty
    ``allocator``; returns the new nodes, in the image's order. On SnapshotError both
    are left empty. ``check=False`` leaves the closing ``check_integrity`` to a caller
    that checks more than the cache right after (and empties both if it fails)."""
    if type(cache) is not RadixCache or type(allocator) is not TokenToKVPoolAllocator:
        raise SnapshotError("only a plain RadixCache over a TokenToKVPoolAllocator")
    if cache.total_size() or allocator.num_allocated():
        raise SnapshotError("restore needs an empty cache and allocator")
    try:
        return _restore(cache, allocator, image, check)
    except Exception as exc:
        cache.reset()
        allocator.clear()
        if isinstance(exc, SnapshotError):
            raise
        raise SnapshotError(f"the tree could not be rebuilt: {exc}") from exc


def _restore(
    cache: RadixCache, allocator: TokenToKVPoolAllocator, image: TreeImage, check: bool
) -> list[TreeNode]:
    if image.page_size != cache.page_size:
        raise SnapshotError(f"page size {image.page_size}, the cache's is {cache.page_size}")
    slots = image.slots
    if slots.dtype != np.int64 or not (slots.flags.writeable and slots.flags.c_contiguous):
        slots = np.array(slots, dtype=np.int64)  # not a view of the snapshot's file
    ps = allocator.page_size
    if slots.size and (int(slots.min()) < ps or int(slots.max()) >= (allocator.num_pages + 1) * ps):
        raise SnapshotError("a slot outside the pool")
    if has_repeats(slots, allocator.num_rows):
        raise SnapshotError("a slot in two places of the tree")
    _claim(allocator, slots)
    nodes = _build(cache, image, slots)
    if check:
        cache.check_integrity()
    return nodes


def _build(cache: RadixCache, image: TreeImage, slots: np.ndarray) -> list[TreeNode]:
    """The nodes of ``image`` under ``cache``'s namespace roots, parents first, with
    the cache's counters, eviction queue, clock, page hashes and listener told."""
    roots = [cache._namespace_root(extra_key, width) for extra_key, width in image.namespaces]
    keys = memoryview(image.keys).cast("B")
    key_end = image.key_ends().tolist()
    slot_end = image.slot_ends().tolist()
    parents, spaces = image.parent.tolist(), image.namespace.tolist()
    ticks = image.ticks.tolist()
    nodes: list[TreeNode] = []
    key_start = slot_start = 0
    for i in range(image.nodes):
        root = roots[spaces[i]]
        ns = root.require_namespace()
        up = root if parents[i] < 0 else nodes[parents[i]]
        key = bytes(keys[key_start : key_end[i]])
        # A view of the one slot array: its memory goes once the last restored node
        # does (a split or an eviction copies or drops a node's slots).
        value = torch.from_numpy(slots[slot_start : slot_end[i]])
        node = TreeNode(ns, key, value, up, ticks[i])
        first = key[: ns.page_bytes]
        if first in up.children:
            raise SnapshotError("two nodes under one parent begin with the same page")
        up.children[first] = node
        nodes.append(node)
        key_start, slot_start = key_end[i], slot_end[i]
    for root in roots:
        if not root.children:
            raise SnapshotError("a namespace with no nodes")
    cache._evictable += int(slots.size)
    leaves = [node for node in nodes if not node.children]
    leaves.sort(key=lambda node: node.last_access_time)
    for leaf in leaves:
        cache._leaves.push(leaf)
    if nodes:
        cache._clock = max(cache._clock, int(image.ticks.max()))
    if cache.eager_page_hashes or cache.listener is not None:
        for node in nodes:  # parents first, as inserts would have told them
            if cache.eager_page_hashes:
                cache.compute_node_hash(node)
            if cache.listener is not None:
                cache.listener.pages_stored(node)
    return nodes


def _claim(allocator: TokenToKVPoolAllocator, slots: np.ndarray) -> None:
    """Make exactly ``slots`` the allocator's handed-out slots (it starts empty). A
    page keeps only its tree slots live, as after the frees that led to the snapshot."""
    allocator.claim(slots)
    if allocator.num_allocated() != slots.size:  # cannot happen: slots are distinct
        raise SnapshotError("the allocator did not take the tree's slots")
