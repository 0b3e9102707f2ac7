"""The fetch path alone (``tier.py --fetch-only``, and after the replays otherwise): our
Match's fetch from another sidecar's segment, beside Mooncake's own ``batch_get_into``
of the same pages in the same batches (``MooncakeReader``: one process reads what
another put), interleaved lookup by lookup, and a memcpy of the same bytes."""

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
from prefixcache.server.tier.mooncake_backend import PartBudget, chunked


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


BYTES = r"prefixcache_tier_fetch_bytes_total\{.*\}"
SECONDS = r"prefixcache_tier_fetch_seconds_total\{.*\}"


def paired_round(node: Sidecar, keys: list[Any], reader: MooncakeReader) -> tuple[float, float]:
    """One round, ours and Mooncake's interleaved lookup by lookup: after a Reset,
    ``node`` looks every prompt up, and right after each lookup that fetched, Mooncake's
    own call reads as many pages (``reader``'s next ones), so that the two see the same
    load of the machine, which swings within a second by 2x or more. Returns the GB/s of
    each: bytes over the seconds of its calls (ours as the metrics count them: each
    fetch from before its store call is handed to a worker thread until the loop has its
    answer; Mooncake's: the call alone)."""
    client = node.connect() if node.client is None else node.client
    client.reset(MODEL)
    ours_bytes = ours_seconds = theirs_seconds = 0.0
    at = 0
    with client.session(600) as session:
        for key in keys:
            b0, s0 = node.metric(BYTES), node.metric(SECONDS)
            client.match(MODEL, key, session=session)
            got = node.metric(BYTES) - b0
            if not got:
                continue
            ours_bytes += got
            ours_seconds += node.metric(SECONDS) - s0
            n = round(got / node.page_bytes)
            if at + n > reader.pages:
                at = 0
            theirs_seconds += reader.read(at, n)
            at += n
    theirs_bytes = ours_bytes  # the same pages' bytes
    return (
        ours_bytes / ours_seconds / 1e9 if ours_seconds else 0.0,
        theirs_bytes / theirs_seconds / 1e9 if theirs_seconds else 0.0,
    )


class MooncakeReader:
    """Mooncake's own ``batch_get_into_multi_buffers``: this process reads ``pages``
    pages of these parts that another process put into its own segment (the baseline
    of our fetch path). Only the calls are timed; their arguments are built before."""

    def __init__(self, master: str, parts: list[int], pages: int, name: str = "fetch") -> None:
        self.parts, self.pages = parts, pages
        self.page_bytes = sum(parts)
        prefix = f"bench/{name}/{len(parts)}x{parts[0]}/"
        self.writer = subprocess.Popen(
            [sys.executable, "-c", _WRITER, master, str(pages), json.dumps(parts), prefix],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=child_env(),
            text=True,
        )
        self.store: Any = None
        try:
            line = self.writer.stdout.readline() if self.writer.stdout else ""
            if line.strip() != "ready":
                raise RuntimeError(f"the Mooncake writer did not start: {line!r}")
            os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
            from mooncake.store import MooncakeDistributedStore

            self.store = MooncakeDistributedStore()
            if self.store.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", master):
                raise RuntimeError("Mooncake setup failed")
            self.buf = np.zeros(pages * self.page_bytes, np.uint8)
            self.store.register_buffer(self.buf.ctypes.data, self.buf.nbytes)
            self.keys = [f"{prefix}{i}" for i in range(pages)]
            self.budget = PartBudget()
        except BaseException:
            self.close()
            raise

    def read(self, at: int, n: int) -> float:
        """Read pages ``at`` to ``at + n`` in one call: its seconds."""
        base = self.buf.ctypes.data
        ptrs = [
            [base + i * self.page_bytes + sum(self.parts[:j]) for j in range(len(self.parts))]
            for i in range(at, at + n)
        ]
        keys, sizes = self.keys[at : at + n], [self.parts] * n
        start = time.perf_counter()
        # In calls of at most MAX_CALL_PARTS parts, as the tier's backend makes them
        # (Mooncake's TCP transport rejects what it cannot queue).
        codes = chunked(
            self.store.batch_get_into_multi_buffers,
            self.budget,
            keys,
            ptrs,
            sizes,
            stop_on=lambda code: False,
        )
        seconds = time.perf_counter() - start
        if any(c != self.page_bytes for c in codes):
            raise RuntimeError(f"Mooncake get failed: {sorted(set(codes))}")
        return seconds

    def round(self, batches: list[int]) -> float:
        """Read the pages, ``batches[i]`` pages in call ``i``: GB/s."""
        seconds, at = 0.0, 0
        for n in batches:
            seconds += self.read(at, n)
            at += n
        return at * self.page_bytes / seconds / 1e9

    def exists(self, at: int, n: int) -> float:
        """Probe pages ``at`` to ``at + n`` in one ``batch_is_exist`` (as a lookup asks
        before it reads): its seconds."""
        keys = self.keys[at : at + n]
        start = time.perf_counter()
        codes = self.store.batch_is_exist(keys)
        seconds = time.perf_counter() - start
        if any(c != 1 for c in codes):
            raise RuntimeError(f"Mooncake exists failed: {sorted(set(codes))}")
        return seconds

    def memcpy(self, rounds: int) -> float:
        """A memcpy of the same bytes, a page at a time: GB/s, best of ``rounds``."""
        buf, step = self.buf, self.page_bytes
        dst = np.empty_like(buf)
        best = float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            for i in range(0, buf.nbytes, step):
                np.copyto(dst[i : i + step], buf[i : i + step])
            best = min(best, time.perf_counter() - start)
        return buf.nbytes / best / 1e9

    def close(self) -> None:
        if self.writer.stdin and not self.writer.stdin.closed:
            self.writer.stdin.close()  # the writer leaves the store meanwhile
        if self.store is not None:
            self.store.close()
            self.store = None
        self.writer.wait(30)


