"""Service configuration: models and server settings from YAML, env and the CLI.

Precedence is CLI > environment (``PREFIXCACHE_<SETTING>``) > YAML > built-in default.
Every value is checked once, here, and an error names the field it is about
(``models[1].page_size: ...``), so a bad config fails at start with exit code 2 rather
than at the first request.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from prefixcache.cache import EVICTION_POLICIES

CACHE_KINDS = ("radix", "swa", "mamba", "slot", "chunk")
DTYPES = ("float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2", "uint8")
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
ENV_PREFIX = "PREFIXCACHE_"


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """Shape of a model's KV pool: ``size`` token slots of per-layer K and V rows."""

    size: int = 16384
    layers: int = 1
    k_heads: int = 2
    k_head_dim: int = 64
    v_heads: int | None = None
    v_head_dim: int | None = None
    dtype: str = "float16"
    device: str = "cpu"
    # SWA models only: slots of the sliding-window pool (defaults to ``size``).
    swa_size: int | None = None


@dataclass(frozen=True, slots=True)
class MambaConfig:
    """The Mamba state pool of a hybrid model (kind ``mamba``)."""

    # Slots that tree nodes and sessions hold (snapshots of the state after a prefix).
    state_slots: int = 256
    # Per-request working slots for attached workers; the service does not track them.
    working_slots: int = 0
    layers: int = 1
    conv_state_shape: tuple[int, ...] = (4, 3)
    temporal_state_shape: tuple[int, ...] = (1, 4, 4)
    dtype: str = "float16"
    temporal_dtype: str = "float32"
    # mamba_branching_seqlen is rounded down to a multiple of this.
    chunk_size: int = 1


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """One hosted model: its cache kind, paging, eviction and pool."""

    name: str
    kind: str = "radix"
    page_size: int = 1
    sliding_window_size: int | None = None
    eviction_policy: str = "lru"
    # Token ids must be below this; 0 accepts any uint32.
    vocab_size: int = 0
    pool: PoolConfig = field(default_factory=PoolConfig)
    # Kind mamba only.
    mamba: MambaConfig | None = None
    # Kind slot only: positions per sequence slot (``pool.size`` is the slot count).
    max_seq_len: int = 0


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """How the service listens, authenticates, logs and manages sessions."""

    listen: str = "unix:/tmp/prefixcache.sock"
    # Octal mode of the unix socket file; 0o600 keeps other users out.
    socket_mode: int = 0o600
    metrics_host: str = "0.0.0.0"
    # 0 picks a free port (logged at start); -1 turns the metrics endpoint off.
    metrics_port: int = 9470
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    # TCP without TLS sends tokens in clear text, so it must be asked for by name.
    insecure: bool = False
    token: str | None = None
    token_file: str | None = None
    admin_token: str | None = None
    admin_token_file: str | None = None
    session_ttl: float = 30.0
    session_ttl_min: float = 1.0
    session_ttl_max: float = 600.0
    grace_period: float = 10.0
    max_message_bytes: int = 64 * 1024 * 1024
    # CPU pools live in shared-memory files here, so workers on this host can map them
    # (DescribePool); "" or "off" keeps them private (ReadKV / WriteKV still work).
    shm_dir: str = "/dev/shm"
    log_format: str = "text"
    log_level: str = "info"
    # Invariant mode (staging): check the caches' integrity after every mutating call;
    # a failure answers INTERNAL and is logged.
    check_integrity: bool = False


@dataclass(frozen=True, slots=True)
class Config:
    """Everything the service needs to start."""

    server: ServerConfig
    models: tuple[ModelConfig, ...]


# A fresh machine has no config: one small CPU model so `prefixcache serve` just works.
DEFAULT_MODELS: tuple[ModelConfig, ...] = (
    ModelConfig(name="default", kind="radix", page_size=16, pool=PoolConfig()),
)


