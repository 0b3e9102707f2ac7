"""The stale shared-memory sweep: owners are proven by a lock held
for the server's life, not by a pid, so a server in another PID namespace sharing the
directory never loses its files to another's sweep."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from server.harness import SOURCE_PATH, wait_serving

from prefixcache.server.memory.shared_pool import (
    MAX_KEEP,
    WARM_SUFFIX,
    SharedPools,
    kept_for,
    mark_kept,
    private_zeros,
    remove_stale,
)

# Above the largest pid_max Linux allows (2**22): no process has this pid, here or in
# any namespace, as the pid of a server in another container would look to us.
NO_SUCH_PID = 2**22 + 7

# Holds an exclusive flock on argv[1] until its stdin closes: a live owner elsewhere.
HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.read()
"""


def _files(directory: Path, owner: str, buffers: int = 2) -> list[Path]:
    paths = [directory / f"{owner}.lock", *(directory / f"{owner}-m-{i}" for i in range(buffers))]
    for path in paths:
        path.write_bytes(b"x")
    return paths


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A live process in "another namespace": its files name a pid that does not exist."""
    owner = f"prefixcache-{NO_SUCH_PID}.{'a' * 16}"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / f"{owner}.lock")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "locked\n"
        yield proc, owner
    finally:
        proc.kill()
        proc.wait()


def test_a_live_owner_keeps_its_files_whatever_its_pid(
    tmp_path: Path, holder: tuple[subprocess.Popen[str], str]
) -> None:
    proc, owner = holder
    live = _files(tmp_path, owner)
    # A dead server's files whose pid is a live process here (pid reuse, or our own pid
    # in another namespace): the old pid check kept these forever.
    stale = _files(tmp_path, f"prefixcache-{os.getpid()}.{'b' * 16}")
    orphan = tmp_path / f"prefixcache-1.{'c' * 16}-m-0"  # its lock file is gone
    legacy = tmp_path / f"prefixcache-{NO_SUCH_PID}-abc-m-0"  # old naming: unprovable
    unrelated = tmp_path / "prefixcache-notes.txt"
    for path in (orphan, legacy, unrelated):
        path.write_bytes(b"x")

    assert remove_stale(tmp_path) == len(stale) + 1
    assert all(p.exists() for p in live), "a live owner's files were swept"
    assert not any(p.exists() for p in [*stale, orphan])
    assert legacy.exists() and unrelated.exists()

    proc.kill()  # the kernel drops its lock, however it dies
    proc.wait()
    assert remove_stale(tmp_path) == len(live)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([legacy.name, unrelated.name])


def test_a_starting_service_sweeps_around_a_live_one(
    tmp_path: Path, holder: tuple[subprocess.Popen[str], str]
) -> None:
    _, owner = holder
    live = _files(tmp_path, owner)
    stale = _files(tmp_path, f"prefixcache-{NO_SUCH_PID}.{'d' * 16}")
    shared = SharedPools(str(tmp_path), epoch=1)  # sweeps at start
    try:
        assert all(p.exists() for p in live) and not any(p.exists() for p in stale)
    finally:
        shared.close()


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A directory of its own on the real tmpfs, as two containers would share it."""
    path = Path(tempfile.mkdtemp(prefix="pc-test-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_a_running_servers_files_survive_a_sweep_by_another_process(
    tmp_path: Path, shm_dir: Path
) -> None:
    (tmp_path / "pc.yaml").write_text(
        "models:\n  - name: m\n    pool: {size: 64, layers: 2, k_heads: 1, k_head_dim: 4}\n"
    )
    sock = tmp_path / "pc.sock"
    env = {**os.environ, "PYTHONPATH": SOURCE_PATH, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prefixcache.server.cli",
            "serve",
            "--config",
            str(tmp_path / "pc.yaml"),
            "--listen",
            f"unix:{sock}",
            "--metrics-port",
            "-1",
            "--shm-dir",
            str(shm_dir),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_serving(proc, f"unix:{sock}")
        files = sorted(shm_dir.iterdir())
        assert len(files) == 5 and files[-1].name.endswith(".lock"), files  # 4 buffers
        assert remove_stale(shm_dir) == 0
        assert sorted(shm_dir.iterdir()) == files
        proc.send_signal(signal.SIGKILL)  # a crash: nothing of its own cleans up
        proc.wait(30)
        assert sorted(shm_dir.iterdir()) == files
        assert remove_stale(shm_dir) == len(files)
        assert list(shm_dir.iterdir()) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _mark(directory: Path, owner: str, text: str) -> Path:
    path = directory / f"{owner}{WARM_SUFFIX}"
    path.write_text(text)
    return path


def test_a_warm_services_marked_files_outlive_another_services_sweep(tmp_path: Path) -> None:
    """A stopped (or killed) warm-restart service marks its files: another service's
    sweep leaves them until the mark runs out; its own next start (the same service)
    does not wait; a mark that is past, too far ahead or garbage holds nothing."""
    now = time.time()
    kept = f"prefixcache-{NO_SUCH_PID}.{'e' * 16}"
    files = [
        *_files(tmp_path, kept),
        _mark(tmp_path, kept, f"keep-until {now + 60} service {'a' * 16}\n"),
    ]
    for i, text in enumerate(
        [
            f"keep-until {now - 1} service {'a' * 16}",  # past
            f"keep-until {now + 2 * MAX_KEEP} service {'a' * 16}",
            "keep-until soon service x",
            "",
        ]
    ):
        owner = f"prefixcache-{NO_SUCH_PID}.{i:016x}"
        _files(tmp_path, owner)
        _mark(tmp_path, owner, text)
    assert remove_stale(tmp_path, "b" * 16) == 4 * 4  # lock, 2 buffers, mark each
    assert sorted(tmp_path.iterdir()) == sorted(files)
    assert remove_stale(tmp_path) == 0  # no service named: marks hold
    assert remove_stale(tmp_path, "a" * 16) == len(files)
    assert list(tmp_path.iterdir()) == []


def test_mark_kept_writes_what_kept_for_reads(tmp_path: Path) -> None:
    owner = f"prefixcache-{NO_SUCH_PID}.{'f' * 16}"
    ms = 0.001  # the mark keeps its time to the millisecond
    before = time.time()
    mark_kept(tmp_path, owner, 30, "c" * 16)
    after = time.time()
    got = kept_for(tmp_path / f"{owner}{WARM_SUFFIX}")
    assert got is not None and got[1] == "c" * 16
    assert before + 30 - ms <= got[0] <= after + 30 + ms  # 30 s from when it was marked
    before = time.time()
    mark_kept(tmp_path, owner, 10 * MAX_KEEP, "c" * 16)  # capped, so it still holds
    after = time.time()
    got = kept_for(tmp_path / f"{owner}{WARM_SUFFIX}")
    assert got is not None and before + MAX_KEEP - ms <= got[0] <= after + MAX_KEEP + ms
    assert [p.name for p in tmp_path.iterdir()] == [f"{owner}{WARM_SUFFIX}"]


def test_big_pool_files_are_reserved_after_the_start(shm_dir: Path) -> None:
    shared = SharedPools(str(shm_dir), epoch=1)
    try:
        factory = shared.factory("m", "cpu")
        assert factory is not None
        big = factory((96 << 20,), torch.uint8)  # over the reserve-now size: later
        small = factory((1 << 20,), torch.uint8)
        files = {p.name[-1]: p for p in shm_dir.iterdir() if not p.name.endswith(".lock")}
        assert files["1"].stat().st_blocks * 512 >= 1 << 20  # reserved as made
        assert files["0"].stat().st_blocks * 512 < 96 << 20  # sparse until reserve
        assert shared.unreserved_bytes == 96 << 20
        assert shared.reserve() is None and shared.unreserved_bytes == 0
        assert files["0"].stat().st_blocks * 512 >= 96 << 20
        assert not big.any() and not small.any()  # zeros either way
    finally:
        shared.close()


def test_private_pools_are_zeros_mapped_lazily() -> None:
    before = _rss()
    buf = private_zeros((256 << 20,), torch.uint8)  # 256 MiB, not touched
    assert _rss() - before < 32 << 20
    assert buf.is_contiguous() and buf.shape == (256 << 20,)
    buf[::4096].fill_(1)  # first writes fault pages in
    assert int(buf[::4096].sum()) == (256 << 20) // 4096 and int(buf[1:4096].sum()) == 0
    shaped = private_zeros((3, 5, 7), torch.bfloat16)
    assert shaped.shape == (3, 5, 7) and not shaped.any()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
