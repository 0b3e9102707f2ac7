"""The warm-restart snapshot file: its format, its atomic write, its careful read, and
the models' fingerprint it carries.

Layout: ``MAGIC``, the body's length (8 bytes, little-endian), the body, then the
body's XXH3-128 digest (16 bytes). The body is a length-prefixed JSON manifest (owner,
pool files, the models' fingerprint, which trees follow, whether a clean stop wrote
it) and, for each tree in the manifest's order, its bytes (``tree_snapshot``) and its
seals (tree_seals.py), each length-prefixed. A file that is short, long, or whose
digest does not match is refused whole: a torn write or a flipped bit starts cold.

Written to a temporary name in the same directory (``<name>.<pid>.tmp``), flushed, and
renamed over the snapshot's name, so a reader sees the old file or the whole new one;
a start removes any temporary file a killed writer left. Read by mapping it, after
its type, owner, size and header are checked and before any byte of the body is
touched: a directory, FIFO, socket, device or symbolic link at the path, or a file too
large for these pools, is refused with a one-line reason (and removed, but for a
directory that is not empty), and the start goes on cold; nothing at the path can
make it hang or exit.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import stat
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import xxhash

from ..config import ModelConfig

MAGIC = b"PCWARM2\n"
# Bump it when the pool's buffers (their order, shapes or row layout), the tree or
# the seal format change: a start of the new code then refuses an old snapshot (cold,
# config_changed) instead of reading old bytes the new way. Same version: an upgrade
# restarts warm.
VERSION = 2
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_HEAD = len(MAGIC) + _U64.size
_DIGEST = 16
_MAX_MANIFEST = 16 << 20
# Host bytes a snapshot may take per pool row, and beyond them: a tree keeps at most a
# slot (8 bytes) and a token (4 bytes a width unit) per row, plus per-node arrays and
# seals; anything larger is not ours and is refused before it is read.
_BYTES_PER_ROW = 128
_SLACK = 64 << 20
_IOV = 512  # buffers per writev


class Refused(Exception):
    """The snapshot cannot be used: ``outcome`` (a metric label) and why, for the log."""

    def __init__(self, outcome: str, reason: str) -> None:
        super().__init__(reason)
        self.outcome = outcome
        self.reason = reason


def fingerprint(models: tuple[ModelConfig, ...] | list[ModelConfig]) -> list[dict[str, Any]]:
    """What must not change for a model's pool and tree to be taken over: its name, kind,
    paging and pool geometry (not its eviction policy, quotas or tier setting)."""
    out = []
    for m in models:
        out.append(
            {
                "name": m.name,
                "kind": m.kind,
                "page_size": m.page_size,
                "sliding_window_size": m.sliding_window_size,
                "max_seq_len": m.max_seq_len,
                "pool": asdict(m.pool),
                "mamba": asdict(m.mamba) if m.mamba is not None else None,
            }
        )
    return json.loads(json.dumps(out))  # tuples as lists, as a snapshot reads back


def max_bytes(models: Sequence[ModelConfig]) -> int:
    """The largest snapshot these models' trees can make (see ``_BYTES_PER_ROW``)."""
    rows = sum(m.pool.size + m.page_size for m in models)
    return rows * _BYTES_PER_ROW + _SLACK


def changed(old: Any, new: list[dict[str, Any]]) -> str | None:
    """The first difference between two fingerprints, said for the log, or None."""
    if not isinstance(old, list) or not all(isinstance(m, dict) for m in old):
        return "the snapshot names no models"
    if [m.get("name") for m in old] != [m["name"] for m in new]:
        return f"models {[m.get('name') for m in old]} then, {[m['name'] for m in new]} now"
    for before, now in zip(old, new, strict=True):
        for field, value in _flat(now):
            was = dict(_flat(before)).get(field)
            if was != value:
                return f"model {now['name']!r}: {field} {was!r} then, {value!r} now"
    return None


