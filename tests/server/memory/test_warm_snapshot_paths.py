"""What a start finds at the snapshot's path, as an attacker with the service's own uid
could leave it: a directory, a FIFO, a symbolic link, a huge sparse file, a killed
writer's temporary file. Each is refused with one line and the start goes on cold: no
exit (a crash loop), no hang, no read of a large file before its header is checked."""

from __future__ import annotations

import os
import resource
import threading
from pathlib import Path

import pytest
from harness import make_config, running

from prefixcache.server.config import Config, ModelConfig, PoolConfig
from prefixcache.server.memory import warm_snapshot
from prefixcache.server.memory.warm_restart import WarmRestart

RADIX = ModelConfig(name="m", page_size=2, pool=PoolConfig(size=64, k_heads=1, k_head_dim=4))


def _config(shm: Path) -> Config:
    """The config ``running(shm.parent, ...)`` serves (its listen names the snapshot)."""
    return make_config(shm.parent, (RADIX,), shm_dir=str(shm), warm_restart=True)


def _prepare(shm: Path) -> WarmRestart:
    """A warm restart's start-up reading of ``shm``, on a thread that must end soon."""
    warm = WarmRestart(_config(shm))
    done = threading.Thread(target=warm.prepare, daemon=True)
    done.start()
    done.join(10)
    assert not done.is_alive(), "the start hangs on what is at the snapshot's path"
    return warm


def _refused(warm: WarmRestart) -> None:
    assert warm.outcome == "corrupt" and warm.counts["corrupt"] == 1, warm.counts


def _reasons(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(str(getattr(r, "reason", "")) for r in caplog.records)


def _path(shm: Path) -> Path:
    return WarmRestart(_config(shm)).path


@pytest.fixture()
def shm(tmp_path: Path) -> Path:
    path = tmp_path / "shm"
    path.mkdir()
    return path


def test_a_directory_is_refused_and_the_server_starts(
    shm: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _path(shm)
    path.mkdir()
    (path / "inside").write_text("x")  # not empty: it stays, and every start says so
    warm = _prepare(shm)
    _refused(warm)
    assert "is a directory, not a snapshot (left in place)" in _reasons(caplog)
    for _ in range(2):  # no crash loop: the server starts, and stops, each time
        with running(tmp_path, (RADIX,), shm_dir=str(shm), warm_restart=True) as srv:
            assert srv.server.warm.outcome == "corrupt"
    (path / "inside").unlink()
    _prepare(shm)
    assert not path.exists()  # an empty one is removed


@pytest.mark.parametrize("kind", ["fifo", "symlink", "dangling symlink"])
def test_what_is_not_a_file_is_refused_and_removed(
    shm: Path, tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = _path(shm)
    target = tmp_path / "target"
    target.write_bytes(b"precious")
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(target if kind == "symlink" else tmp_path / "nowhere")
    warm = _prepare(shm)
    _refused(warm)
    what = "a FIFO" if kind == "fifo" else "a symbolic link"
    assert f"is {what}, not a snapshot" in _reasons(caplog)
    assert not os.path.lexists(path)
    assert target.read_bytes() == b"precious"  # a link is removed, never followed


def test_a_huge_file_is_refused_before_it_is_read(shm: Path) -> None:
    path = _path(shm)
    with path.open("wb") as f:
        f.truncate(2 << 30)  # 2 GiB, sparse
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    warm = _prepare(shm)
    _refused(warm)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB
    assert not path.exists()
    # Within the bound but not a snapshot: its 16-byte header says so, nothing more.
    with path.open("wb") as f:
        f.truncate(warm_snapshot.max_bytes([RADIX]) - 1)
    _refused(_prepare(shm))


def test_a_torn_header_or_a_lying_length_is_refused(shm: Path) -> None:
    path = _path(shm)
    path.write_bytes(warm_snapshot.MAGIC + (10**9).to_bytes(8, "little") + bytes(64))
    warm = _prepare(shm)
    _refused(warm)
    assert not path.exists()


def test_a_killed_writers_temporary_files_are_removed(
    shm: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _path(shm)
    leftover = path.with_name(f"{path.name}.4242.tmp")
    leftover.write_bytes(bytes(1 << 20))
    other = shm / "prefixcache-warm-0123456789abcdef.snapshot.4242.tmp"  # another service's
    other.write_bytes(b"x")
    warm = _prepare(shm)
    assert warm.outcome == "no_snapshot"
    assert not leftover.exists() and other.exists()
    assert "temporary files" in caplog.text
