"""Reading and writing pool rows from a vLLM worker: through the mapped pool on the
service's host (shared memory or CUDA IPC, no call per copy), or through ReadKV /
WriteKV from anywhere else. torch is imported inside the functions only.

A reader hands out one layer at a time (``rows(layer) -> (k, v)``, ``[n, heads, dim]``
each), so a copy holds one layer's rows at most on the mapped path. An MLA pool has no
V: its rows are ``(latent, None)``, both ways.

Saves through the mapped pool hold the session's write fence for the whole copy
(``prefixcache.client.write_fence``; the service's ``write_fence.py`` has the
protocol). A lease alone cannot keep them safe: a worker frozen (SIGSTOP, a debugger)
past its scheduler's lease, between the scheduler's last look at the session and the
end of the copy, would resume and write rows of slots the service has handed to
another session since. Under the fence the service frees none of the session's slots
while the copy may still run, however long the worker is stopped, and the worker
copies nothing once the session has ended; a session that ended during the copy fails
the save (``SessionLost``), so its rows are never inserted. Where there is no fence (a
service without shared memory for it, a fence file this host cannot open, an older
service, every record taken) the rows go through WriteKV instead, which checks the
session's hold on every slot as it writes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prefixcache.client import (
    FailedPrecondition,
    PrefixCacheClient,
    PrefixCacheError,
    SessionLost,
    StaleEpoch,
)
from prefixcache.client.errors import ResourceExhausted
from prefixcache.client.results import PoolInfo
from prefixcache.client.transfer.kv import KVData
from prefixcache.client.write_fence import WriteFence, open_fence

from .block_copy import slot_run
from .layerwise import pin_host, unpin_host
from .layout import LayerView, byte_view

Rows = Callable[[int], tuple[Any, Any | None]]
# Writes one layer's rows straight into the pool's rows given (K, V: views of the pool).
Fill = Callable[[int, Any, Any | None], None]
# Sessions whose fences a worker keeps open (the scheduler's: one, a new one after a loss).
_FENCES = 4


class PoolAccess(Protocol):
    """How a worker reaches a model's pool."""

    info: PoolInfo
    mapped: bool

    def reader(self, slots: Any, server_epoch: int, session_id: str) -> Rows: ...

    def pin(self) -> None: ...

    def write(
        self,
        slots: Any,
        source: Rows,
        heads: slice,
        session_id: str,
        server_epoch: int,
        fill: Fill | None = None,
    ) -> None: ...


