"""Against the real SGLang package, where it imports (it does not install on CI's CPU-only
torch; run these by hand in a venv with ``pip install --no-deps sglang`` plus the few
small packages its ``mem_cache`` modules import). Skipped cleanly otherwise.

SGLang's own factory loads the adapter from the extra-config exactly as
``--hicache-storage-backend dynamic`` does, its ``get_hash_str`` names the pages, and
its controller's calls (``batch_exists``, then ``batch_get_v1`` / ``batch_set_v1``
with ``HiCacheStorageExtraInfo``) move them; host pools are built with its buffer
shapes (its own host-pool classes need CUDA-era extensions to import).
"""

from __future__ import annotations

import pytest
from hicache_hosts import PAGE, HostPool, StatePool, host_indices

storage = pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage", reason="sglang is not installed (CPU CI)"
)
factory = pytest.importorskip(
    "sglang.srt.mem_cache.storage", reason="sglang's storage backends do not import here"
)


def sglang_hashes(tokens: list[int], prior: str | None = None) -> list[str]:
    try:
        from sglang.srt.mem_cache.utils import get_hash_str

        return get_hash_str(tokens, prior, page_size=PAGE)
    except Exception as exc:  # its native hash is compiled on first use
        pytest.skip(f"sglang's page hash does not build here: {exc}")


def backend_for(address: str, pool: HostPool, tp_rank: int = 0, tp_size: int = 1):
    config = storage.HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=pool.layout == "page_first",
        model_name="served-name",
        extra_config={
            "backend_name": "prefixcache",
            "interface_v1": 1,
            "module_path": "prefixcache.integrations.sglang.backend",
            "class_name": "PrefixCacheStorage",
            "target": address,
            "model": "kv",
        },
    )
    backend = factory.StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)  # as HiCacheController.attach_storage_backend
    return backend


def test_hashes_match_sglang() -> None:
    from prefixcache.cache import hash_token_ids

    tokens = list(range(100, 100 + 3 * PAGE))
    ours, prior = [], None
    for i in range(0, len(tokens), PAGE):
        prior = hash_token_ids(tokens[i : i + PAGE], prior)
        ours.append(prior)
    assert sglang_hashes(tokens) == ours


def test_loaded_by_sglang_and_round_trips(server) -> None:
    from prefixcache.integrations.sglang.backend import PrefixCacheStorage

    writer_pool, reader_pool = HostPool("page_first", seed=1), HostPool("layer_first", seed=2)
    writer = backend_for(server.address, writer_pool)
    reader = backend_for(server.address, reader_pool)
    try:
        assert isinstance(writer, PrefixCacheStorage)
        assert isinstance(writer, storage.HiCacheStorage)
        keys = sglang_hashes(list(range(7, 7 + 4 * PAGE)))
        info = storage.HiCacheStorageExtraInfo(prefix_keys=[])
        assert reader.batch_exists(keys, info) == 0
        assert all(writer.batch_set_v1(keys[:2], host_indices([0, 1]), info))
        more = storage.HiCacheStorageExtraInfo(prefix_keys=keys[:2])
        assert all(writer.batch_set_v1(keys[2:], host_indices([2, 3]), more))
        assert reader.batch_exists(keys, info) == 4
        assert reader.batch_get_v1(keys, host_indices([9, 8, 7, 6]), info) == [True] * 4
        for a, b in zip([0, 1, 2, 3], [9, 8, 7, 6], strict=True):
            assert reader_pool.page_bytes(b * PAGE) == writer_pool.page_bytes(a * PAGE)
        result = reader.batch_exists_v2(
            keys,
            [
                storage.PoolTransfer(
                    name=storage.PoolName.MAMBA,
                    keys=keys[-1:],
                    hit_policy=storage.PoolHitPolicy.TRAILING_PAGES,
                )
            ],
        )
        assert (result.kv_hit_pages, result.extra_pool_hit_pages) == (0, {"kv": 4})
    finally:
        writer.close()
        reader.close()


def test_v2_mamba_state_through_sglang_types(server) -> None:
    """SGLang's v2 types end to end: a Mamba pool registered as its controller does, a
    prefix stored with its state, found usable only where the state is, loaded back."""
    import torch

    pools = [HostPool("page_first", seed=3), HostPool("page_first", seed=4)]
    states = [StatePool(4, (5, 61), torch.float32, seed=s) for s in (3, 4)]
    writer, reader = (backend_for(server.address, p) for p in pools)
    try:
        for backend, state in zip((writer, reader), states, strict=True):
            backend.register_mem_host_pool_v2(state, storage.PoolName.MAMBA)
        keys = sglang_hashes(list(range(300, 300 + 3 * PAGE)))
        info = storage.HiCacheStorageExtraInfo(prefix_keys=[])
        kv = storage.PoolTransfer(
            name=storage.PoolName.KV, keys=keys, host_indices=host_indices([0, 1, 2])
        )
        mamba = storage.PoolTransfer(
            name=storage.PoolName.MAMBA,
            keys=[keys[1]],
            host_indices=torch.tensor([2]),
            hit_policy=storage.PoolHitPolicy.TRAILING_PAGES,
        )
        assert writer.batch_set_v2([kv, mamba], info) == {"kv": [True] * 3, "mamba": [True]}
        probe = storage.PoolTransfer(
            name=storage.PoolName.MAMBA,
            keys=keys[-1:],
            hit_policy=storage.PoolHitPolicy.TRAILING_PAGES,
        )
        result = reader.batch_exists_v2(keys, [probe], info)
        assert (result.kv_hit_pages, result.extra_pool_hit_pages) == (2, {"kv": 3, "mamba": 2})
        if hasattr(result, "restorable_prefix_pages"):
            assert result.restorable_prefix_pages == [2]
        load = storage.PoolTransfer(
            name=storage.PoolName.MAMBA, keys=[keys[1]], host_indices=torch.tensor([0])
        )
        assert reader.batch_get_v2([load], info) == {"mamba": [True]}
        assert states[1].page_bytes(0) == states[0].page_bytes(2)
    finally:
        writer.close()
        reader.close()
