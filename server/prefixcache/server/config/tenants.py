"""``server.tenants``: tokens bound to extra_key namespaces, and their checks."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from .values import ConfigError, as_mapping, coerce, read_secret, reject_unknown

# ----------------------------------------------------------------- server.tenants
# Tokens bound to extra_key namespaces (tenants.py). In YAML a list of mappings; in
# PREFIXCACHE_TENANTS the same list as JSON.


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """One entry of ``server.tenants``: a bearer token that may use only the
    ``extra_key`` values starting with one of ``namespaces``."""

    name: str
    token: str | None = None
    token_file: str | None = None
    namespaces: tuple[str, ...] = ()


def parse_tenants(value: Any, default: Any, where: str) -> tuple[TenantConfig, ...]:
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value) if value.strip() else []
        except ValueError as exc:
            raise ConfigError(f"{where}: not a JSON list: {exc}") from None
    if isinstance(value, tuple) and all(isinstance(t, TenantConfig) for t in value):
        return value
    if not isinstance(value, list):
        raise ConfigError(f"{where}: a list of tenants, got {type(value).__name__}")
    out: list[TenantConfig] = []
    for i, entry in enumerate(value):
        at = f"{where}[{i}]"
        data = dict(as_mapping(entry, at))
        reject_unknown(data, tuple(f.name for f in fields(TenantConfig)), at)
        name = data.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{at}.name: required, a non-empty string")
        if name in (t.name for t in out):
            raise ConfigError(f"{at}.name: {name!r} is used twice")
        spaces = data.get("namespaces")
        if (
            not isinstance(spaces, list)
            or not spaces
            or not all(isinstance(s, str) for s in spaces)
        ):
            raise ConfigError(f"{at}.namespaces: a non-empty list of extra_key prefixes")
        token = read_secret(
            coerce(data.get("token"), None, f"{at}.token"),
            coerce(data.get("token_file"), None, f"{at}.token_file"),
            f"{at}.token_file",
        )
        if not token:
            raise ConfigError(f"{at}.token: required (token or token_file)")
        out.append(TenantConfig(name, token, data.get("token_file"), tuple(spaces)))
    return tuple(out)


def check_tenant_tokens(
    tenants: tuple[TenantConfig, ...], others: tuple[str | None, ...], where: str
) -> None:
    """A tenant's token names one caller: never shared with another tenant, nor with the
    server's token or admin token (whose callers are bound to no namespace)."""
    seen = {t for t in others if t}
    for i, tenant in enumerate(tenants):
        if tenant.token in seen:
            raise ConfigError(
                f"{where}[{i}].token: the same as another tenant's, the "
                "server token or the admin token"
            )
        seen.add(tenant.token)
