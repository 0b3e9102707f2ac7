"""Warm restart: real `prefixcache serve` processes with
``server.warm_restart: true`` and a small pool under a private shm_dir.

A clean stop (SIGTERM) keeps the pool files and writes a snapshot of the tree; a start
with the same config takes both over: the prompts cached before hit again, their KV
read back byte for byte, in a new epoch with nothing locked. Every inconsistency starts
cold, says why in one log line and counts in prefixcache_warm_restarts_total: another
pool geometry, a damaged or torn snapshot, a start after SIGKILL (the decision: a
killed run leaves no snapshot, so nothing it may have half-written is ever served).
The servers run in invariant mode (--check-integrity): every mutating call checks the
cache, so a restored tree that broke an invariant would answer INTERNAL.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import SOURCE_PATH, wait_serving

from prefixcache.client import PrefixCacheClient, StaleEpoch
from prefixcache.client.write_fence import open_fence

ENV = {**os.environ, "PYTHONPATH": SOURCE_PATH,
       "OMP_NUM_THREADS": "1", "PREFIXCACHE_LOG_FORMAT": "json"}
LAYERS = 2


def config(shm: Path, size: int = 128, warm: bool = True) -> str:
    return f"""\
server:
  shm_dir: {shm}
  warm_restart: {str(warm).lower()}
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
                [sys.executable, "-m", "prefixcache.server.cli", "serve", "--config",
                 str(tmp / "pc.yaml"), "--listen", self.address, "--metrics-port", "0",
                 "--check-integrity"], env=ENV, stdout=subprocess.DEVNULL, stderr=err)
        try:
            wait_serving(self.proc, self.address, timeout=60)
        except RuntimeError as exc:
            raise AssertionError(f"{exc}\n{self.log.read_text()}") from None

    def records(self, event: str) -> list[dict[str, Any]]:
        lines = [json.loads(line) for line in self.log.read_text().splitlines()
                 if line.startswith("{")]
        return [r for r in lines if r.get("event") == event]

    def outcomes(self) -> dict[str, float]:
        port = self.records("serving")[0]["metrics_port"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        return {m[1]: float(m[2]) for m in re.finditer(
            r'^prefixcache_warm_restarts_total\{outcome="(\w+)"\} (\S+)$', text, re.M)}

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
    prompts = [tuple(range(seed, seed + 16)), (*range(seed, seed + 8), *range(900, 912)),
               tuple(range(500 + seed, 508 + seed))]
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


def test_a_clean_restart_brings_the_cache_back_byte_for_byte(tmp_path: Path,
                                                            shm: Path) -> None:
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
    assert len(snapshot) == 1 and len(pool_files(shm)) == 1 + 2 * LAYERS  # lock + K, V

    second = Server(tmp_path, config(shm))
    try:
        restored = second.records("warm restart: cache restored")
        assert len(restored) == 1 and restored[0]["tokens"] == 16 + 12 + 8, restored
        assert second.outcomes() == {"restored": 1, "no_snapshot": 0, "corrupt": 0,
                                     "config_changed": 0, "foreign": 0, "stale": 0,
                                     "unsupported": 0}
        assert not snapshot[0].exists()  # consumed: a crash now leaves none
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


def test_a_start_after_sigkill_is_cold(tmp_path: Path, shm: Path) -> None:
    """The decision: a killed run wrote no snapshot after its last pool write (the one
    its start read was removed), so the next start is cold and serves nothing the
    killed run's workers may have half-written."""
    first = Server(tmp_path, config(shm))
    cache_prompts(first.address, 5)
    first.stop()
    second = Server(tmp_path, config(shm))  # warm: takes over the pool
    assert second.records("warm restart: cache restored")
    cached = cache_prompts(second.address, 7)  # more writes after the snapshot
    second.kill()
    third = Server(tmp_path, config(shm))
    try:
        assert "did not stop cleanly" in cold_reason(third, "no_snapshot")
        assert misses(third.address, cached)
    finally:
        third.stop()


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


@pytest.mark.parametrize("change", ["owner_alive", "written"])
def test_files_that_changed_hands_start_cold(tmp_path: Path, shm: Path, change: str) -> None:
    """Another owner's files (its lock held by a live process) are neither adopted nor
    swept; a pool file written after the snapshot is not trusted."""
    first = Server(tmp_path, config(shm))
    cached = cache_prompts(first.address, 13)
    first.stop()
    (lock,) = shm.glob("*.lock")
    holder = None
    if change == "owner_alive":
        holder = subprocess.Popen(  # a live process in the owner's place
            [sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1]); "
             "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); sys.stdin.read()",
             str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    else:
        pool = next(p for p in shm.iterdir() if p.name.endswith("-m-0"))
        with pool.open("r+b") as f:
            f.write(b"\0")
    try:
        second = Server(tmp_path, config(shm))
        try:
            if change == "owner_alive":
                assert "is alive" in cold_reason(second, "foreign")
                assert lock.exists()  # its files stay: nothing proves the owner dead
            else:
                assert "written after the snapshot" in cold_reason(second, "stale")
                assert not lock.exists()
            assert misses(second.address, cached)
        finally:
            second.stop()
    finally:
        if holder is not None:
            holder.communicate("", timeout=30)


def test_a_worker_inside_a_copy_at_the_stop_means_no_snapshot(tmp_path: Path,
                                                              shm: Path) -> None:
    """A worker holding its write fence (mid-copy through the mapped pool) when the
    service stops could finish its copy into slots the next run hands out: the stop
    writes no snapshot, and the next start is cold (the old files swept)."""
    first = Server(tmp_path, config(shm))
    cached = cache_prompts(first.address, 15)
    with PrefixCacheClient(first.address, timeout=10) as client:
        session = client.session(30)
        session.alloc("m", 8)
        fence = open_fence(client, session.info.session_id)
        with fence.held():  # the worker's copy is under way
            first.stop()
        fence.close()
    lines = first.records("warm restart: no snapshot written; the next start is cold")
    assert len(lines) == 1 and "still copying" in lines[0]["reason"], lines
    assert not list(shm.glob("*.snapshot"))
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
            [sys.executable, "-m", "prefixcache.server.cli", "serve", "--config",
             str(tmp_path / "pc.yaml"), "--listen", first.address, "--metrics-port", "-1"],
            env=ENV, stdout=subprocess.DEVNULL, stderr=err)
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
