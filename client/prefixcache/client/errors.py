"""Typed errors for the client: one class per status code a worker can act on.

Every failed call raises a subclass of :class:`PrefixCacheError` carrying the gRPC
``code`` and the server's ``details``; the original ``grpc.RpcError`` is chained as
``__cause__``. CANCELLED raises :class:`Unavailable`: the client never cancels a call
it is waiting on, so a cancelled call is one a stopping server dropped before it ran.
Codes without a class of their own (UNIMPLEMENTED, ...) raise the base class.
Malformed input caught on the client side, before any call is made, raises
:class:`InvalidArgument` with ``code`` INVALID_ARGUMENT too.
"""

from __future__ import annotations

from typing import Any

import grpc

# Trailing metadata of a stale-epoch refusal: the service's current epoch, in decimal.
EPOCH_TRAILER = "prefixcache-server-epoch"


class PrefixCacheError(Exception):
    """A call to the prefix-cache service failed.

    Attributes:
        code: the gRPC status code (None only for errors made up by the client itself).
        details: the server's message, for people.
    """

    default_code: grpc.StatusCode | None = None

    def __init__(self, details: str = "", code: grpc.StatusCode | None = None) -> None:
        super().__init__(details)
        self.details = details
        self.code = code if code is not None else self.default_code

    def __str__(self) -> str:
        name = self.code.name if self.code is not None else "ERROR"
        return f"{name}: {self.details}" if self.details else name


class InvalidArgument(PrefixCacheError, ValueError):
    """Malformed input: bad token or slot bytes, a token outside the vocabulary, ..."""

    default_code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(PrefixCacheError, LookupError):
    """Unknown model, node, lock or session (evicted, reset, expired or never issued)."""

    default_code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(PrefixCacheError):
    """The state refuses the request: a double free, an unlock of a lock not held, an
    operation the model's cache kind lacks, a lock or allocation without a session."""

    default_code = grpc.StatusCode.FAILED_PRECONDITION


class StaleEpoch(FailedPrecondition):
    """The call named handles (or a session) from before a restart of the service.

    Raised when the service refuses a call fenced with an older epoch, and by client
    sessions, without a call, for handles they know to be stale. Nothing changed.

    Attributes:
        server_epoch: the service's current epoch (0 when not known).
    """

    def __init__(
        self, details: str = "", code: grpc.StatusCode | None = None, server_epoch: int = 0
    ) -> None:
        super().__init__(details, code)
        self.server_epoch = server_epoch


class SessionLost(NotFound):
    """The call named handles of a client session whose service-side session is gone
    (the service restarted, or the lease lapsed): its locks and slots were released, so
    the client drops the call instead of sending it. Nothing changed."""


class ResourceExhausted(PrefixCacheError):
    """The pool is full even after eviction, or a message is over the size limit."""

    default_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unauthenticated(PrefixCacheError):
    """The bearer token is missing or wrong."""

    default_code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(PrefixCacheError):
    """An admin call (Reset) without the admin token."""

    default_code = grpc.StatusCode.PERMISSION_DENIED


class Unavailable(PrefixCacheError, ConnectionError):
    """The service cannot be reached, or is draining before shutdown."""

    default_code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(PrefixCacheError, TimeoutError):
    """No answer within the call's deadline."""

    default_code = grpc.StatusCode.DEADLINE_EXCEEDED


class Internal(PrefixCacheError):
    """A bug in the service (never the client's fault)."""

    default_code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[PrefixCacheError]] = {
    cls.default_code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        FailedPrecondition,
        ResourceExhausted,
        Unauthenticated,
        PermissionDenied,
        Unavailable,
        DeadlineExceeded,
        Internal,
    )
    if cls.default_code is not None
}
_BY_CODE[grpc.StatusCode.CANCELLED] = Unavailable
_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def error_for(code: grpc.StatusCode | int, details: str = "") -> PrefixCacheError:
    """The typed error for a status code (a ``grpc.StatusCode`` or its int value)."""
    if isinstance(code, int):
        code = _BY_VALUE.get(code, grpc.StatusCode.UNKNOWN)
    return _BY_CODE.get(code, PrefixCacheError)(details, code)


def from_rpc_error(exc: grpc.RpcError) -> PrefixCacheError:
    """The typed error for a failed gRPC call (sync or asyncio)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.FAILED_PRECONDITION and (epoch := _epoch_trailer(exc)):
        return StaleEpoch(details or "", code, epoch)
    return error_for(code or grpc.StatusCode.UNKNOWN, details or "")


def _epoch_trailer(exc: grpc.RpcError) -> int:
    """The current epoch the service reports when it refuses a stale one, else 0."""
    # (key, value) pairs; the stubs type a metadatum as a class of its own.
    trailers: Any = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == EPOCH_TRAILER:
            try:
                return int(value)
            except (TypeError, ValueError):
                return 0
    return 0


__all__ = [
    "DeadlineExceeded",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "PrefixCacheError",
    "ResourceExhausted",
    "SessionLost",
    "StaleEpoch",
    "Unauthenticated",
    "Unavailable",
    "error_for",
    "from_rpc_error",
]
