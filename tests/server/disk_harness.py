"""Real parts for the disk tier's tests: a DiskStore on a real file system over a real
KVPool (``StoreRig``: pages staged and sealed as the tier stages them, read back into
fresh pool rows), a small tmpfs of its own where the machine lets us mount one
(``small_filesystem``: a file system that fills up), and ``prefixcache serve``
subprocesses with the disk tier on (``start``) with a prompt's KV written, evicted to
disk and read back (``cache``, ``demote``, ``read``)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tier_harness import Node

from prefixcache.cache.eviction import get_eviction_policy
from prefixcache.cache.pools.kv_pool import KVPool
from prefixcache.client import PrefixCacheClient
from prefixcache.server.tier.backend import PageRetention
from prefixcache.server.tier.disk.slot_file import probe_direct
from prefixcache.server.tier.disk.store import DiskStore, slots_for
from prefixcache.server.tier.layout import PageLayout
from prefixcache.server.tier.seals import SealSlots
from prefixcache.server.tier.staging import Staging

PS = 4
IDENTITY = b"disk-tier-tests!"
MODEL = "m"
PAGE = PS
ROW = (2, 8)
POOL = 256
DEMOTED = r'prefixcache_disk_demoted_pages_total\{model="m"\}'
READY = r'prefixcache_disk_capacity_bytes\{model="m"\}'


def disk_config(path: Path, nbytes: int = 8 << 20, **disk: Any) -> dict[str, Any]:
    return {
        "server": {
            "shm_dir": "off",
            "check_integrity": True,
            "disk": {"path": str(path), "bytes": nbytes, "timeout": 5.0, **disk},
        },
        "models": [
            {
                "name": MODEL,
                "kind": "radix",
                "page_size": PAGE,
                "pool": {
                    "size": POOL,
                    "layers": 2,
                    "k_heads": ROW[0],
                    "k_head_dim": ROW[1],
                    "dtype": "float16",
                },
            }
        ],
    }


def start(tmp: Path, name: str, path: Path, **disk: Any) -> Node:
    node = Node(tmp, name, disk_config(path, **disk))
    node.wait(READY, 1)
    return node


def tokens_of(seed: int, n: int = 24) -> list[int]:
    return np.random.default_rng(seed).integers(1, 30000, n).tolist()


def cache(node: Node, tokens: list[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    kv = [torch.randn(len(tokens), *ROW, generator=gen).half() for _ in range(4)]
    with PrefixCacheClient(node.address, timeout=10) as client, client.session() as s:
        slots = client.alloc(MODEL, len(tokens), session=s).slots
        client.write_kv(MODEL, slots, kv[:2], kv[2:], session=s)
        client.insert(MODEL, tokens, slots, session=s)
    return kv


def demote(node: Node, tokens: list[int], seed: int) -> list[torch.Tensor]:
    before = node.metric(DEMOTED)
    kv = cache(node, tokens, seed)
    with PrefixCacheClient(node.address, timeout=10) as client:
        client.evict(MODEL, POOL)
    node.wait(DEMOTED, before + len(tokens) // PAGE)
    return kv


def read(node: Node, tokens: list[int]) -> tuple[int, list[torch.Tensor]]:
    with PrefixCacheClient(node.address, timeout=10) as client, client.session() as s:
        reply = client.match(MODEL, tokens, session=s, lock=True)
        if not reply.prefix_len:
            return 0, []
        data = client.read_kv(MODEL, reply.slots, session=s)
        return reply.prefix_len, [*data.k, *data.v]


def same(got: list[torch.Tensor], want: list[torch.Tensor], n: int) -> bool:
    return len(got) == len(want) and all(
        g.view(torch.int16).equal(w[:n].view(torch.int16)) for g, w in zip(got, want, strict=True)
    )


class StoreRig:
    """A store of ``slots`` slots in ``folder`` for a 2-layer pool of ``pool`` slots."""

    def __init__(
        self,
        folder: Path,
        slots: int = 16,
        pool: int = 256,
        policy: str = "lru",
        identity: bytes = IDENTITY,
        heads: int = 2,
        dim: int = 8,
        retain_limit: int | None = None,
    ) -> None:
        self.folder = folder
        self.retain_limit = retain_limit
        self.pool = KVPool(pool, PS, torch.float16, 2, heads, dim)
        self.layout = PageLayout(self.pool, PS)
        self.align = probe_direct(folder.parent)
        page = self.layout.page_bytes
        self.slot_bytes = -(-page // self.align) * self.align if self.align else page
        self.staging = Staging(self.layout, slots + 8, stride=self.slot_bytes)
        self.seals = SealSlots(4 * slots + 64)
        self.slots = slots
        self.identity = identity
        self.policy = policy
        self.store = self.open()

    def open(self) -> DiskStore:
        store = DiskStore(
            self.folder,
            self.layout.page_bytes,
            self.slots,
            self.slot_bytes,
            self.align,
            self.identity,
            get_eviction_policy(self.policy),
            retain_limit=self.retain_limit,
        )
        for ptr, size in [*self.layout.regions(), *self.staging.regions(), self.seals.region()]:
            store.register(ptr, size)
        return store

    def reopen(self) -> DiskStore:
        self.store.close()
        self.store = self.open()
        return self.store

    def fill(self, slots: np.ndarray, seed: int) -> None:
        """Random bytes in the pool rows ``slots``."""
        gen = torch.Generator().manual_seed(seed)
        for buf in self.layout.buffers:
            buf[torch.as_tensor(slots)] = torch.randn(len(slots), *buf.shape[1:], generator=gen).to(
                buf.dtype
            )

    def page_bytes_of(self, slots: np.ndarray) -> list[bytes]:
        """Each page's object bytes (without the seal) in the pool rows ``slots``."""
        ptrs, sizes = self.layout.parts(slots)
        return [
            b"".join(ctypes.string_at(p, s) for p, s in zip(pp, zz, strict=True))
            for pp, zz in zip(ptrs, sizes, strict=True)
        ]

    def put(
        self, keys: list[str], slots: np.ndarray, retain: PageRetention | None = None
    ) -> list[int]:
        """Stage the pages of pool rows ``slots`` and put them, each with a seal that
        names its key (and the retention ``retain``); returns the codes."""
        taken = self.staging.copy(slots)
        assert taken is not None
        seals = self.seals.take(len(keys))
        assert seals is not None
        try:
            for key, slot in zip(keys, seals, strict=True):
                self.seals.write(int(slot), seal_of(key))
            ptrs, sizes = self.staging.parts(taken)
            ptrs = [[*p, s] for p, s in zip(ptrs, self.seals.ptrs(seals), strict=True)]
            sizes = [[*z, 32] for z in sizes]
            if retain is None:
                return self.store.put_from(keys, ptrs, sizes)
            return self.store.put_from(keys, ptrs, sizes, [retain] * len(keys))
        finally:
            self.staging.release(taken)
            self.seals.release(seals)

    def get(
        self, keys: list[str], into: np.ndarray, deadline: float | None = None
    ) -> tuple[list[int], list[bytes], list[bytes]]:
        """Read ``keys`` into pool rows ``into``: the codes, the pages' bytes there and
        the seals read."""
        seals = self.seals.take(len(keys))
        assert seals is not None
        try:
            ptrs, sizes = self.layout.parts(into)
            ptrs = [[*p, s] for p, s in zip(ptrs, self.seals.ptrs(seals), strict=True)]
            sizes = [[*z, 32] for z in sizes]
            codes = self.store.get_into(keys, ptrs, sizes, deadline)
            return codes, self.page_bytes_of(into), [self.seals.read(int(s)) for s in seals]
        finally:
            self.seals.release(seals)


