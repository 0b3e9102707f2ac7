"""Warm restart: real `prefixcache serve` processes with ``server.warm_restart: true``
and a small pool under a private shm_dir.

A clean stop (SIGTERM) keeps the pool files and writes a sealed snapshot of the tree;
while serving, checkpoints are written too. A start with the same config takes both
over: the prompts cached before hit again, their KV read back byte for byte, in a new
epoch with nothing locked, after a clean stop and after SIGKILL alike; a page whose
bytes changed since (a late write into the mapped pool, slots given to other KV after
the last checkpoint) is never served, and is counted. Every inconsistency starts cold,
says why in one log line and counts in prefixcache_warm_restarts_total. The servers
run in invariant mode (--check-integrity): every mutating call checks the cache, so a
restored tree that broke an invariant would answer INTERNAL.
"""

from __future__ import annotations

import json
import mmap
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from harness import SOURCE_PATH, wait_serving

from prefixcache.client import PrefixCacheClient, SessionLost, StaleEpoch
from prefixcache.client.write_fence import open_fence

pytestmark = pytest.mark.slow  # servers stopped, killed and restarted: 9-29 s a test at load 10

ENV = {
    **os.environ,
    "PYTHONPATH": SOURCE_PATH,
    "OMP_NUM_THREADS": "1",
    "PREFIXCACHE_LOG_FORMAT": "json",
}
LAYERS = 2


def config(shm: Path, size: int = 128, warm: bool = True, checkpoint: float = 30.0) -> str:
    return f"""\
server:
  shm_dir: {shm}
  warm_restart: {str(warm).lower()}
  warm_checkpoint_interval: {checkpoint}
models:
  - name: m
    page_size: 4
    pool: {{size: {size}, layers: {LAYERS}, k_heads: 1, k_head_dim: 8}}
"""


