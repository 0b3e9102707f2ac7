"""The fetch path alone (``tier.py --fetch-only``, and after the replays otherwise): our
Match's fetch from another sidecar's segment, beside Mooncake's own ``batch_get_into``
of the same pages in the same batches (``MooncakeReader``: one process reads what
another put), in alternate rounds, and a memcpy of the same bytes."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.tier_nodes import (
    MODEL,
    Master,
    Sidecar,
    child_env,
    model_config,
    replay,
    stop_all,
    unique_pages,
)


def fetch_batches(node: Sidecar, keys: list[Any]) -> list[int]:
    """A warm-up round of ``node`` (empty) looking every prompt up: the pages each
    lookup fetched (those that fetched), scraped between lookups. Later rounds, a Reset
    before each, fetch the same batches."""
    client = node.connect()
    client.reset(MODEL)
    batches = []
    with client.session(600) as session:
        for key in keys:
            b0 = node.metric(r"prefixcache_tier_fetch_bytes_total\{.*\}")
            client.match(MODEL, key, session=session)
            got = node.metric(r"prefixcache_tier_fetch_bytes_total\{.*\}") - b0
            if got:
                batches.append(round(got / node.page_bytes))
    return batches


def fetch_round(node: Sidecar, keys: list[Any]) -> tuple[float, float]:
    """One round of ``node`` looking every prompt up after a Reset: the bytes fetched
    and the GB/s (fetch bytes over fetch seconds, as the metrics count them: each
    fetch from before its store call is handed to a worker thread until the loop has
    its answer)."""
    client = node.connect() if node.client is None else node.client
    client.reset(MODEL)
    b0 = node.metric(r"prefixcache_tier_fetch_bytes_total\{.*\}")
    s0 = node.metric(r"prefixcache_tier_fetch_seconds_total\{.*\}")
    with client.session(600) as session:
        for key in keys:
            client.match(MODEL, key, session=session)
    fetched = node.metric(r"prefixcache_tier_fetch_bytes_total\{.*\}") - b0
    seconds = node.metric(r"prefixcache_tier_fetch_seconds_total\{.*\}") - s0
    return fetched, fetched / seconds / 1e9 if seconds else 0.0


class MooncakeReader:
    """Mooncake's own ``batch_get_into_multi_buffers``: this process reads ``pages``
    pages of these parts that another process put into its own segment (the baseline
    of our fetch path). Only the calls are timed; their arguments are built before."""

    def __init__(self, master: str, parts: list[int], pages: int) -> None:
        self.parts, self.pages = parts, pages
        self.page_bytes = sum(parts)
        prefix = f"bench/{len(parts)}x{parts[0]}/"
        self.writer = subprocess.Popen([sys.executable, "-c", _WRITER, master, str(pages),
                                        json.dumps(parts), prefix],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       env=child_env(), text=True)
        self.store: Any = None
        try:
            line = self.writer.stdout.readline() if self.writer.stdout else ""
            if line.strip() != "ready":
                raise RuntimeError(f"the Mooncake writer did not start: {line!r}")
            os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
            from mooncake.store import MooncakeDistributedStore

            self.store = MooncakeDistributedStore()
            if self.store.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "",
                                master):
                raise RuntimeError("Mooncake setup failed")
            self.buf = np.zeros(pages * self.page_bytes, np.uint8)
            self.store.register_buffer(self.buf.ctypes.data, self.buf.nbytes)
            self.keys = [f"{prefix}{i}" for i in range(pages)]
        except BaseException:
            self.close()
            raise

    def round(self, batches: list[int]) -> float:
        """Read the pages, ``batches[i]`` pages in call ``i``: GB/s."""
        calls, at = [], 0
        for n in batches:
            ptrs = [[self.buf.ctypes.data + i * self.page_bytes + sum(self.parts[:j])
                     for j in range(len(self.parts))] for i in range(at, at + n)]
            calls.append((self.keys[at:at + n], ptrs, [self.parts] * n))
            at += n
        seconds = 0.0
        for keys, ptrs, sizes in calls:
            start = time.perf_counter()
            codes = self.store.batch_get_into_multi_buffers(keys, ptrs, sizes)
            seconds += time.perf_counter() - start
            if any(c != self.page_bytes for c in codes):
                raise RuntimeError(f"Mooncake get failed: {codes[:4]}")
        return at * self.page_bytes / seconds / 1e9

    def memcpy(self, rounds: int) -> float:
        """A memcpy of the same bytes, a page at a time: GB/s, best of ``rounds``."""
        buf, step = self.buf, self.page_bytes
        dst = np.empty_like(buf)
        best = float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            for i in range(0, buf.nbytes, step):
                np.copyto(dst[i:i + step], buf[i:i + step])
            best = min(best, time.perf_counter() - start)
        return buf.nbytes / best / 1e9

    def close(self) -> None:
        if self.writer.stdin and not self.writer.stdin.closed:
            self.writer.stdin.close()  # the writer leaves the store meanwhile
        if self.store is not None:
            self.store.close()
            self.store = None
        self.writer.wait(30)


def mooncake_get_gbps(master: str, parts: list[int], pages: int, batch: int,
                      rounds: int = 3) -> float:
    """Mooncake's own reads of ``pages`` pages of these parts, ``batch`` a call: GB/s,
    best of ``rounds`` (after one to warm up)."""
    reader = MooncakeReader(master, parts, pages)
    try:
        batches = [min(batch, pages - at) for at in range(0, pages, batch)]
        reader.round(batches)
        return max(reader.round(batches) for _ in range(rounds))
    finally:
        reader.close()


# The other process of mooncake_get_gbps: puts the pages into its own segment and holds
# them until its stdin closes.
_WRITER = """
import json, os, sys
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
import numpy as np
from mooncake.store import MooncakeDistributedStore, ReplicateConfig
master, pages, parts, prefix = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
page = sum(parts)
store = MooncakeDistributedStore()
assert store.setup("127.0.0.1", "P2PHANDSHAKE", pages * page + (64 << 20), 16 << 20, "tcp", "",
                   master) == 0
