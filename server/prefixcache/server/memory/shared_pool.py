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
own owner name and mapping it as it is, instead of creating it zeroed. Between a stop
(or a crash) and that start the owner is dead, so its files carry a mark
(``<owner>-warm``: keep until when, for which service, ``mark_kept``): another
service's sweep leaves them until then (``server.warm_keep``, at most ``MAX_KEEP``), and
the same service's next start does not wait for it.

Memory. A new file is sized with ``ftruncate``; its memory is reserved with
``posix_fallocate`` (so that a full tmpfs is an error, not a SIGBUS on the first write
to a page) at once for small files and, for large ones, by ``reserve`` on a thread
after the start, since tmpfs reserves 3-4 GB/s here and a start must not wait seconds
per GiB. Private CPU pools (no directory) are anonymous mappings in huge pages where
the host allows (``private_zeros``): the kernel's zero pages, taken as first written,
where ``torch.zeros`` would touch every byte at start.

CUDA buffers need no files: ``DescribePool`` carries the fields of torch's
``_share_cuda_()`` as plain proto fields, and a worker opens them with
``UntypedStorage._new_shared_cuda``. Nothing is pickled either way.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import math
import mmap
import os
import re
import secrets
import socket
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from prefixcache.v1 import prefix_cache_pb2 as pb

from ..config import MAX_WARM_KEEP, ConfigError

log = logging.getLogger("prefixcache.server")

