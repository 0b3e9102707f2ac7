"""Retention hints on the wire: a request's (or its session's) ``Retention`` as a hint,
what it did as a ``RetentionResult``, and the Retain RPC.

A hint is read, and a malformed one refused, before the call it comes with changes
anything; it is applied once the call has found (or cached) its prefix, owned by the
caller's tenant (tenants.py; None for callers without a tenant's token).
"""

from __future__ import annotations

from typing import Any

from prefixcache.cache.retention import ACCEPTED, CLIPPED, REJECTED
from prefixcache.v1 import prefix_cache_pb2 as pb

from ..access.limits import Limits, request_tokens
from ..access.tenants import CALLER
from ..codec import decode_key
from ..config import RetentionConfig
from ..engine.retention import Grant
from ..service import CacheService
from ..sessions.retention import Hint, granted
from ..sessions.session import Session

_OUTCOMES = {
    ACCEPTED: pb.RETENTION_OUTCOME_ACCEPTED,
    CLIPPED: pb.RETENTION_OUTCOME_CLIPPED,
    REJECTED: pb.RETENTION_OUTCOME_REJECTED,
}


def hint(message: Any, config: RetentionConfig) -> Hint | None:
    """The hint ``message``'s ``retention`` field asks for, None when it has none.

    Raises:
        InvalidInputError: malformed seconds or priority.
    """
    if not message.HasField("retention"):
        return None
    return granted(message.retention.seconds, message.retention.priority, config)


def of_call(message: Any, session: Session | None, config: RetentionConfig) -> Hint | None:
    """A call's hint: its own, else its session's default."""
    own = hint(message, config)
    if own is not None or session is None:
        return own
    return session.retention


def result(grant: Grant) -> pb.RetentionResult:
    return pb.RetentionResult(
        outcome=_OUTCOMES[grant.outcome],
        retained_tokens=grant.tokens,
        seconds=grant.seconds,
        priority=grant.priority,
    )


def of_session(session_hint: Hint) -> pb.RetentionResult:
    """What OpenSession answers for its default: the hint as granted."""
    return pb.RetentionResult(
        outcome=pb.RETENTION_OUTCOME_CLIPPED
        if session_hint.clipped
        else pb.RETENTION_OUTCOME_ACCEPTED,
        seconds=session_hint.seconds,
        priority=session_hint.priority,
    )


def apply(engine: Any, node_id: int, call_hint: Hint, reply: Any) -> None:
    """Retain the prefix ending at the node ``node_id`` names (0: nothing cached) and
    say so in ``reply.retention``."""
    node = engine._node(node_id) if node_id and engine.retentions.on else None
    grant = engine.retentions.grant(node, call_hint, CALLER.get().tenant)
    reply.retention.CopyFrom(result(grant))


def retain(service: CacheService, limits: Limits, req: pb.RetainRequest) -> pb.RetainResponse:
    """Retain: the longest cached prefix of the request's tokens that ends at a node,
    found without a lookup (no touch, no hit), takes the retention."""
    engine = service.engine(req.model)
    key = decode_key(
        req.token_ids,
        req.token_width,
        req.extra_key if req.HasField("extra_key") else None,
        engine.config.vocab_size,
        request_tokens(limits, engine.config),
    )
    call_hint = granted(req.retention.seconds, req.retention.priority, limits.retention)
    cached, grant = engine.retentions.of_prefix(key, call_hint, CALLER.get().tenant)
    return pb.RetainResponse(prefix_len=cached, retention=result(grant))