class MappedAccess:
    """The pool mapped into this process (same host)."""

    mapped = True

    def __init__(self, client: PrefixCacheClient, model: str) -> None:
        self.client = client
        self.model = model
        self.pool = client.attach_pool(model)
        self.info = self.pool.info
        self._fences: dict[str, WriteFence] = {}
        self._no_fence = False  # the service has none: saves go through WriteKV
        self._pinned: list[int] = []

    def pin(self) -> None:
        """Page-lock a host pool for copies to a GPU that overlap (layerwise.py), until
        ``close``."""
        if self.pool.device == "cpu" and not self._pinned:
            self._pinned = pin_host([*self.pool.k_buffer, *self.pool.v_buffer])

    def close(self) -> None:
        """Drop the mapping (of a service that restarted) and the fences."""
        unpin_host(self._pinned)  # before the memory can be unmapped
        self._pinned = []
        self.pool.close()
        for fence in self._fences.values():
            fence.close()
        self._fences.clear()

    def _fence(self, session_id: str, server_epoch: int) -> WriteFence | None:
        """``session_id``'s write fence, or None to write through WriteKV."""
        fence = self._fences.get(session_id)
        if fence is not None or self._no_fence:
            return fence
        try:
            fence = open_fence(self.client, session_id, server_epoch)
        except ResourceExhausted:
            return None  # every record is taken: this copy goes through WriteKV
        except StaleEpoch:
            raise
        except PrefixCacheError as err:
            # No shared memory for a fence here, or a service older than fences: every
            # save through WriteKV. Anything else (the session gone, the service down)
            # fails the save.
            unimplemented = err.code is not None and err.code.name == "UNIMPLEMENTED"
            if not (isinstance(err, FailedPrecondition) or unimplemented):
                raise
            self._no_fence = True
            return None
        while len(self._fences) >= _FENCES:
            self._fences.pop(next(iter(self._fences))).close()
        self._fences[session_id] = fence
        return fence

    def _index(self, slots: Any, server_epoch: int) -> Any:
        import torch

        self._check_epoch(server_epoch)
        return torch.frombuffer(slots, dtype=torch.int64).to(self.pool.k_buffer[0].device)

    def _check_epoch(self, server_epoch: int) -> None:
        if server_epoch != self.info.server_epoch:
            # The slots belong to another start of the service than the mapped pool.
            raise StaleEpoch(
                f"slots of epoch {server_epoch}, the mapped pool is of "
                f"epoch {self.info.server_epoch}",
                server_epoch=self.info.server_epoch,
            )

    def _run(self, slots: Any) -> int | None:
        """The first slot of ``slots`` when they are one run inside the pool."""
        first = slot_run(slots)
        if first is None or first < 0 or first + len(slots) > self.pool.k_buffer[0].shape[0]:
            return None  # not a run, or out of range: the index path says so
        return first

    def reader(self, slots: Any, server_epoch: int, session_id: str) -> Rows:
        first = self._run(slots)
        k, v = self.pool.k_buffer, self.pool.v_buffer
        if first is not None:
            # One run of slots: the pool's own rows, no copy (the caller copies them once).
            self._check_epoch(server_epoch)
            end = first + len(slots)
            if self.info.mla:
                return lambda layer: (byte_view(k[layer][first:end]), None)
            return lambda layer: (byte_view(k[layer][first:end]), byte_view(v[layer][first:end]))
        index = self._index(slots, server_epoch)
        if self.info.mla:
            return lambda layer: (byte_view(k[layer]).index_select(0, index), None)
        return lambda layer: (
            byte_view(k[layer]).index_select(0, index),
            byte_view(v[layer]).index_select(0, index),
        )

    def write(
        self,
        slots: Any,
        source: Rows,
        heads: slice,
        session_id: str,
        server_epoch: int,
        fill: Fill | None = None,
    ) -> None:
        """Copy ``source``'s rows into ``slots`` under the session's write fence; when
        the slots are one run, ``fill`` (if given) writes each layer's rows straight
        into the pool's (one copy, not a gather and a scatter).

        Raises:
            SessionLost: the session ended before or during the copy (the save fails).
        """
        index = self._index(slots, server_epoch)
        fence = self._fence(session_id, server_epoch)
        if fence is None:
            _write_kv(
                self.client, self.model, self.info, slots, source, heads, session_id, server_epoch
            )
            return
        try:
            with fence.held():
                first = self._run(slots) if fill is not None else None
                if first is not None and fill is not None:
                    self._fill(first, len(slots), fill, heads)
                else:
                    self._copy(index, source, heads)
                fence.check()  # ended mid-copy: the rows went into slots it lost
        except SessionLost:
            self._fences.pop(session_id, None)
            fence.close()
            raise

    def _fill(self, first: int, count: int, fill: Fill, heads: slice) -> None:
        end = first + count
        for layer in range(self.info.layer_num):
            k = self.pool.k_buffer[layer][first:end, heads]
            fill(layer, k, None if self.info.mla else self.pool.v_buffer[layer][first:end, heads])
        self._synchronize()

    def _copy(self, index: Any, source: Rows, heads: slice) -> None:
        for layer in range(self.info.layer_num):
            k, v = source(layer)
            pairs = [(self.pool.k_buffer[layer], k)]
            if not self.info.mla:
                pairs.append((self.pool.v_buffer[layer], v))
            for buf, rows in pairs:
                target = byte_view(buf)
                rows = byte_view(rows).to(target.device)
                if heads == slice(None):
                    target.index_copy_(0, index, rows)  # faster than an index_put
                else:
                    target[index, heads] = rows
        self._synchronize()

    def _synchronize(self) -> None:
        if self.pool.device.startswith("cuda"):
            import torch

            # The scheduler inserts once every worker says it is done, and the fence is
            # let go after this: the copies must have landed by then, not merely be
            # queued on a stream.
            torch.cuda.synchronize(self.pool.device)


class RemoteAccess:
    """The pool through ReadKV / WriteKV (any host)."""

    mapped = False

    def __init__(self, client: PrefixCacheClient, model: str) -> None:
        self.client = client
        self.model = model
        self.info = client.describe_pool(model)
        # Staging rows the reads land in, kept between loads: fresh memory costs more
        # to fault in than the copy into it (a load's profile). A load's rows are
        # consumed before the next read.
        self._staging: tuple[list[Any], list[Any]] | None = None

    def _out(self, count: int) -> KVData:
        import torch

        info = self.info
        have = self._staging
        if have is None or have[0][0].shape[0] < count:
            rows = max(count, 2 * have[0][0].shape[0]) if have else count
            dtype = getattr(torch, info.dtype)
            layers = range(info.layer_num)
            have = self._staging = (
                [torch.empty(rows, info.k_head_num, info.k_head_dim, dtype=dtype) for _ in layers],
                []
                if info.mla
                else [
                    torch.empty(rows, info.v_head_num, info.v_head_dim, dtype=dtype) for _ in layers
                ],
            )
        return KVData(
            tuple(range(info.layer_num)), [t[:count] for t in have[0]], [t[:count] for t in have[1]]
        )

    def pin(self) -> None:
        return None  # the rows are read into staging tensors, a fresh read each load

    def reader(self, slots: Any, server_epoch: int, session_id: str) -> Rows:
        data = self.client.read_kv(
            self.model,
            slots,
            session=session_id,
            server_epoch=server_epoch,
            out=self._out(len(slots)),
        )
        if self.info.mla:
            return lambda layer: (byte_view(data.k[layer]), None)
        return lambda layer: (byte_view(data.k[layer]), byte_view(data.v[layer]))

    def write(
        self,
        slots: Any,
        source: Rows,
        heads: slice,
        session_id: str,
        server_epoch: int,
        fill: Fill | None = None,
    ) -> None:
        _write_kv(
            self.client, self.model, self.info, slots, source, heads, session_id, server_epoch
        )