def load_config(path: str | os.PathLike[str] | None = None,
                env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> Config:
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
    _reject_unknown(raw, ("server", "models"), "")

    settings = dict(_mapping(raw.get("server") or {}, "server"))
    for f in fields(ServerConfig):
        value = env.get(ENV_PREFIX + f.name.upper())
        if value is not None and value != "":
            settings[f.name] = value
    settings.update({k: v for k, v in (overrides or {}).items() if v is not None})
    server = _server_config(settings)

    if "models" in raw:
        entries = raw["models"]
        if not isinstance(entries, list) or not entries:
            raise ConfigError("models: must be a non-empty list")
        models = tuple(_model_config(e, f"models[{i}]") for i, e in enumerate(entries))
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
    return dict(_mapping(data or {}, "config"))


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: must be a mapping, got {type(value).__name__}")
    return value


def _reject_unknown(data: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    for key in data:
        if key not in known:
            prefix = f"{where}." if where else ""
            raise ConfigError(f"{prefix}{key}: unknown setting (known: {', '.join(known)})")


def _server_config(settings: Mapping[str, Any]) -> ServerConfig:
    names = tuple(f.name for f in fields(ServerConfig))
    _reject_unknown(settings, names, "server")
    base = ServerConfig()
    values = {name: _coerce(settings[name], getattr(base, name), f"server.{name}")
              for name in settings}
    cfg = replace(base, **values)
    where = "server"
    if not (cfg.listen.startswith("unix:") or _host_port(cfg.listen)):
        raise ConfigError(f"{where}.listen: expected unix:PATH or HOST:PORT, got {cfg.listen!r}")
    if not -1 <= cfg.metrics_port <= 65535:
        raise ConfigError(f"{where}.metrics_port: must be -1 (off), 0 (any) or a port")
    if (cfg.tls_cert is None) != (cfg.tls_key is None):
        raise ConfigError(f"{where}.tls_cert: tls_cert and tls_key go together")
    if cfg.tls_client_ca and not cfg.tls_cert:
        raise ConfigError(f"{where}.tls_client_ca: mutual TLS needs tls_cert and tls_key")
    if cfg.tls_cert and cfg.listen.startswith("unix:"):
        raise ConfigError(f"{where}.tls_cert: TLS applies to TCP listeners, not {cfg.listen}")
    if not 0 < cfg.session_ttl_min <= cfg.session_ttl <= cfg.session_ttl_max:
        raise ConfigError(f"{where}.session_ttl: need 0 < session_ttl_min <= session_ttl "
                          f"<= session_ttl_max")
    if cfg.grace_period < 0:
        raise ConfigError(f"{where}.grace_period: must be >= 0")
    if cfg.max_message_bytes < 1024:
        raise ConfigError(f"{where}.max_message_bytes: must be >= 1024")
    if cfg.log_format not in LOG_FORMATS:
        raise ConfigError(f"{where}.log_format: one of {', '.join(LOG_FORMATS)}")
    if cfg.log_level not in LOG_LEVELS:
        raise ConfigError(f"{where}.log_level: one of {', '.join(LOG_LEVELS)}")
    if not 0 <= cfg.socket_mode <= 0o777:
        raise ConfigError(f"{where}.socket_mode: must be a file mode such as 0o600")
    if cfg.shm_dir.lower() == "off":
        cfg = replace(cfg, shm_dir="")
    token = _secret(cfg.token, cfg.token_file, f"{where}.token_file")
    admin = _secret(cfg.admin_token, cfg.admin_token_file, f"{where}.admin_token_file")
    return replace(cfg, token=token, admin_token=admin)


def _secret(value: str | None, path: str | None, where: str) -> str | None:
    if value:
        return value
    if not path:
        return None
    try:
        secret = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{where}: {exc.strerror or exc}") from exc
    if not secret:
        raise ConfigError(f"{where}: {path} is empty")
    return secret


def _host_port(listen: str) -> bool:
    host, sep, port = listen.rpartition(":")
    return bool(sep and host and port.isdigit() and int(port) <= 65535)


def _coerce(value: Any, default: Any, where: str) -> Any:
    """``value`` as the type of ``default`` (env and CLI values arrive as strings)."""
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0",
                                                        "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value, 0)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if isinstance(default, float):
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if value is None or isinstance(value, str):
        return value
    raise ConfigError(f"{where}: expected a string, got {value!r}")


def _model_config(entry: Any, where: str) -> ModelConfig:
    data = dict(_mapping(entry, where))
    names = tuple(f.name for f in fields(ModelConfig))
    _reject_unknown(data, names, where)
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
        model = replace(model, **{name: _coerce(value, default, f"{where}.{name}")})
    _check_int(model.page_size, f"{where}.page_size", 1)
    _check_int(model.vocab_size, f"{where}.vocab_size", 0)
    if model.kind not in CACHE_KINDS:
        raise ConfigError(f"{where}.kind: one of {', '.join(CACHE_KINDS)}, got {model.kind!r}")
    if model.kind == "swa":
        if not model.sliding_window_size:
            raise ConfigError(f"{where}.sliding_window_size: required for kind swa")
        _check_int(model.sliding_window_size, f"{where}.sliding_window_size", 1)
    elif model.sliding_window_size:
        raise ConfigError(f"{where}.sliding_window_size: only for kind swa")
    if model.kind == "slot":
        _check_int(model.max_seq_len, f"{where}.max_seq_len", 1)
        if model.page_size != 1:
            raise ConfigError(f"{where}.page_size: kind slot keeps whole sequences (page 1)")
    elif model.max_seq_len:
        raise ConfigError(f"{where}.max_seq_len: only for kind slot")
    if model.kind == "mamba":
        if model.mamba is None:
            model = replace(model, mamba=MambaConfig())
        if model.eviction_policy != "lru":
            raise ConfigError(f"{where}.eviction_policy: kind mamba evicts in lru order only")
    elif model.mamba is not None:
        raise ConfigError(f"{where}.mamba: only for kind mamba")
    if model.eviction_policy not in EVICTION_POLICIES:
        raise ConfigError(f"{where}.eviction_policy: one of {', '.join(EVICTION_POLICIES)}")
    if pool.size < model.page_size:
        raise ConfigError(f"{where}.pool.size: smaller than one page ({model.page_size})")
    return model


def _mamba_config(entry: Any, where: str) -> MambaConfig:
    data = dict(_mapping(entry, where))
    _reject_unknown(data, tuple(f.name for f in fields(MambaConfig)), where)
    mamba = MambaConfig()
    for name, value in data.items():
        default = getattr(mamba, name)
        if isinstance(default, tuple):
            if not isinstance(value, list | tuple) or not value or not all(
                    isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value):
                raise ConfigError(f"{where}.{name}: a list of positive ints, got {value!r}")
            value = tuple(value)
        else:
            value = _coerce(value, default, f"{where}.{name}")
        mamba = replace(mamba, **{name: value})
    for name in ("state_slots", "layers", "chunk_size"):
        _check_int(getattr(mamba, name), f"{where}.{name}", 1)
    _check_int(mamba.working_slots, f"{where}.working_slots", 0)
    for name in ("dtype", "temporal_dtype"):
        if getattr(mamba, name) not in DTYPES:
            raise ConfigError(f"{where}.{name}: one of {', '.join(DTYPES)}")
    return mamba


def _pool_config(entry: Any, where: str) -> PoolConfig:
    data = dict(_mapping(entry, where))
    _reject_unknown(data, tuple(f.name for f in fields(PoolConfig)), where)
    pool = PoolConfig()
    for name, value in data.items():
        default = getattr(pool, name)
        if name in ("v_heads", "v_head_dim", "swa_size"):
            if value is None:
                continue
            default = 0
        pool = replace(pool, **{name: _coerce(value, default, f"{where}.{name}")})
    for name in ("size", "layers", "k_heads", "k_head_dim"):
        _check_int(getattr(pool, name), f"{where}.{name}", 1)
    for name in ("v_heads", "v_head_dim", "swa_size"):
        if getattr(pool, name) is not None:
            _check_int(getattr(pool, name), f"{where}.{name}", 1)
    if pool.dtype not in DTYPES:
        raise ConfigError(f"{where}.dtype: one of {', '.join(DTYPES)}, got {pool.dtype!r}")
    if not (pool.device == "cpu" or pool.device.startswith("cuda")):
        raise ConfigError(f"{where}.device: 'cpu' or 'cuda[:N]', got {pool.device!r}")
    return pool


def _check_int(value: int, where: str, minimum: int) -> None:
    if value < minimum:
        raise ConfigError(f"{where}: must be >= {minimum}, got {value}")
