"""Snapshot and restore of a RadixCache's tree: what a warm restart keeps of the cache.

The KV itself stays in the pool (the caller keeps the pool's memory); a snapshot holds
the tree's metadata: every node below the namespace roots, parents first, with its
namespace, its own tokens (packed, as the tree keeps them), its slots and its last
access tick. ``encode`` and ``decode`` turn it into bytes and back.

Restoring inserts each leaf's whole path, oldest leaf first (so LRU order survives),
into an empty cache whose allocator has handed out exactly the tree's slots. Locks,
hit counts and node ids are not kept: every restored node is unlocked and evictable.

Nothing here trusts a snapshot: ``decode`` checks every count, length and parent
link, ``restore`` every slot's range and uniqueness, and the restored cache must pass
``check_integrity`` with the allocator holding exactly the tree's slots; otherwise
``SnapshotError`` is raised and the cache and allocator are left empty.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..distinct import has_repeats
from ..errors import CacheError
from ..key import TOKEN_BYTES, RadixKey
from ..pools.allocator import TokenToKVPoolAllocator, host_indices
from .radix_cache import RadixCache

FORMAT = "prefixcache-radix-tree"
VERSION = 1
_LEN = struct.Struct("<I")
_I64 = np.dtype("<i8")


class SnapshotError(CacheError):
    """A snapshot that cannot be taken, decoded or restored as it stands."""


@dataclass(frozen=True, slots=True)
class TreeImage:
    """A radix tree's nodes, parents before children (index order).

    ``parent[i]`` is the index of node i's parent, or -1 for a child of its namespace
    root; ``namespace[i]`` indexes ``namespaces`` (``(extra_key, token_width)``).
    ``key_lens`` are in tokens; ``keys`` and ``slots`` are the nodes' own packed tokens
    and slots end to end.
    """

    page_size: int
    namespaces: list[tuple[str | None, int]]
    parent: np.ndarray
    namespace: np.ndarray
    key_lens: np.ndarray
    ticks: np.ndarray
    keys: bytes
    slots: np.ndarray

    @property
    def tokens(self) -> int:
        return int(self.slots.size)

    @property
    def nodes(self) -> int:
        return int(self.parent.size)


def take(cache: RadixCache) -> TreeImage:
    """The tree of ``cache`` (a plain RadixCache: SWA and Mamba trees keep more state
    per node than this holds)."""
    if type(cache) is not RadixCache:
        raise SnapshotError(f"only a plain RadixCache can be snapshotted, not "
                            f"{type(cache).__name__}")
    namespaces: list[tuple[str | None, int]] = []
    parent: list[int] = []
    ns_of: list[int] = []
    lens: list[int] = []
    ticks: list[int] = []
    keys: list[bytes] = []
    slots: list[np.ndarray] = []
    for (extra_key, width), ns_root in cache.root_node.children.items():
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
            keys.append(node.key_bytes)
            slots.append(host_indices(node.value).copy())
            stack.extend((child, index) for child in node.children.values())
    return TreeImage(cache.page_size, namespaces, np.asarray(parent, dtype=np.int64),
                     np.asarray(ns_of, dtype=np.int64), np.asarray(lens, dtype=np.int64),
                     np.asarray(ticks, dtype=np.int64), b"".join(keys),
                     np.concatenate(slots) if slots else np.zeros(0, dtype=np.int64))


def encode(image: TreeImage) -> bytes:
    """``image`` as bytes: a length-prefixed JSON header, then the arrays (int64 LE)."""
    header = json.dumps({
        "format": FORMAT, "version": VERSION, "page_size": image.page_size,
        "namespaces": [list(ns) for ns in image.namespaces], "nodes": image.nodes,
        "key_bytes": len(image.keys), "slots": image.tokens}).encode()
    parts = [_LEN.pack(len(header)), header]
    parts += [a.astype(_I64).tobytes() for a in (image.parent, image.namespace,
                                                  image.key_lens, image.ticks)]
    parts += [image.keys, image.slots.astype(_I64).tobytes()]
    return b"".join(parts)


def decode(data: bytes) -> TreeImage:
    """The image ``encode`` wrote; SnapshotError for anything else."""
    try:
        return _decode(memoryview(data))
    except SnapshotError:
        raise
    except (ValueError, TypeError, KeyError, struct.error, OverflowError) as exc:
        raise SnapshotError(f"not a tree snapshot: {exc}") from exc


def _decode(data: memoryview) -> TreeImage:
    (size,) = _LEN.unpack_from(data, 0)
    header = json.loads(bytes(data[_LEN.size:_LEN.size + size]))
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise SnapshotError(f"not a version-{VERSION} tree snapshot")
    n, nkey, nslot = int(header["nodes"]), int(header["key_bytes"]), int(header["slots"])
    page_size = int(header["page_size"])
    namespaces = [(ek, int(w)) for ek, w in header["namespaces"]]
    if min(n, nkey, nslot) < 0 or page_size < 1 or any(
            w < 1 or not (ek is None or isinstance(ek, str)) for ek, w in namespaces):
        raise SnapshotError("negative counts, or a bad page size or namespace")
    pos = _LEN.size + size
    if len(data) != pos + 4 * n * 8 + nkey + nslot * 8:
        raise SnapshotError(f"{len(data)} bytes, not what the header counts")
    arrays = []
    for _ in range(4):
        arrays.append(np.frombuffer(data, dtype=_I64, count=n, offset=pos).astype(np.int64))
        pos += n * 8
    parent, namespace, key_lens, ticks = arrays
    keys = bytes(data[pos:pos + nkey])
    slots = np.frombuffer(data, dtype=_I64, count=nslot, offset=pos + nkey).astype(np.int64)
    index = np.arange(n, dtype=np.int64)
    if n and (not ((parent >= -1) & (parent < index)).all()
              or not ((namespace >= 0) & (namespace < len(namespaces))).all()
              or (key_lens < 1).any() or (key_lens % page_size).any()):
        raise SnapshotError("a node with a bad parent, namespace or length")
    inner = parent >= 0
    if (namespace[inner] != namespace[parent[inner]]).any():
        raise SnapshotError("a node in another namespace than its parent")
    widths = np.asarray([w for _, w in namespaces] or [1], dtype=np.int64)[namespace]
    if int(key_lens.sum()) != nslot or int((key_lens * widths).sum()) * TOKEN_BYTES != nkey:
        raise SnapshotError("the nodes' lengths do not add up to their tokens and slots")
    return TreeImage(page_size, namespaces, parent, namespace, key_lens, ticks, keys, slots)


def restore(cache: RadixCache, allocator: TokenToKVPoolAllocator, image: TreeImage) -> int:
    """Rebuild ``image`` in the empty ``cache``, its slots taken from the empty
    ``allocator``; returns the tokens restored. On SnapshotError both are left empty."""
    if type(cache) is not RadixCache or type(allocator) is not TokenToKVPoolAllocator:
        raise SnapshotError("only a plain RadixCache over a TokenToKVPoolAllocator")
    if cache.total_size() or allocator.num_allocated():
        raise SnapshotError("restore needs an empty cache and allocator")
    try:
        _restore(cache, allocator, image)
    except Exception as exc:
        cache.reset()
        allocator.clear()
        if isinstance(exc, SnapshotError):
            raise
        raise SnapshotError(f"the tree could not be rebuilt: {exc}") from exc
    return image.tokens


def _restore(cache: RadixCache, allocator: TokenToKVPoolAllocator, image: TreeImage) -> None:
    if image.page_size != cache.page_size:
        raise SnapshotError(f"page size {image.page_size}, the cache's is {cache.page_size}")
    slots = image.slots
    ps = allocator.page_size
    if slots.size and (int(slots.min()) < ps or int(slots.max()) >= (allocator.num_pages + 1) * ps):
        raise SnapshotError("a slot outside the pool")
    if has_repeats(slots, allocator.num_rows):
        raise SnapshotError("a slot in two places of the tree")
    _claim(allocator, slots)
    n = image.nodes
    widths = [w for _, w in image.namespaces]
    node_width = np.asarray(widths or [1], dtype=np.int64)[image.namespace]
    key_end = np.cumsum(image.key_lens * node_width * TOKEN_BYTES)
    slot_end = np.cumsum(image.key_lens)
    has_child = np.zeros(n, dtype=bool)
    has_child[image.parent[image.parent >= 0]] = True
    leaves = np.flatnonzero(~has_child)
    for leaf in leaves[np.argsort(image.ticks[leaves], kind="stable")].tolist():
        path = []
        node = leaf
        while node >= 0:
            path.append(node)
            node = int(image.parent[node])
        path.reverse()
        key = b"".join(image.keys[_start(key_end, i):int(key_end[i])] for i in path)
        value = np.concatenate([slots[_start(slot_end, i):int(slot_end[i])] for i in path])
        extra_key, width = image.namespaces[int(image.namespace[leaf])]
        cache.insert(RadixKey.from_bytes(key, width, extra_key), torch.from_numpy(value))
    # A snapshot whose paths overlap (two siblings with one first page) inserts fewer
    # tokens than it claimed slots: the counts tell, and the check finds the rest.
    if cache.total_size() != slots.size or allocator.num_allocated() != slots.size:
        raise SnapshotError(f"{cache.total_size()} tokens rebuilt from {slots.size} slots")
    cache.check_integrity()


def _start(ends: np.ndarray, i: int) -> int:
    return int(ends[i - 1]) if i else 0


def _claim(allocator: TokenToKVPoolAllocator, slots: np.ndarray) -> None:
    """Make exactly ``slots`` the allocator's handed-out slots (it starts empty): take
    every page, then free every slot not in the tree. A page keeps only its tree slots
    live, as after the frees that led to the snapshot."""
    got = allocator.alloc_host(allocator.available_size())
    if got is None:  # cannot happen: an empty allocator hands out all it has
        raise SnapshotError("the allocator could not hand out its pages")
    every = got[0]
    keep = np.zeros(allocator.num_rows, dtype=bool)
    keep[slots] = True
    rest = every[~keep[every]]
    if rest.size:
        allocator.free(rest)
