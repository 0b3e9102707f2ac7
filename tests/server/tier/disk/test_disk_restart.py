"""The disk tier across restarts of real ``prefixcache serve`` processes: what the pool
evicted is a hit after a clean stop and after a SIGKILL, byte for byte; a clean stop
leaves the index file written and the journal empty; a second sidecar on the same
``disk.path`` is refused while the first runs, and starts once it is gone."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from disk_harness import demote, disk_config, read, same, start, tokens_of
from tier_harness import CLI

from prefixcache.server.tier.disk.journal import JOURNAL_HEAD_BYTES


def test_pages_on_disk_survive_a_clean_stop_and_a_sigkill(tmp_path: Path) -> None:
    path = tmp_path / "disk"
    path.mkdir()
    first, second = tokens_of(1), tokens_of(2)
    a = start(tmp_path, "a", path)
    try:
        kv1 = demote(a, first, seed=1)
    finally:
        assert a.stop() == 0
    (folder,) = [p for p in path.iterdir() if p.is_dir()]
    assert (folder / "journal").stat().st_size == JOURNAL_HEAD_BYTES  # the index has it
    b = start(tmp_path, "b", path)
    try:
        hit, got = read(b, first)
        assert hit == len(first) and same(got, kv1, hit)
        assert b.metric(r'prefixcache_tier_hit_tokens_total\{.*tier="disk".*\}') == hit
        kv2 = demote(b, second, seed=2)
    finally:
        b.proc.send_signal(signal.SIGKILL)  # the second prompt is in the journal only
        b.proc.wait(10)
        b.stop()
    assert (folder / "journal").stat().st_size > JOURNAL_HEAD_BYTES
    c = start(tmp_path, "c", path)
    try:
        for toks, kv in ((first, kv1), (second, kv2)):
            hit, got = read(c, toks)
            assert hit == len(toks) and same(got, kv, hit)
        assert c.metric(r'prefixcache_integrity_failures_total\{.*source="disk".*\}') == 0
    finally:
        assert c.stop() == 0


def _serve(
    tmp: Path, name: str, path: Path, timeout: float = 60, **disk: Any
) -> subprocess.CompletedProcess[str]:
    """``prefixcache serve`` that is expected to fail at start."""
    import yaml
    from harness import SOURCE_PATH

    folder = tmp / name
    folder.mkdir()
    (folder / "pc.yaml").write_text(yaml.safe_dump(disk_config(path, **disk)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXCACHE_")}
    env.update(PYTHONPATH=SOURCE_PATH, OMP_NUM_THREADS="1")
    return subprocess.run(
        [
            *CLI,
            "serve",
            "--config",
            str(folder / "pc.yaml"),
            "--listen",
            f"unix:{folder / 'pc.sock'}",
            "--metrics-port",
            "-1",
        ],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_a_second_sidecar_on_the_same_path_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "disk"
    path.mkdir()
    a = start(tmp_path, "a", path)
    try:
        second = _serve(tmp_path, "b", path)
        assert second.returncode == 2
        assert "server.disk.path" in second.stderr
        assert f"in use by another prefixcache serve (pid {a.proc.pid})" in second.stderr
    finally:
        a.proc.send_signal(signal.SIGKILL)  # the kernel drops the lock with the process
        a.proc.wait(10)
        a.stop()
    c = start(tmp_path, "c", path)
    assert c.stop() == 0


def test_a_missing_path_is_a_start_error_naming_it(tmp_path: Path) -> None:
    result = _serve(tmp_path, "a", tmp_path / "nowhere")
    assert result.returncode == 2
    assert "server.disk.path" in result.stderr and "does not exist" in result.stderr


def test_a_read_only_path_is_a_start_error_naming_it(tmp_path: Path) -> None:
    from disk_harness import small_filesystem

    with small_filesystem(tmp_path, 4 << 20) as fs:
        if fs is None:
            pytest.skip("needs root to mount a read-only file system")
        subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
        result = _serve(tmp_path, "a", fs)
    assert result.returncode == 2
    assert "server.disk.path" in result.stderr and "not writable" in result.stderr


def test_bytes_the_file_system_cannot_hold_refuse_the_start(tmp_path: Path) -> None:
    from disk_harness import small_filesystem

    with small_filesystem(tmp_path, 4 << 20) as fs:
        if fs is None:
            pytest.skip("needs root to mount a small file system")
        result = _serve(tmp_path, "a", fs, nbytes=16 << 20)
        assert list(fs.iterdir()) in ([], [fs / "prefixcache-disk.lock"])
    assert result.returncode == 2
    assert "server.disk.bytes" in result.stderr and "do not fit" in result.stderr


def test_the_path_is_free_again_after_a_refused_start(tmp_path: Path) -> None:
    path = tmp_path / "disk"
    path.mkdir()
    assert _serve(tmp_path, "a", path, nbytes=1 << 50).returncode == 2
    node = start(tmp_path, "b", path)
    assert node.stop() == 0
