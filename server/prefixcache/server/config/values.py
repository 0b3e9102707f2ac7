"""Parsing one config value: the error type, type coercion and the shared checks.

Env and CLI values arrive as strings and YAML ones as their own types; every section of
the config (config/checks.py, config/kv_events.py, config/tenants.py) reads them here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

ENV_PREFIX = "PREFIXCACHE_"


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""


def as_mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: must be a mapping, got {type(value).__name__}")
    return value


def reject_unknown(data: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    for key in data:
        if key not in known:
            prefix = f"{where}." if where else ""
            raise ConfigError(f"{prefix}{key}: unknown setting (known: {', '.join(known)})")


def check_int(value: int, where: str, minimum: int) -> None:
    if value < minimum:
        raise ConfigError(f"{where}: must be >= {minimum}, got {value}")


def file_mode(value: Any, default: int, where: str) -> int:
    """A file mode. In a string a leading 0 means octal, as chmod and operators write it
    (``PREFIXCACHE_SOCKET_MODE=0660``) and as YAML reads an unquoted 0660; 0o660 works too.
    """
    if isinstance(value, str):
        text = value.strip()
        if len(text) > 1 and text[0] == "0" and text[1:].isdigit():
            try:
                return int(text, 8)
            except ValueError:
                raise ConfigError(f"{where}: {value!r} is not an octal mode") from None
    return coerce(value, default, where)


# Set by files_read_later: where secret files that cannot be read here are noted
# instead of refused (a config checked on another machine than the one it is for).
_UNREAD: ContextVar[list[str] | None] = ContextVar("unread_files", default=None)


@contextmanager
def files_read_later() -> Iterator[list[str]]:
    """Within this block, a secret file that cannot be read is noted in the list
    yielded (and stands for a placeholder token) instead of refusing the config."""
    notes: list[str] = []
    reset = _UNREAD.set(notes)
    try:
        yield notes
    finally:
        _UNREAD.reset(reset)


def note_unread(message: str) -> bool:
    """Within ``files_read_later``, note ``message`` (a file that cannot be read here)
    and return True; elsewhere False: the caller refuses the config."""
    notes = _UNREAD.get()
    if notes is None:
        return False
    notes.append(message)
    return True


def read_secret(value: str | None, path: str | None, where: str) -> str | None:
    if value:
        return value
    if not path:
        return None
    try:
        secret = Path(path).read_text().strip()
    except OSError as exc:
        notes = _UNREAD.get()
        if notes is not None:
            notes.append(f"{where}: cannot read {path}: {exc.strerror or exc}")
            return f"<{path}>"
        raise ConfigError(f"{where}: cannot read {path}: {exc.strerror or exc}") from exc
    if not secret:
        raise ConfigError(f"{where}: {path} is empty")
    return secret


def is_host_port(listen: str) -> bool:
    host, sep, port = listen.rpartition(":")
    return bool(sep and host and port.isdigit() and int(port) <= 65535)


def coerce(value: Any, default: Any, where: str) -> Any:
    """``value`` as the type of ``default`` (env and CLI values arrive as strings)."""
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in (
            "1",
            "true",
            "yes",
            "on",
            "0",
            "false",
            "no",
            "off",
        ):
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
