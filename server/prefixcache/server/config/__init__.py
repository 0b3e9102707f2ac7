"""Service configuration: models and server settings from YAML, env and the CLI.

Precedence is CLI > environment (``PREFIXCACHE_<SETTING>``) > YAML > built-in default.
Every value is checked once, here, and an error names the field it is about
(``models[1].page_size: ...``), so a bad config fails at start with exit code 2 rather
than at the first request.

The config is split by concept: config/types.py (the dataclasses), config/values.py
(value parsing, ConfigError), config/env.py (environment variables), config/checks.py
(the server section, its limits and the models), config/kv_events.py and
config/tenants.py (those server blocks). Every public name stays importable from here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from .checks import (
    LOG_FORMATS,
    LOG_LEVELS,
    MAX_GRACE_PERIOD,
    MAX_MESSAGE_BYTES,
    MAX_SESSION_TTL,
    MAX_WARM_KEEP,
    build_model_config,
    build_server_config,
)
from .env import ENV_OTHER, server_env_settings, unknown_env_warning
from .kv_events import (
    KV_EVENTS_ENCODINGS,
    KV_EVENTS_ENV,
    KV_EVENTS_HASH_FORMATS,
    KV_EVENTS_PUBLISHERS,
    KvEventsConfig,
    kv_events_settings,
)
from .retention import RetentionConfig
from .tenants import TenantConfig
from .types import CACHE_KINDS, DTYPES, Config, MambaConfig, ModelConfig, PoolConfig, ServerConfig
from .values import ENV_PREFIX, ConfigError, as_mapping, reject_unknown

__all__ = [
    "CACHE_KINDS",
    "DEFAULT_MODELS",
    "DTYPES",
    "ENV_OTHER",
    "ENV_PREFIX",
    "KV_EVENTS_ENCODINGS",
    "KV_EVENTS_ENV",
    "KV_EVENTS_HASH_FORMATS",
    "KV_EVENTS_PUBLISHERS",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "MAX_GRACE_PERIOD",
    "MAX_MESSAGE_BYTES",
    "MAX_SESSION_TTL",
    "MAX_WARM_KEEP",
    "Config",
    "ConfigError",
    "KvEventsConfig",
    "MambaConfig",
    "ModelConfig",
    "PoolConfig",
    "RetentionConfig",
    "ServerConfig",
    "TenantConfig",
    "load_config",
    "unknown_env_warning",
]

# A fresh machine has no config: one small CPU model so `prefixcache serve` just works.
DEFAULT_MODELS: tuple[ModelConfig, ...] = (
    ModelConfig(name="default", kind="radix", page_size=16, pool=PoolConfig()),
)


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build the config from a YAML file (or the default), then env, then CLI overrides.

    Args:
        path: YAML file with optional ``server:`` and ``models:`` sections.
        env: Environment to read ``PREFIXCACHE_*`` settings from (default os.environ).
        overrides: Server settings from the command line; None values are ignored.

    Raises:
        ConfigError: naming the offending field.
    """
    env = os.environ if env is None else env
    raw: dict[str, Any] = {}
    if path is None and env.get(ENV_PREFIX + "CONFIG"):
        path = env[ENV_PREFIX + "CONFIG"]
    if path is not None:
        raw = _read_yaml(Path(path))
    reject_unknown(raw, ("server", "models"), "")

    settings = dict(as_mapping(raw.get("server") or {}, "server"))
    settings.update(server_env_settings(env))
    settings.update({k: v for k, v in (overrides or {}).items() if v is not None})
    settings["kv_events"] = kv_events_settings(raw.get("server"), env, overrides or {})
    server = build_server_config(settings)

    if "models" in raw:
        entries = raw["models"]
        if not isinstance(entries, list) or not entries:
            raise ConfigError("models: must be a non-empty list")
        models = tuple(build_model_config(e, f"models[{i}]") for i, e in enumerate(entries))
    else:
        models = DEFAULT_MODELS
    names = [m.name for m in models]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(f"models[{i}].name: {name!r} is used twice")
    return Config(server, models)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path}: not valid YAML: {exc}") from exc
    return dict(as_mapping(data or {}, "config"))
