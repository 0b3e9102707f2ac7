"""Limits on what one client may ask of a service that others share.

A sidecar serves every worker of a node, so one careless or hostile client must not take
memory, time or slots from the rest. The limits here are checked as a request is
decoded, before it does any work, and a refusal names the setting that refused it
(``server.max_...``), changes nothing, and counts in ``prefixcache_refusals_total``.

Sizes of string fields are INVALID_ARGUMENT (``TooLargeError``): the request itself is
wrong, and retrying cannot help. Counts (tokens in a request, open sessions) are
RESOURCE_EXHAUSTED (``OverLimitError``), like a pool too full for a request.
"""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig, ServerConfig
from ..errors import OverLimitError, TooLargeError

# The `limit` label values of prefixcache_refusals_total that this module's checks use.
LIMIT_NAMES = (
    "max_extra_key_bytes",
    "max_client_name_bytes",
    "max_session_id_bytes",
    "max_request_tokens",
    "max_sessions",
    "max_sessions_per_client",
    "max_step_items",
    "max_step_bytes",
    # request_caps.py: a request's bytes, checked before it is parsed.
    "max_request_bytes",
    # kv_access.py and evict_policy.py; tenant_namespaces is tenants.py's refusal.
    "max_read_bytes",
    "max_inflight_write_bytes",
    "max_inflight_write_bytes_total",
    "max_evict_tokens",
    "tenant_namespaces",
    # quotas.py: what one session may hold.
    "max_session_slots",
    "max_session_state_slots",
    "max_session_locked_tokens",
    "max_session_streams",
    # reply_caps.py: a reply that could not be sent is refused before the work.
    "max_message_bytes",
    # subscriptions.py: Subscribe streams, and how far behind one may fall.
    "max_subscribe_streams",
    "max_session_subscribes",
    "max_subscribes_per_client",
    "max_subscriber_pending_bytes",
    # turns.py: long calls (Explain, ExistsPages) admitted per client.
    "long_calls_per_client",
)

# String fields with a size limit, by field name: the setting that bounds them.
STRING_LIMITS = {
    "extra_key": "max_extra_key_bytes",
    "client_name": "max_client_name_bytes",
    "session_id": "max_session_id_bytes",
}


# The limits are settings of ``ServerConfig``, declared there once with their defaults
# and meaning; the checks take the server config itself.
Limits = ServerConfig


def limits_of(server: ServerConfig | None = None) -> ServerConfig:
    """The limits of ``server`` (the defaults when None)."""
    return ServerConfig() if server is None else server


def request_tokens(limits: ServerConfig, model: ModelConfig) -> int:
    """Token ids (or slot indices) one request may carry for ``model``: the setting, or
    by default as many as the model's pool holds."""
    return limits.max_request_tokens or max(model.pool.size, model.max_seq_len)


def sessions_required(limits: ServerConfig) -> bool:
    """Whether calls that may go without a session (ExistsPages) must name one: where
    tenants or per-session quotas are configured, every call should be some session's,
    so that its cost can be told apart and bounded."""
    return bool(
        limits.tenants
        or limits.max_session_slots
        or limits.max_session_state_slots
        or limits.max_session_locked_tokens
    )


# Per message type: its string fields that have a limit (found once, from the descriptor).
_LIMITED_FIELDS: dict[str, tuple[tuple[str, str], ...]] = {}


def _limited_fields(message: Any) -> tuple[tuple[str, str], ...]:
    descriptor = message.DESCRIPTOR
    found = _LIMITED_FIELDS.get(descriptor.full_name)
    if found is None:
        found = tuple(
            (name, setting)
            for name, setting in STRING_LIMITS.items()
            if name in descriptor.fields_by_name
        )
        _LIMITED_FIELDS[descriptor.full_name] = found
    return found


def check_fields(message: Any, limits: Limits) -> None:
    """Refuse a message (or the operation a SessionRequest carries) whose ``extra_key``,
    ``client_name`` or ``session_id`` is over its size limit.

    The refusal does not repeat the value: a 1 MiB client name is neither kept nor
    logged, not even in an error message.

    Raises:
        TooLargeError: naming the field and the setting.
    """
    if message.DESCRIPTOR.name == "SessionRequest":
        op = message.WhichOneof("op")
        if op is None:
            return
        message = getattr(message, op)
    for name, setting in _limited_fields(message):
        value = getattr(message, name)
        cap = getattr(limits, setting)
        # Characters first: one UTF-8 byte at least, four at most.
        if len(value) > cap or (len(value) * 4 > cap and len(value.encode()) > cap):
            raise too_large(name, setting, limits)


def too_large(name: str, setting: str, limits: Limits) -> TooLargeError:
    """The refusal of string field ``name`` over ``setting``; it does not repeat the
    value."""
    return TooLargeError(
        f"{name} is longer than {getattr(limits, setting)} bytes, the limit server.{setting}",
        setting,
    )


def check_count(field: str, count: int, cap: int) -> None:
    """Refuse ``count`` token ids or slot indices in one request when over ``cap``.

    Raises:
        OverLimitError: naming ``max_request_tokens``.
    """
    if cap and count > cap:
        raise OverLimitError(
            f"{field} holds {count} entries, more than the {cap} one request may carry "
            "(server.max_request_tokens; by default the model's pool size)",
            "max_request_tokens",
        )


def truncate(text: str, cap: int) -> str:
    """``text`` cut to at most ``cap`` UTF-8 bytes (for names the service does not refuse,
    such as a stream's peer address)."""
    data = text.encode()
    return text if len(data) <= cap else data[:cap].decode(errors="ignore")
