"""``server.kv_events``: the KV events publisher's settings and where they come from."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from .values import ENV_PREFIX, ConfigError, as_mapping, check_int, coerce, reject_unknown

# ----------------------------------------------------------------- server.kv_events
# KV events out: what a model's tree caches, published over ZMQ as vLLM and SGLang do,
# for cache-aware routers (llm-d, Dynamo, Mooncake Conductor, SGLang's router). The
# names are vLLM's --kv-events-config keys, plus hash_format and encoding. Per key, the
# CLI's --kv-events-config JSON wins over PREFIXCACHE_KV_EVENTS_<KEY>, which wins over
# PREFIXCACHE_KV_EVENTS (JSON), which wins over the YAML section server.kv_events.

KV_EVENTS_ENV = ENV_PREFIX + "KV_EVENTS_"
KV_EVENTS_PUBLISHERS = ("zmq", "null")
KV_EVENTS_HASH_FORMATS = ("vllm", "sglang")
KV_EVENTS_ENCODINGS = ("map", "array")
# What the events show of tenants' namespaces (server.tenants): "refuse" (the default)
# fails the start when tenants are configured; "hashed" publishes hashed namespace
# names and no token ids; "all" publishes everything, an explicit opt-in.
KV_EVENTS_TENANT_POLICIES = ("refuse", "hashed", "all")
_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")
MIN_KEY_BYTES = 32


@dataclass(frozen=True, slots=True)
class KvEventsConfig:
    """``server.kv_events``: one ZMQ publisher per model (server/kv_events.py)."""

    enable_kv_cache_events: bool = False
    # "zmq", or "null" (enabled but publishing nothing, as vLLM allows).
    publisher: str = "zmq"
    # Bound when it holds "*" or "::" or is ipc:// or inproc://, else connected to (a
    # central indexer that binds). Model i of the config gets TCP port + i.
    endpoint: str = "tcp://*:5557"
    # ROUTER socket for replays; model i gets port + i here too. None: no replay.
    replay_endpoint: str | None = None
    # "" means kv@{host}:{port}@{model}; {host}, {port} and {model} are filled in.
    topic: str = ""
    # Batches kept for replay.
    buffer_steps: int = 10_000
    # Replay answers in flight, in total and per requester (ZMQ identity); a request
    # over either cap is refused with a "busy" end marker (events/replay.py).
    max_replays: int = 16
    max_replays_per_peer: int = 2
    # Seconds a replay answer may wait on a requester that reads nothing; then dropped.
    replay_timeout: float = 10.0
    # Batches ZMQ queues per subscriber; past it that subscriber's copy is dropped (it
    # sees a seq gap and replays), never waited on. It bounds what a stuck subscriber
    # pins: hwm batches. vLLM's default is 100,000 (+165 MiB for one stopped peer).
    hwm: int = 1000
    # Accepted for vLLM compatibility; there is no queue (batches go out on the loop).
    max_queue_size: int = 100_000
    # "vllm": the page hash's low 64 bits, unsigned; "sglang": its first 8 bytes, signed.
    hash_format: str = "vllm"
    # "map": events are maps tagged with "type"; "array": the legacy positional arrays.
    encoding: str = "map"
    # Events go to any ZMQ subscriber, unauthenticated. With server.tenants set they
    # would show every tenant's token ids and namespaces: "refuse" (the default) fails
    # the start; "hashed": token_ids empty and lora_name a hash of the namespace, in
    # every namespace; "all": publish everything (trusted network only).
    tenants: str = "refuse"
    # With "hashed": a file of at least 32 random bytes, the key of the published block
    # hashes and namespace names (HMAC-SHA256), the same on every node; routers that
    # compute hashes from tokens read it too. None: a random key per start.
    hash_key_file: str | None = None


def kv_events_settings(
    server: Any, env: Mapping[str, str], overrides: Mapping[str, Any]
) -> dict[str, Any]:
    """The ``server.kv_events`` keys from every source, merged key by key."""
    merged: dict[str, Any] = {}
    section = (server or {}).get("kv_events") if isinstance(server, Mapping) else None
    if section is not None:
        merged.update(as_mapping(section, "server.kv_events"))
    if env.get(ENV_PREFIX + "KV_EVENTS"):
        merged.update(_kv_events_json(env[ENV_PREFIX + "KV_EVENTS"], ENV_PREFIX + "KV_EVENTS"))
    for f in fields(KvEventsConfig):
        value = env.get(KV_EVENTS_ENV + f.name.upper())
        if value is not None and value != "":
            merged[f.name] = value
    if overrides.get("kv_events"):
        merged.update(_kv_events_json(overrides["kv_events"], "--kv-events-config"))
    return merged


def _kv_events_json(value: Any, where: str) -> Mapping[str, Any]:
    if isinstance(value, Mapping):
        return value
    import json

    try:
        data = json.loads(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: not a JSON object: {exc}") from None
    return as_mapping(data, where)


def parse_kv_events(value: Any, default: Any, where: str) -> KvEventsConfig:
    data = dict(as_mapping(value, where))
    reject_unknown(data, tuple(f.name for f in fields(KvEventsConfig)), where)
    cfg = KvEventsConfig()
    for name, item in data.items():
        base = getattr(cfg, name)
        if name in ("replay_endpoint", "hash_key_file"):
            if item is None or item == "":
                continue
            base = ""
        cfg = replace(cfg, **{name: coerce(item, base, f"{where}.{name}")})
    choices = {
        "publisher": KV_EVENTS_PUBLISHERS,
        "hash_format": KV_EVENTS_HASH_FORMATS,
        "encoding": KV_EVENTS_ENCODINGS,
        "tenants": KV_EVENTS_TENANT_POLICIES,
    }
    for name, allowed in choices.items():
        if getattr(cfg, name) not in allowed:
            raise ConfigError(
                f"{where}.{name}: one of {', '.join(allowed)}, got {getattr(cfg, name)!r}"
            )
    for name in ("endpoint", "replay_endpoint"):
        endpoint = getattr(cfg, name)
        if endpoint is not None and not endpoint.startswith(_ZMQ_SCHEMES):
            raise ConfigError(
                f"{where}.{name}: a ZMQ endpoint (tcp://, ipc:// or inproc://), got {endpoint!r}"
            )
    check_int(cfg.buffer_steps, f"{where}.buffer_steps", 1)
    check_int(cfg.hwm, f"{where}.hwm", 1)  # 0 is unbounded in ZMQ: a stuck peer would pin all
    check_int(cfg.max_queue_size, f"{where}.max_queue_size", 0)
    check_int(cfg.max_replays, f"{where}.max_replays", 1)
    check_int(cfg.max_replays_per_peer, f"{where}.max_replays_per_peer", 1)
    if not 0 < cfg.replay_timeout <= 3600:  # nan and inf fail this too
        raise ConfigError(f"{where}.replay_timeout: seconds in (0, 3600], got {cfg.replay_timeout}")
    if cfg.enable_kv_cache_events and cfg.replay_endpoint == cfg.endpoint:
        raise ConfigError(f"{where}.replay_endpoint: must differ from endpoint")
    if cfg.hash_key_file is not None:
        if cfg.tenants != "hashed":
            raise ConfigError(
                f"{where}.hash_key_file: keys hashed events only (tenants: "
                f"hashed); with tenants: {cfg.tenants} the token ids are "
                "published, so there is nothing to key"
            )
        read_key(cfg.hash_key_file, f"{where}.hash_key_file")
    return cfg


def read_key(path: str, where: str) -> bytes:
    """A key file's bytes (all of them, a trailing newline too).

    Raises:
        ConfigError: unreadable, or shorter than ``MIN_KEY_BYTES``.
    """
    try:
        with open(path, "rb") as fh:
            key = fh.read(1 << 16)
    except OSError as exc:
        raise ConfigError(f"{where}: {path}: {exc.strerror or exc}") from exc
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(
            f"{where}: {path} holds {len(key)} bytes, a key has at least "
            f"{MIN_KEY_BYTES} random ones (`head -c 32 /dev/urandom > {path}`)"
        )
    return key


def check_kv_events_tenants(cfg: KvEventsConfig, tenants: Any, where: str) -> None:
    """Refuse to publish tenants' prompts by accident: with ``server.tenants`` set and
    events on, ``kv_events.tenants`` must say ``hashed`` or ``all``.

    Raises:
        ConfigError: tenants are configured and the policy is ``refuse``.
    """
    if not tenants or not cfg.enable_kv_cache_events or cfg.publisher == "null":
        return
    if cfg.tenants == "refuse":
        raise ConfigError(
            f"{where}.tenants: server.tenants is set, and KV events go to any ZMQ "
            "subscriber unauthenticated, with every tenant's token_ids and namespace; "
            "set it to 'hashed' (no token ids, hashed namespace names) or 'all' "
            "(publish everything, on a trusted network only)"
        )
