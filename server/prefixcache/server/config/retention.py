"""``server.retention``: how the service honours clients' retention hints.

A hint (the proto's ``Retention``: seconds and a priority) makes a cached prefix a soft
eviction priority (prefixcache.cache.retention). These keys bound it: ``enabled``,
``max_seconds`` (longer hints are clipped to it) and ``tenant_share`` (the share of each
model's pool one tenant's retentions may cover; all callers without a tenant's token
count as one tenant; 0, the default, shares the pool evenly among them:
``retention_share``). ``PREFIXCACHE_RETENTION`` may carry the section as JSON; ``off``
turns retention off.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from typing import Any

from .values import ConfigError, as_mapping, coerce, reject_unknown

# A retention longer than a day is a pin by another name.
MAX_RETENTION_SECONDS = 86400.0


@dataclass(frozen=True, slots=True)
class RetentionConfig:
    """``server.retention``: whether hints are honoured, and their bounds."""

    enabled: bool = True
    # Seconds a hint may ask for (renewed by every hit); longer ones are clipped.
    max_seconds: float = 3600.0
    # Of each model's pool tokens, what one tenant's retentions may cover; 0: the pool
    # shared evenly among the tenants (retention_share).
    tenant_share: float = 0.0


def parse_retention(value: Any, default: Any, where: str) -> RetentionConfig:
    """``server.retention`` from YAML (a mapping), env or the CLI (JSON, or ``off``)."""
    if isinstance(value, RetentionConfig):
        return value
    if value is None:
        return RetentionConfig()
    if isinstance(value, str):
        if value.strip().lower() in ("off", "false"):
            return RetentionConfig(enabled=False)
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError as exc:
            raise ConfigError(f"{where}: not a JSON object: {exc}") from None
    data = dict(as_mapping(value, where))
    reject_unknown(data, tuple(f.name for f in fields(RetentionConfig)), where)
    cfg = RetentionConfig()
    cfg = replace(
        cfg,
        **{
            name: coerce(item, getattr(cfg, name), f"{where}.{name}") for name, item in data.items()
        },
    )
    if not (math.isfinite(cfg.max_seconds) and 0 < cfg.max_seconds <= MAX_RETENTION_SECONDS):
        raise ConfigError(
            f"{where}.max_seconds: seconds in (0, {MAX_RETENTION_SECONDS:g}], got {cfg.max_seconds}"
        )
    if not (math.isfinite(cfg.tenant_share) and 0 <= cfg.tenant_share <= 1):
        raise ConfigError(
            f"{where}.tenant_share: a share of the pool in [0, 1] (0: shared "
            f"evenly), got {cfg.tenant_share}"
        )
    return cfg


def retention_share(config: RetentionConfig, tenants: int) -> float:
    """What one tenant may retain of a pool: ``tenant_share``, or with 0 the pool shared
    evenly by the ``tenants`` configured and the callers without a tenant's token (all
    of it when there are no tenants), so that together they never retain more than the
    pool. A share below the whole pool leaves a single tenant less than it could use:
    hints past it are clipped while the first ones keep theirs."""
    return config.tenant_share or 1.0 / (tenants + 1)
