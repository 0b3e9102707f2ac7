"""``server.tier`` and ``models[].tier`` in the config, and the tier's object keys."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from prefixcache.cache.index.page_index import hash_namespace
from prefixcache.server.config import ConfigError, ModelConfig, PoolConfig, load_config
from prefixcache.server.tier.keys import KeyMaker, token_namespace


def _load(tmp_path: Path, text: str) -> object:
    path = tmp_path / "pc.yaml"
    path.write_text(text)
    return load_config(path, env={})


def test_off_by_default_and_every_key_read(tmp_path: Path) -> None:
    assert load_config(None, env={}).server.tier is None
    cfg = _load(tmp_path, """
server:
  tier:
    backend: mooncake
    master: 10.0.0.5:50051
    metadata: http://10.0.0.5:8080/metadata
    protocol: rdma
    local_hostname: 10.0.0.7
    segment_bytes: 2147483648
    write: on_evict
    min_hits: 2
    timeout: 0.25
models:
  - name: a
  - name: b
    tier: false
""")
    tier = cfg.server.tier
    assert (tier.master, tier.metadata, tier.protocol, tier.local_hostname, tier.segment_bytes,
            tier.write, tier.min_hits, tier.timeout) == (
        "10.0.0.5:50051", "http://10.0.0.5:8080/metadata", "rdma", "10.0.0.7", 2 << 30,
        "on_evict", 2, 0.25)
    assert [m.tier for m in cfg.models] == [True, False]


def test_the_env_carries_the_section_as_json() -> None:
    cfg = load_config(None, env={"PREFIXCACHE_TIER": '{"master": "m:1", "timeout": 2}'})
    assert (cfg.server.tier.master, cfg.server.tier.timeout) == ("m:1", 2.0)
    assert load_config(None, env={"PREFIXCACHE_TIER": "off"}).server.tier is None


@pytest.mark.parametrize(("key", "value"), [
    ("protocol", "udp"), ("write", "sometimes"), ("timeout", 0),
    ("timeout", ".nan"), ("timeout", 61), ("min_hits", -1), ("segment_bytes", 10),
    ("master", "nohost"), ("metadata", "etcd://x"), ("backend", "redis"),
    ("local_hostname", "a b"), ("colour", "blue")])
def test_bad_settings_are_refused_by_name(tmp_path: Path, key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"server.tier.{key}"):
        _load(tmp_path, f"server:\n  tier:\n    {key}: {value}\n")


def test_models_tier_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"models\[0\].tier"):
        _load(tmp_path, "models:\n  - name: a\n    tier: maybe\n")


MODEL = ModelConfig(name="m", page_size=4, pool=PoolConfig(size=64, layers=2, k_heads=2,
                                                            k_head_dim=8))
HASHES = ["ab" * 32, "cd" * 32]


def test_keys_agree_across_equal_configs_and_differ_otherwise() -> None:
    keys = KeyMaker(MODEL).keys(None, 1, HASHES)
    assert keys == KeyMaker(replace(MODEL, pool=replace(MODEL.pool, size=128))).keys(
        None, 1, HASHES)  # the pool's size decides no page's bytes
    others = [
        KeyMaker(replace(MODEL, name="other")).keys(None, 1, HASHES),
        KeyMaker(replace(MODEL, page_size=8)).keys(None, 1, HASHES),
        KeyMaker(replace(MODEL, pool=replace(MODEL.pool, dtype="bfloat16"))).keys(None, 1, HASHES),
        KeyMaker(replace(MODEL, pool=replace(MODEL.pool, layers=3))).keys(None, 1, HASHES),
        KeyMaker(replace(MODEL, pool=replace(MODEL.pool, v_head_dim=16))).keys(None, 1, HASHES),
        KeyMaker(MODEL).keys("", 1, HASHES),          # "" is not None
        KeyMaker(MODEL).keys("tenant-a/", 1, HASHES),
        KeyMaker(MODEL).keys(None, 2, HASHES),
    ]
    seen = {tuple(keys)}
    for other in others:
        assert tuple(other) not in seen
        seen.add(tuple(other))
    assert all(k.endswith(h) for k, h in zip(keys, HASHES, strict=True))


@pytest.mark.parametrize(("extra_key", "width"), [(None, 1), ("", 1), ("a=b/", 2), ("x", 3)])
def test_hash_page_namespaces_map_back(extra_key: str | None, width: int) -> None:
    assert token_namespace(hash_namespace(extra_key, width)) == (extra_key, width)
