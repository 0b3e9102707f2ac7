"""Pool attach: map a model's pool from a process on the service's host, zero-copy.

``DescribePool`` lists every buffer of the pool with plain values (no pickle): a
shared-memory file and offset for a CPU pool, the fields of torch's CUDA IPC handle for
a GPU pool. Here they become tensors that alias the service's own buffers, so a worker
reads and writes KV by slot index with no copy and no RPC. torch is imported inside the
functions only (the client must load without it).

What the service guarantees about the contents is what the protocol says: a slot's rows
are the worker's to write while its session holds the slot, and stable while it holds a
lock on the node that owns it. Nothing stops a buggy worker from writing other rows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..errors import FailedPrecondition
from ..results import BufferInfo, PoolInfo


@dataclass(slots=True)
class AttachedPool:
    """A model's pool, mapped into this process.

    Attributes:
        info: The layout (``DescribePool``).
        k_buffer, v_buffer: One tensor per attention layer, ``[num_rows, heads, dim]``
            (slot models: ``[num_rows, max_seq_len, heads, dim]``, views of the one
            ``[num_rows, max_seq_len, layers, heads, dim]`` tensor). Index by slot.
            An MLA pool (``info.mla``) has its latent in ``k_buffer`` and no V.
        swa_k_buffer, swa_v_buffer: SWA models: the sliding-window pool, per layer.
        conv_state, temporal_state: Mamba models: one tensor per Mamba layer,
            ``[num_rows, *state_shape]``, indexed by state slot (or working slot).
    """

    info: PoolInfo
    k_buffer: list[Any] = field(default_factory=list)
    v_buffer: list[Any] = field(default_factory=list)
    swa_k_buffer: list[Any] = field(default_factory=list)
    swa_v_buffer: list[Any] = field(default_factory=list)
    conv_state: list[Any] = field(default_factory=list)
    temporal_state: list[Any] = field(default_factory=list)

    @property
    def device(self) -> str:
        return self.info.device

    def close(self) -> None:
        """Drop this object's tensors; the mappings go once no view of them is left."""
        for name in (
            "k_buffer",
            "v_buffer",
            "swa_k_buffer",
            "swa_v_buffer",
            "conv_state",
            "temporal_state",
        ):
            getattr(self, name).clear()


def attach(info: PoolInfo) -> AttachedPool:
    """Map every buffer ``info`` describes.

    Raises:
        FailedPrecondition: the pool cannot be mapped from here (the service shares no
            buffers, runs on another host, or the CUDA pool's device is not visible).
    """
    if not info.buffers:
        raise FailedPrecondition(
            f"model {info.model!r}: the service shares no buffers "
            "(shared memory is off); use read_kv / write_kv"
        )
    pool = AttachedPool(info)
    files: dict[str, Any] = {}
    for buf in info.buffers:
        tensor = _map_cuda(buf) if buf.cuda is not None else _map_shm(buf, files)
        if info.max_seq_len and buf.role in ("k", "v"):
            # A slot model's one tensor holds every layer on dim 2: hand out per-layer views.
            views = [tensor[:, :, layer] for layer in range(tensor.shape[2])]
            getattr(pool, f"{buf.role}_buffer").extend(views)
            continue
        target = {
            "k": pool.k_buffer,
            "v": pool.v_buffer,
            "swa_k": pool.swa_k_buffer,
            "swa_v": pool.swa_v_buffer,
            "conv": pool.conv_state,
            "temporal": pool.temporal_state,
        }.get(buf.role)
        if target is None:
            continue  # a role this client does not know yet
        while len(target) <= buf.layer:
            target.append(None)
        target[buf.layer] = tensor
    return pool


def _map_shm(buf: BufferInfo, files: dict[str, Any]) -> Any:
    import torch

    flat = files.get(buf.shm_path)
    if flat is None:
        try:
            size = os.stat(buf.shm_path).st_size
        except OSError as exc:
            raise FailedPrecondition(
                f"cannot open {buf.shm_path}: {exc.strerror}; the service must run on this "
                "host, with the same /dev/shm, to attach (else use read_kv / write_kv)"
            ) from exc
        # MAP_SHARED: writes land in the service's own buffer, and its writes show here.
        flat = torch.from_file(buf.shm_path, shared=True, size=size, dtype=torch.uint8)
        files[buf.shm_path] = flat
    end = buf.offset_bytes + buf.nbytes
    if end > flat.numel():
        raise FailedPrecondition(
            f"{buf.shm_path} has {flat.numel()} bytes, the buffer "
            f"needs {end}: the pool changed; describe it again"
        )
    dtype = getattr(torch, buf.dtype)
    return flat[buf.offset_bytes : end].view(dtype).view(buf.shape)


def _map_cuda(buf: BufferInfo) -> Any:
    import torch

    if buf.cuda is None:
        raise FailedPrecondition(
            f"buffer {buf.role} of layer {buf.layer} names no CUDA handle: describe the pool again"
        )
    if not torch.cuda.is_available():
        raise FailedPrecondition("the pool is on a GPU and this process has no CUDA")
    torch.cuda._lazy_init()  # type: ignore[no-untyped-call]  # unannotated in torch
    try:
        # The same call, with the same arguments in the same order, that torch's own
        # multiprocessing rebuild makes (torch/multiprocessing/reductions.py).
        storage = torch.UntypedStorage._new_shared_cuda(*buf.cuda)
    except RuntimeError as exc:
        raise FailedPrecondition(
            f"cannot open the CUDA IPC handle of {buf.role}[{buf.layer}]: {exc}"
        ) from exc
    dtype = getattr(torch, buf.dtype)
    size = torch.empty((), dtype=dtype).element_size()
    if buf.offset_bytes % size:
        raise FailedPrecondition(f"offset {buf.offset_bytes} is not a multiple of {size}")
    out = torch.empty(0, dtype=dtype, device=f"cuda:{buf.cuda[0]}")
    stride = _contiguous_strides(buf.shape)
    return out.set_(storage, buf.offset_bytes // size, buf.shape, stride)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))
