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
from collections.abc import Iterator
from pathlib import Path

import pytest
from server.harness import SOURCE_PATH, wait_serving

from prefixcache.server.memory.shared_pool import SharedPools, remove_stale

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
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / f"{owner}.lock")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "locked\n"
        yield proc, owner
    finally:
        proc.kill()
        proc.wait()


def test_a_live_owner_keeps_its_files_whatever_its_pid(
        tmp_path: Path, holder: tuple[subprocess.Popen[str], str]) -> None:
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
        tmp_path: Path, holder: tuple[subprocess.Popen[str], str]) -> None:
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
        tmp_path: Path, shm_dir: Path) -> None:
    (tmp_path / "pc.yaml").write_text(
        "models:\n  - name: m\n    pool: {size: 64, layers: 2, k_heads: 1, k_head_dim: 4}\n")
    sock = tmp_path / "pc.sock"
    env = {**os.environ, "PYTHONPATH": SOURCE_PATH,
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixcache.server.cli", "serve", "--config",
         str(tmp_path / "pc.yaml"), "--listen", f"unix:{sock}", "--metrics-port", "-1",
         "--shm-dir", str(shm_dir)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
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
