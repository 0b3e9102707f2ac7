"""What checking seals costs a tier fetch (``tier.py``; ``--no-seal`` skips it): the tier's
own read, ``seals.checked_get`` (Mooncake's ``batch_get_into`` into pool-like buffers and
seal slots, then every page's seal checked in place), against the same call without the
checks (the backend's ``get_into`` alone), interleaved call by call over the same pages
in the same batches, for a digest (XXH3-128) and a MAC (AES-GMAC); and the GB/s of the
seal check itself over those pages, in memory.

Another process puts the pages into its own segment, each object the page's parts and
a 32-byte seal made by ``PageSeal``, as a sidecar's put makes them; this one reads them
with the tier's ``MooncakeBackend``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.tier_nodes import Master, child_env
from prefixcache.server.config.tier import TierConfig
from prefixcache.server.memory.page_seal import MemoryRegions, PageSeal, identity
from prefixcache.server.tier.mooncake_backend import MooncakeBackend
from prefixcache.server.tier.seals import SealSlots, checked_get, page_checker, sealed

KINDS = {"digest": None, "mac": bytes(range(32))}  # a fixed key: a bench, not a secret


def _ident(i: int) -> bytes:
    return identity("bench-page", i)


class SealedPages:
    """``pages`` pages of ``parts`` parts, put sealed by another process under each seal
    kind, and this process's reader of them: pool-like buffers and seal slots
    registered with its own backend."""

    def __init__(self, master: str, parts: list[int], pages: int) -> None:
        self.parts, self.pages = parts, pages
        self.page_bytes = sum(parts)
        self.writer = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _WRITER,
                master,
                str(pages),
                json.dumps(parts),
                json.dumps({k: (v.hex() if v else None) for k, v in KINDS.items()}),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=child_env(),
            text=True,
        )
        self.backend: Any = None
        try:
            line = self.writer.stdout.readline() if self.writer.stdout else ""
            if line.strip() != "ready":
                raise RuntimeError(f"the sealed-page writer did not start: {line!r}")
            self.backend = MooncakeBackend(
                TierConfig(master=master, local_hostname="127.0.0.1", segment_bytes=16 << 20)
            )
            # One buffer per K/V part, page i's part at row i: a pool's layout.
            self.buffers = [np.zeros((pages, size), np.uint8) for size in parts]
            self.slots = SealSlots(pages)
            regions = [(int(b.ctypes.data), int(b.nbytes)) for b in self.buffers]
            regions.append(self.slots.region())
            for ptr, size in regions:
                self.backend.register(ptr, size)
            self.memory = MemoryRegions(regions)
            taken = self.slots.take(pages)
            if taken is None:
                raise RuntimeError("no seal slots")
            self.taken = taken
        except BaseException:
            self.close()
            raise

    def _call(self, kind: str, at: int, n: int) -> tuple[list[str], Any, Any]:
        keys = [f"bench/seal/{kind}/{i}" for i in range(at, at + n)]
        ptrs = [
            [
                int(b.ctypes.data) + i * size
                for b, size in zip(self.buffers, self.parts, strict=True)
            ]
            for i in range(at, at + n)
        ]
        sizes = [list(self.parts)] * n
        return keys, *sealed(ptrs, sizes, self.slots.ptrs(self.taken[at : at + n]))

    def read(self, kind: str, at: int, n: int, check: bool) -> float:
        """Read pages ``at`` to ``at + n`` in one call (checked or not): its seconds."""
        keys, ptrs, sizes = self._call(kind, at, n)
        object_bytes = self.page_bytes + 32
        seal = PageSeal(KINDS[kind])
        checker = page_checker(
            seal,
            [_ident(i) for i in range(at, at + n)],
            ptrs,
            sizes,
            self.memory,
            self.slots,
            self.taken[at : at + n],
        )
        start = time.perf_counter()
        if check:
            codes = checked_get(self.backend, keys, ptrs, sizes, checker, object_bytes)
        else:
            codes = self.backend.get_into(keys, ptrs, sizes)
        seconds = time.perf_counter() - start
        if any(c != object_bytes for c in codes):
            raise RuntimeError(f"the {kind} read failed: {sorted(set(codes))}")
        return seconds

    def seal_gbps(self, kind: str, rounds: int) -> float:
        """The seal check alone over every page in memory: GB/s, best of ``rounds``."""
        _, ptrs, sizes = self._call(kind, 0, self.pages)
        check = page_checker(
            PageSeal(KINDS[kind]),
            [_ident(i) for i in range(self.pages)],
            ptrs,
            sizes,
            self.memory,
            self.slots,
            self.taken,
        )
        best = float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            for i in range(self.pages):
                if check(i) is not None:
                    raise RuntimeError(f"page {i}'s {kind} seal does not check")
            best = min(best, time.perf_counter() - start)
        return self.pages * self.page_bytes / best / 1e9

    def close(self) -> None:
        if self.writer.stdin and not self.writer.stdin.closed:
            self.writer.stdin.close()
        if self.backend is not None:
            self.backend.close()
            self.backend = None
        self.writer.wait(30)


def seal_phase(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Fetches with and without the seal checks, and the checks' own GB/s (module doc),
    at the fetch measurement's geometry (``--fetch-*``), ``--seal-pages`` pages in calls
    of ``--seal-batch``."""
    row = args.fetch_heads * args.fetch_head_dim * 2
    parts = [args.fetch_page_size * row] * (2 * args.fetch_layers)
    pages, batch = args.seal_pages, args.seal_batch
    batches = [(at, min(batch, pages - at)) for at in range(0, pages, batch)]
    master = Master(tmp)
    out: dict[str, Any] = {"seal_pages": pages, "seal_page_bytes": sum(parts), "seal_batch": batch}
    reader: SealedPages | None = None
    try:
        reader = SealedPages(master.address, parts, pages)
        for kind in KINDS:
            for at, n in batches:  # warm-up: the buffers' first touch
                reader.read(kind, at, n, True)
            plain, checked, pairs = [], [], []
            for r in range(args.rounds):
                times = [0.0, 0.0]
                for at, n in batches:
                    # Call by call, both ways, so both see the same load; which goes first
                    # alternates.
                    first = r % 2 == 1
                    one = reader.read(kind, at, n, first)
                    two = reader.read(kind, at, n, not first)
                    unchecked, with_checks = (two, one) if first else (one, two)
                    times[0] += unchecked
                    times[1] += with_checks
                    pairs.append(with_checks / unchecked)
                plain.append(pages * sum(parts) / times[0] / 1e9)
                checked.append(pages * sum(parts) / times[1] / 1e9)
            out[f"fetch_gbps_{kind}_unchecked"] = max(plain)
            out[f"fetch_gbps_{kind}_checked"] = max(checked)
            out[f"fetch_checked_cost_{kind}"] = max(plain) / max(checked)
            out[f"fetch_checked_cost_{kind}_median"] = float(np.median(pairs))
            out[f"fetch_checked_cost_{kind}_rounds"] = [
                p / c for p, c in zip(plain, checked, strict=True)
            ]
            out[f"seal_check_gbps_{kind}"] = reader.seal_gbps(kind, args.rounds)
    finally:
        if reader is not None:
            reader.close()
        master.stop()
    return out