buf = np.random.default_rng(0).integers(0, 255, pages * page, dtype=np.uint8)
store.register_buffer(buf.ctypes.data, buf.nbytes)
cfg = ReplicateConfig(); cfg.replica_num = 1; cfg.preferred_segment = store.get_hostname()
for at in range(0, pages, 64):
    n = min(64, pages - at)
    ptrs = [[buf.ctypes.data + (at + i) * page + sum(parts[:j]) for j in range(len(parts))]
            for i in range(n)]
    codes = store.batch_put_from_multi_buffers([f"{prefix}{at + i}" for i in range(n)], ptrs,
                                               [parts] * n, cfg)
    assert all(c == 0 for c in codes), codes
print("ready", flush=True)
sys.stdin.read()
store.close()
"""


def fetch_phase(args: argparse.Namespace, keys: list[Any], tmp: Path) -> dict[str, Any]:
    """The fetch path alone, at a realistic page size (``--fetch-*``): a sidecar caches
    ``keys`` and writes them to the store, then another, empty, looks every prompt up,
    so everything it fetches crosses from the first one's segment (a warm-up round,
    then ``--rounds`` rounds, a Reset before each); in alternate rounds, Mooncake's own
    reads of as many pages, in the same batches, from another process's segment."""
    page_size = args.fetch_page_size
    unique = unique_pages(keys, page_size)
    geometry = argparse.Namespace(page_size=page_size, layers=args.fetch_layers,
                                  heads=args.fetch_heads, head_dim=args.fetch_head_dim)
    model = model_config(geometry, (unique + 2) * page_size + max(map(len, keys)))
    row = args.fetch_heads * args.fetch_head_dim * 2
    parts = [page_size * row] * (2 * args.fetch_layers)
    master = Master(tmp)
    tier = {"master": master.address, "timeout": 10.0,
            "segment_bytes": max(64 << 20, 2 * unique * sum(parts))}
    # The reader starts beside the writer (it looks nothing up until the writer is done).
    nodes = [Sidecar(tmp, "fetch-writer", model, tier), Sidecar(tmp, "fetch-reader", model, tier)]
    out: dict[str, Any] = {"fetch_page_bytes": sum(parts), "fetch_requests": len(keys)}
    reader: MooncakeReader | None = None
    try:
        for node in nodes:
            node.wait(r"prefixcache_tier_connected", 1)
        replay(nodes[:1], keys, page_size, True)
        batches = fetch_batches(nodes[1], keys)
        pages = sum(batches)
        if not pages:
            return out
        out["fetch_bytes"] = pages * sum(parts)
        out["fetch_pages_per_lookup"] = round(pages / len(batches))
        # Ours and Mooncake's in alternate rounds, the same batches of the same pages,
        # so that both see the same load of the machine (which swings either by 2x).
        reader = MooncakeReader(master.address, parts, pages)
        reader.round(batches)  # warm-up: its buffer's first touch
        ours, theirs = [], []
        for _ in range(args.rounds):
            ours.append(fetch_round(nodes[1], keys)[1])
            theirs.append(reader.round(batches))
        out["fetch_gbps"], out["mooncake_get_gbps"] = max(ours), max(theirs)
        out["fetch_vs_mooncake_rounds"] = [o / t for o, t in zip(ours, theirs, strict=True)]
        out["memcpy_gbps"] = reader.memcpy(args.rounds)
        for node in nodes:  # they leave the store while the reader does
            node.signal()
        reader.close()
        reader = None
        stop_all(nodes)
        if args.split:
            # The other split (docs/across-nodes.md): an object per page and buffer
            # (layer, K or V), the same bytes in len(parts) times the objects.
            batch = out["fetch_pages_per_lookup"]
            out["mooncake_get_gbps_object_per_buffer"] = mooncake_get_gbps(
                master.address, parts[:1], pages * len(parts), batch * len(parts),
                args.rounds)
    finally:
        if reader is not None:
            reader.close()
        stop_all(nodes)
        master.stop()
    return out
