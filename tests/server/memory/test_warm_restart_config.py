"""server.warm_restart: the setting's checks, and the kinds that are not restored (in
process; tests/reliability/test_warm_restart.py restarts real `prefixcache serve`s)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import SMALL_POOL, make_config, running

from prefixcache.cache.radix.tree_snapshot import decode, encode
from prefixcache.client import PrefixCacheClient
from prefixcache.server.config import ConfigError, ModelConfig, PoolConfig, load_config
from prefixcache.server.memory import warm_snapshot

RADIX = ModelConfig(name="m", page_size=2, pool=PoolConfig(size=64, k_heads=1, k_head_dim=4))
SWA = ModelConfig(name="w", kind="swa", page_size=1, sliding_window_size=4, pool=SMALL_POOL)
CHUNK = ModelConfig(name="c", kind="chunk", page_size=1, pool=SMALL_POOL)


def test_off_by_default_and_refused_without_shared_memory(tmp_path: Path) -> None:
    path = tmp_path / "pc.yaml"
    path.write_text("models: [{name: m}]\n")
    assert load_config(path).server.warm_restart is False
    path.write_text("server: {warm_restart: true, shm_dir: 'off'}\nmodels: [{name: m}]\n")
    with pytest.raises(ConfigError, match=r"server\.warm_restart: needs shm_dir"):
        load_config(path)
    path.write_text(f"server: {{warm_restart: true, shm_dir: {tmp_path}}}\nmodels: [{{name: m}}]\n")
    assert load_config(path).server.warm_restart is True


def test_a_kind_that_is_not_restored_starts_cold_and_writes_nothing(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    for _ in range(2):
        with running(tmp_path, (RADIX, SWA), shm_dir=str(shm), warm_restart=True) as srv:
            assert srv.server.warm.outcome == "unsupported"
        assert list(shm.iterdir()) == []  # no snapshot; the pool files removed as usual


def test_a_restored_cache_passes_the_integrity_check_and_evicts(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    keys = [list(range(1, 11)), [*range(1, 5), 70, 71], [5, 6, 7, 8]]
    # A chunk model beside it holds nothing to restore; its pool is taken over too.
    with (
        running(tmp_path, (RADIX, CHUNK), shm_dir=str(shm), warm_restart=True) as srv,
        PrefixCacheClient(srv.address, timeout=10) as client,
        client.session(10) as s,
    ):
        for key in keys:
            have = s.match("m", key)
            new = list(s.alloc("m", len(key) - have.prefix_len).slots)
            s.write_kv(
                "m",
                new,
                torch.ones((1, len(new), 1, 4)).half(),
                torch.ones((1, len(new), 1, 4)).half(),
            )
            s.insert("m", key, [*have.slots, *new])
        before = {tuple(k): list(client.match("m", k).slots) for k in keys}
        used = srv.service.engines["m"].allocator.num_allocated()
    with running(tmp_path, (RADIX, CHUNK), shm_dir=str(shm), warm_restart=True) as srv:
        assert srv.server.warm.outcome == "restored"
        assert len(srv.service.shared.adopted) == 4  # K and V of each model
        srv.check_integrity()
        engine = srv.service.engines["m"]
        assert engine.allocator.num_allocated() == used == engine.cache.evictable_size()
        assert engine.cache.protected_size() == 0 and len(srv.service.sessions) == 0
        with PrefixCacheClient(srv.address, timeout=10) as client:
            assert {tuple(k): list(client.match("m", k).slots) for k in keys} == before
            # New allocations never get a restored slot.
            with client.session(10) as s:
                fresh = set(s.alloc("m", engine.allocator.available_size()).slots)
                assert not fresh & {x for v in before.values() for x in v}
            assert client.evict("m", used).evicted_tokens == used
        srv.check_integrity()


def test_a_pool_on_a_gpu_starts_cold(tmp_path: Path) -> None:
    """Device memory does not outlive the process: such a model is unsupported (the
    check runs before any pool is made, so no GPU is needed here)."""
    from prefixcache.server.config import Config, ServerConfig
    from prefixcache.server.memory.warm_restart import WarmRestart

    gpu = replace(RADIX, pool=replace(RADIX.pool, device="cuda:0"))
    warm = WarmRestart(Config(ServerConfig(shm_dir=str(tmp_path), warm_restart=True), (RADIX, gpu)))
    assert warm.prepare() is None and warm.outcome == "unsupported"
    assert warm.counts["unsupported"] == 1


def _cached_then_stopped(tmp_path: Path, shm: Path) -> list[list[int]]:
    keys = [list(range(1, 9)), [1, 2, 3, 4, 60, 61]]
    with (
        running(tmp_path, (RADIX,), shm_dir=str(shm), warm_restart=True) as srv,
        PrefixCacheClient(srv.address, timeout=10) as client,
        client.session(10) as s,
    ):
        for key in keys:
            have = s.match("m", key)
            new = list(s.alloc("m", len(key) - have.prefix_len).slots)
            s.insert("m", key, [*have.slots, *new])
    return keys


Trees = list[tuple[bytes, bytes]]  # each tree's bytes and its seals


def _rewrite(shm: Path, edit: Any) -> None:
    """Read the snapshot, change it with ``edit(manifest, trees)``, write it back
    whole and checksummed: a well-formed snapshot that must still be refused."""
    (path,) = shm.glob("*.snapshot")
    read = warm_snapshot.consume(path, 1 << 30)
    assert read is not None
    manifest = read.manifest
    trees = edit(manifest, [(bytes(tree), bytes(seals)) for tree, seals in read.trees])
    warm_snapshot.write(
        path, warm_snapshot.encode_body(manifest, [([tree], seals) for tree, seals in trees]), 0o600
    )


def test_another_snapshot_format_starts_cold(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    keys = _cached_then_stopped(tmp_path, shm)

    def newer(manifest: dict[str, Any], trees: Trees) -> Trees:
        manifest["version"] = warm_snapshot.VERSION + 1
        return trees

    _rewrite(shm, newer)
    with (
        running(tmp_path, (RADIX,), shm_dir=str(shm), warm_restart=True) as srv,
        PrefixCacheClient(srv.address, timeout=10) as client,
    ):
        assert srv.server.warm.outcome == "config_changed"
        assert all(client.match("m", k).prefix_len == 0 for k in keys)


def test_a_tree_that_does_not_rebuild_leaves_every_model_empty(tmp_path: Path) -> None:
    """Checksummed, decodable, but two nodes name one slot: refused at the rebuild
    (corrupt); the pools were taken over already, so the models are emptied."""
    shm = tmp_path / "shm"
    shm.mkdir()
    keys = _cached_then_stopped(tmp_path, shm)

    def twice(manifest: dict[str, Any], trees: Trees) -> Trees:
        image = decode(trees[0][0])
        slots = image.slots.copy()
        slots[-1] = slots[0]
        return [(encode(replace(image, slots=slots).parts()), trees[0][1])]

    _rewrite(shm, twice)
    with (
        running(tmp_path, (RADIX,), shm_dir=str(shm), warm_restart=True) as srv,
        PrefixCacheClient(srv.address, timeout=10) as client,
    ):
        assert srv.server.warm.outcome == "corrupt"
        engine = srv.service.engines["m"]
        assert engine.cache.total_size() == 0 and engine.allocator.num_allocated() == 0
        srv.check_integrity()
        assert all(client.match("m", k).prefix_len == 0 for k in keys)
        with client.session(10) as s:  # the whole pool is usable again
            assert len(s.alloc("m", engine.allocator.available_size()).slots) == 64


def test_another_services_start_leaves_a_stopped_warm_services_pool(tmp_path: Path) -> None:
    """Between a warm service's stop and its next start, another service without warm
    restart starts in the same shm_dir: its sweep leaves the marked files alone, and the
    warm service comes back warm."""
    shm = tmp_path / "shm"
    shm.mkdir()
    keys = _cached_then_stopped(tmp_path, shm)
    kept = sorted(p.name for p in shm.iterdir())
    (tmp_path / "other").mkdir()
    with running(tmp_path / "other", (RADIX,), shm_dir=str(shm)):
        assert set(kept) <= {p.name for p in shm.iterdir()}
    with (
        running(tmp_path, (RADIX,), shm_dir=str(shm), warm_restart=True) as srv,
        PrefixCacheClient(srv.address, timeout=10) as client,
    ):
        assert srv.server.warm.outcome == "restored"
        assert all(client.match("m", k).prefix_len == len(k) - len(k) % 2 for k in keys)


def test_a_checkpoint_that_does_not_fit_is_skipped_and_counted(tmp_path: Path) -> None:
    """Over warm_checkpoint_max_bytes (as over shm_dir's free space) a checkpoint is
    skipped, counted and logged; the service goes on serving, and a clean stop still
    writes its snapshot when that fits."""
    shm = tmp_path / "shm"
    shm.mkdir()
    with (
        running(
            tmp_path,
            (RADIX,),
            shm_dir=str(shm),
            warm_restart=True,
            warm_checkpoint_interval=0.05,
            warm_checkpoint_max_bytes=64,
        ) as srv,
        PrefixCacheClient(srv.address, timeout=10) as client,
        client.session(10) as s,
    ):
        s.insert("m", [1, 2, 3, 4], list(s.alloc("m", 4).slots))
        deadline = time.monotonic() + 30
        while srv.server.warm.checkpoints["no_room"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert srv.server.warm.checkpoints["written"] == 0
        assert not list(shm.glob("*.snapshot"))
        assert client.match("m", [1, 2, 3, 4]).prefix_len == 4
    assert len(list(shm.glob("*.snapshot"))) == 1  # the stop's is not capped
    with (
        running(tmp_path, (RADIX,), shm_dir=str(shm), warm_restart=True) as srv,
        PrefixCacheClient(srv.address, timeout=10) as client,
    ):
        assert srv.server.warm.outcome == "restored"
        assert client.match("m", [1, 2, 3, 4]).prefix_len == 4


def test_a_start_that_does_not_fit_names_the_pool_a_warm_service_keeps(tmp_path: Path) -> None:
    from prefixcache.server.app import PrefixCacheServer
    from prefixcache.server.memory.shared_pool import WARM_SUFFIX, kept_elsewhere, mark_kept

    shm = tmp_path / "shm"
    shm.mkdir()
    owner = "prefixcache-4194311." + "a" * 16  # no such pid, its lock free: a dead owner
    (shm / f"{owner}.lock").write_bytes(b"")
    (shm / f"{owner}-m-0").write_bytes(bytes(1 << 20))
    mark_kept(shm, owner, 600, "b" * 16)
    assert kept_elsewhere(shm, "b" * 16) == (0, 0.0)  # its own: not kept from it
    kept, until = kept_elsewhere(shm, "c" * 16)
    assert kept >= 1 << 20 and until > time.time()
    huge = replace(RADIX, pool=replace(RADIX.pool, size=1 << 40))
    with pytest.raises(ConfigError, match="stopped warm-restart service"):
        PrefixCacheServer(make_config(tmp_path, (huge,), shm_dir=str(shm)))
    assert (shm / f"{owner}{WARM_SUFFIX}").exists() and (shm / f"{owner}-m-0").exists()
