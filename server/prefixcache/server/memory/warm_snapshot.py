"""The warm-restart snapshot file: its format, its atomic write, and the models'
fingerprint it carries.

Layout: ``MAGIC``, the body's length (8 bytes, little-endian), the body, then the body's
SHA-256. The body is a length-prefixed JSON manifest (owner, pool files, the models'
fingerprint, which trees follow) and each model's tree (``tree_snapshot.encode``),
length-prefixed, in the manifest's order. A file that is short, long, or whose digest
does not match is refused whole: a torn write or a flipped bit starts cold.

The file is written to a temporary name in the same directory, flushed to the disk,
and renamed over the snapshot's name, so a reader sees the old file or the whole new
one, never half of one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..config import ModelConfig

MAGIC = b"PCWARM1\n"
# Bump it when the pool's buffers (their order, shapes or row layout) or the tree
# format change: a start of the new code then refuses an old snapshot (cold,
# config_changed) instead of reading old bytes the new way. Same version: an upgrade
# restarts warm.
VERSION = 1
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_DIGEST = 32
# A snapshot larger than this is not ours (the trees of the largest pools are far
# smaller): refused before it is read into memory.
MAX_BYTES = 1 << 34


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
        out.append({"name": m.name, "kind": m.kind, "page_size": m.page_size,
                    "sliding_window_size": m.sliding_window_size,
                    "max_seq_len": m.max_seq_len, "pool": asdict(m.pool),
                    "mamba": asdict(m.mamba) if m.mamba is not None else None})
    return json.loads(json.dumps(out))  # tuples as lists, as a snapshot reads back


def changed(old: Any, new: list[dict[str, Any]]) -> str | None:
    """The first difference between two fingerprints, said for the log, or None."""
    if not isinstance(old, list) or not all(isinstance(m, dict) for m in old):
        return "the snapshot names no models"
    if [m.get("name") for m in old] != [m["name"] for m in new]:
        return (f"models {[m.get('name') for m in old]} then, "
                f"{[m['name'] for m in new]} now")
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


def write(path: Path, manifest: dict[str, Any], trees: list[bytes], mode: int) -> int:
    """Write the snapshot atomically (temporary file, fsync, rename); returns its bytes."""
    head = json.dumps(manifest).encode()
    parts = [_U32.pack(len(head)), head]
    for tree in trees:
        parts += [_U64.pack(len(tree)), tree]
    body = b"".join(parts)
    data = b"".join([MAGIC, _U64.pack(len(body)), body, hashlib.sha256(body).digest()])
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    os.close(fd)
    os.rename(tmp, path)
    with contextlib.suppress(OSError):  # the rename itself, on a disk that keeps it
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return len(data)


def consume(path: Path) -> tuple[dict[str, Any], list[bytes]] | None:
    """Read the snapshot at ``path`` and remove it (a snapshot is used once: a start
    that then crashes must not find it again); None when there is none.

    Raises:
        Refused: ``foreign`` (not this user's file), ``corrupt`` (torn, damaged, or
            not a snapshot).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise Refused("foreign", f"{path} cannot be read: {exc.strerror or exc}") from exc
    try:
        st = os.fstat(fd)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        if st.st_uid != os.geteuid():
            raise Refused("foreign", f"{path} belongs to uid {st.st_uid}, not to this user")
        if st.st_size > MAX_BYTES:
            raise Refused("corrupt", f"{path} is {st.st_size} bytes, too large")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read()
    finally:
        os.close(fd)
    return _parse(data, path)


def _parse(data: bytes, path: Path) -> tuple[dict[str, Any], list[bytes]]:
    head = len(MAGIC) + _U64.size
    if len(data) < head + _DIGEST or not data.startswith(MAGIC):
        raise Refused("corrupt", f"{path} is not a snapshot, or is torn")
    (size,) = _U64.unpack_from(data, len(MAGIC))
    if len(data) != head + size + _DIGEST:
        raise Refused("corrupt", f"{path} is torn: {len(data)} bytes, the header says "
                                 f"{head + size + _DIGEST}")
    body = data[head:head + size]
    if hashlib.sha256(body).digest() != data[head + size:]:
        raise Refused("corrupt", f"{path} fails its checksum")
    try:
        (hlen,) = _U32.unpack_from(body, 0)
        manifest = json.loads(body[_U32.size:_U32.size + hlen])
        if not isinstance(manifest, dict):
            raise ValueError("no manifest")
        pos, trees = _U32.size + hlen, []
        while pos < len(body):
            (tlen,) = _U64.unpack_from(body, pos)
            trees.append(body[pos + _U64.size:pos + _U64.size + tlen])
            pos += _U64.size + tlen
        if pos != len(body):
            raise ValueError("a tree runs past the end")
    except (ValueError, struct.error) as exc:
        raise Refused("corrupt", f"{path}: {exc}") from exc
    return manifest, trees
