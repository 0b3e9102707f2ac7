"""The shared-memory pool files' mode is its own setting: by default the
owner's, plus the group's when the socket grants it, never the world's; only an
explicit ``shm_mode`` opens them further."""

from __future__ import annotations

from pathlib import Path

import pytest
from server.harness import running

from prefixcache.server.config import ConfigError, load_config

PREFIX = "prefixcache-"


def _modes(shm: Path) -> set[int]:
    files = [p for p in shm.iterdir() if p.name.startswith(PREFIX)]
    assert files  # the pool's buffers and the lock file
    return {p.stat().st_mode & 0o777 for p in files}


@pytest.mark.parametrize(
    ("settings", "mode"),
    [
        ({}, 0o600),
        ({"socket_mode": 0o660}, 0o660),
        ({"socket_mode": 0o666}, 0o660),  # a socket open to all: the pool is not
        ({"socket_mode": 0o777}, 0o660),
        ({"socket_mode": 0o666, "shm_mode": 0o640}, 0o640),
        ({"shm_mode": 0o666}, 0o666),  # only when asked for by name
    ],
)
def test_pool_files_take_the_shm_mode(tmp_path: Path, settings: dict[str, int], mode: int) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    with running(tmp_path, shm_dir=str(shm), **settings) as srv:
        assert _modes(shm) == {mode}
        assert Path(srv.address.removeprefix("unix:")).stat().st_mode & 0o777 == settings.get(
            "socket_mode", 0o600
        )


def test_shm_mode_setting(tmp_path: Path) -> None:
    assert load_config(env={}).server.shm_mode is None
    assert load_config(env={"PREFIXCACHE_SHM_MODE": "0640"}).server.shm_mode == 0o640
    path = tmp_path / "pc.yaml"
    path.write_text("server:\n  shm_mode: 0o660\n")
    assert load_config(path, env={}).server.shm_mode == 0o660
    for bad in ("0400", "0o1777", "rw"):
        with pytest.raises(ConfigError, match=r"server\.shm_mode"):
            load_config(env={"PREFIXCACHE_SHM_MODE": bad})
