"""The disk tier's rows of ``kv_bandwidth.py``: promoting pages from disk into the pool,
and demoting evicted pages to disk, against a plain ``O_DIRECT`` read and write of the
same bytes on the same file system, paired in one run.

A server runs in this process (its event loop on a thread) with one model and the disk
tier on (``server.disk`` under ``--disk-dir``, the pool in shared memory as in
production, so reads land straight in pool rows). For each page count:

- ``disk_demote``: a prompt of that many pages, cached as nodes of at most the staging
  buffer's pages (as prompts are), is evicted node by node (each one staged inside the
  eviction); the clock runs until every page is written and journaled. Ceiling: one
  ``pwrite`` of the same bytes with ``O_DIRECT`` into a preallocated file beside it,
  at blocks never written before (as the tier's slots are, the first time).
- ``disk_promote``: the tier's prefetch of the prompt (what a Match runs before it is
  answered: the index probe, fresh pool slots, the reads and every page's seal check,
  the insert), in lookups of at most 2048 pages; then the prompt is evicted again (its
  pages stay on disk, held, and are not written again). Ceiling: one ``preadv`` of the
  same number of bytes with ``O_DIRECT`` from the tier's own pages file.

The first promotion of each count is checked byte for byte against the pool's bytes
before demotion (the bench exits non-zero if they differ). Best of ``repeat`` each.
"""

from __future__ import annotations

import asyncio
import hashlib
import mmap
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from prefixcache.cache import RadixKey
from prefixcache.server.app import PrefixCacheServer
from prefixcache.server.config import Config, ModelConfig, PoolConfig, ServerConfig
from prefixcache.server.config.disk import DiskConfig
from prefixcache.server.tier.disk.journal import metadata_bytes
from prefixcache.server.tier.fetch import prefetch

HEADS, DIM = 8, 128


