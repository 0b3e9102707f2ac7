"""Pools other processes on this host can map: shared-memory files and CUDA IPC handles.

CPU buffers are allocated as files under a shared-memory directory (``/dev/shm``) and
mapped MAP_SHARED, so a worker that maps the same file sees and writes the very same
bytes. Each file's name carries the service's pid and epoch: ``close`` unlinks this
service's files, and a service starting up removes the files of services whose process
is gone (a crash leaves them behind otherwise, holding memory until reboot).

CUDA buffers need no files: ``DescribePool`` carries the fields of torch's
``_share_cuda_()`` as plain proto fields, and a worker opens them with
``UntypedStorage._new_shared_cuda``. Nothing is pickled either way.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from prefixcache.v1 import prefix_cache_pb2 as pb

from .config import ConfigError

log = logging.getLogger("prefixcache.server")

PREFIX = "prefixcache-"
_NAME = re.compile(rf"^{PREFIX}(\d+)-[0-9a-f]+-")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.]")


class SharedPools:
    """Allocates shareable buffers for one service and describes them to workers.

    Args:
        directory: Where shared-memory files go; None or "" keeps CPU buffers private
            (workers then use ReadKV / WriteKV).
        epoch: The service's epoch, part of every file name.
        mode: File mode of the buffers. Whoever may connect to the socket may map the
            pool, so the service passes the socket's mode.
    """

    def __init__(self, directory: str | None, epoch: int, mode: int = 0o600) -> None:
        self.directory = Path(directory) if directory else None
        self.mode = mode
        self._prefix = f"{PREFIX}{os.getpid()}-{epoch:x}-"
        self._files: list[Path] = []
        # data_ptr of each file's mapping -> (path, bytes), to find where a view lives.
        self._maps: dict[int, tuple[str, int]] = {}
        self._cuda: dict[int, tuple[Any, ...]] = {}
        if self.directory is not None:
            if not self.directory.is_dir():
                raise ConfigError(f"server.shm_dir: {self.directory} is not a directory")
            remove_stale(self.directory)

    def factory(self, model: str, device: str) -> Callable[[tuple[int, ...], torch.dtype],
                                                           torch.Tensor] | None:
        """A ``buffer_factory`` for ``model``'s pools, or None to allocate as usual."""
        if self.directory is None or torch.device(device).type != "cpu":
            return None
        tag = _UNSAFE.sub("_", model)[:64]
        return lambda shape, dtype: self._zeros(tag, shape, dtype)

    def _zeros(self, tag: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        assert self.directory is not None
        numel = math.prod(shape)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        path = self.directory / f"{self._prefix}{tag}-{len(self._files)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._files.append(path)
        try:
            os.fchmod(fd, self.mode)  # not subject to the umask, unlike open's mode
            # Reserve the memory now: on a full tmpfs the service fails at start with a
            # clear error, instead of dying of SIGBUS when a page is first touched.
            os.posix_fallocate(fd, 0, max(nbytes, 1))
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            raise ConfigError(f"server.shm_dir: {self.directory} has no room for a "
                              f"{nbytes}-byte pool buffer; make it larger (e.g. docker "
                              "--shm-size), or set shm_dir to '' to keep pools private"
                              ) from exc
        finally:
            os.close(fd)
        # A new file reads as zeros, which is what a pool starts as.
        flat = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
        self._maps[flat.data_ptr()] = (str(path), nbytes)
        return flat.view(shape)

    def handle(self, role: int, layer: int, tensor: torch.Tensor) -> pb.BufferHandle | None:
        """How a worker maps ``tensor`` (a contiguous buffer or view), or None."""
        if not tensor.is_contiguous():
            return None
        shape = list(tensor.shape)
        nbytes = tensor.numel() * tensor.element_size()
        dtype = str(tensor.dtype).removeprefix("torch.")
        if tensor.device.type == "cuda":
            fields = self._cuda_fields(tensor)
            offset = tensor.storage_offset() * tensor.element_size()
            return pb.BufferHandle(role=role, layer=layer, shape=shape, dtype=dtype,
                                   nbytes=nbytes, offset_bytes=offset, cuda=pb.CudaIpcHandle(
                                       device=fields[0], handle=fields[1],
                                       storage_size_bytes=fields[2],
                                       storage_offset_bytes=fields[3],
                                       ref_counter_handle=fields[4] or b"",
                                       ref_counter_offset=fields[5],
                                       event_handle=fields[6] or b"",
                                       event_sync_required=fields[7]))
        ptr = tensor.data_ptr()
        for base, (path, size) in self._maps.items():
            if base <= ptr and ptr + nbytes <= base + size:
                return pb.BufferHandle(role=role, layer=layer, shape=shape, dtype=dtype,
                                       nbytes=nbytes, shm_path=path, offset_bytes=ptr - base)
        return None

    def _cuda_fields(self, tensor: torch.Tensor) -> tuple[Any, ...]:
        # Exported once per storage: each export makes torch keep a reference counter
        # for it, and the buffers live as long as the service anyway.
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self._cuda:
            self._cuda[key] = storage._share_cuda_()
        return self._cuda[key]

    def close(self) -> None:
        """Unlink this service's files (workers' mappings stay valid until unmapped)."""
        for path in self._files:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self._files.clear()


def remove_stale(directory: Path) -> int:
    """Unlink the shared-memory files of services whose process no longer exists."""
    removed = 0
    for path in directory.glob(f"{PREFIX}*"):
        match = _NAME.match(path.name)
        if match is None or _alive(int(match.group(1))):
            continue
        with contextlib.suppress(FileNotFoundError, PermissionError):
            path.unlink()
            removed += 1
    if removed:
        log.warning("removed shared-memory files of dead services",
                    extra={"files": removed, "dir": str(directory)})
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def describe_buffers(engine: Any, shared: SharedPools) -> list[pb.BufferHandle]:
    """Every buffer of ``engine``'s pools, or [] when any one cannot be shared."""
    buffers: list[tuple[int, int, torch.Tensor]] = []
    if engine.kind == "slot":
        buffers += [(pb.BUFFER_ROLE_K, 0, engine.k_cache), (pb.BUFFER_ROLE_V, 0, engine.v_cache)]
    else:
        kv = engine.kv_pool
        for layer in range(kv.layer_num):
            buffers += [(pb.BUFFER_ROLE_K, layer, kv.k_buffer[layer]),
                        (pb.BUFFER_ROLE_V, layer, kv.v_buffer[layer])]
        if engine.swa_kv_pool is not None:
            swa = engine.swa_kv_pool
            for layer in range(swa.layer_num):
                buffers += [(pb.BUFFER_ROLE_SWA_K, layer, swa.k_buffer[layer]),
                            (pb.BUFFER_ROLE_SWA_V, layer, swa.v_buffer[layer])]
        if engine.mamba_pool is not None:
            m = engine.mamba_pool
            for layer in range(m.num_layers):
                buffers += [(pb.BUFFER_ROLE_CONV, layer, m.conv_state[layer]),
                            (pb.BUFFER_ROLE_TEMPORAL, layer, m.temporal_state[layer])]
    out = []
    for role, layer, tensor in buffers:
        handle = shared.handle(role, layer, tensor)
        if handle is None:  # all or nothing: half a pool is no use to a worker
            return []
        out.append(handle)
    return out
