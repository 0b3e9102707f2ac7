"""``server.tier`` and ``models[].tier`` in the config, the tier's object keys and page
identities, and a lookup's deadline."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from prefixcache.cache.index.page_index import hash_namespace
from prefixcache.server.config import (
    ConfigError,
    ModelConfig,
    PoolConfig,
    TenantConfig,
    load_config,
)
from prefixcache.server.config.tier import TierConfig
from prefixcache.server.config.values import files_read_later
from prefixcache.server.tier.keys import KeyMaker, namespace_tenant, token_namespace
from prefixcache.server.tier.store_read import Deadline


def _load(tmp_path: Path, text: str) -> object:
    path = tmp_path / "pc.yaml"
    path.write_text(text)
    return load_config(path, env={})


def test_off_by_default_and_every_key_read(tmp_path: Path) -> None:
    assert load_config(None, env={}).server.tier is None
    cfg = _load(
        tmp_path,
        """
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
    min_fetch_bandwidth: 5e8
    max_fetch_slots: 4096
models:
  - name: a
  - name: b
    tier: false
""",
    )
    tier = cfg.server.tier
    assert (
        tier.master,
        tier.metadata,
        tier.protocol,
        tier.local_hostname,
        tier.segment_bytes,
        tier.write,
        tier.min_hits,
        tier.timeout,
        tier.min_fetch_bandwidth,
        tier.max_fetch_slots,
        tier.secret_file,
    ) == (
        "10.0.0.5:50051",
        "http://10.0.0.5:8080/metadata",
        "rdma",
        "10.0.0.7",
        2 << 30,
        "on_evict",
        2,
        0.25,
        5e8,
        4096,
        None,
    )
    assert [m.tier for m in cfg.models] == [True, False]


def test_the_env_carries_the_section_as_json() -> None:
    cfg = load_config(None, env={"PREFIXCACHE_TIER": '{"master": "m:1", "timeout": 2}'})
    assert (cfg.server.tier.master, cfg.server.tier.timeout) == ("m:1", 2.0)
    assert load_config(None, env={"PREFIXCACHE_TIER": "off"}).server.tier is None


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("protocol", "udp"),
        ("write", "sometimes"),
        ("timeout", 0),
        ("timeout", ".nan"),
        ("timeout", 61),
        ("min_hits", -1),
        ("segment_bytes", 10),
        ("master", "nohost"),
        ("metadata", "etcd://x"),
        ("backend", "redis"),
        ("local_hostname", "a b"),
        ("colour", "blue"),
        ("min_fetch_bandwidth", 0),
        ("min_fetch_bandwidth", ".inf"),
        ("max_fetch_slots", -1),
        ("secret_file", "/nonexistent"),
        ("secret_file", '" "'),
    ],
)
def test_bad_settings_are_refused_by_name(tmp_path: Path, key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"server.tier.{key}"):
        _load(tmp_path, f"server:\n  tier:\n    {key}: {value}\n")


def test_a_segment_below_mooncakes_minimum_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        _load(tmp_path, "server:\n  tier:\n    segment_bytes: 8388608\n")
    message = str(refused.value)
    assert "\n" not in message and "16 MiB" in message and "8388608" in message
    assert _load(tmp_path, "server:\n  tier:\n    segment_bytes: 16777216\n") is not None


def test_the_secret_file_holds_at_least_32_bytes(tmp_path: Path) -> None:
    secret = tmp_path / "tier-secret"
    secret.write_bytes(b"short\n")
    text = f"server:\n  tier:\n    secret_file: {secret}\n"
    with pytest.raises(ConfigError, match=r"holds 6 bytes.*head -c 32 /dev/urandom"):
        _load(tmp_path, text)
    secret.write_bytes(bytes(range(32)))
    assert _load(tmp_path, text).server.tier.secret_file == str(secret)
    # A config checked for another host (--check-config) notes a file missing here.
    missing = f"server:\n  tier:\n    secret_file: {tmp_path / 'gone'}\n"
    with files_read_later() as unread:
        _load(tmp_path, missing)
    assert len(unread) == 1 and "gone" in unread[0]


def test_a_fetch_deadline_grows_with_its_bytes() -> None:
    cfg = TierConfig(timeout=0.5, min_fetch_bandwidth=1e8)
    deadline = Deadline(cfg, start=100.0)
    assert deadline.at == 100.5  # an exists probe, a small fetch: about the timeout
    assert deadline.grow(70_000_000) == pytest.approx(101.2)  # a 70 MB hit: 0.7 s more
    assert deadline.grow(10**12) == 160.0  # never past MAX_TIER_TIMEOUT from the start


def test_models_tier_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"models\[0\].tier"):
        _load(tmp_path, "models:\n  - name: a\n    tier: maybe\n")


MODEL = ModelConfig(
    name="m", page_size=4, pool=PoolConfig(size=64, layers=2, k_heads=2, k_head_dim=8)
)
HASHES = ["ab" * 32, "cd" * 32]


def test_keys_agree_across_equal_configs_and_differ_otherwise() -> None:
    keys = KeyMaker(MODEL).keys(None, 1, HASHES)
    assert keys == KeyMaker(replace(MODEL, pool=replace(MODEL.pool, size=128))).keys(
        None, 1, HASHES
    )  # the pool's size decides no page's bytes
    others = [
        KeyMaker(replace(MODEL, name="other")).keys(None, 1, HASHES),
        KeyMaker(replace(MODEL, page_size=8)).keys(None, 1, HASHES),
        KeyMaker(replace(MODEL, pool=replace(MODEL.pool, dtype="bfloat16"))).keys(None, 1, HASHES),
        KeyMaker(replace(MODEL, pool=replace(MODEL.pool, layers=3))).keys(None, 1, HASHES),
        KeyMaker(replace(MODEL, pool=replace(MODEL.pool, v_head_dim=16))).keys(None, 1, HASHES),
        KeyMaker(replace(MODEL, vocab_size=32000)).keys(None, 1, HASHES),
        KeyMaker(replace(MODEL, tokenizer="llama-3@rev2")).keys(None, 1, HASHES),
        KeyMaker(MODEL, TENANTS).keys("acme/app", 1, HASHES),
        KeyMaker(MODEL, TENANTS[:1]).keys("acme/shared/x", 1, HASHES),
        KeyMaker(MODEL, secret=SECRET).keys(None, 1, HASHES),
        KeyMaker(MODEL, secret=bytes(32 - i for i in range(32))).keys(None, 1, HASHES),
        KeyMaker(MODEL).keys("", 1, HASHES),  # "" is not None
        KeyMaker(MODEL).keys("tenant-a/", 1, HASHES),
        KeyMaker(MODEL).keys(None, 2, HASHES),
    ]
    seen = {tuple(keys)}
    for other in others:
        assert tuple(other) not in seen
        seen.add(tuple(other))
    assert all(k.endswith(h) for k, h in zip(keys, HASHES, strict=True))


SECRET = bytes(range(32))
TENANTS = (
    TenantConfig("acme", "t1", None, ("acme/",)),
    TenantConfig("beta", "t2", None, ("beta/", "acme/shared/")),
)


def test_a_namespace_is_its_tenants_and_only_theirs() -> None:
    assert namespace_tenant(TENANTS, "acme/app") == '["acme"]'
    assert namespace_tenant(TENANTS, "acme/shared/x") == '["acme", "beta"]'
    assert namespace_tenant(TENANTS, "other/") is None
    assert namespace_tenant(TENANTS, None) is None
    assert namespace_tenant((), "acme/app") is None
    # A namespace no tenant covers keeps its keys whatever the tenants.
    assert KeyMaker(MODEL, TENANTS).keys("other/", 1, HASHES) == KeyMaker(MODEL).keys(
        "other/", 1, HASHES
    )


def test_keyed_keys_name_neither_the_page_nor_the_tenant() -> None:
    plain = KeyMaker(MODEL, TENANTS).keys("acme/app", 1, HASHES)
    keyed = KeyMaker(MODEL, TENANTS, SECRET).keys("acme/app", 1, HASHES)
    assert keyed == KeyMaker(MODEL, TENANTS, SECRET).keys("acme/app", 1, HASHES)
    assert not any(h in k for k in keyed for h in HASHES)
    assert set(keyed).isdisjoint(plain) and len(set(keyed)) == len(HASHES)
    prefixes = {k.rsplit("/", 1)[0] for k in keyed}
    assert len(prefixes) == 1 and prefixes.isdisjoint({k.rsplit("/", 1)[0] for k in plain})


def test_page_identities_differ_wherever_keys_do() -> None:
    ns = KeyMaker(MODEL, TENANTS).namespace
    idents = {
        ns("acme/app", 1).ident(HASHES[0]),
        ns("acme/app", 1).ident(HASHES[1]),
        ns("acme/app", 2).ident(HASHES[0]),
        ns("beta/app", 1).ident(HASHES[0]),
        KeyMaker(replace(MODEL, tokenizer="t")).namespace("acme/app", 1).ident(HASHES[0]),
    }
    assert len(idents) == 5
    assert KeyMaker(MODEL, secret=SECRET).namespace(None, 1).seal.keyed
    assert not KeyMaker(MODEL).namespace(None, 1).seal.keyed


@pytest.mark.parametrize(("extra_key", "width"), [(None, 1), ("", 1), ("a=b/", 2), ("x", 3)])
def test_hash_page_namespaces_map_back(extra_key: str | None, width: int) -> None:
    assert token_namespace(hash_namespace(extra_key, width)) == (extra_key, width)
