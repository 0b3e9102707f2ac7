"""What checking seals costs a tier fetch (``tier.py``; ``--no-seal`` skips it): the tier's
own read, ``seals.checked_get`` (Mooncake's ``batch_get_into`` into pool-like buffers and
seal slots, then every page's seal checked in place), against the same call without the
checks (the backend's ``get_into`` alone), interleaved call by call over the same pages
in the same batches, for a digest (XXH3-128) and a MAC (AES-GMAC); the GB/s of the
seal check itself over those pages, in memory; and the tier's put of those pages from
the same buffers, sealed (``seals.seal_pages`` into the seal slots, then the backend's
``put_from``, as the tier's write thread does) against the same ``put_from`` alone,
call by call. ``save_phase``: the sidecar's save path, as the vLLM connector drives it
(a Match that allocates, then an Insert), with the tier sealing by digest, by MAC and
without the tier.

Another process puts the pages into its own segment, each object the page's parts and
a 32-byte seal made by ``PageSeal``, as a sidecar's put makes them; this one reads them
with the tier's ``MooncakeBackend``.
"""

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

from bench.tier_nodes import MODEL, Master, Sidecar, child_env, stop_all
from prefixcache.server.config.tier import TierConfig
from prefixcache.server.memory.page_seal import MemoryRegions, PageSeal, identity
from prefixcache.server.tier.mooncake_backend import MooncakeBackend
from prefixcache.server.tier.seals import (
    SealSlots,
    checked_get,
    page_checker,
    seal_pages,
    sealed,
)

KINDS = {"digest": None, "mac": bytes(range(32))}  # a fixed key: a bench, not a secret


def _ident(i: int) -> bytes:
    return identity("bench-page", i)


