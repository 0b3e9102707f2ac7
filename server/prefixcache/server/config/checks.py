"""Checks of the ``server`` section and of each ``models[i]`` entry.

Each builds its dataclass from the merged settings, coercing every value to the type of
its default, and raises ConfigError naming the field when a value is out of range.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import fields, replace
from typing import Any, TypeVar

from .disk import parse_disk
from .kv_events import check_kv_events_tenants, parse_kv_events
from .retention import parse_retention
from .tenants import check_tenant_tokens, parse_tenants
from .tier import parse_tier
from .types import CACHE_KINDS, DTYPES, MambaConfig, ModelConfig, PoolConfig, ServerConfig
from .values import (
    ConfigError,
    as_mapping,
    check_int,
    coerce,
    file_mode,
    is_host_port,
    read_secret,
    reject_unknown,
)

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
# Upper bounds of server settings: beyond them a value is a mistake (or overflows gRPC).
MAX_SESSION_TTL = 86400.0
MAX_GRACE_PERIOD = 3600.0
# The longest a stopped warm-restart service's files are kept from others' sweeps.
MAX_WARM_KEEP = 86400.0
MAX_MESSAGE_BYTES = 2**31 - 1

# Server settings parsed other than by the type of their default.
_PARSERS: dict[str, Callable[[Any, Any, str], Any]] = {
    "socket_mode": file_mode,
    "shm_mode": lambda v, d, w: None if v is None or v == "" else file_mode(v, 0, w),
    # "auto": the derived cap of quotas.Quota.of (None).
    "max_session_locked_tokens": lambda v, d, w: None if v == "auto" else coerce(v, 0, w),
    "kv_events": parse_kv_events,
    "tenants": parse_tenants,
    "tier": parse_tier,
    "retention": parse_retention,
    "disk": parse_disk,
}


def build_server_config(settings: Mapping[str, Any]) -> ServerConfig:
    names = tuple(f.name for f in fields(ServerConfig))
    reject_unknown(settings, names, "server")
    base = ServerConfig()
    values = {
        name: _PARSERS.get(name, coerce)(settings[name], getattr(base, name), f"server.{name}")
        for name in settings
    }
    cfg = replace(base, **values)
    where = "server"
    if not (cfg.listen.startswith("unix:") or is_host_port(cfg.listen)):
        raise ConfigError(f"{where}.listen: expected unix:PATH or HOST:PORT, got {cfg.listen!r}")
    if not -1 <= cfg.metrics_port <= 65535:
        raise ConfigError(f"{where}.metrics_port: must be -1 (off), 0 (any) or a port")
    if (cfg.tls_cert is None) != (cfg.tls_key is None):
        raise ConfigError(f"{where}.tls_cert: tls_cert and tls_key go together")
    if cfg.tls_client_ca and not cfg.tls_cert:
        raise ConfigError(f"{where}.tls_client_ca: mutual TLS needs tls_cert and tls_key")
    if cfg.tls_cert and cfg.listen.startswith("unix:"):
        raise ConfigError(f"{where}.tls_cert: TLS applies to TCP listeners, not {cfg.listen}")
    # nan compares false and inf passes a ">= 0": either would slip through a range check.
    for name in ("session_ttl_min", "session_ttl", "session_ttl_max", "grace_period"):
        if not math.isfinite(getattr(cfg, name)):
            raise ConfigError(
                f"{where}.{name}: must be a finite number of seconds, got {getattr(cfg, name)}"
            )
    if not 0 < cfg.session_ttl_min <= cfg.session_ttl <= cfg.session_ttl_max:
        raise ConfigError(
            f"{where}.session_ttl: need 0 < session_ttl_min <= session_ttl <= session_ttl_max"
        )
    if not cfg.session_ttl_max <= MAX_SESSION_TTL:
        raise ConfigError(
            f"{where}.session_ttl_max: at most {MAX_SESSION_TTL:g} seconds "
            f"(a lease outlives a crashed worker), got {cfg.session_ttl_max}"
        )
    if not 0 <= cfg.grace_period <= MAX_GRACE_PERIOD:
        raise ConfigError(
            f"{where}.grace_period: seconds in [0, {MAX_GRACE_PERIOD:g}], got {cfg.grace_period}"
        )
    if not 1024 <= cfg.max_message_bytes <= MAX_MESSAGE_BYTES:
        raise ConfigError(
            f"{where}.max_message_bytes: must be in [1024, {MAX_MESSAGE_BYTES}]"
            f" (gRPC's limit is a signed 32-bit int), got {cfg.max_message_bytes}"
        )
    if cfg.log_format not in LOG_FORMATS:
        raise ConfigError(f"{where}.log_format: one of {', '.join(LOG_FORMATS)}")
    if cfg.log_level not in LOG_LEVELS:
        raise ConfigError(f"{where}.log_level: one of {', '.join(LOG_LEVELS)}")
    if not 0 <= cfg.socket_mode <= 0o777:
        raise ConfigError(f"{where}.socket_mode: must be a file mode such as 0o600")
    if cfg.socket_mode & 0o600 != 0o600:  # the service's own workers must connect and map
        raise ConfigError(
            f"{where}.socket_mode: must let the owner read and write "
            f"(0o600 bits), got {cfg.socket_mode:#o}"
        )
    if cfg.shm_mode is not None and (
        not 0 <= cfg.shm_mode <= 0o777 or cfg.shm_mode & 0o600 != 0o600
    ):
        raise ConfigError(
            f"{where}.shm_mode: a file mode with the owner's read and write "
            f"bits (0o600), got {cfg.shm_mode:#o}"
        )
    _check_limits(cfg, where)
    check_int(cfg.change_log_capacity, f"{where}.change_log_capacity", 0)
    if cfg.shm_dir.lower() == "off":
        cfg = replace(cfg, shm_dir="")
    if not (math.isfinite(cfg.warm_checkpoint_interval) and cfg.warm_checkpoint_interval >= 0):
        raise ConfigError(
            f"{where}.warm_checkpoint_interval: seconds >= 0 (0: no "
            f"checkpoints), got {cfg.warm_checkpoint_interval}"
        )
    check_int(cfg.warm_checkpoint_max_bytes, f"{where}.warm_checkpoint_max_bytes", 0)
    if not 0 < cfg.warm_keep <= MAX_WARM_KEEP:
        raise ConfigError(
            f"{where}.warm_keep: seconds in (0, {MAX_WARM_KEEP:g}], got {cfg.warm_keep}"
        )
    if cfg.warm_restart and not cfg.shm_dir:
        raise ConfigError(
            f"{where}.warm_restart: needs shm_dir, where the pools outlive "
            "the process (they are private memory with shm_dir off)"
        )
    token = read_secret(cfg.token, cfg.token_file, f"{where}.token_file")
    admin = read_secret(cfg.admin_token, cfg.admin_token_file, f"{where}.admin_token_file")
    check_tenant_tokens(cfg.tenants, (token, admin), f"{where}.tenants")
    check_kv_events_tenants(cfg.kv_events, cfg.tenants, f"{where}.kv_events")
    metrics_token = read_secret(
        cfg.metrics_token, cfg.metrics_token_file, f"{where}.metrics_token_file"
    )
    return replace(cfg, token=token, admin_token=admin, metrics_token=metrics_token)


_LIMIT_INTS = {
    "min_chunk_bytes": 1,
    "max_read_bytes": 0,
    "max_inflight_write_bytes": 1,
    "max_inflight_write_bytes_total": 1,
    "max_evict_tokens": 0,
    "max_extra_key_bytes": 1,
    "max_client_name_bytes": 1,
    "max_session_id_bytes": 1,
    "max_request_tokens": 0,
    "max_sessions": 1,
    "max_sessions_per_client": 0,
    "max_step_items": 1,
    "max_step_bytes": 0,
    "max_request_bytes": 0,
    "log_queue_lines": 1,
    "max_session_slots": 0,
    "max_session_state_slots": 0,
    "max_session_locked_tokens": 0,
    "max_session_streams": 1,
    "max_subscribe_streams": 1,
    "max_session_subscribes": 1,
    "max_subscribes_per_client": 0,
    "max_subscriber_pending_bytes": 0,
}
_LIMIT_SECONDS = (
    "stream_ttl",
    "evict_interval",
    "keepalive_time",
    "keepalive_timeout",
    "keepalive_min_client_interval",
)


def _check_limits(cfg: ServerConfig, where: str) -> None:
    """The limits block of ServerConfig: counts and sizes >= their minimum, durations
    finite and positive (a nan or inf would turn a limit off unnoticed)."""
    for name, minimum in _LIMIT_INTS.items():
        if getattr(cfg, name) is not None:  # None: a derived default
            check_int(getattr(cfg, name), f"{where}.{name}", minimum)
    for name in _LIMIT_SECONDS:
        value = getattr(cfg, name)
        if not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"{where}.{name}: must be a positive number of seconds, got {value}")


def build_model_config(entry: Any, where: str) -> ModelConfig:
    data = dict(as_mapping(entry, where))
    names = tuple(f.name for f in fields(ModelConfig))
    reject_unknown(data, names, where)
    if not isinstance(data.get("name"), str) or not data["name"]:
        raise ConfigError(f"{where}.name: required, a non-empty string")
    pool = _pool_config(data.pop("pool", {}) or {}, f"{where}.pool")
    mamba = data.pop("mamba", None)
    mamba = None if mamba is None else _mamba_config(mamba, f"{where}.mamba")
    model = ModelConfig(name=data["name"], pool=pool, mamba=mamba)
    for name, value in data.items():
        if name == "name":
            continue
        default = getattr(model, name)
        if name == "sliding_window_size":
            if value is None:
                continue
            default = 0
        model = replace(model, **{name: coerce(value, default, f"{where}.{name}")})
    check_int(model.page_size, f"{where}.page_size", 1)
    check_int(model.vocab_size, f"{where}.vocab_size", 0)
    if not isinstance(model.tokenizer, str):
        raise ConfigError(
            f"{where}.tokenizer: a string naming the tokenizer, got {model.tokenizer!r}"
        )
    if model.kind not in CACHE_KINDS:
        raise ConfigError(f"{where}.kind: one of {', '.join(CACHE_KINDS)}, got {model.kind!r}")
    if model.kind == "swa":
        if not model.sliding_window_size:
            raise ConfigError(f"{where}.sliding_window_size: required for kind swa")
        check_int(model.sliding_window_size, f"{where}.sliding_window_size", 1)
    elif model.sliding_window_size:
        raise ConfigError(f"{where}.sliding_window_size: only for kind swa")
    if model.kind == "slot":
        check_int(model.max_seq_len, f"{where}.max_seq_len", 1)
        if model.page_size != 1:
            raise ConfigError(f"{where}.page_size: kind slot keeps whole sequences (page 1)")
        if model.pool.mla:
            raise ConfigError(f"{where}.pool.mla: not for kind slot")
    elif model.max_seq_len:
        raise ConfigError(f"{where}.max_seq_len: only for kind slot")
    if model.kind == "mamba":
        if model.mamba is None:
            model = replace(model, mamba=MambaConfig())
        if model.eviction_policy != "lru":
            raise ConfigError(f"{where}.eviction_policy: kind mamba evicts in lru order only")
    elif model.mamba is not None:
        raise ConfigError(f"{where}.mamba: only for kind mamba")
    # Imported here: loading the cache loads torch, and every `prefixcache` command
    # (health, stats: client-side) reads the config's types through this package.
    from prefixcache.cache.eviction import EVICTION_POLICIES

    if model.eviction_policy not in EVICTION_POLICIES:
        raise ConfigError(f"{where}.eviction_policy: one of {', '.join(EVICTION_POLICIES)}")
    if pool.size < model.page_size:
        raise ConfigError(f"{where}.pool.size: smaller than one page ({model.page_size})")
    return model


# The blocks of plain fields that _block builds.
_Block = TypeVar("_Block", MambaConfig, PoolConfig)


def _block(
    entry: Any, where: str, cls: type[_Block], convert: Callable[[str, Any, Any], Any]
) -> _Block:
    """``cls``'s defaults with the keys of mapping ``entry`` set, each value converted by
    ``convert(name, value, default)``; a key that is no field of ``cls`` is refused."""
    data = dict(as_mapping(entry, where))
    reject_unknown(data, tuple(f.name for f in fields(cls)), where)
    block = cls()
    return replace(
        block, **{name: convert(name, value, getattr(block, name)) for name, value in data.items()}
    )


def _mamba_config(entry: Any, where: str) -> MambaConfig:
    def convert(name: str, value: Any, default: Any) -> Any:
        if isinstance(default, tuple):
            if (
                not isinstance(value, list | tuple)
                or not value
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)
            ):
                raise ConfigError(f"{where}.{name}: a list of positive ints, got {value!r}")
            return tuple(value)
        return coerce(value, default, f"{where}.{name}")

    mamba = _block(entry, where, MambaConfig, convert)
    for name in ("state_slots", "layers", "chunk_size"):
        check_int(getattr(mamba, name), f"{where}.{name}", 1)
    check_int(mamba.working_slots, f"{where}.working_slots", 0)
    for name in ("dtype", "temporal_dtype"):
        if getattr(mamba, name) not in DTYPES:
            raise ConfigError(f"{where}.{name}: one of {', '.join(DTYPES)}")
    return mamba


def _pool_config(entry: Any, where: str) -> PoolConfig:
    def convert(name: str, value: Any, default: Any) -> Any:
        if name in ("v_heads", "v_head_dim", "swa_size"):
            if value is None:
                return None  # their default: unset
            default = 0
        return coerce(value, default, f"{where}.{name}")

    pool = _block(entry, where, PoolConfig, convert)
    for name in ("size", "layers", "k_heads", "k_head_dim"):
        check_int(getattr(pool, name), f"{where}.{name}", 1)
    for name in ("v_heads", "v_head_dim", "swa_size"):
        if getattr(pool, name) is not None:
            check_int(getattr(pool, name), f"{where}.{name}", 1)
    if pool.mla and (pool.v_heads is not None or pool.v_head_dim is not None):
        raise ConfigError(f"{where}.mla: an MLA pool has no V; leave v_heads and v_head_dim unset")
    if pool.dtype not in DTYPES:
        raise ConfigError(f"{where}.dtype: one of {', '.join(DTYPES)}, got {pool.dtype!r}")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", pool.device):
        raise ConfigError(f"{where}.device: 'cpu' or 'cuda[:N]', got {pool.device!r}")
    return pool
