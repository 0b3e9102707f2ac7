"""Pools other processes on this host can map: shared-memory files and CUDA IPC handles.

CPU buffers are allocated as files under a shared-memory directory (``/dev/shm``) and
mapped MAP_SHARED, so a worker that maps the same file sees and writes the very same
bytes. ``close`` unlinks this service's files, and a service starting up removes the
files of services that are gone (a crash leaves them behind otherwise, holding memory
until reboot), before it checks that its own pools fit (``sweep``).

Who owns a file is proven by a lock, not by a pid: the directory may be shared by
services in other PID namespaces (two containers on the host's ``/dev/shm``, or one
emptyDir), where a pid means nothing, or names a different live process. Before its
first buffer a service creates ``prefixcache-<pid>.<random>.lock`` and holds an
exclusive ``flock`` on it for its whole life; its buffers are
``prefixcache-<pid>.<random>-<model>-<n>``. The kernel drops the lock when the process
dies, however it dies, so a sweep that can take the lock knows the owner is gone, in
any namespace; the random part keeps names unique across namespaces. Files named the
old way (``prefixcache-<pid>-<epoch>-...``) are left alone: nothing proves them dead.

A warm restart (warm_restart.py) keeps a stopped service's buffer files: ``close``
may keep them, and the next start takes them over (``adopt``), renaming each to its
own owner name and mapping it as it is, instead of creating it zeroed.

CUDA buffers need no files: ``DescribePool`` carries the fields of torch's
``_share_cuda_()`` as plain proto fields, and a worker opens them with
``UntypedStorage._new_shared_cuda``. Nothing is pickled either way.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import math
import os
import re
import secrets
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from prefixcache.v1 import prefix_cache_pb2 as pb

from ..config import ConfigError

log = logging.getLogger("prefixcache.server")

PREFIX = "prefixcache-"
LOCK_SUFFIX = ".lock"
# The owner part of a name: prefixcache-<pid>.<16 hex>; then ".lock" or "-<model>-<n>".
_NAME = re.compile(rf"^({PREFIX}\d+\.[0-9a-f]{{16}})(?:{re.escape(LOCK_SUFFIX)}|-.+)$")
_CLAIM_TRIES = 16
_UNSAFE = re.compile(r"[^A-Za-z0-9_.]")


class SharedPools:
    """Allocates shareable buffers for one service and describes them to workers.

    Args:
        directory: Where shared-memory files go; None or "" keeps CPU buffers private
            (workers then use ReadKV / WriteKV).
        epoch: The service's epoch, written into its lock file (for people).
        mode: File mode of the buffers and the lock file (``shm_file_mode``).
        adopt: A warm restart's files to take over, by the part of their name after
            the owner (``<model>-<n>``), with the byte size each must have; a buffer
            whose name is there is that file, renamed, instead of a new one.
    """

    def __init__(self, directory: str | None, epoch: int, mode: int = 0o600,
                 adopt: dict[str, tuple[Path, int]] | None = None) -> None:
        self.directory = Path(directory) if directory else None
        self.mode = mode
        self.epoch = epoch
        self._owner: str | None = None  # set, and locked, before the first file
        self._lock: tuple[Path, int] | None = None
        self._files: list[Path] = []
        # data_ptr of each file's mapping -> (path, bytes), to find where a view lives.
        self._maps: dict[int, tuple[str, int]] = {}
        self._cuda: dict[int, tuple[Any, ...]] = {}
        self._adopt = dict(adopt or {})
        self.adopted: list[Path] = []  # the files taken over, under their new names
        if self.directory is not None:
            sweep(self.directory)

    def factory(self, model: str, device: str) -> Callable[[tuple[int, ...], torch.dtype],
                                                           torch.Tensor] | None:
        """A ``buffer_factory`` for ``model``'s pools, or None to allocate as usual."""
        if self.directory is None or torch.device(device).type != "cpu":
            return None
        tag = _UNSAFE.sub("_", model)[:64]
        return lambda shape, dtype: self._zeros(tag, shape, dtype)

    def _zeros(self, tag: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.directory is None:
            raise RuntimeError("shared buffers need a directory")
        numel = math.prod(shape)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        suffix = f"{tag}-{len(self._files)}"
        path = self.directory / f"{self._claim(self.directory)}-{suffix}"
        old = self._adopt.pop(suffix, None)
        fd = _create(path, self.mode) if old is None else _take_over(old[0], path, nbytes,
                                                                     self.mode)
        self._files.append(path)
        if old is not None:
            self.adopted.append(path)
        try:
            # Reserve the memory now: on a full tmpfs the service fails at start with a
            # clear error, instead of dying of SIGBUS when a page is first touched.
            os.posix_fallocate(fd, 0, max(nbytes, 1))
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise ConfigError(f"server.shm_dir: cannot reserve {nbytes} bytes in "
                                  f"{path}: {exc.strerror or exc}") from exc
            raise ConfigError(f"server.shm_dir: {self.directory} has no room for a "
                              f"{nbytes}-byte pool buffer; make it larger (e.g. docker "
                              "--shm-size), or set shm_dir to '' to keep pools private"
                              ) from exc
        finally:
            os.close(fd)
        # A new file reads as zeros, which is what a pool starts as; an adopted one
        # holds the KV of the tree the warm restart brings back.
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

    def _claim(self, directory: Path) -> str:
        """This service's owner name, its lock file created and locked on first use."""
        if self._owner is None:
            self._owner, self._lock = _take_lock(directory, self.mode, self.epoch)
        return self._owner

    @property
    def owner(self) -> str | None:
        """This service's owner name (``prefixcache-<pid>.<random>``), once it has files."""
        return self._owner

    def close(self, keep: frozenset[str] = frozenset()) -> None:
        """Unlink this service's files (workers' mappings stay valid until unmapped),
        but those in ``keep`` (paths, for a warm restart): then the lock file stays too,
        unlocked, so the next start knows whose they were and that the owner is gone."""
        for path in self._files:
            if str(path) not in keep:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        self._files.clear()
        if self._lock is not None and keep:
            os.close(self._lock[1])
            self._lock = None
            self._owner = None
        if self._lock is not None:
            # The lock file goes last, while still locked: until it is gone, a sweep
            # sees a live owner and leaves the files above alone.
            path, fd = self._lock
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            os.close(fd)
            self._lock = None
            self._owner = None


def shm_file_mode(server: Any) -> int:
    """The mode of the pool's files: ``server.shm_mode`` when set, else the socket's
    owner and group read/write bits. Whoever may connect may map the pool, but a socket
    opened to everyone (0o666) must not make the pool writable by every local user:
    that takes an explicit ``shm_mode``."""
    if server.shm_mode is not None:
        return int(server.shm_mode)
    return int(server.socket_mode) & 0o660


def _create(path: Path, mode: int) -> int:
    """A new file at ``path`` with exactly ``mode``; a ConfigError if it cannot be made."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise ConfigError(f"server.shm_dir: cannot create files in {path.parent}: "
                          f"{exc.strerror or exc}; set shm_dir to a writable tmpfs, or to "
                          "'' to keep pools private") from exc
    try:
        os.fchmod(fd, mode)  # not subject to the umask, unlike open's mode
    except BaseException:
        os.close(fd)
        raise
    return fd


class AdoptError(ConfigError):
    """A file a warm restart meant to take over is not what its snapshot said."""


def _take_over(old: Path, path: Path, nbytes: int, mode: int) -> int:
    """Rename ``old`` to ``path`` and open it, checked to be a regular file of ours of
    exactly ``nbytes`` bytes (the warm restart checked it already; this is the last
    look, after the rename, so that what is mapped is what was checked)."""
    try:
        os.rename(old, path)
    except OSError as exc:
        raise AdoptError(f"cannot take over {old}: {exc.strerror or exc}") from exc
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError as exc:
        with contextlib.suppress(OSError):
            path.unlink()
        raise AdoptError(f"cannot open {path}: {exc.strerror or exc}") from exc
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size != nbytes or st.st_uid != os.geteuid():
        os.close(fd)
        with contextlib.suppress(OSError):
            path.unlink()
        raise AdoptError(f"{old} is not a {nbytes}-byte pool file of this user")
    os.fchmod(fd, mode)
    return fd


def _take_lock(directory: Path, mode: int, epoch: int) -> tuple[str, tuple[Path, int]]:
    """Create a uniquely named lock file and hold an exclusive flock on it."""
    for _ in range(_CLAIM_TRIES):
        owner = f"{PREFIX}{os.getpid()}.{secrets.token_hex(8)}"
        path = directory / f"{owner}{LOCK_SUFFIX}"
        fd = _create(path, mode)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # Between our create and our flock a sweep may have taken the lock, judged
            # the file stale and unlinked it: then this lock guards nothing, try again.
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                os.write(fd, f"pid {os.getpid()} host {socket.gethostname()} "
                             f"epoch {epoch:x}\n".encode())
                return owner, (path, fd)
        except (BlockingIOError, FileNotFoundError):
            pass
        os.close(fd)
    raise ConfigError(f"server.shm_dir: could not lock a file in {directory} after "
                      f"{_CLAIM_TRIES} tries")


def sweep(directory: str | Path) -> int:
    """Check that ``directory`` can hold pool files and remove dead services' files;
    returns the bytes of those that another process still maps (not freed yet).

    The service runs this before it sizes its pools (sizing.check_fits): the files of a
    server that was killed hold as much shared memory as the pools about to replace
    them, so counting them as taken would refuse every restart of a pool over half of
    the directory: a crash loop that needs a human.
    """
    path = Path(directory)
    if not path.is_dir():
        raise ConfigError(f"server.shm_dir: {path} is not a directory")
    try:
        return _remove_stale(path)[1]
    except OSError as exc:  # e.g. a directory we may not list
        raise ConfigError(f"server.shm_dir: {path}: {exc.strerror or exc}") from exc


def remove_stale(directory: Path) -> int:
    """Unlink the files of services that are gone; returns how many were removed.

    An owner is gone when its lock file can be locked (the kernel released its lock when
    it died), or when its lock file no longer exists (a live owner's lock file outlives
    its buffers). A lock file someone else holds, or cannot be opened by us, means alive.

    Unlinking frees a file's memory only once no process maps it any more: a worker
    still mapping a dead service's pool keeps it until it unmaps (it does when it sees
    the new epoch, or exits). The log says how much is pinned so, measured as the
    removed files' bytes that the filesystem's free space did not get back.
    """
    return _remove_stale(directory)[0]


def _remove_stale(directory: Path) -> tuple[int, int]:
    """(files removed, bytes of them still mapped elsewhere)."""
    owners: dict[str, list[Path]] = {}
    for path in directory.glob(f"{PREFIX}*"):
        match = _NAME.match(path.name)
        if match is not None:
            owners.setdefault(match.group(1), []).append(path)
    before = _free_bytes(directory)
    removed = nbytes = pinned = 0
    for owner, paths in owners.items():
        files, size = _remove_if_gone(directory / f"{owner}{LOCK_SUFFIX}", paths)
        removed += files
        nbytes += size
    if removed:
        after = _free_bytes(directory)
        freed = after - before if before is not None and after is not None else nbytes
        # Still mapped by another process (a worker of the dead service): freed when it
        # unmaps; until then the free space does not include it.
        pinned = max(0, nbytes - max(0, freed))
        log.warning("removed shared-memory files of dead services", extra={
            "files": removed, "dir": str(directory), "bytes": nbytes,
            "pinned_bytes": pinned})
    return removed, pinned


def _free_bytes(directory: Path) -> int | None:
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _remove_if_gone(lock: Path, paths: list[Path]) -> tuple[int, int]:
    """(files removed, bytes they held) of one owner; nothing when it is alive."""
    try:
        fd: int | None = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        fd = None
    except OSError:  # e.g. another user's: not ours to judge
        return 0, 0
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return 0, 0  # its owner is alive, in whatever namespace
        removed = nbytes = 0
        # Buffers first, the lock file last (as close does), so that a sweep that dies
        # half-way leaves a lock file that the next one finds again.
        for path in sorted(paths, key=lambda p: p == lock):
            try:
                size = path.stat().st_blocks * 512  # allocated, not the apparent size
                path.unlink()
                removed += 1
                nbytes += size
            except (FileNotFoundError, PermissionError):
                pass
        return removed, nbytes
    finally:
        if fd is not None:
            os.close(fd)


def describe_buffers(engine: Any, shared: SharedPools) -> list[pb.BufferHandle]:
    """Every buffer of ``engine``'s pools, or [] when any one cannot be shared."""
    buffers: list[tuple[int, int, torch.Tensor]] = []
    if engine.kind == "slot":
        buffers += [(pb.BUFFER_ROLE_K, 0, engine.k_cache), (pb.BUFFER_ROLE_V, 0, engine.v_cache)]
    else:
        kv = engine.kv_pool
        for layer in range(kv.layer_num):
            buffers.append((pb.BUFFER_ROLE_K, layer, kv.k_buffer[layer]))
            if not kv.mla:  # an MLA pool's latent is its K; there is no V
                buffers.append((pb.BUFFER_ROLE_V, layer, kv.v_buffer[layer]))
        if engine.swa_kv_pool is not None:
            swa = engine.swa_kv_pool
            for layer in range(swa.layer_num):
                buffers.append((pb.BUFFER_ROLE_SWA_K, layer, swa.k_buffer[layer]))
                if not swa.mla:
                    buffers.append((pb.BUFFER_ROLE_SWA_V, layer, swa.v_buffer[layer]))
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
