"""Settings from ``PREFIXCACHE_*`` environment variables, and the warning that names
the ones no setting reads."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import fields

from .kv_events import KV_EVENTS_ENV, KvEventsConfig
from .types import ServerConfig
from .values import ENV_PREFIX

# Variables of ours that are no server setting: the config file, and the client's address.
ENV_OTHER = ("CONFIG", "TARGET")


def server_env_settings(env: Mapping[str, str]) -> dict[str, str]:
    """The server settings ``env`` sets (``PREFIXCACHE_<SETTING>``); empty ones are unset."""
    settings: dict[str, str] = {}
    for f in fields(ServerConfig):
        value = env.get(ENV_PREFIX + f.name.upper())
        if value is not None and value != "":
            settings[f.name] = value
    return settings


def unknown_env_warning(env: Mapping[str, str]) -> str | None:
    """One line naming the ``PREFIXCACHE_*`` variables in ``env`` that no setting reads
    (a typo would otherwise be ignored in silence), each with the closest known name."""
    known = [ENV_PREFIX + f.name.upper() for f in fields(ServerConfig)]
    known += [ENV_PREFIX + name for name in ENV_OTHER]
    known += [KV_EVENTS_ENV + f.name.upper() for f in fields(KvEventsConfig)]
    unknown = sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known)
    if not unknown:
        return None
    names = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1)
        names.append(f"{name} (did you mean {close[0]}?)" if close else name)
    return f"ignoring unknown environment variables: {', '.join(names)}"