class Server:
    """One start of `prefixcache serve` on ``tmp``'s socket, its JSON log in a file."""

    def __init__(self, tmp: Path, text: str) -> None:
        n = len(list(tmp.glob("serve-*.log")))
        (tmp / "pc.yaml").write_text(text)
        self.address = f"unix:{tmp / 'pc.sock'}"
        self.log = tmp / f"serve-{n}.log"
        with self.log.open("wb") as err:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "prefixcache.server.cli",
                    "serve",
                    "--config",
                    str(tmp / "pc.yaml"),
                    "--listen",
                    self.address,
                    "--metrics-port",
                    "0",
                    "--check-integrity",
                ],
                env=ENV,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        try:
            wait_serving(self.proc, self.address, timeout=60)
        except RuntimeError as exc:
            raise AssertionError(f"{exc}\n{self.log.read_text()}") from None

    def records(self, event: str) -> list[dict[str, Any]]:
        lines = [
            json.loads(line) for line in self.log.read_text().splitlines() if line.startswith("{")
        ]
        return [r for r in lines if r.get("event") == event]

    def metrics(self) -> str:
        port = self.records("serving")[0]["metrics_port"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return r.read().decode()

    def outcomes(self) -> dict[str, float]:
        return {
            m[1]: float(m[2])
            for m in re.finditer(
                r'^prefixcache_warm_restarts_total\{outcome="(\w+)"\} (\S+)$', self.metrics(), re.M
            )
        }

    def integrity_failures(self) -> dict[str, float]:
        """``prefixcache_integrity_failures_total`` of source snapshot, by reason (those
        above 0: every pair is exported from the start)."""
        found = {
            m[1]: float(m[2])
            for m in re.finditer(
                r'^prefixcache_integrity_failures_total\{reason="(\w+)",source="snapshot"\} '
                r"(\S+)$",
                self.metrics(),
                re.M,
            )
        }
        return {reason: n for reason, n in found.items() if n}

    def checkpoints_written(self) -> float:
        found = re.search(
            r'^prefixcache_warm_checkpoints_total\{outcome="written"\} (\S+)$', self.metrics(), re.M
        )
        return float(found[1]) if found else 0.0

    def wait_checkpoint(self, after: float) -> None:
        """Until a checkpoint beyond the ``after``-th is written."""
        deadline = time.monotonic() + 30
        while self.checkpoints_written() <= after:
            assert time.monotonic() < deadline, "no checkpoint written"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(60) == 0, self.log.read_text()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(60)


def cache_prompts(address: str, seed: int) -> dict[tuple[int, ...], tuple[list[int], Any, Any]]:
    """Insert three prompts (two sharing a prefix) with their KV written through
    WriteKV; returns prompt -> (slots, k, v)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [
        tuple(range(seed, seed + 16)),
        (*range(seed, seed + 8), *range(900, 912)),
        tuple(range(500 + seed, 508 + seed)),
    ]
    out = {}
    with PrefixCacheClient(address, timeout=10) as client, client.session(30) as s:
        for prompt in prompts:
            have = s.match("m", list(prompt), lock=True)
            new = list(s.alloc("m", len(prompt) - have.prefix_len).slots)
            k = torch.randn((LAYERS, len(new), 1, 8), generator=gen).half()
            v = torch.randn((LAYERS, len(new), 1, 8), generator=gen).half()
            s.write_kv("m", new, k, v)
            slots = [*have.slots, *new]
            done = s.insert("m", list(prompt), slots, lock=True)
            assert done.prefix_len == have.prefix_len
            back = s.read_kv("m", slots)
            out[prompt] = (slots, back.k, back.v)  # the KV of the whole prompt
            s.unlock(done.lock_id)
            s.unlock(have.lock_id)
    return out


def check_hits(address: str, cached: dict[tuple[int, ...], tuple[list[int], Any, Any]]) -> None:
    with PrefixCacheClient(address, timeout=10) as client, client.session(30) as s:
        for prompt, (slots, k, v) in cached.items():
            hit = s.match("m", list(prompt), lock=True)
            assert hit.prefix_len == len(prompt) and list(hit.slots) == slots
            back = s.read_kv("m", slots)
            for layer in range(LAYERS):  # byte for byte
                assert back.k[layer].view(torch.int16).equal(k[layer].view(torch.int16))
                assert back.v[layer].view(torch.int16).equal(v[layer].view(torch.int16))
            s.unlock(hit.lock_id)
        stats = client.stats("m")
    assert stats["m"].protected_tokens == 0  # the reads' locks are released


def misses(address: str, cached: dict[tuple[int, ...], Any]) -> bool:
    with PrefixCacheClient(address, timeout=10) as client:
        return all(client.match("m", list(p)).prefix_len == 0 for p in cached)


def cold_reason(server: Server, outcome: str) -> str:
    lines = server.records("warm restart: starting cold")
    assert len(lines) == 1 and lines[0]["outcome"] == outcome, lines
    counts = server.outcomes()
    assert counts[outcome] == 1 and sum(counts.values()) == 1, counts
    return str(lines[0]["reason"])


def pool_files(shm: Path) -> list[str]:
    return sorted(p.name for p in shm.iterdir() if not p.name.endswith(".snapshot"))


@pytest.fixture()
def shm(tmp_path: Path) -> Path:
    path = tmp_path / "shm"
    path.mkdir()
    return path


def test_a_clean_restart_brings_the_cache_back_byte_for_byte(tmp_path: Path, shm: Path) -> None:
    first = Server(tmp_path, config(shm))
    try:
        assert cold_reason(first, "no_snapshot")
        cached = cache_prompts(first.address, 1)
        with PrefixCacheClient(first.address, timeout=10) as client:
            old_epoch = client.stats("m").server_epoch
            held = client.session(30)  # left open, a prefix locked: the stop ends it
            lock = held.match("m", list(next(iter(cached))), lock=True).lock_id
            held_id = held.info.session_id
    finally:
        first.stop()
    assert first.records("warm restart: snapshot written")
    snapshot = list(shm.glob("*.snapshot"))
    # lock, mark (kept for a warm restart) + K, V
    assert len(snapshot) == 1 and len(pool_files(shm)) == 2 + 2 * LAYERS

    second = Server(tmp_path, config(shm))
    try:
        restored = second.records("warm restart: cache restored")
        assert len(restored) == 1 and restored[0]["tokens"] == 16 + 12 + 8, restored
        assert second.outcomes() == {
            "restored": 1,
            "restored_from_checkpoint": 0,
            "no_snapshot": 0,
            "corrupt": 0,
            "config_changed": 0,
            "foreign": 0,
            "stale": 0,
            "unsupported": 0,
        }
        # Consumed, and in its place at once this run's first checkpoint (its own names).
        assert b'"clean": false' in snapshot[0].read_bytes()
        check_hits(second.address, cached)
        with PrefixCacheClient(second.address, timeout=10) as client:
            assert client.stats("m").server_epoch != old_epoch
            # Locks and sessions do not survive: the handle from before is refused.
            with pytest.raises(StaleEpoch):
                client.unlock(lock, session=held_id, server_epoch=old_epoch)
            # Everything restored is evictable.
            assert client.evict("m", 10**6).evicted_tokens == 16 + 12 + 8
        assert misses(second.address, cached)
    finally:
        second.stop()


def test_another_pool_geometry_starts_cold(tmp_path: Path, shm: Path) -> None:
    first = Server(tmp_path, config(shm))
    cached = cache_prompts(first.address, 3)
    first.stop()
    second = Server(tmp_path, config(shm, size=256))
    try:
        reason = cold_reason(second, "config_changed")
        assert "pool.size 128 then, 256 now" in reason, reason
        assert misses(second.address, cached)
        # The old pool's files were swept, not adopted: one owner's files remain.
        assert len({n.split("-m-")[0].removesuffix(".lock") for n in pool_files(shm)}) == 1
    finally:
        second.stop()


def test_a_crash_restores_the_last_checkpoint(tmp_path: Path, shm: Path) -> None:
    """SIGKILL loses what came after the last checkpoint, not the cache: the next start
    restores the checkpoint from the pool files that are still there."""
    first = Server(tmp_path, config(shm, checkpoint=0.2))
    cached = cache_prompts(first.address, 5)
    first.wait_checkpoint(first.checkpoints_written())
    first.kill()
    second = Server(tmp_path, config(shm))
    try:
        assert second.outcomes()["restored_from_checkpoint"] == 1
        restored = second.records("warm restart: cache restored")
        assert restored[0]["outcome"] == "restored_from_checkpoint"
        assert restored[0]["tokens"] == 16 + 12 + 8
        check_hits(second.address, cached)
        assert second.integrity_failures() == {}
    finally:
        second.kill()


def test_what_changed_after_the_checkpoint_misses(tmp_path: Path, shm: Path) -> None:
    """After the checkpoint, the cached prompts are evicted and their slots written with
    other KV (the pool has room for one set: they must reuse the slots); then SIGKILL.
    The next start finds the checkpoint's pages changed: they miss (counted, reason
    changed_after_checkpoint), never serving the other KV."""
    first = Server(tmp_path, config(shm, size=40))
    cached = cache_prompts(first.address, 7)
    first.stop()
    second = Server(tmp_path, config(shm, size=40))  # restores, and checkpoints at once
    second.wait_checkpoint(0)
    with PrefixCacheClient(second.address, timeout=10) as client:
        assert client.evict("m", 10**6).evicted_tokens == 16 + 12 + 8
    other = cache_prompts(second.address, 40)  # into the freed slots, other KV
    old_slots = {s for slots, _, _ in cached.values() for s in slots}
    assert old_slots & {s for slots, _, _ in other.values() for s in slots}
    second.kill()
    third = Server(tmp_path, config(shm, size=40))
    try:
        assert third.outcomes()["restored_from_checkpoint"] == 1
        assert third.integrity_failures()["changed_after_checkpoint"] >= 1
        assert misses(third.address, cached)
        assert misses(third.address, other)  # written after the checkpoint
    finally:
        third.stop()


def test_a_late_write_into_the_pool_is_never_served(tmp_path: Path, shm: Path) -> None:
    """A process that maps the pool writes into an already-cached page after the clean
    stop (through the mapping: tmpfs keeps the file's mtime). The next start restores
    the rest and drops that page: a counted integrity failure and a miss, not a hit."""
    first = Server(tmp_path, config(shm))
    cached = cache_prompts(first.address, 9)
    first.stop()
    prompt = next(p for p in cached if p[0] >= 500)  # the one that shares no prefix
    slot = cached[prompt][0][2]
    (k0,) = [p for p in shm.iterdir() if p.name.endswith("-m-0")]  # K of layer 0
    with k0.open("r+b") as f, mmap.mmap(f.fileno(), 0) as pool:
        pool[slot * 16] ^= 0x01  # one bit of one row: 8 fp16 of K per row
    second = Server(tmp_path, config(shm))
    try:
        assert second.outcomes()["restored"] == 1
        assert second.integrity_failures() == {"seal_mismatch": 1.0}
        assert misses(second.address, {prompt: None})
        check_hits(second.address, {p: v for p, v in cached.items() if p != prompt})
    finally:
        second.stop()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_snapshot_starts_cold(tmp_path: Path, shm: Path, damage: str) -> None:
    first = Server(tmp_path, config(shm))
    cached = cache_prompts(first.address, 9)
    first.stop()
    (snapshot,) = shm.glob("*.snapshot")
    data = bytearray(snapshot.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        del data[-40:]
    snapshot.write_bytes(bytes(data))
    second = Server(tmp_path, config(shm))
    try:
        reason = cold_reason(second, "corrupt")
        assert ("checksum" if damage == "flip" else "torn") in reason, reason
        assert misses(second.address, cached)
    finally:
        second.stop()


@pytest.mark.parametrize("change", ["owner_alive", "replaced"])
def test_files_that_changed_hands_start_cold(tmp_path: Path, shm: Path, change: str) -> None:
    """Another owner's files (its lock held by a live process) are neither adopted nor
    swept; a pool file replaced since the snapshot is not taken over."""
    first = Server(tmp_path, config(shm))
    cached = cache_prompts(first.address, 13)
    first.stop()
    (lock,) = shm.glob("*.lock")
    holder = None
    if change == "owner_alive":
        holder = subprocess.Popen(  # a live process in the owner's place
            [
                sys.executable,
                "-c",
                "import fcntl, sys; f = open(sys.argv[1]); "
                "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); sys.stdin.read()",
                str(lock),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    else:
        pool = next(p for p in shm.iterdir() if p.name.endswith("-m-0"))
        copy = pool.with_name("copy")
        copy.write_bytes(pool.read_bytes())
        copy.rename(pool)  # the same bytes, another file (the old one lives until then)
    try:
        second = Server(tmp_path, config(shm))
        try:
            if change == "owner_alive":
                assert "is alive" in cold_reason(second, "foreign")
                assert lock.exists()  # its files stay: nothing proves the owner dead
            else:
                assert "replaced since the snapshot" in cold_reason(second, "stale")
                assert not lock.exists()
            assert misses(second.address, cached)
        finally:
            second.stop()
    finally:
        if holder is not None:
            holder.communicate("", timeout=30)


def test_a_worker_inside_a_copy_at_the_stop_means_no_snapshot(tmp_path: Path, shm: Path) -> None:
    """A worker holding its write fence (mid-copy through the mapped pool) when the
    service stops could finish its copy into slots the next run hands out: the stop
    writes no snapshot (the checkpoint written while serving goes too), and the next
    start is cold: nothing of the old run is left in shm_dir."""
    first = Server(tmp_path, config(shm, checkpoint=0.2))
    cached = cache_prompts(first.address, 15)
    first.wait_checkpoint(first.checkpoints_written())
    with PrefixCacheClient(first.address, timeout=10) as client:
        session = client.session(30)
        session.alloc("m", 8)
        fence = open_fence(client, session.info.session_id)
        with fence.held():  # the worker's copy is under way
            first.stop()
        fence.close()
    lines = first.records("warm restart: no snapshot written; the next start is cold")
    assert len(lines) == 1 and "still copying" in lines[0]["reason"], lines
    assert list(shm.iterdir()) == []  # no snapshot, checkpoint, mark or pool file
    second = Server(tmp_path, config(shm))
    try:
        cold_reason(second, "no_snapshot")
        assert misses(second.address, cached)
    finally:
        second.stop()


def test_a_stop_during_start_up_keeps_what_was_restored(tmp_path: Path, shm: Path) -> None:
    """SIGTERM while a warm start makes its pools (before it serves): it stops before
    start, and, having served nothing, writes the restored tree back."""
    first = Server(tmp_path, config(shm))
    cached = cache_prompts(first.address, 17)
    first.stop()
    (old_lock,) = shm.glob("*.lock")
    log = tmp_path / "serve-interrupted.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "prefixcache.server.cli",
                "serve",
                "--config",
                str(tmp_path / "pc.yaml"),
                "--listen",
                first.address,
                "--metrics-port",
                "-1",
            ],
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        while not [p for p in shm.glob("*.lock") if p != old_lock]:  # its pools begin
            assert proc.poll() is None, log.read_text()
            time.sleep(0.001)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "stopped before start" in text and "warm restart: snapshot written" in text, text
    third = Server(tmp_path, config(shm))
    try:
        assert third.records("warm restart: cache restored")
        check_hits(third.address, cached)
    finally:
        third.stop()


def test_off_by_default_the_stop_removes_everything(tmp_path: Path, shm: Path) -> None:
    first = Server(tmp_path, config(shm, warm=False))
    cache_prompts(first.address, 11)
    assert sum(first.outcomes().values()) == 0  # exported, at 0
    first.stop()
    assert list(shm.iterdir()) == []


def _kv_of(prompt: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V rows (layers, tokens, 1, 8) a prompt's tokens have, each row a
    function of the prefix up to it: the page computed for a prefix is always the same,
    whoever computed it."""
    rows = []
    for j in range(len(prompt)):
        seed = hash(prompt[: j + 1]) & 0xFFFFFFFF
        rows.append(np.random.default_rng(seed).standard_normal((2, LAYERS, 8)))
    kv = torch.from_numpy(np.stack(rows, axis=2)).half()  # (2, layers, tokens, 8)
    return kv[0].unsqueeze(2).contiguous(), kv[1].unsqueeze(2).contiguous()


def _serve_randomly(
    address: str, rng: random.Random, prompts: set[tuple[int, ...]], seconds: float
) -> None:
    """Cache random prompts (shared prefixes, a pool small enough to evict) until the
    server dies or ``seconds`` pass; each one's KV is ``_kv_of`` it."""
    deadline = time.monotonic() + seconds
    stems = [tuple(rng.randrange(1, 50) for _ in range(8)) for _ in range(4)]
    try:
        with PrefixCacheClient(address, timeout=5) as client, client.session(30) as s:
            while time.monotonic() < deadline:
                prompt = rng.choice(stems) + tuple(
                    rng.randrange(1, 50) for _ in range(rng.randrange(4, 40))
                )
                have = s.match("m", list(prompt), lock=True)
                new = list(s.alloc("m", len(prompt) - have.prefix_len).slots)
                k, v = _kv_of(prompt)
                s.write_kv("m", new, k[:, have.prefix_len :], v[:, have.prefix_len :])
                prompts.add(prompt)
                done = s.insert("m", list(prompt), [*have.slots, *new])
                s.unlock(have.lock_id)
                if done.prefix_len > have.prefix_len:  # cached meanwhile: ours go back
                    s.free("m", new[: done.prefix_len - have.prefix_len])
    except Exception:  # the server was killed under us
        return


def _check_served(address: str, prompts: set[tuple[int, ...]]) -> int:
    """Every hit's KV is its prefix's; returns the tokens hit."""
    hit = 0
    with PrefixCacheClient(address, timeout=10) as client, client.session(30) as s:
        for prompt in sorted(prompts):
            got = s.match("m", list(prompt), lock=True)
            if got.prefix_len:
                back = s.read_kv("m", list(got.slots))
                k, v = _kv_of(prompt[: got.prefix_len])
                for layer in range(LAYERS):
                    assert back.k[layer].view(torch.int16).equal(k[layer].view(torch.int16))
                    assert back.v[layer].view(torch.int16).equal(v[layer].view(torch.int16))
                hit += got.prefix_len
            s.unlock(got.lock_id)
    return hit


def test_sigkill_at_random_points_serves_only_what_was_cached(tmp_path: Path, shm: Path) -> None:
    """SIGKILL at random points of serving and of checkpoints (every 20 ms), again and
    again: each start comes up, serves only KV equal to what its prefix was cached
    with, and leaves no file of a dead run or a torn checkpoint behind."""
    rng = random.Random(1234)
    prompts: set[tuple[int, ...]] = set()
    text = config(shm, size=512, checkpoint=0.02)
    outcomes = []
    for _ in range(3):
        server = Server(tmp_path, text)
        outcomes += [k for k, v in server.outcomes().items() if v]
        _check_served(server.address, prompts)
        killer = threading.Timer(rng.uniform(0.3, 1.5), server.kill)
        killer.start()
        _serve_randomly(server.address, rng, prompts, 3.0)
        killer.join()
        server.kill()
    last = Server(tmp_path, text)
    try:
        outcomes += [k for k, v in last.outcomes().items() if v]
        assert _check_served(last.address, prompts) > 0
        assert "restored_from_checkpoint" in outcomes, outcomes
        owners = {
            p.name.split("-m-")[0].removesuffix(".lock").removesuffix("-warm")
            for p in shm.iterdir()
            if not p.name.endswith(".snapshot")
        }
        assert len(owners) == 1 and not list(shm.glob("*.tmp")), sorted(shm.iterdir())
    finally:
        last.stop()


def test_a_crash_ends_the_killed_runs_fences_first(tmp_path: Path, shm: Path) -> None:
    """After SIGKILL the killed run's fences were never ended: the next start ends them
    before it checks a seal, so its worker copies nothing more (it reads "ended"); and
    while a worker is inside a copy (holding its record) the start is cold."""
    first = Server(tmp_path, config(shm, checkpoint=0.2))
    cached = cache_prompts(first.address, 21)
    with PrefixCacheClient(first.address, timeout=10) as client:
        session = client.session(60)
        fence = open_fence(client, session.info.session_id)
        fence.check()  # the record holds its token: it may copy
        first.wait_checkpoint(first.checkpoints_written())
        first.kill()
    second = Server(tmp_path, config(shm, checkpoint=0.2))
    try:
        assert second.outcomes()["restored_from_checkpoint"] == 1
        with pytest.raises(SessionLost):
            fence.check()  # ended by the start: the old worker copies nothing more
        check_hits(second.address, cached)
        with PrefixCacheClient(second.address, timeout=10) as client:
            session = client.session(60)
            inside = open_fence(client, session.info.session_id)
            second.wait_checkpoint(second.checkpoints_written())
            with inside.held():  # a copy under way when the service dies
                second.kill()
                third = Server(tmp_path, config(shm))
            inside.close()
        try:
            assert "still copying" in cold_reason(third, "stale")
            assert misses(third.address, cached)
        finally:
            third.stop()
    finally:
        fence.close()
        if second.proc.poll() is None:
            second.kill()