# The other process of SealedPages: puts every page sealed under each kind into its own
# segment and holds them until its stdin closes.
_WRITER = """
import json, os, sys
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
import numpy as np
from mooncake.store import MooncakeDistributedStore, ReplicateConfig
from prefixcache.server.memory.page_seal import PageSeal, identity
master, pages, parts, kinds = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), \\
    json.loads(sys.argv[4])
page = sum(parts)
store = MooncakeDistributedStore()
if store.setup("127.0.0.1", "P2PHANDSHAKE", len(kinds) * pages * (page + 32) + (64 << 20),
               16 << 20, "tcp", "", master):
    raise SystemExit("setup failed")
buf = np.random.default_rng(0).integers(0, 255, pages * page, dtype=np.uint8)
seals = np.zeros((len(kinds), pages, 32), np.uint8)
store.register_buffer(buf.ctypes.data, buf.nbytes)
store.register_buffer(seals.ctypes.data, seals.nbytes)
cfg = ReplicateConfig(); cfg.replica_num = 1; cfg.preferred_segment = store.get_hostname()
for k, (kind, key) in enumerate(kinds.items()):
    seal = PageSeal(bytes.fromhex(key) if key else None)
    for i in range(pages):
        data = buf[i * page:(i + 1) * page]
        seals[k, i] = np.frombuffer(seal.seal(identity("bench-page", i), [data]), np.uint8)
    for at in range(0, pages, 64):
        n = min(64, pages - at)
        ptrs = [[buf.ctypes.data + (at + i) * page + sum(parts[:j]) for j in range(len(parts))]
                + [seals[k, at + i].ctypes.data] for i in range(n)]
        codes = store.batch_put_from_multi_buffers(
            [f"bench/seal/{kind}/{at + i}" for i in range(n)], ptrs, [parts + [32]] * n, cfg)
        if any(c != 0 for c in codes):
            raise SystemExit(f"put failed: {codes}")
print("ready", flush=True)
sys.stdin.read()
store.close()
"""