class SealedPages:
    """``pages`` pages of ``parts`` parts, put sealed by another process under each seal
    kind, and this process's reader of them: pool-like buffers and seal slots
    registered with its own backend."""

    def __init__(self, master: str, parts: list[int], pages: int, put_batch: int = 0) -> None:
        self.parts, self.pages = parts, pages
        self.puts = 0  # calls of ``put`` so far: each puts under keys of its own
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
            # The segment holds one call's puts (each removed before the next).
            put_bytes = (self.page_bytes + 32) * put_batch
            self.backend = MooncakeBackend(
                TierConfig(
                    master=master,
                    local_hostname="127.0.0.1",
                    segment_bytes=max(16 << 20, 2 * put_bytes + (16 << 20)),
                )
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

    def put(self, kind: str, at: int, n: int, seal: bool) -> float:
        """Put pages ``at`` to ``at + n`` from the buffers in one call, under new keys
        (Mooncake keeps an object it holds: a put under a held key moves no bytes),
        sealed first or not: its seconds. The objects are removed afterwards."""
        _, ptrs, sizes = self._call(kind, at, n)
        self.puts += 1
        keys = [f"bench/put/{kind}/{self.puts}/{i}" for i in range(n)]
        page_seal = PageSeal(KINDS[kind])
        idents = [_ident(i) for i in range(at, at + n)]
        start = time.perf_counter()
        if seal:
            seal_pages(
                page_seal, idents, ptrs, sizes, self.memory, self.slots, self.taken[at : at + n]
            )
        codes = self.backend.put_from(keys, ptrs, sizes)
        seconds = time.perf_counter() - start
        self.backend.remove(keys)
        if any(c != 0 for c in codes):
            raise RuntimeError(f"the {kind} put failed: {sorted(set(codes))}")
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
        reader = SealedPages(master.address, parts, pages, batch)
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
            out.update(_puts(reader, kind, batches, args.rounds))
    finally:
        if reader is not None:
            reader.close()
        master.stop()
    return out


def _puts(
    reader: SealedPages, kind: str, batches: list[tuple[int, int]], rounds: int
) -> dict[str, Any]:
    """The sealed put against the same put unsealed, call by call (``seal_phase``'s
    pairing): GB/s of each, best of the rounds, and the cost of sealing."""
    page_bytes = reader.page_bytes
    pages = sum(n for _, n in batches)
    for at, n in batches:  # warm-up: the segment's first touch
        reader.put(kind, at, n, True)
    plain, with_seals, pairs = [], [], []
    for r in range(rounds):
        times = [0.0, 0.0]
        for at, n in batches:
            first = r % 2 == 1
            one = reader.put(kind, at, n, first)
            two = reader.put(kind, at, n, not first)
            unsealed, sealed_put = (two, one) if first else (one, two)
            times[0] += unsealed
            times[1] += sealed_put
            pairs.append(sealed_put / unsealed)
        plain.append(pages * page_bytes / times[0] / 1e9)
        with_seals.append(pages * page_bytes / times[1] / 1e9)
    return {
        f"put_gbps_{kind}_unsealed": max(plain),
        f"put_gbps_{kind}_sealed": max(with_seals),
        f"put_sealed_cost_{kind}": max(plain) / max(with_seals),
        f"put_sealed_cost_{kind}_median": float(np.median(pairs)),
        f"put_sealed_cost_{kind}_rounds": [p / s for p, s in zip(plain, with_seals, strict=True)],
    }


_PUT = r"prefixcache_tier_put_(pages|failed_pages|dropped_pages)_total\{.*\}"


def save_phase(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Saves per second on the request path (Match with allocation, then Insert, one
    request at a time: the vLLM connector's save), ``--save-requests`` requests of
    ``--save-pages`` pages at the fetch measurement's geometry, on three sidecars: the
    tier with digests, the tier with ``secret_file`` (MACs), no tier. Each sidecar in
    turn, the order rotating each round; a tiered sidecar's write thread seals and
    puts while its saves run, and is drained (then the pool emptied) before the next
    sidecar's turn."""
    page = args.fetch_page_size
    n, tokens = args.save_requests, args.save_pages * args.fetch_page_size
    pool = {
        "size": n * tokens + 4 * page,
        "layers": args.fetch_layers,
        "k_heads": args.fetch_heads,
        "k_head_dim": args.fetch_head_dim,
        "dtype": "float16",
    }
    model = {"name": MODEL, "page_size": page, "pool": pool}
    page_bytes = page * args.fetch_heads * args.fetch_head_dim * 2 * 2 * args.fetch_layers
    (tmp / "secret").write_bytes(os.urandom(32))
    master = Master(tmp)
    segment = (args.rounds + 1) * n * args.save_pages * (page_bytes + 32) + (32 << 20)
    tier = {
        "master": master.address,
        "local_hostname": "127.0.0.1",
        "segment_bytes": segment,
        "timeout": 5.0,
    }
    tiers: dict[str, dict[str, Any] | None] = {
        "digest": tier,
        "mac": {**tier, "secret_file": str(tmp / "secret")},
        "none": None,
    }
    nodes: dict[str, Sidecar] = {}
    rng = np.random.default_rng(7)
    rates: dict[str, list[float]] = {kind: [] for kind in tiers}
    try:
        for kind, cfg in tiers.items():
            nodes[kind] = Sidecar(tmp, f"save-{kind}", model, cfg)
        for kind, node in nodes.items():
            node.connect()
            if tiers[kind] is not None:
                node.wait(r"prefixcache_tier_connected", 1)
        order = list(tiers)
        for r in range(args.rounds + 1):  # round 0 warms up
            for kind in order[r % 3 :] + order[: r % 3]:
                prompts = rng.integers(1, 1 << 30, (n, tokens), dtype=np.uint32)
                seconds = _saves(nodes[kind], prompts, page, tiers[kind] is not None)
                if r:
                    rates[kind].append(n / seconds)
    finally:
        stop_all(list(nodes.values()))
        master.stop()
    out: dict[str, Any] = {
        "save_requests": n,
        "save_bytes": args.save_pages * page_bytes,
    }
    for kind, got in rates.items():
        out[f"saves_per_s_{kind}"] = max(got)
    for kind in ("digest", "mac"):
        out[f"save_cost_{kind}"] = max(rates["none"]) / max(rates[kind])
        out[f"save_cost_{kind}_rounds"] = [
            a / b for a, b in zip(rates["none"], rates[kind], strict=True)
        ]
    out["save_cost_mac_vs_digest"] = max(rates["digest"]) / max(rates["mac"])
    return out


def _saves(node: Sidecar, prompts: np.ndarray, page: int, tiered: bool) -> float:
    """Save every prompt (new tokens: each a miss) on ``node``: the seconds of the
    request path; then wait for the tier's puts and empty the pool."""
    client = node.client
    if client is None:
        raise RuntimeError("the sidecar is not connected")
    before = node.metric(_PUT) if tiered else 0.0
    session = client.open_session(600)
    start = time.perf_counter()
    for prompt in prompts:
        reply = client.match(MODEL, prompt, session=session, allocate=True)
        client.insert(MODEL, prompt, reply.all_slots(), session=session)
    seconds = time.perf_counter() - start
    client.close_session(session)
    if tiered:
        node.wait(_PUT, before + prompts.size // page)
    client.evict(MODEL, 1 << 40)
    return seconds


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
