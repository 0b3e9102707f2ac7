"""``server.disk`` and ``models[].disk`` in the config: off by default, a section from
YAML or ``PREFIXCACHE_DISK`` (JSON), each bad value refused naming its key; a model
with ``disk: false`` stays out of the disk tier."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import running

from prefixcache.server.config import ModelConfig, PoolConfig, load_config
from prefixcache.server.config.disk import DiskConfig
from prefixcache.server.config.values import ConfigError


def test_the_disk_tier_is_off_unless_asked_for() -> None:
    assert load_config(None, env={}).server.disk is None
    assert load_config(None, env={"PREFIXCACHE_DISK": "off"}).server.disk is None


def test_the_section_from_the_environment() -> None:
    disk = load_config(
        None,
        env={
            "PREFIXCACHE_DISK": json.dumps(
                {"path": "/var/cache/pc", "bytes": 1 << 30, "min_hits": 1}
            )
        },
    ).server.disk
    assert disk == DiskConfig(path="/var/cache/pc", bytes=1 << 30, min_hits=1)
    assert disk.write == "on_evict"


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"bytes": 1 << 30}, "server.disk.path"),
        ({"path": "/x"}, "server.disk.bytes"),
        ({"path": "/x", "bytes": 1000}, "server.disk.bytes"),
        ({"path": "/x", "bytes": 1 << 30, "timeout": 0}, "server.disk.timeout"),
        ({"path": "/x", "bytes": 1 << 30, "timeout": 100}, "server.disk.timeout"),
        (
            {"path": "/x", "bytes": 1 << 30, "min_fetch_bandwidth": 0},
            "server.disk.min_fetch_bandwidth",
        ),
        ({"path": "/x", "bytes": 1 << 30, "min_hits": -1}, "server.disk.min_hits"),
        ({"path": "/x", "bytes": 1 << 30, "max_fetch_slots": -1}, "server.disk.max_fetch_slots"),
        ({"path": "/x", "bytes": 1 << 30, "size": 1}, "server.disk.size"),
    ],
)
def test_bad_values_are_refused_naming_their_key(section: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{key.replace('.', '[.]')}:"):
        load_config(None, env={"PREFIXCACHE_DISK": json.dumps(section)})


def test_a_model_with_disk_false_stays_out(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    models = [
        ModelConfig(name="in", page_size=4, pool=PoolConfig(size=64)),
        ModelConfig(name="out", page_size=4, pool=PoolConfig(size=64), disk=False),
    ]
    with running(
        tmp_path, models, shm_dir="", disk=DiskConfig(path=str(tmp_path / "d"), bytes=4 << 20)
    ) as srv:
        assert list(srv.server.tier.tiers[0].models) == ["in"]
        assert srv.server.tier.models.keys() == {"in"}
    assert [p.name.split("-")[0] for p in (tmp_path / "d").iterdir() if p.is_dir()] == ["in"]


def test_check_config_says_when_the_path_is_not_here(tmp_path: Path) -> None:
    from test_cli import _env, _run

    (tmp_path / "c.yaml").write_text(
        f"server:\n  disk: {{path: {tmp_path / 'nope'}, bytes: 1073741824}}\nmodels:\n  - name: m\n"
    )
    done = _run(
        "serve", "--check-config", "--config", str(tmp_path / "c.yaml"), cwd=tmp_path, env=_env()
    )
    assert done.returncode == 1, done.stderr
    assert f"server.disk.path: {tmp_path / 'nope'} is not a directory here" in done.stdout