class _Server:
    """A PrefixCacheServer on an event loop thread of its own."""

    def __init__(self, config: Config) -> None:
        self.loop = asyncio.new_event_loop()
        self.server = PrefixCacheServer(config)
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.call(self.server.start())

    def call(self, coro: Any, timeout: float = 600.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.call(self.server.stop(0.1))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        self.loop.close()


def _aligned(nbytes: int) -> tuple[mmap.mmap, memoryview]:
    buf = mmap.mmap(-1, max(nbytes, 4096))
    return buf, memoryview(buf)[:nbytes]


def bench_disk(
    folder: Path, layers: int, page: int, counts: list[int], repeat: int, row: Any
) -> list[dict]:
    rows: list[dict] = []
    for n in counts:
        rows += _bench_count(folder, layers, page, n, repeat, row)
    return rows


def _bench_count(folder: Path, layers: int, page: int, n: int, repeat: int, row: Any) -> list[dict]:
    run = folder / f"disk-{n}"
    run.mkdir()
    page_bytes = page * layers * 2 * HEADS * DIM * 2
    pool_pages = n + 8
    nbytes = (repeat + 2) * n * page_bytes + metadata_bytes((repeat + 2) * n) + (16 << 20)
    model = ModelConfig(
        name="d",
        page_size=page,
        pool=PoolConfig(
            size=pool_pages * page, layers=layers, k_heads=HEADS, k_head_dim=DIM, dtype="bfloat16"
        ),
    )
    disk = DiskConfig(path=str(run / "tier"), bytes=nbytes, timeout=60.0, max_fetch_slots=n * page)
    (run / "tier").mkdir()
    server = _Server(
        Config(ServerConfig(listen=f"unix:{run / 'pc.sock'}", metrics_port=-1, disk=disk), (model,))
    )
    try:
        return _measure(server, run, n, page, page_bytes, repeat, row)
    finally:
        server.stop()
        for p in sorted(run.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
        run.rmdir()


def _measure(
    server: _Server, run: Path, n: int, page: int, page_bytes: int, repeat: int, row: Any
) -> list[dict]:
    engine = server.server.service.engines["d"]
    tier = server.server.tier.tiers[0]
    mt = tier.models["d"]
    store = mt.backend
    for buf in [*engine.kv_pool.k_buffer, *engine.kv_pool.v_buffer]:
        buf.view(torch.uint8).copy_(
            torch.randint(0, 256, buf.view(torch.uint8).shape, dtype=torch.uint8)
        )
    node_pages = max(1, min(mt.staging.pages, n))
    nbytes = n * page_bytes
    plain = run / "plain"
    fd = os.open(plain, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if store.align else 0), 0o600)
    # Fresh preallocated blocks for each write, as the tier's slots are the first time
    # they are written (ext4 converts unwritten extents then).
    os.posix_fallocate(fd, 0, (repeat + 1) * nbytes)
    pages_fd = os.open(store.file.path, os.O_RDONLY | (os.O_DIRECT if store.align else 0))
    wbuf, wview = _aligned(nbytes)
    np.frombuffer(wview, dtype=np.uint8)[:] = np.random.default_rng(0).integers(
        0, 256, nbytes, dtype=np.uint8
    )
    rbuf, rview = _aligned(nbytes)
    session = server.server.service.sessions.open(None, "bench")
    digest: dict[int, str] = {}

    async def cache(i: int) -> RadixKey:
        """Cache prompt ``i`` (n pages of the pool's random rows) as nodes of at most
        ``node_pages`` pages; returns its key."""
        tokens = np.random.default_rng(i).integers(1, 1 << 30, n * page).tolist()
        key = RadixKey(tokens)
        slots, _ = engine.alloc(session, n * page)
        if i not in digest:
            digest[i] = _bytes_digest(mt, slots)
        for end in range(node_pages, n + node_pages, node_pages):
            end = min(end, n) * page
            head = np.asarray(engine.cache.match_prefix(key[:end]).indices, dtype=np.int64)
            head = head[:end]
            engine.insert(key[:end], np.concatenate([head, slots[len(head) : end]]), session)
        return key

    async def demote(key: RadixKey) -> float:
        target = mt.put_pages + n
        start = time.perf_counter()
        while engine.cache.match_prefix(key).prefix_len:  # a node of it is in the pool
            while mt.staging.available < node_pages:
                await asyncio.sleep(0.0002)
            engine.evict(page)  # the deepest node, whole, staged inside the eviction
        while mt.put_pages < target:
            await asyncio.sleep(0.0002)
        return time.perf_counter() - start

    async def promote(key: RadixKey) -> float:
        start = time.perf_counter()
        got = 0
        while got < n * page:
            got_now = await prefetch(tier, mt, key)
            if not got_now:
                raise RuntimeError(
                    f"promotion stopped at {got} of {n * page} tokens ({mt.lookups})"
                )
            got = engine.cache.match_prefix(key).prefix_len
        return time.perf_counter() - start

    async def evict_again(key: RadixKey) -> None:
        while engine.cache.match_prefix(key).prefix_len:
            engine.evict(n * page)

    def plain_write(i: int) -> None:
        os.pwritev(fd, [wview], i * nbytes)

    def plain_read() -> None:
        os.preadv(pages_fd, [rview], 0)

    demote_s, write_s, promote_s, read_s = [], [], [], []
    try:
        for i in range(repeat + 1):  # the first of each is the warm-up
            key = server.call(cache(i))
            t = server.call(demote(key))
            start = time.perf_counter()
            plain_write(i)
            write_s.append(time.perf_counter() - start)
            demote_s.append(t)
            promote_s.append(server.call(promote(key)))
            if i == 0:
                slots = np.asarray(engine.cache.match_prefix(key).indices, dtype=np.int64)
                if _bytes_digest(mt, slots) != digest[0]:
                    raise SystemExit(f"disk_promote of {n} pages: the bytes differ")
            start = time.perf_counter()
            plain_read()
            read_s.append(time.perf_counter() - start)
            server.call(evict_again(key))
    finally:
        os.close(fd)
        os.close(pages_fd)
        wview.release()
        rview.release()
        wbuf.close()
        rbuf.close()
        server.call(_close(server.server.service, session))
    extra = {
        "pages": n,
        "page_bytes": page_bytes,
        "page_size": page,
        "direct_io": bool(store.align),
    }
    best = {
        k: min(v[1:] or v)
        for k, v in (("d", demote_s), ("w", write_s), ("p", promote_s), ("r", read_s))
    }
    return [
        row("disk_promote", nbytes, best["p"], best["r"], tokens=n * page, **extra),
        row("disk_demote", nbytes, best["d"], best["w"], tokens=n * page, **extra),
    ]


def _bytes_digest(mt: Any, slots: np.ndarray) -> str:
    """A digest of the pages' bytes in the pool rows ``slots``."""
    import ctypes

    h = hashlib.sha256()
    ptrs, sizes = mt.layout.parts(slots)
    for pp, zz in zip(ptrs, sizes, strict=True):
        for p, z in zip(pp, zz, strict=True):
            h.update(ctypes.string_at(p, z))
    return h.hexdigest()


async def _close(service: Any, session: Any) -> None:
    service.close_session(session)
