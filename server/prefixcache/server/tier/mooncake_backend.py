"""The Mooncake Store client as a tier backend (``tier.backend: mooncake``).

``mooncake-transfer-engine-non-cuda`` (the ``tier`` extra) is imported here only, when
a server starts with the tier on; it needs ``libibverbs.so.1`` even over TCP. Pages are
put and got with the multi-buffer batch calls, straight from and into the pool's
buffers (registered with the store once): one object per page, its parts one run of
rows per K and V buffer of every layer, so no page is ever copied into Python bytes.
Calls are cut to what Mooncake's TCP transport can queue (``MAX_CALL_PARTS``).
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..config.tier import TierConfig
from .backend import RPC_FAIL, Parts, TierUnavailable

# Buffer for the store's own copies; every call here uses registered pool memory.
_LOCAL_BUFFER_BYTES = 16 << 20

# Mooncake's TCP transport queues about 2048 buffers ("parts") per peer at most; past
# that it rejects them ("TCP lane queue-full rejection") and their objects fail with
# TRANSFER_FAIL, the leading ones too. A page has a part per K and V buffer of every
# layer (64 for 32 layers), so one lookup's fetch of 33 such pages would fail whole.
# Measured on 0.3.13.post1: a call of 2048 parts (of 256 B to 1 MiB) always read whole,
# one of 4096 never; four threads of 1024 each lost pages. So a batch call carries at
# most MAX_CALL_PARTS parts, and the client's calls together MAX_QUEUED_PARTS.
MAX_CALL_PARTS = 1024
MAX_QUEUED_PARTS = 2048


def part_chunks(ptrs: Parts, limit: int = MAX_CALL_PARTS) -> Iterator[tuple[int, int, int]]:
    """``(start, end, parts)`` of consecutive objects with ``limit`` parts together at
    most (an object with more parts than that alone)."""
    start, count = 0, 0
    for i, parts in enumerate(ptrs):
        if count and count + len(parts) > limit:
            yield start, i, count
            start, count = i, 0
        count += len(parts)
    if count:
        yield start, len(ptrs), count


class PartBudget:
    """Parts in flight across the threads that share one store client."""

    def __init__(self, limit: int = MAX_QUEUED_PARTS) -> None:
        self.limit = limit
        self._used = 0
        self._cv = threading.Condition()

    def run(self, parts: int, call: Callable[[], Any]) -> Any:
        """``call()`` once ``parts`` more are within the limit (a call larger than the
        limit waits until nothing else is in flight)."""
        parts = min(parts, self.limit)
        with self._cv:
            while self._used and self._used + parts > self.limit:
                self._cv.wait()
            self._used += parts
        try:
            return call()
        finally:
            with self._cv:
                self._used -= parts
                self._cv.notify_all()


def chunked(
    call: Callable[[list[str], Parts, Parts], Any],
    budget: PartBudget,
    keys: list[str],
    ptrs: Parts,
    sizes: Parts,
    stop_on: Callable[[int], bool],
) -> list[int]:
    """``call`` over ``keys`` in chunks of MAX_CALL_PARTS parts, each within ``budget``;
    one code per key. After a chunk with a code that ``stop_on`` names, the keys after
    it are not tried and answer that code (a dead master would hold each chunk's call
    for seconds; a read's leading run ends there anyway)."""
    codes: list[int] = []
    for start, end, parts in part_chunks(ptrs):
        got = list(budget.run(parts, lambda s=start, e=end: call(keys[s:e], ptrs[s:e], sizes[s:e])))
        codes += got
        stop = next((c for c in got if stop_on(c)), None)
        if stop is not None:
            codes += [stop] * (len(keys) - end)
            break
    return codes


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
            raise TierUnavailable(
                f"the Mooncake Store client cannot be imported ({exc}); "
                "install the tier extra (pip install "
                "'prefixcache[tier]') and libibverbs1"
            ) from exc
        self.hostname = resolve_hostname(cfg)
        self._store: Any = MooncakeDistributedStore()
        rc = self._store.setup(
            self.hostname,
            cfg.metadata,
            cfg.segment_bytes,
            _LOCAL_BUFFER_BYTES,
            cfg.protocol,
            "",
            cfg.master,
        )
        if rc != 0:
            raise TierUnavailable(
                f"Mooncake setup against master {cfg.master} failed "
                f"({rc}): is mooncake_master running there?"
            )
        # Pages are written into this sidecar's own segment: a put is a local copy and
        # never crosses the network; readers on other nodes pull them from here.
        self._config = ReplicateConfig()
        self._config.replica_num = 1
        self._config.preferred_segment = self._store.get_hostname()
        self._budget = PartBudget()

    def exists(self, keys: list[str]) -> list[int]:
        return list(self._store.batch_is_exist(keys))

    def get_into(
        self,
        keys: list[str],
        ptrs: Parts,
        sizes: Parts,
        deadline: float | None = None,
        check: Any = None,
    ) -> list[int]:
        # The deadline is the caller's (a transfer in flight cannot be cut short), and
        # so are the checks, after the call.
        return chunked(
            self._store.batch_get_into_multi_buffers,
            self._budget,
            keys,
            ptrs,
            sizes,
            stop_on=lambda code: code < 0,
        )

    def put_from(self, keys: list[str], ptrs: Parts, sizes: Parts) -> list[int]:
        def put(k: list[str], p: Parts, z: Parts) -> Any:
            return self._store.batch_put_from_multi_buffers(k, p, z, self._config)

        return chunked(put, self._budget, keys, ptrs, sizes, stop_on=lambda code: code == RPC_FAIL)

    def remove(self, keys: list[str]) -> list[int]:
        return list(self._store.batch_remove(keys, True))  # force: past read leases

    def object_size(self, key: str) -> int:
        return int(self._store.get_size(key))

    def register(self, ptr: int, size: int) -> None:
        rc = self._store.register_buffer(ptr, size)
        if rc != 0:
            raise TierUnavailable(f"Mooncake could not register {size} bytes of the pool ({rc})")

    def close(self) -> None:
        self._store.close()
