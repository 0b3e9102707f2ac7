"""The SGLang adapter: a ``HiCacheStorage`` over ``HiCacheCore``, loaded by configuration.

    python -m sglang.launch_server ... --page-size 64 --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
        '{"backend_name": "prefixcache",
          "module_path": "prefixcache.integrations.sglang.backend",
          "class_name": "PrefixCacheStorage", "interface_v1": 1,
          "target": "unix:/tmp/prefixcache.sock", "model": "llama-8b"}'

This is the only module that imports SGLang; every decision is the core's (core.py),
which the tests drive without SGLang. ``interface_v1`` makes SGLang call the zero-copy
``batch_get_v1``/``batch_set_v1``; without it SGLang uses ``batch_get``/``batch_set``
with flat pages, which work too, with one more copy.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolTransferResult,
)

from .aux_pools import AuxPools
from .core import HiCacheCore, prior_of
from .host_layout import HostLayout
from .settings import Ranks, Settings
from .v2 import exists_v2, transfer_v2

log = logging.getLogger("prefixcache.integrations.sglang")


class PrefixCacheStorage(HiCacheStorage):
    """SGLang HiCache L3 storage in a prefixcache sidecar's pool (see the module doc)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        settings = Settings.parse(
            storage_config.extra_config, Ranks.of(storage_config), storage_config.model_name
        )
        self.core = HiCacheCore(settings)
        self.pools = AuxPools(self.core)  # Mamba, SWA, indexer, draft: the v2 calls
        log.info(
            "prefixcache HiCache storage: model %r namespace %r at %s",
            settings.model,
            settings.namespace,
            settings.target,
        )

    # ------------------------------------------------------------ set-up

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.core.register_host_pool(HostLayout.of_pool(mem_pool_host))

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self.pools.register(host_pool_name, host_pool)

    def close(self) -> None:
        self.core.close()

    def clear(self) -> None:
        # The sidecar's pool is shared with other workers: a flush of this engine must
        # not drop their pages. Pages leave by eviction, or by the sidecar's Reset.
        log.info("prefixcache HiCache storage: clear() leaves the shared sidecar as is")

    def get_stats(self) -> Any:
        return None

    # --------------------------------------------- zero-copy (interface_v1)

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        return self.core.exists(keys)

    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        return self.core.get(keys, host_indices)

    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        return self.core.set(keys, host_indices, prior_of(extra_info))

    # ------------------------------------------------ flat pages (generic)

    def exists(self, key: str) -> bool:
        return self.core.exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.core.get_flat([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[Any]:
        return self.core.get_flat(keys, list(target_locations or []))

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.core.set_flat([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        return self.core.set_flat(keys, list(values or []))

    # -------------------------------------------------- pools (interface v2)

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: Any = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> Any:
        pages, hits, usable = exists_v2(self.core, keys, pool_transfers, self.pools)
        if "restorable_prefix_pages" in getattr(
            PoolTransferResult, "__dataclass_fields__", ()
        ):  # SGLang versions that have it
            return PoolTransferResult(pages, hits, restorable_prefix_pages=usable)
        return PoolTransferResult(pages, hits)

    def batch_get_v2(
        self, transfers: list[Any], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return transfer_v2(self.core, transfers, None, load=True, pools=self.pools)

    def batch_set_v2(
        self, transfers: list[Any], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return transfer_v2(self.core, transfers, prior_of(extra_info), load=False, pools=self.pools)
