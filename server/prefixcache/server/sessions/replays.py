"""Retries by request id: the kept reply, and a digest of the request it answered.

A call with a request id (Match with lock or allocate, Insert, Lock, Unlock, Step,
GetPages, SetPages) is remembered in its session's replay window (sessions/session.py), so that
a retry after a lost reply gets the first answer instead of doing the work twice. A
retry is the same request sent again; a request id reused for a different request is a
client bug that a plain lookup would answer with the other request's reply (a Step
retried with other tokens would be answered ``replayed``, its new tokens' slots never
allocated and the old lock named). So the window keeps a digest of each request beside
its reply, and a request whose digest differs is refused FAILED_PRECONDITION (the
request is well formed; the session's state, the id already taken, does not allow it),
changing nothing.

The digest covers the whole request but ``server_epoch`` and ``session_id``: a retry
over the Session stream instead of the unary RPC (or back) names its session
differently, and the epoch is checked on its own. BLAKE2b of the serialized request,
128 bits: about 1 ms per MiB, a small part of the work such a request does.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ..errors import PreconditionError
from .session import Session

DIGEST_BYTES = 16
# Fields a faithful retry may send differently (see the module docstring).
_IGNORED = ("server_epoch", "session_id")


class Kept:
    """What the replay window keeps of one call: its reply and its request's digest."""

    __slots__ = ("digest", "reply")

    def __init__(self, reply: Any, digest: bytes) -> None:
        self.reply = reply
        self.digest = digest

    def ByteSize(self) -> int:  # the window sizes what it keeps as it sizes messages
        return self.reply.ByteSize() + DIGEST_BYTES


def digest(request: Any) -> bytes:
    """The request's digest, ``server_epoch`` and ``session_id`` left out."""
    fields = request.DESCRIPTOR.fields_by_name
    saved = [(name, getattr(request, name)) for name in _IGNORED if name in fields]
    for name, _ in saved:
        request.ClearField(name)
    try:
        data = request.SerializeToString(deterministic=True)
    finally:
        for name, value in saved:
            if value:
                setattr(request, name, value)
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


def replayed(session: Session | None, op: str, request: Any) -> Any:
    """The kept reply to an earlier try of ``request``, or None (no session, no request
    id, or none kept).

    Raises:
        PreconditionError: the request id was used by a different request.
    """
    if session is None or not request.request_id:
        return None
    kept = session.replay(op, request.request_id)
    if kept is None:
        return None
    if not isinstance(kept, Kept):  # kept by a caller of Session.remember itself
        return kept
    if kept.digest != digest(request):
        raise PreconditionError(
            f"request_id {request.request_id} was used by a different {op} request in "
            "this session: a retry must repeat its request unchanged (a new request "
            "takes a new request_id)"
        )
    return kept.reply


def remember(session: Session | None, op: str, request: Any, reply: Any) -> None:
    """Keep ``reply`` for retries of ``request`` (nothing without a request id)."""
    if session is not None and request.request_id:
        session.remember(op, request.request_id, Kept(reply, digest(request)))