def seal_of(key: str) -> bytes:
    """A stand-in seal for ``key``'s page (the store keeps seals; it checks none)."""
    return key.encode().ljust(32, b".")[:32]


def pages(first_page: int, n: int) -> np.ndarray:
    """Pool rows of ``n`` pages from page ``first_page``."""
    return np.arange(first_page * PS, (first_page + n) * PS, dtype=np.int64)


def store_bytes_for(slots: int, slot_bytes: int) -> int:
    """The smallest ``bytes`` that gives a store ``slots`` slots."""
    n = slots * slot_bytes
    while slots_for(n, slot_bytes) < slots:
        n += slot_bytes
    return n


@contextlib.contextmanager
def small_filesystem(parent: Path, nbytes: int) -> Iterator[Path | None]:
    """A tmpfs of ``nbytes`` mounted under ``parent`` (None where this process may not
    mount one), unmounted after."""
    where = parent / f"fs-{uuid.uuid4().hex[:8]}"
    where.mkdir()
    mounted = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(where)],
            capture_output=True,
        ).returncode
        == 0
    )
    try:
        yield where if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)
        with contextlib.suppress(OSError):
            where.rmdir()


def fill(path: Path) -> None:
    """Write zeros to ``path`` until its file system is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, bytes(4096))
    except OSError:
        pass
    finally:
        os.close(fd)