PREFIX = "prefixcache-"
LOCK_SUFFIX = ".lock"
# A stopped (or killed) warm-restart service's mark on its files (``mark_kept``), and
# the longest any mark holds them.
WARM_SUFFIX = "-warm"
MAX_KEEP = MAX_WARM_KEEP
# The owner part of a name: prefixcache-<pid>.<16 hex>; then ".lock" or "-<model>-<n>".
_NAME = re.compile(rf"^({PREFIX}\d+\.[0-9a-f]{{16}})(?:{re.escape(LOCK_SUFFIX)}|-.+)$")
_CLAIM_TRIES = 16
# Files up to this size are reserved as they are made; larger ones by ``reserve``.
_RESERVE_NOW = 64 << 20
_RESERVE_SLICE = 256 << 20
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

    def __init__(
        self,
        directory: str | None,
        epoch: int,
        mode: int = 0o600,
        adopt: dict[str, tuple[Path, int]] | None = None,
        service: str | None = None,
    ) -> None:
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
        # Files whose memory is not reserved yet (``reserve``), with their sizes.
        self._unreserved: list[tuple[Path, int]] = []
        self._closing = threading.Event()
        if self.directory is not None:
            sweep(self.directory, service)

    def factory(
        self, model: str, device: str
    ) -> Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None:
        """A ``buffer_factory`` for ``model``'s pools, or None to allocate as usual."""
        if self.directory is None or torch.device(device).type != "cpu":
            return None
        tag = file_tag(model)
        return lambda shape, dtype: self._zeros(tag, shape, dtype)

    def pool_factory(
        self, model: str, device: str
    ) -> Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None:
        """The ``buffer_factory`` of ``model``'s pools: shared files (``factory``), or,
        for private CPU pools, lazily mapped memory (``private_zeros``; pinned ones, on
        a CUDA host, come from torch as usual); None for device pools."""
        shared = self.factory(model, device)
        if shared is not None or torch.device(device).type != "cpu":
            return shared
        return None if torch.cuda.is_available() else private_zeros

    def _zeros(self, tag: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.directory is None:
            raise RuntimeError("shared buffers need a directory")
        numel = math.prod(shape)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        suffix = f"{tag}-{len(self._files)}"
        path = self.directory / f"{self._claim(self.directory)}-{suffix}"
        old = self._adopt.pop(suffix, None)
        fd = (
            _create(path, self.mode) if old is None else _take_over(old[0], path, nbytes, self.mode)
        )
        self._files.append(path)
        if old is not None:
            self.adopted.append(path)
        try:
            if old is None:
                os.ftruncate(fd, nbytes)
            # The memory is reserved (so that a full tmpfs is found out, instead of a
            # SIGBUS when a page is first touched) at once for small files, and for
            # large ones by ``reserve``, off the start's path: 3-4 GB/s here, seconds
            # for a large pool. An adopted file holds its memory already.
            if os.fstat(fd).st_blocks * 512 < nbytes:
                if nbytes <= _RESERVE_NOW:
                    _reserve(fd, path, max(nbytes, 1), self.directory)
                else:
                    self._unreserved.append((path, nbytes))
        finally:
            os.close(fd)
        # A new file reads as zeros, which is what a pool starts as; an adopted one
        # holds the KV of the tree the warm restart brings back.
        flat = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
        self._maps[flat.data_ptr()] = (str(path), nbytes)
        return flat.view(shape)

    def reserve(self) -> str | None:
        """Reserve the memory of every pool file made so far, a slice at a time (so
        that ``close`` need not wait for it); None when done (or closed meanwhile),
        else why not (a full shm_dir). Runs on a thread of its own."""
        try:
            while self._unreserved and not self._closing.is_set():
                path, nbytes = self._unreserved[0]
                try:
                    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
                except FileNotFoundError:  # closed meanwhile
                    return None
                try:
                    for start in range(0, nbytes, _RESERVE_SLICE):
                        if self._closing.is_set():
                            return None
                        _reserve(
                            fd, path, min(_RESERVE_SLICE, nbytes - start), self.directory, start
                        )
                finally:
                    os.close(fd)
                self._unreserved.pop(0)
            return None
        except ConfigError as exc:
            return str(exc)

    def stop_reserving(self) -> None:
        """Let a ``reserve`` in progress return after its current slice."""
        self._closing.set()

    @property
    def unreserved_bytes(self) -> int:
        """Bytes of pool files whose memory ``reserve`` has yet to reserve."""
        return sum(n for _, n in self._unreserved)

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
            return pb.BufferHandle(
                role=role,
                layer=layer,
                shape=shape,
                dtype=dtype,
                nbytes=nbytes,
                offset_bytes=offset,
                cuda=pb.CudaIpcHandle(
                    device=fields[0],
                    handle=fields[1],
                    storage_size_bytes=fields[2],
                    storage_offset_bytes=fields[3],
                    ref_counter_handle=fields[4] or b"",
                    ref_counter_offset=fields[5],
                    event_handle=fields[6] or b"",
                    event_sync_required=fields[7],
                ),
            )
        ptr = tensor.data_ptr()
        for base, (path, size) in self._maps.items():
            if base <= ptr and ptr + nbytes <= base + size:
                return pb.BufferHandle(
                    role=role,
                    layer=layer,
                    shape=shape,
                    dtype=dtype,
                    nbytes=nbytes,
                    shm_path=path,
                    offset_bytes=ptr - base,
                )
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
        self._closing.set()
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
            for mark in (f"{self._owner}{WARM_SUFFIX}", f"{self._owner}{WARM_SUFFIX}.tmp"):
                with contextlib.suppress(FileNotFoundError):
                    (path.parent / mark).unlink()
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
        raise ConfigError(
            f"server.shm_dir: cannot create files in {path.parent}: "
            f"{exc.strerror or exc}; set shm_dir to a writable tmpfs, or to "
            "'' to keep pools private"
        ) from exc
    try:
        os.fchmod(fd, mode)  # not subject to the umask, unlike open's mode
    except BaseException:
        os.close(fd)
        raise
    return fd


def _reserve(fd: int, path: Path, nbytes: int, directory: Path | None, start: int = 0) -> None:
    """Reserve ``nbytes`` of ``path``'s memory from ``start``; a ConfigError naming the
    fix when the directory is full."""
    try:
        os.posix_fallocate(fd, start, nbytes)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise ConfigError(
                f"server.shm_dir: cannot reserve {nbytes} bytes in {path}: {exc.strerror or exc}"
            ) from exc
        raise ConfigError(
            f"server.shm_dir: {directory} has no room for the pool's "
            f"{path.name}; make it larger (e.g. docker --shm-size), or set "
            "shm_dir to '' to keep pools private"
        ) from exc


def private_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed private buffer whose memory is taken page by page as it is first
    written (an anonymous mapping: the kernel's zero pages), in huge pages where the
    host allows them, so that a start does not touch every byte of a large pool
    (torch.zeros does: ~0.7 GB/s here, 11 s for 8 GiB). The host's memory was
    checked against the pools before (sizing.check_fits)."""
    nbytes = max(1, math.prod(shape) * torch.empty((), dtype=dtype).element_size())
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no THP: 4 KiB pages then
        region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=dtype, count=math.prod(shape)).view(shape)


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
                os.write(
                    fd, f"pid {os.getpid()} host {socket.gethostname()} epoch {epoch:x}\n".encode()
                )
                return owner, (path, fd)
        except (BlockingIOError, FileNotFoundError):
            pass
        os.close(fd)
    raise ConfigError(
        f"server.shm_dir: could not lock a file in {directory} after {_CLAIM_TRIES} tries"
    )


def sweep(directory: str | Path, service: str | None = None) -> int:
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
        return _remove_stale(path, service)[1]
    except OSError as exc:  # e.g. a directory we may not list
        raise ConfigError(f"server.shm_dir: {path}: {exc.strerror or exc}") from exc


def remove_stale(directory: Path, service: str | None = None) -> int:
    """Unlink the files of services that are gone; returns how many were removed.

    An owner is gone when its lock file can be locked (the kernel released its lock when
    it died), or when its lock file no longer exists (a live owner's lock file outlives
    its buffers). A lock file someone else holds, or cannot be opened by us, means alive.

    Unlinking frees a file's memory only once no process maps it any more: a worker
    still mapping a dead service's pool keeps it until it unmaps (it does when it sees
    the new epoch, or exits). The log says how much is pinned so, measured as the
    removed files' bytes that the filesystem's free space did not get back.
    """
    return _remove_stale(directory, service)[0]


def _remove_stale(directory: Path, service: str | None = None) -> tuple[int, int]:
    """(files removed, bytes of them still mapped elsewhere)."""
    owners: dict[str, list[Path]] = {}
    for path in directory.glob(f"{PREFIX}*"):
        match = _NAME.match(path.name)
        if match is not None:
            owners.setdefault(match.group(1), []).append(path)
    before = _free_bytes(directory)
    removed = nbytes = pinned = 0
    for owner, paths in owners.items():
        files, size = _remove_if_gone(directory / f"{owner}{LOCK_SUFFIX}", paths, service)
        removed += files
        nbytes += size
    if removed:
        after = _free_bytes(directory)
        freed = after - before if before is not None and after is not None else nbytes
        # Still mapped by another process (a worker of the dead service): freed when it
        # unmaps; until then the free space does not include it.
        pinned = max(0, nbytes - max(0, freed))
        log.warning(
            "removed shared-memory files of dead services",
            extra={
                "files": removed,
                "dir": str(directory),
                "bytes": nbytes,
                "pinned_bytes": pinned,
            },
        )
    return removed, pinned


def _free_bytes(directory: Path) -> int | None:
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _remove_if_gone(lock: Path, paths: list[Path], service: str | None = None) -> tuple[int, int]:
    """(files removed, bytes they held) of one owner; nothing when it is alive, or when
    it kept them for a warm restart of another service (``kept_for``)."""
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
        kept = kept_for(lock.with_name(lock.name.removesuffix(LOCK_SUFFIX) + WARM_SUFFIX))
        if kept is not None and kept[1] != service:
            return 0, 0  # another service's warm restart will take them over
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


def file_tag(model: str) -> str:
    """The part of a buffer file's name that names its model (or other user)."""
    return _UNSAFE.sub("_", model)[:64]


def kept_elsewhere(directory: str | Path, service: str | None) -> tuple[int, float]:
    """(bytes, until when) of the pool files that other services' warm restarts keep
    in ``directory`` (their owners gone, their marks holding): what a start that does
    not fit should name, since the sweep leaves them."""
    nbytes, until = 0, 0.0
    owners: dict[str, list[Path]] = {}
    with contextlib.suppress(OSError):
        for path in Path(directory).glob(f"{PREFIX}*"):
            match = _NAME.match(path.name)
            if match is not None:
                owners.setdefault(match.group(1), []).append(path)
    for owner, paths in owners.items():
        kept = kept_for(Path(directory) / f"{owner}{WARM_SUFFIX}")
        if kept is None or kept[1] == service:
            continue
        for path in paths:
            with contextlib.suppress(OSError):
                nbytes += path.stat().st_blocks * 512
        until = max(until, kept[0])
    return nbytes, until


def service_tag(listen: str) -> str:
    """A service's name among others sharing a shm_dir: from its listen address, which
    no two services on a host share."""
    return hashlib.sha256(listen.encode()).hexdigest()[:16]


def mark_kept(directory: Path, owner: str, seconds: float, service: str) -> None:
    """Mark ``owner``'s files as kept for a warm restart of ``service`` for ``seconds``
    from now: another service's sweep leaves them alone until then (``kept_for``).
    Written whole (a temporary name, renamed), so a sweep never reads half of it."""
    until = time.time() + min(seconds, MAX_KEEP)
    path = directory / f"{owner}{WARM_SUFFIX}"
    tmp = path.with_name(f"{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, f"keep-until {until:.3f} service {service}\n".encode())
    finally:
        os.close(fd)
    os.rename(tmp, path)


def kept_for(marker: Path) -> tuple[float, str] | None:
    """(until, service) of a warm restart's mark, while it holds: written by this user,
    not yet past, and not further ahead than ``MAX_KEEP`` (a mark cannot pin memory
    for longer than that); None otherwise."""
    try:
        fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None
        words = os.read(fd, 256).decode(errors="replace").split()
    finally:
        os.close(fd)
    try:
        if len(words) != 4 or words[0] != "keep-until" or words[2] != "service":
            return None
        until = float(words[1])
    except ValueError:
        return None
    now = time.time()
    if not now < until <= now + MAX_KEEP + 60:  # a minute of slack for rounding
        return None
    return until, words[3]


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
                buffers += [
                    (pb.BUFFER_ROLE_CONV, layer, m.conv_state[layer]),
                    (pb.BUFFER_ROLE_TEMPORAL, layer, m.temporal_state[layer]),
                ]
    out = []
    for role, layer, tensor in buffers:
        handle = shared.handle(role, layer, tensor)
        if handle is None:  # all or nothing: half a pool is no use to a worker
            return []
        out.append(handle)
    return out
