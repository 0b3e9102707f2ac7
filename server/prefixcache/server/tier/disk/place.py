"""The disk tier's directory (``disk.path``): checked, locked and shared out at start.

* It must exist and be a directory this process can write: a missing or read-only
  path is a start error that names it (ConfigError), as is one that another
  ``prefixcache serve`` holds: each holds an exclusive ``flock`` on the lock file in
  it for as long as it runs (released by the kernel when it dies, so a killed sidecar
  never locks out its restart).
* Each model that takes part gets a folder of its own, named after the model and a
  digest of its fingerprint (keys.py: what decides its pages' bytes), and a share of
  ``disk.bytes`` in proportion to its pool's bytes. Folders of models that no longer
  take part (another name or geometry) are removed at start: the bound is a bound on
  everything the tier keeps there.
* ``disk.bytes`` must fit: what the folders' files take now plus the file system's
  free space (``statvfs``), else the start is refused with both numbers. The slot files
  are then preallocated (``posix_fallocate``), so their room is the tier's for good.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from ...config.values import ConfigError
from ..keys import model_fingerprint
from .store import stored_bytes

log = logging.getLogger("prefixcache.server")

LOCK_FILE = "prefixcache-disk.lock"
# A model folder's name: <model name, made safe>-<16 hex digits of its fingerprint>.
_FOLDER = re.compile(r"^[A-Za-z0-9._-]{1,64}-[0-9a-f]{16}$")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def model_folder(model: Any) -> str:
    """The folder name of ``model``'s pages (a ModelConfig)."""
    digest = hashlib.sha256(model_fingerprint(model).encode()).hexdigest()[:16]
    return f"{_UNSAFE.sub('_', model.name)[:64] or '_'}-{digest}"


class Place:
    """``disk.path``, locked by this process until ``close``."""

    def __init__(self, path: str, where: str = "server.disk.path") -> None:
        self.path = Path(path).absolute()
        if not self.path.exists():
            raise ConfigError(
                f"{where}: {self.path} does not exist; create it (a volume "
                "of this node's disk) or choose another path"
            )
        if not self.path.is_dir():
            raise ConfigError(f"{where}: {self.path} is not a directory")
        try:
            self._fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise ConfigError(
                    f"{where}: {self.path} is not writable here "
                    f"({exc.strerror}): the disk tier writes its pages "
                    "there"
                ) from exc
            raise ConfigError(f"{where}: cannot use {self.path}: {exc.strerror}") from exc
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(self._fd)
            os.close(self._fd)
            raise ConfigError(
                f"{where}: {self.path} is in use by another prefixcache "
                f"serve{f' (pid {holder})' if holder else ''}: each needs "
                "its own disk.path"
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)
        if not os.access(self.path, os.W_OK):  # a read-only bind with a lock file in it
            self.close()
            raise ConfigError(
                f"{where}: {self.path} is not writable here: the disk tier writes its pages there"
            )

    def prepare(self, folders: dict[str, int], where: str = "server.disk.bytes") -> None:
        """Remove the folders of models that no longer take part, then check that the
        file system holds ``folders`` (name: bytes) beside what they take now."""
        for entry in self.path.iterdir():
            if entry.is_dir() and _FOLDER.match(entry.name) and entry.name not in folders:
                log.warning(
                    "disk tier: removing the pages of a model that no longer takes part",
                    extra={"folder": str(entry)},
                )
                shutil.rmtree(entry, ignore_errors=True)
        have = sum(stored_bytes(self.path / name) for name in folders)
        stats = os.statvfs(self.path)
        free = stats.f_bavail * stats.f_frsize
        need = sum(folders.values())
        if need > free + have:
            raise ConfigError(
                f"{where}: {need} bytes do not fit under {self.path}: its "
                f"file system has {free} free, and the disk tier's files "
                f"there take {have}"
            )

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1


def _read_pid(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        return ""
    return text if text.isdigit() else ""