def _batches(pages: int, batch: int) -> list[int]:
    return [min(batch, pages - at) for at in range(0, pages, batch)]


# Pages the split comparison reads at most (two writers and two readers hold them).
SPLIT_PAGES = 512


def split_gbps(
    master: str, parts: list[int], pages: int, batch: int, rounds: int = 3
) -> dict[str, Any]:
    """The object split (docs/across-nodes.md), Mooncake alone: the same bytes read as
    an object per page (``parts`` its parts, ``batch`` pages a call) and as an object per
    page and buffer (``len(parts)`` times the objects and the batch), the two
    interleaved call by call so that both see the same load; and what a lookup's
    ``batch_is_exist`` over those objects' keys costs."""
    pages = max(batch, min(pages, SPLIT_PAGES))
    whole = MooncakeReader(master, parts, pages, "split-page")
    try:
        split = MooncakeReader(master, parts[:1], pages * len(parts), "split-buffer")
        try:
            by_page, per = _batches(pages, batch), len(parts)
            whole.round(by_page)  # warm-up: the buffers' first touch
            split.round([n * per for n in by_page])
            page_gbps, buffer_gbps, page_probe, buffer_probe = [], [], [], []
            for _ in range(rounds):
                # Call by call, the same pages each way, so both see the same load.
                times = [0.0] * 4
                at = 0
                for n in by_page:
                    times[0] += whole.read(at, n)
                    times[1] += split.read(at * per, n * per)
                    times[2] += whole.exists(at, n)
                    times[3] += split.exists(at * per, n * per)
                    at += n
                page_gbps.append(pages * whole.page_bytes / times[0] / 1e9)
                buffer_gbps.append(pages * whole.page_bytes / times[1] / 1e9)
                page_probe.append(times[2] / len(by_page))
                buffer_probe.append(times[3] / len(by_page))
        finally:
            split.close()
    finally:
        whole.close()
    return {
        "split_pages": pages,
        "mooncake_get_gbps_object_per_page": max(page_gbps),
        "mooncake_get_gbps_object_per_buffer": max(buffer_gbps),
        "object_per_buffer_vs_page_rounds": [
            b / p for p, b in zip(page_gbps, buffer_gbps, strict=True)
        ],
        # A lookup's exists probe (its batch of keys in one call), best of the rounds.
        "exists_ms_object_per_page": 1e3 * min(page_probe),
        "exists_ms_object_per_buffer": 1e3 * min(buffer_probe),
    }


# The other process of MooncakeReader: puts the pages into its own segment and holds
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
    then ``--rounds`` rounds, a Reset before each); after each lookup, Mooncake's own
    reads of as many pages, in the same batches, from another process's segment."""
    page_size = args.fetch_page_size
    unique = unique_pages(keys, page_size)
    geometry = argparse.Namespace(
        page_size=page_size,
        layers=args.fetch_layers,
        heads=args.fetch_heads,
        head_dim=args.fetch_head_dim,
    )
    model = model_config(geometry, (unique + 2) * page_size + max(map(len, keys)))
    row = args.fetch_heads * args.fetch_head_dim * 2
    parts = [page_size * row] * (2 * args.fetch_layers)
    master = Master(tmp)
    tier = {
        "master": master.address,
        "timeout": 10.0,
        "segment_bytes": max(64 << 20, 2 * unique * sum(parts)),
    }
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
        # Ours and Mooncake's interleaved lookup by lookup, the same batches of the same
        # pages, so that both see the same load of the machine.
        reader = MooncakeReader(master.address, parts, pages)
        reader.round(batches)  # warm-up: its buffer's first touch
        ours, theirs = [], []
        for _ in range(args.rounds):
            mine, its = paired_round(nodes[1], keys, reader)
            ours.append(mine)
            theirs.append(its)
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
            out.update(
                split_gbps(master.address, parts, pages, out["fetch_pages_per_lookup"], args.rounds)
            )
    finally:
        if reader is not None:
            reader.close()
        stop_all(nodes)
        master.stop()
    return out
