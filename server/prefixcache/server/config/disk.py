"""``server.disk``: the local disk tier below each model's pool (server/tier/disk/).

Off unless the section is given. Keys: ``path`` (a directory this sidecar owns, on a
local file system: an emptyDir or a local persistent volume in Kubernetes), ``bytes``
(the hard bound on what the tier keeps there, shared by the models in proportion to
their pools' bytes), ``min_hits`` (admission: 0 writes every page the pool evicts, 1
only pages hit at least once after they were cached, i.e. touched twice), ``timeout``
and ``min_fetch_bandwidth`` (a lookup's read deadline, as the Mooncake tier's) and
``max_fetch_slots``. ``PREFIXCACHE_DISK`` may carry the section as JSON (Helm does).
A model opts out with ``models[].disk: false``. Whether the path can hold the bytes is
checked at start, where the files are made (tier/disk/store.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from .tier import MAX_TIER_TIMEOUT
from .values import ConfigError, as_mapping, check_int, coerce, note_unread, reject_unknown

# A disk tier smaller than this holds too few pages to be one.
MIN_DISK_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class DiskConfig:
    """``server.disk``: where the disk tier keeps its pages, how much, and its reads."""

    # A directory of this sidecar's own (it must exist, and be writable).
    path: str
    # Bytes the tier may take there in all (page slots, index and journal); the files
    # are made at start, so a file system that cannot hold them refuses the start.
    bytes: int
    # Admission: a page the pool evicts is written once lookups hit it this many times.
    min_hits: int = 0
    # Seconds a lookup's disk reads may take (plus their bytes over min_fetch_bandwidth);
    # what is not read by then is a miss.
    timeout: float = 0.5
    # Bytes per second a read is given at least.
    min_fetch_bandwidth: float = 2e8
    # Slots of each model's pool that the tier's reads hold at once; 0: half the pool.
    max_fetch_slots: int = 0

    @property
    def write(self) -> str:
        """The disk tier writes back: a page goes to disk when the pool evicts it."""
        return "on_evict"


def parse_disk(value: Any, default: Any, where: str) -> DiskConfig | None:
    """``server.disk`` from YAML (a mapping), env or the CLI (JSON); None or "" or
    "off": no disk tier."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "off")):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ConfigError(f"{where}: not a JSON object: {exc}") from None
    data = dict(as_mapping(value, where))
    reject_unknown(data, tuple(f.name for f in fields(DiskConfig)), where)
    base = DiskConfig(path="", bytes=0)
    cfg = replace(
        base,
        **{
            name: coerce(item, getattr(base, name), f"{where}.{name}")
            for name, item in data.items()
        },
    )
    if not isinstance(cfg.path, str) or not cfg.path.strip():
        raise ConfigError(f"{where}.path: the directory the disk tier keeps its pages in")
    if cfg.bytes < MIN_DISK_BYTES:
        raise ConfigError(
            f"{where}.bytes: the bytes the disk tier may take, at least "
            f"{MIN_DISK_BYTES} (1 MiB), got {cfg.bytes}"
        )
    check_int(cfg.min_hits, f"{where}.min_hits", 0)
    check_int(cfg.max_fetch_slots, f"{where}.max_fetch_slots", 0)
    if not (math.isfinite(cfg.timeout) and 0 < cfg.timeout <= MAX_TIER_TIMEOUT):
        raise ConfigError(
            f"{where}.timeout: seconds in (0, {MAX_TIER_TIMEOUT:g}], got {cfg.timeout}"
        )
    if not (math.isfinite(cfg.min_fetch_bandwidth) and cfg.min_fetch_bandwidth > 0):
        raise ConfigError(
            f"{where}.min_fetch_bandwidth: bytes per second, more than 0, "
            f"got {cfg.min_fetch_bandwidth}"
        )
    if not Path(cfg.path).is_dir():
        # --check-config says so (the start refuses it, naming it, where it runs).
        note_unread(f"{where}.path: {cfg.path} is not a directory here")
    return cfg
