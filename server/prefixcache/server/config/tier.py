"""``server.tier``: the shared cross-node KV tier below each model's pool (server/tier/).

Off unless the section is given. The keys are the tier's contract (docs/across-nodes.md,
docs/configuration.md): backend, master, metadata, protocol, local_hostname,
segment_bytes, write, min_hits, timeout, min_fetch_bandwidth, max_fetch_slots and
secret_file (docs/security.md). ``PREFIXCACHE_TIER`` may carry the section as JSON (Helm
does). A model opts out with ``models[].tier: false``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from .values import (
    ConfigError,
    as_mapping,
    check_int,
    coerce,
    is_host_port,
    note_unread,
    reject_unknown,
)

TIER_BACKENDS = ("mooncake",)
TIER_PROTOCOLS = ("tcp", "rdma")
TIER_WRITES = ("on_insert", "on_evict")
# A tier call slower than this is no cache any more; a longer timeout is a mistake.
MAX_TIER_TIMEOUT = 60.0
# Mooncake refuses a smaller segment (and the tier would never connect).
MIN_SEGMENT_BYTES = 16 << 20
# A cluster secret has at least this many bytes (make one: head -c 32 /dev/urandom).
MIN_SECRET_BYTES = 32


@dataclass(frozen=True, slots=True)
class TierConfig:
    """``server.tier``: where the store's master is, and how this sidecar uses it."""

    # The only backend now (server/tier/backend.py is the interface).
    backend: str = "mooncake"
    # mooncake_master's RPC address, HOST:PORT.
    master: str = "127.0.0.1:50051"
    # "P2PHANDSHAKE" (no metadata service) or an http:// metadata server.
    metadata: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    # How peers reach this sidecar's segment: an IP or host name ($POD_IP in
    # Kubernetes), or "auto": the address this host uses to reach the master.
    local_hostname: str = "auto"
    # Memory this sidecar lends to the cluster's pool of stored pages.
    segment_bytes: int = 1 << 30
    # on_insert: a page is written when it enters the tree (write-through); on_evict:
    # when eviction takes it (write-back, from a bounded staging copy: staging.py).
    write: str = "on_insert"
    # Admission: a page is stored once it was hit this many times (0: at once).
    min_hits: int = 0
    # Seconds a lookup's tier calls may take before they count as a miss, plus, for a
    # fetch, its bytes over min_fetch_bandwidth.
    timeout: float = 0.5
    # Bytes per second a fetch is given at least: a slower peer is taken for dead.
    min_fetch_bandwidth: float = 1e8
    # Slots of each model's pool that the tier's fetches hold at once; 0: half the pool.
    max_fetch_slots: int = 0
    # A file of at least MIN_SECRET_BYTES random bytes, the same on every node: objects
    # carry a MAC under a key per tenant derived from it, and their keys are keyed
    # (docs/security.md). None: a digest only, and the tier trusts every store client.
    secret_file: str | None = None


def parse_tier(value: Any, default: Any, where: str) -> TierConfig | None:
    """``server.tier`` from YAML (a mapping), env or the CLI (JSON); None or "" or
    "off": no tier."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "off")):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ConfigError(f"{where}: not a JSON object: {exc}") from None
    data = dict(as_mapping(value, where))
    reject_unknown(data, tuple(f.name for f in fields(TierConfig)), where)
    cfg = TierConfig()
    cfg = replace(
        cfg,
        **{
            name: coerce(item, getattr(cfg, name), f"{where}.{name}") for name, item in data.items()
        },
    )
    choices = {"backend": TIER_BACKENDS, "protocol": TIER_PROTOCOLS, "write": TIER_WRITES}
    for name, allowed in choices.items():
        if getattr(cfg, name) not in allowed:
            raise ConfigError(
                f"{where}.{name}: one of {', '.join(allowed)}, got {getattr(cfg, name)!r}"
            )
    if not isinstance(cfg.master, str) or not is_host_port(cfg.master):
        raise ConfigError(
            f"{where}.master: HOST:PORT of mooncake_master's RPC port, got {cfg.master!r}"
        )
    if not isinstance(cfg.metadata, str) or not (
        cfg.metadata == "P2PHANDSHAKE" or cfg.metadata.startswith(("http://", "https://"))
    ):
        raise ConfigError(
            f"{where}.metadata: P2PHANDSHAKE or an http:// metadata server, got {cfg.metadata!r}"
        )
    if (
        not isinstance(cfg.local_hostname, str)
        or not cfg.local_hostname.strip()
        or any(c.isspace() for c in cfg.local_hostname)
    ):
        raise ConfigError(
            f"{where}.local_hostname: auto, or the address peers reach this "
            f"host at, got {cfg.local_hostname!r}"
        )
    if cfg.segment_bytes < MIN_SEGMENT_BYTES:
        raise ConfigError(
            f"{where}.segment_bytes: Mooncake's smallest segment is "
            f"{MIN_SEGMENT_BYTES} bytes (16 MiB), got {cfg.segment_bytes}"
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
    if cfg.secret_file is not None:
        if not cfg.secret_file.strip():
            raise ConfigError(f"{where}.secret_file: a path, or leave it out")
        try:
            read_tier_secret(cfg.secret_file, f"{where}.secret_file")
        except ConfigError as exc:
            # --check-config of a config for another host: a missing file is noted.
            if Path(cfg.secret_file).exists() or not note_unread(str(exc)):
                raise
    return cfg


def read_tier_secret(path: str, where: str = "server.tier.secret_file") -> bytes:
    """The cluster secret's bytes (all of them: the file is the secret), refused with a
    one-line reason when unreadable or too short to be one.

    Raises:
        ConfigError: naming ``where``.
    """
    try:
        with open(path, "rb") as fh:
            secret = fh.read(1 << 16)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read {path}: {exc.strerror or exc}") from exc
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"{where}: {path} holds {len(secret)} bytes, a secret at least "
            f"{MIN_SECRET_BYTES} random ones; make one with "
            f"`head -c 32 /dev/urandom > {path}`"
        )
    return secret
