"""Faults under a running ``prefixcache serve`` with the disk tier (real processes, real
file systems): a full file system stops demotion (counted) and nothing else; a slow
disk (reads throttled by the kernel's block-I/O controller) does not hold a lookup past
its deadline; files removed or cut under the sidecar are misses, never a wrong page."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest
from disk_harness import (
    DEMOTED,
    cache,
    demote,
    disk_config,
    fill,
    read,
    same,
    small_filesystem,
    start,
    tokens_of,
)

from prefixcache.client import PrefixCacheClient

POOL = 256
DISK_FULL = r'prefixcache_disk_demote_dropped_pages_total\{.*reason="disk_full".*\}'
FULL_ERRORS = r'prefixcache_disk_errors_total\{.*code="DISK_FULL".*\}'


@pytest.mark.slow
def test_a_full_file_system_stops_demotion_and_nothing_fails(tmp_path: Path) -> None:
    """A tmpfs of 6 MiB, 4 MiB of it the tier's: filled by someone else, the journal
    cannot grow; demotion stops (counted), lookups and the pages on disk go on."""
    with small_filesystem(tmp_path, 6 << 20) as fs:
        if fs is None:
            pytest.skip("needs root to mount a small tmpfs to fill")
        node = start(tmp_path, "a", fs, nbytes=4 << 20)
        try:
            kept = tokens_of(1)
            kv = demote(node, kept, seed=1)
            fill(fs / "filler")
            for seed in range(2, 40):  # the journal's last page takes a few blocks more
                cache(node, tokens_of(seed), seed)
                with PrefixCacheClient(node.address, timeout=10) as client:
                    client.evict("m", POOL)
                if node.metric(FULL_ERRORS) + node.metric(DISK_FULL) > 0:
                    break
                time.sleep(0.05)
            node.wait(FULL_ERRORS, 1)
            hit, got = read(node, kept)
            assert hit == len(kept) and same(got, kv, hit)
            (fs / "filler").unlink()
            time.sleep(5.5)  # store.FULL_PAUSE: then writes are tried again
            before = node.metric(DEMOTED)
            fresh = tokens_of(99)
            kv2 = demote(node, fresh, seed=99)
            assert node.metric(DEMOTED) >= before + len(fresh) // 4
            hit, got = read(node, fresh)
            assert hit == len(fresh) and same(got, kv2, hit)
        finally:
            assert node.stop() == 0


def _throttle(pid: int, path: Path, bps: int) -> Path | None:
    """Put process ``pid`` in a blkio cgroup reading ``bps`` bytes/s from the disk under
    ``path``; the cgroup, or None where this machine has no such controller for us."""
    root = Path("/sys/fs/cgroup/blkio")
    if os.geteuid() != 0 or not (root / "blkio.throttle.read_bps_device").exists():
        return None
    dev = os.stat(path).st_dev
    group = root / f"prefixcache-test-{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        (group / "blkio.throttle.read_bps_device").write_text(
            f"{os.major(dev)}:{os.minor(dev)} {bps}\n"
        )
        (group / "cgroup.procs").write_text(str(pid))
    except OSError:
        _unthrottle(group, pid)
        return None
    return group


def _unthrottle(group: Path, pid: int) -> None:
    with contextlib.suppress(OSError):
        (group.parent / "cgroup.procs").write_text(str(pid))
    with contextlib.suppress(OSError):
        group.rmdir()


def test_a_slow_disk_does_not_hold_a_lookup_past_its_deadline(tmp_path: Path) -> None:
    """Reads throttled to 256 KiB/s, 2 MiB of pages to read: the lookup gives up at its
    deadline (0.3 s) what is not read by then (TIMEOUT), and answers with what was."""
    path = tmp_path / "disk"
    path.mkdir()
    config_model = {
        "name": "m",
        "kind": "radix",
        "page_size": 16,
        "pool": {"size": 1024, "layers": 2, "k_heads": 8, "k_head_dim": 128, "dtype": "float16"},
    }
    from tier_harness import Node

    config = disk_config(path, nbytes=64 << 20, timeout=0.3)
    config["models"] = [config_model]
    node = Node(tmp_path, "a", config)
    node.wait(r'prefixcache_disk_capacity_bytes\{model="m"\}', 1)
    group = None
    try:
        tokens = tokens_of(1, 256)
        with PrefixCacheClient(node.address, timeout=10) as client, client.session() as s:
            slots = client.alloc("m", len(tokens), session=s).slots
            client.insert("m", tokens, slots, session=s)
            client.evict("m", 1024)
        node.wait(DEMOTED, 16)
        group = _throttle(node.proc.pid, path, 256 << 10)
        if group is None:
            pytest.skip("needs root and cgroup v1's blkio controller to slow a disk down")
        with PrefixCacheClient(node.address, timeout=30) as client, client.session() as s:
            reply = client.match("m", tokens, session=s)
        assert reply.prefix_len < len(tokens)
        # Answered with what was read by the deadline; the rest given up (TIMEOUT), not
        # waited for at the throttled disk's pace.
        errors = node.metric(
            r'prefixcache_disk_errors_total\{(?=.*op="get")(?=.*code="TIMEOUT").*\}'
        )
        assert errors >= 1
    finally:
        if group is not None:
            _unthrottle(group, node.proc.pid)
        assert node.stop() == 0


def test_files_removed_or_cut_under_a_running_sidecar_are_misses(tmp_path: Path) -> None:
    path = tmp_path / "disk"
    path.mkdir()
    node = start(tmp_path, "a", path)
    try:
        gone = tokens_of(1)
        demote(node, gone, seed=1)
        (folder,) = [p for p in path.iterdir() if p.is_dir()]
        (folder / "pages").unlink()
        assert read(node, gone)[0] == 0
        assert (folder / "pages").exists()  # made anew
        kept = tokens_of(2, 32)
        kv = demote(node, kept, seed=2)
        hit, got = read(node, kept)
        assert hit == len(kept) and same(got, kv, hit)
        cut = tokens_of(3, 32)
        demote(node, cut, seed=3)
        os.truncate(folder / "pages", 0)
        hit, got = read(node, cut)
        assert hit == 0
        assert node.metric(r'prefixcache_disk_pages\{model="m"\}') == 0
        assert (folder / "pages").stat().st_size > 0  # grown back
        again = tokens_of(4)
        kv = demote(node, again, seed=4)
        hit, got = read(node, again)
        assert hit == len(again) and same(got, kv, hit)
    finally:
        assert node.stop() == 0