def _flat(model: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in model.items():
        if isinstance(value, dict):
            out += _flat(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


Buffer = bytes | bytearray | memoryview


def encode_body(manifest: dict[str, Any], trees: list[tuple[list[Buffer], bytes]]) -> list[Buffer]:
    """The body's buffers: the manifest, then each tree's parts and seals."""
    head = json.dumps(manifest).encode()
    parts: list[Buffer] = [_U32.pack(len(head)), head]
    for tree, seals in trees:
        parts += [_U64.pack(sum(len(p) for p in tree)), *tree, _U64.pack(len(seals)), seals]
    return parts


def temporary(path: Path) -> Path:
    return path.with_name(f"{path.name}.{os.getpid()}.tmp")


def write(path: Path, body: list[Buffer], mode: int, limit: int | None = None) -> int:
    """Write the snapshot atomically (temporary file, fsync, rename); returns its bytes.

    Raises:
        OSError: ENOSPC when the directory has no room for it (checked before a byte
            is written) or ``limit`` is exceeded; any error of the write itself.
    """
    size = _HEAD + sum(len(p) for p in body) + _DIGEST
    if limit is not None and size > limit:
        raise OSError(28, f"{size} bytes, over server.warm_checkpoint_max_bytes ({limit})")
    st = os.statvfs(path.parent)
    if size > st.f_bavail * st.f_frsize:
        raise OSError(28, f"{size} bytes, {st.f_bavail * st.f_frsize} free in {path.parent}")
    digest = xxhash.xxh3_128()
    for part in body:
        digest.update(part)
    parts = [MAGIC, _U64.pack(size - _HEAD - _DIGEST), *body, digest.digest()]
    tmp = temporary(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, mode)
        _write_all(fd, parts)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    os.close(fd)
    try:
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    with contextlib.suppress(OSError):  # the rename itself, on a disk that keeps it
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return size


def _write_all(fd: int, parts: list[Buffer]) -> None:
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        done = os.writev(fd, views[:_IOV])
        while done and views:
            if done >= len(views[0]):
                done -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][done:]
                done = 0


def remove_leftovers(path: Path) -> int:
    """Remove the temporary files of writers that were killed; returns how many. Only
    this service writes under its snapshot's name (one per listen address)."""
    removed = 0
    with contextlib.suppress(OSError):
        for tmp in path.parent.glob(f"{path.name}.*.tmp"):
            with contextlib.suppress(OSError):
                if not stat.S_ISDIR(tmp.lstat().st_mode):
                    tmp.unlink()
                    removed += 1
    return removed


@dataclass
class Snapshot:
    """A snapshot read: its manifest and, per tree, its bytes and seals (views of the
    mapped file, valid while this object lives)."""

    manifest: dict[str, Any]
    trees: list[tuple[memoryview, memoryview]]
    nbytes: int


def consume(path: Path, limit: int) -> Snapshot | None:
    """Read the snapshot at ``path`` and remove it (a snapshot is used once: a start
    that then crashes must not find it again); None when there is none.

    Raises:
        Refused: ``foreign`` (not this user's file), ``corrupt`` (not a regular file,
            over ``limit`` bytes, torn, damaged, or not a snapshot).
    """
    try:  # O_NONBLOCK: a FIFO at the path must not hang the start
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        kind = _kind(path)
        if kind is not None:  # a symbolic link (O_NOFOLLOW), or what cannot be opened
            _remove(path)
            raise Refused("corrupt", f"{path} is {kind}, not a snapshot (removed)") from exc
        raise Refused("foreign", f"{path} cannot be read: {exc.strerror or exc}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = _describe(st.st_mode)
            removed = _remove(path)
            raise Refused(
                "corrupt",
                f"{path} is {kind}, not a snapshot"
                f"{' (removed)' if removed else ' (left in place)'}",
            )
        if st.st_uid != os.geteuid():
            raise Refused("foreign", f"{path} belongs to uid {st.st_uid}, not to this user")
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        if st.st_size > limit:
            raise Refused(
                "corrupt",
                f"{path} is {st.st_size} bytes, larger than any snapshot of these pools ({limit})",
            )
        if st.st_size < _HEAD + _DIGEST:
            raise Refused("corrupt", f"{path} is not a snapshot, or is torn")
        head = os.pread(fd, _HEAD, 0)
        if not head.startswith(MAGIC):
            raise Refused("corrupt", f"{path} is not a version-{VERSION} snapshot")
        (size,) = _U64.unpack_from(head, len(MAGIC))
        if st.st_size != _HEAD + size + _DIGEST:
            raise Refused(
                "corrupt",
                f"{path} is torn: {st.st_size} bytes, the header says {_HEAD + size + _DIGEST}",
            )
        data = memoryview(mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ))
    finally:
        os.close(fd)
    body = data[_HEAD : _HEAD + size]
    if xxhash.xxh3_128_digest(body) != bytes(data[_HEAD + size :]):
        raise Refused("corrupt", f"{path} fails its checksum")
    try:
        manifest, trees = _parse(body)
    except (ValueError, struct.error) as exc:
        raise Refused("corrupt", f"{path}: {exc}") from exc
    return Snapshot(manifest, trees, st.st_size)


def _parse(body: memoryview) -> tuple[dict[str, Any], list[tuple[memoryview, memoryview]]]:
    (hlen,) = _U32.unpack_from(body, 0)
    if hlen > _MAX_MANIFEST:
        raise ValueError("a manifest too large")
    manifest = json.loads(bytes(body[_U32.size : _U32.size + hlen]))
    if not isinstance(manifest, dict):
        raise ValueError("no manifest")
    pos, trees = _U32.size + hlen, []
    while pos < len(body):
        parts = []
        for _ in range(2):
            (n,) = _U64.unpack_from(body, pos)
            if pos + _U64.size + n > len(body):
                raise ValueError("a tree runs past the end")
            parts.append(body[pos + _U64.size : pos + _U64.size + n])
            pos += _U64.size + n
        trees.append((parts[0], parts[1]))
    return manifest, trees


def _kind(path: Path) -> str | None:
    try:
        return _describe(os.lstat(path).st_mode)
    except OSError:
        return None


def _describe(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _remove(path: Path) -> bool:
    """Remove what is at ``path`` (an empty directory too); False if it stays."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            os.rmdir(path)
        else:
            os.unlink(path)
        return True
    except OSError:
        return False
