"""vLLM's ``kv_role``: which of loading and saving this instance does.

Disaggregated prefill runs a prefill instance and a decode instance of one model: the
prefill instance (``kv_producer``) computes each prompt and saves it, and never loads;
the decode instance (``kv_consumer``) loads the prompt the producer saved, and never
saves (the KV it computes itself stays vLLM's own); ``kv_both`` does both. Through one
sidecar (or sidecars sharing the Mooncake tier) the decode instance's request for a
prompt the producer just computed is then a hit of every whole block.

The producer orders its saves (``KVRole.orders_saves``): a request's save is inserted
before vLLM lets its output go, so that a proxy which sends the request to the consumer
once the producer answered finds the prompt cached (``scheduler.py``,
"Prefill/decode").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .config import ConnectorConfig

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
    error, not silently overridden."""
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
    return config
