"""The connector's settings, read from vLLM's ``kv_connector_extra_config``, and what
vLLM's ``kv_role`` leaves of them.

Every key is optional but ``model``. An unknown key or a bad value is an error at
start-up, with the key named: a typo must not silently turn the cache off.

Prefill/decode. Disaggregated prefill runs a prefill instance and a decode instance of
one model: the prefill instance (``kv_producer``) computes each prompt and saves it,
and never loads; the decode instance (``kv_consumer``) loads the prompt the producer
saved, and never saves (the KV it computes itself stays vLLM's own); ``kv_both`` does
both. Through one sidecar (or sidecars sharing the Mooncake tier) the decode instance's
request for a prompt the producer just computed is then a hit of every whole block.
The producer orders its saves (``KVRole.orders_saves``): a request's save is inserted
before vLLM lets its output go, so that a proxy which sends the request to the consumer
once the producer answered finds the prompt cached (``scheduler.py``,
"Prefill/decode").
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

SAVE_MODES = ("prompt", "all", "off")
TRANSFERS = ("auto", "attach", "remote")
# "auto": the layout of the attention backend vLLM reports (attn_backends); the others
# force one of layout.KNOWN_LAYOUTS.
LAYOUTS = ("auto", "kv_first", "blocks_first", "bhn2d", "cpu_vec", "cpu_amx", "mla")


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """How the connector reaches the service and what it does.

    Attributes:
        model: the service's model whose pool holds this engine's KV (required).
        target: ``unix:/path`` or ``host:port`` of the service.
        token: bearer token; ``token_env`` names an environment variable holding it
            instead (keeps the secret out of the command line).
        tls, root_certificates, server_name: TLS for a service on another host.
        timeout: deadline of each call to the service, in seconds. A call that misses
            it counts as a miss (lookups) or a skipped save; nothing fails.
        lease_ttl: seconds a reservation (a locked hit) lives without being probed
            again before vLLM allocated blocks for it. vLLM may count a hit and never
            come back for it; the lease releases the lock then.
        session_ttl: the lease of the connector's session with the service; when the
            engine dies, the service releases its locks and slots after this long.
        load: look up and load cached prefixes.
        save: which tokens of a finished request to store: "prompt", "all" (prompt and
            output, for multi-turn chat) or "off".
        transfer: "attach" maps the pool (same host: shared memory or CUDA IPC),
            "remote" streams through ReadKV / WriteKV, "auto" attaches when it can.
        verify_loads: after copying, check with one Match that the tree still maps
            the tokens to the slots copied from (catches a Reset or a lapsed lock).
        kv_layout: vLLM's per-layer KV tensor layout: "auto" takes it from the
            attention backend vLLM reports for each layer (an unknown backend disables
            the connector); a layout name forces that layout (``layout`` lists them).
        max_inflight: calls to the service in flight at once (a thread each).
        fast_miss: follow the service's page set (a Subscribe stream) and answer a
            prompt it holds no block of at once, without a lookup (``scheduler``,
            "Fast misses"); off: every request looks up and waits a step for it.
        layerwise_load: with the engine's KV on a GPU, issue a step's loads layer by
            layer on a stream of their own, each layer's attention waiting (on the GPU)
            for its own layer's copies only (``layerwise.py``); off: every load is
            complete before the forward starts. On the CPU it changes nothing but the
            order of the copies.
    """

    model: str
    target: str = "unix:/tmp/prefixcache.sock"
    token: str | None = None
    token_env: str | None = None
    tls: bool | None = None
    root_certificates: str | None = None
    server_name: str | None = None
    timeout: float = 2.0
    lease_ttl: float = 30.0
    session_ttl: float = 30.0
    load: bool = True
    save: str = "prompt"
    transfer: str = "auto"
    verify_loads: bool = True
    kv_layout: str = "auto"
    max_inflight: int = 16
    fast_miss: bool = True
    layerwise_load: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(
                "kv_connector_extra_config: 'model' (the prefixcache model name) is required"
            )
        for name in ("timeout", "lease_ttl", "session_ttl"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"kv_connector_extra_config: {name!r} must be a number > 0, got {value!r}"
                )
        for name, allowed in (
            ("save", SAVE_MODES),
            ("transfer", TRANSFERS),
            ("kv_layout", LAYOUTS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"kv_connector_extra_config: {name!r} must be one of "
                    f"{', '.join(allowed)}; got {getattr(self, name)!r}"
                )
        if not isinstance(self.max_inflight, int) or self.max_inflight < 1:
            raise ValueError(
                "kv_connector_extra_config: 'max_inflight' must be an "
                f"integer >= 1, got {self.max_inflight!r}"
            )
        for name in ("load", "verify_loads", "fast_miss", "layerwise_load"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"kv_connector_extra_config: {name!r} must be true or "
                    f"false, got {getattr(self, name)!r}"
                )

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """The settings in ``kv_connector_extra_config`` (a JSON object)."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config: unknown key(s) {unknown}; known: {sorted(known)}"
            )
        if "model" not in extra:
            raise ValueError(
                "kv_connector_extra_config: 'model' (the prefixcache model name) is required"
            )
        return cls(**extra)

    def bearer_token(self) -> str | None:
        """The token: given, or read from the ``token_env`` variable."""
        if self.token is not None:
            return self.token
        if self.token_env:
            value = os.environ.get(self.token_env)
            if not value:
                raise ValueError(
                    f"kv_connector_extra_config: token_env {self.token_env!r} is not set"
                )
            return value
        return None

    def client_kwargs(self, name: str) -> dict[str, Any]:
        """Arguments for a prefixcache client of this service."""
        kwargs: dict[str, Any] = {
            "timeout": self.timeout,
            "token": self.bearer_token(),
            "fail_open": True,
            "client_name": name,
        }
        if self.tls is not None:
            kwargs["tls"] = self.tls
        if self.root_certificates:
            kwargs["root_certificates"] = self.root_certificates
        if self.server_name:
            kwargs["server_name"] = self.server_name
        return kwargs


ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True, slots=True)
class KVRole:
    """What an instance of ``name`` does with the service."""

    name: str
    loads: bool
    saves: bool

    @property
    def orders_saves(self) -> bool:
        """Whether a request's save is inserted before its output leaves the engine: a
        producer's consumer asks for the prompt as soon as the producer answered."""
        return self.saves and not self.loads


