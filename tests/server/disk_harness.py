"""Real parts for the disk tier's tests: a DiskStore on a real file system over a real
KVPool (``StoreRig``: pages staged and sealed as the tier stages them, read back into
fresh pool rows), and a small tmpfs of its own where the machine lets us mount one
(``small_filesystem``: a file system that fills up)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from prefixcache.cache.eviction import get_eviction_policy
from prefixcache.cache.pools.kv_pool import KVPool
from prefixcache.server.tier.disk.slot_file import probe_direct
from prefixcache.server.tier.disk.store import DiskStore, slots_for
from prefixcache.server.tier.layout import PageLayout
from prefixcache.server.tier.seals import SealSlots
from prefixcache.server.tier.staging import Staging

PS = 4
IDENTITY = b"disk-tier-tests!"


class StoreRig:
    """A store of ``slots`` slots in ``folder`` for a 2-layer pool of ``pool`` slots."""

    def __init__(self, folder: Path, slots: int = 16, pool: int = 256, policy: str = "lru",
                 identity: bytes = IDENTITY, heads: int = 2, dim: int = 8) -> None:
        self.folder = folder
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
        store = DiskStore(self.folder, self.layout.page_bytes, self.slots, self.slot_bytes,
                          self.align, self.identity, get_eviction_policy(self.policy))
        for ptr, size in [*self.layout.regions(), *self.staging.regions(),
                          self.seals.region()]:
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
            buf[torch.as_tensor(slots)] = torch.randn(len(slots), *buf.shape[1:],
                                                       generator=gen).to(buf.dtype)

    def page_bytes_of(self, slots: np.ndarray) -> list[bytes]:
        """Each page's object bytes (without the seal) in the pool rows ``slots``."""
        ptrs, sizes = self.layout.parts(slots)
        return [b"".join(ctypes.string_at(p, s) for p, s in zip(pp, zz, strict=True))
                for pp, zz in zip(ptrs, sizes, strict=True)]

    def put(self, keys: list[str], slots: np.ndarray) -> list[int]:
        """Stage the pages of pool rows ``slots`` and put them, each with a seal that
        names its key; returns the codes."""
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
            return self.store.put_from(keys, ptrs, sizes)
        finally:
            self.staging.release(taken)
            self.seals.release(seals)

    def get(self, keys: list[str], into: np.ndarray, deadline: float | None = None
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
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(where)],
        capture_output=True).returncode == 0
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
