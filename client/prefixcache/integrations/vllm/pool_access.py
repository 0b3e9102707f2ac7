"""Reading and writing pool rows from a vLLM worker: through the mapped pool on the
service's host (shared memory or CUDA IPC, no call per copy), or through ReadKV /
WriteKV from anywhere else. torch is imported inside the functions only.

A reader hands out one layer at a time (``rows(layer) -> (k, v)``, ``[n, heads, dim]``
each), so a copy holds one layer's rows at most on the mapped path. An MLA pool has no
V: its rows are ``(latent, None)``, both ways.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from prefixcache.client import (
    FailedPrecondition,
    PrefixCacheClient,
    PrefixCacheError,
    StaleEpoch,
)
from prefixcache.client.results import PoolInfo

from .layout import byte_view

Rows = Callable[[int], tuple[Any, Any | None]]


class PoolAccess(Protocol):
    """How a worker reaches a model's pool."""

    info: PoolInfo
    mapped: bool

    def reader(self, slots: Any, server_epoch: int, session_id: str) -> Rows: ...

    def write(self, slots: Any, source: Rows, heads: slice, session_id: str,
              server_epoch: int) -> None: ...


class MappedAccess:
    """The pool mapped into this process (same host)."""

    mapped = True

    def __init__(self, client: PrefixCacheClient, model: str) -> None:
        self.pool = client.attach_pool(model)
        self.info = self.pool.info

    def close(self) -> None:
        """Drop the mapping (of a service that restarted)."""
        self.pool.close()

    def _index(self, slots: Any, server_epoch: int) -> Any:
        import torch

        if server_epoch != self.info.server_epoch:
            # The slots belong to another start of the service than the mapped pool.
            raise StaleEpoch(f"slots of epoch {server_epoch}, the mapped pool is of "
                             f"epoch {self.info.server_epoch}",
                             server_epoch=self.info.server_epoch)
        return torch.frombuffer(slots, dtype=torch.int64).to(self.pool.k_buffer[0].device)

    def reader(self, slots: Any, server_epoch: int, session_id: str) -> Rows:
        index = self._index(slots, server_epoch)
        k, v = self.pool.k_buffer, self.pool.v_buffer
        if self.info.mla:
            return lambda layer: (byte_view(k[layer]).index_select(0, index), None)
        return lambda layer: (byte_view(k[layer]).index_select(0, index),
                              byte_view(v[layer]).index_select(0, index))

    def write(self, slots: Any, source: Rows, heads: slice, session_id: str,
              server_epoch: int) -> None:
        index = self._index(slots, server_epoch)
        for layer in range(self.info.layer_num):
            k, v = source(layer)
            pairs = [(self.pool.k_buffer[layer], k)]
            if not self.info.mla:
                pairs.append((self.pool.v_buffer[layer], v))
            for buf, rows in pairs:
                target = byte_view(buf)
                target[index, heads] = byte_view(rows).to(target.device)
        if self.pool.device.startswith("cuda"):
            import torch

            # The scheduler inserts once every worker says it is done: the copies must
            # have landed by then, not merely be queued on a stream.
            torch.cuda.synchronize(self.pool.device)


class RemoteAccess:
    """The pool through ReadKV / WriteKV (any host)."""

    mapped = False

    def __init__(self, client: PrefixCacheClient, model: str) -> None:
        self.client = client
        self.model = model
        self.info = client.describe_pool(model)

    def reader(self, slots: Any, server_epoch: int, session_id: str) -> Rows:
        data = self.client.read_kv(self.model, slots, session=session_id,
                                   server_epoch=server_epoch)
        if self.info.mla:
            return lambda layer: (byte_view(data.k[layer]), None)
        return lambda layer: (byte_view(data.k[layer]), byte_view(data.v[layer]))

    def write(self, slots: Any, source: Rows, heads: slice, session_id: str,
              server_epoch: int) -> None:
        if heads != slice(None):
            raise FailedPrecondition("WriteKV writes whole rows: a tensor-parallel "
                                     "worker can only save through the mapped pool")
        import torch

        ks, vs = [], []
        dtype = getattr(torch, self.info.dtype)
        for layer in range(self.info.layer_num):
            k, v = source(layer)
            ks.append(k.view(dtype) if k.dtype != dtype else k)
            if not self.info.mla:
                vs.append(v.view(dtype) if v.dtype != dtype else v)
        self.client.write_kv(self.model, slots, ks, None if self.info.mla else vs,
                             session=session_id, server_epoch=server_epoch)


def open_access(client: PrefixCacheClient, model: str, transfer: str) -> PoolAccess:
    """The access ``transfer`` asks for; "auto" maps the pool when it can.

    Raises:
        PrefixCacheError: the service cannot be reached, or (transfer "attach") the
            pool cannot be mapped from here.
    """
    if transfer == "remote":
        return RemoteAccess(client, model)
    try:
        return MappedAccess(client, model)
    except FailedPrecondition:
        if transfer == "attach":
            raise
        return RemoteAccess(client, model)


__all__ = ["MappedAccess", "PoolAccess", "PrefixCacheError", "RemoteAccess", "Rows",
           "open_access"]