def _write_kv(
    client: PrefixCacheClient,
    model: str,
    info: PoolInfo,
    slots: Any,
    source: Rows,
    heads: slice,
    session_id: str,
    server_epoch: int,
) -> None:
    """Write ``source``'s rows into ``slots`` through WriteKV (whole rows only)."""
    if heads != slice(None):
        raise FailedPrecondition(
            "WriteKV writes whole rows: a tensor-parallel worker "
            "can only save through the mapped pool (with its write "
            "fence)"
        )
    import torch

    ks, vs = [], []
    dtype = getattr(torch, info.dtype)
    for layer in range(info.layer_num):
        k, v = source(layer)
        ks.append(k.view(dtype) if k.dtype != dtype else k)
        if not info.mla:
            vs.append(v.view(dtype) if v.dtype != dtype else v)
    client.write_kv(
        model, slots, ks, None if info.mla else vs, session=session_id, server_epoch=server_epoch
    )


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


__all__ = ["MappedAccess", "PoolAccess", "PrefixCacheError", "RemoteAccess", "Rows", "open_access"]


@dataclass(frozen=True)
class HeadShare:
    """The pool heads one tensor-parallel rank's layers hold, and whether this rank
    writes them (of ranks holding the same heads, one saves)."""

    heads: slice
    writes: bool


def fit_pool(
    info: PoolInfo, layers: Sequence[LayerView], tp_rank: int, tp_size: int
) -> HeadShare | str:
    """Which heads of the pool ``layers`` (one rank's, at least one) hold, or why the
    pool cannot hold their KV."""
    if info.max_seq_len or info.mamba is not None:
        return f"model {info.model!r} is not a radix/SWA model"
    if info.layer_num != len(layers):
        return f"the pool of {info.model!r} has {info.layer_num} layers, vLLM {len(layers)}"
    first = layers[0]
    if not _same_dtype(info.dtype, first.dtype):
        return f"the pool's dtype is {info.dtype}, vLLM's {first.dtype}"
    if any(view.mla != first.mla for view in layers):
        return "vLLM's layers mix MLA and K/V caches"
    if first.mla or info.mla:
        return _fit_mla(info, first, tp_rank)
    local = first.heads
    if (info.k_head_dim, info.v_head_dim) != (first.head_dim, first.v_head_dim):
        return (
            f"the pool's head dims are {info.k_head_dim}/{info.v_head_dim}, "
            f"vLLM's {first.head_dim}/{first.v_head_dim}"
        )
    total, rank, size = info.k_head_num, tp_rank, tp_size
    if info.v_head_num != total:
        return "K and V head counts differ in the pool"
    if total == local * size:
        return HeadShare(
            slice(None) if size == 1 else slice(rank * local, (rank + 1) * local), True
        )
    if local == 1 and total < size and size % total == 0:
        # Fewer KV heads than ranks: vLLM replicates each head over size/total ranks;
        # the first of each group writes it.
        group = size // total
        return HeadShare(slice(rank // group, rank // group + 1), rank % group == 0)
    return f"the pool has {total} KV heads; vLLM's rank {rank} of {size} holds {local}"


def _fit_mla(info: PoolInfo, first: LayerView, tp_rank: int) -> HeadShare | str:
    """The MLA half of ``fit_pool``: both sides MLA, one latent of the same size."""
    if not first.mla:
        return (
            f"the pool of {info.model!r} is an MLA pool (no V) but vLLM's KV cache "
            "has K and V: configure the model's pool without mla"
        )
    if not info.mla:
        return (
            f"vLLM's KV cache is MLA (one latent of {first.head_dim}, no V) but the "
            f"pool of {info.model!r} has K and V: configure its pool with "
            f"mla: true, k_heads: 1, k_head_dim: {first.head_dim}"
        )
    if (info.k_head_num, info.k_head_dim) != (1, first.head_dim):
        return (
            f"the MLA pool of {info.model!r} is {info.k_head_num} x "
            f"{info.k_head_dim}; vLLM's latent needs k_heads: 1, "
            f"k_head_dim: {first.head_dim}"
        )
    # Every rank holds the whole latent (worker.py's docstring, MLA): rank 0 saves it.
    return HeadShare(slice(None), tp_rank == 0)


def _same_dtype(pool: str, vllm: Any) -> bool:
    """Whether the pool's element type holds vLLM's bytes as they are: the same type, or
    an fp8 cache that vLLM allocates as uint8 (``kv_cache_dtype`` fp8) against an fp8
    pool, and back (every copy of one-byte types is bytewise)."""
    theirs = str(vllm).removeprefix("torch.")
    if theirs == pool:
        return True
    return "uint8" in (theirs, pool) and {theirs, pool} <= {"uint8", "float8_e4m3fn", "float8_e5m2"}