_ROLES = {
    "kv_producer": KVRole("kv_producer", loads=False, saves=True),
    "kv_consumer": KVRole("kv_consumer", loads=True, saves=False),
    "kv_both": KVRole("kv_both", loads=True, saves=True),
}


def kv_role(value: object) -> KVRole:
    """The role ``kv_transfer_config.kv_role`` names; anything else is an error, so that a
    typo never turns loading or saving off unnoticed."""
    role = _ROLES.get(value) if isinstance(value, str) else None
    if role is None:
        raise ValueError(
            f"kv_transfer_config: 'kv_role' must be one of {', '.join(ROLES)}; got {value!r}"
        )
    return role


def role_config(role: KVRole, extra: Mapping[str, Any] | None) -> ConnectorConfig:
    """The connector's settings (``kv_connector_extra_config``) for ``role``: a producer
    does not load, a consumer does not save. A setting that asks for what the role rules
    out (a producer's ``load: true``, a consumer's ``save`` other than ``off``) is an
    error, not silently overridden. A consumer looks every request up (``fast_miss``
    off unless set): its requests are the prompts a producer saved a moment ago, which
    its shadow index may not show yet."""
    config = ConnectorConfig.from_extra(extra)
    given = dict(extra or {})
    if not role.loads:
        if given.get("load") is True:
            raise ValueError(
                f"kv_connector_extra_config: 'load' is true, but kv_role {role.name!r} "
                "never loads (use kv_both)"
            )
        config = dataclasses.replace(config, load=False)
    if not role.saves:
        if given.get("save", "off") != "off":
            raise ValueError(
                f"kv_connector_extra_config: 'save' is {given['save']!r}, but kv_role "
                f"{role.name!r} never saves (use kv_both)"
            )
        config = dataclasses.replace(config, save="off")
        if "fast_miss" not in given:
            config = dataclasses.replace(config, fast_miss=False)
    return config
