"""The Mooncake Store client as a tier backend (``tier.backend: mooncake``).

``mooncake-transfer-engine-non-cuda`` (the ``tier`` extra) is imported here only, when
a server starts with the tier on; it needs ``libibverbs.so.1`` even over TCP. Pages are
put and got with the multi-buffer batch calls, straight from and into the pool's
buffers (registered with the store once): one object per page, its parts one run of
rows per K and V buffer of every layer, so no page is ever copied into Python bytes.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from ..config.tier import TierConfig
from .backend import Parts, TierUnavailable

# Buffer for the store's own copies; every call here uses registered pool memory.
_LOCAL_BUFFER_BYTES = 16 << 20


def resolve_hostname(cfg: TierConfig) -> str:
    """``local_hostname``, with "auto" resolved to the address this host reaches the
    master from (loopback for a master on loopback). No packet is sent."""
    if cfg.local_hostname != "auto":
        return cfg.local_hostname
    host = cfg.master.rpartition(":")[0].strip("[]")
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, int(cfg.master.rpartition(":")[2])))
            return str(probe.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())


class MooncakeBackend:
    """One ``MooncakeDistributedStore`` client, set up and lending ``segment_bytes``.

    Raises:
        TierUnavailable: the wheel is missing, or setup failed (master unreachable).
    """

    def __init__(self, cfg: TierConfig) -> None:
        # Before the import: the client reads these once. One setup try (the default,
        # 20, takes about 90 s against a master that is down, holding the GIL all along:
        # service.py calls setup only once the master's port answers); quiet logs.
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as exc:  # the extra, or libibverbs1, is missing
            raise TierUnavailable(f"the Mooncake Store client cannot be imported ({exc}); "
                                  "install the tier extra (pip install "
                                  "'prefixcache[tier]') and libibverbs1") from exc
        self.hostname = resolve_hostname(cfg)
        self._store: Any = MooncakeDistributedStore()
        rc = self._store.setup(self.hostname, cfg.metadata, cfg.segment_bytes,
                               _LOCAL_BUFFER_BYTES, cfg.protocol, "", cfg.master)
        if rc != 0:
            raise TierUnavailable(f"Mooncake setup against master {cfg.master} failed "
                                  f"({rc}): is mooncake_master running there?")
        # Pages are written into this sidecar's own segment: a put is a local copy and
        # never crosses the network; readers on other nodes pull them from here.
        self._config = ReplicateConfig()
        self._config.replica_num = 1
        self._config.preferred_segment = self._store.get_hostname()

    def exists(self, keys: list[str]) -> list[int]:
        return list(self._store.batch_is_exist(keys))

    def get_into(self, keys: list[str], ptrs: Parts, sizes: Parts) -> list[int]:
        return list(self._store.batch_get_into_multi_buffers(keys, ptrs, sizes))

    def put_from(self, keys: list[str], ptrs: Parts, sizes: Parts) -> list[int]:
        return list(self._store.batch_put_from_multi_buffers(keys, ptrs, sizes,
                                                             self._config))

    def remove(self, keys: list[str]) -> list[int]:
        return list(self._store.batch_remove(keys, True))

    def register(self, ptr: int, size: int) -> None:
        rc = self._store.register_buffer(ptr, size)
        if rc != 0:
            raise TierUnavailable(f"Mooncake could not register {size} bytes of the pool "
                                  f"({rc})")

    def close(self) -> None:
        self._store.close()
