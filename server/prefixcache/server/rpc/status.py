"""The one table from exceptions to gRPC status codes.

A client mistake maps to a specific code; only a bug (anything not listed, including a
failed integrity check) is INTERNAL.
"""

from __future__ import annotations

import grpc

from prefixcache.cache import DoubleFreeError, InvalidInputError, LockError

from ..errors import (
    DeniedError,
    DrainingError,
    NotFoundError,
    OverLimitError,
    PoolExhaustedError,
    PreconditionError,
    StaleEpochError,
    TooLargeError,
)

# The trailing metadata key that tells a client the current epoch (decimal).
EPOCH_TRAILER = "prefixcache-server-epoch"

# First match wins, so subclasses come before their bases.
STATUS_TABLE: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidInputError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (DoubleFreeError, grpc.StatusCode.FAILED_PRECONDITION),
    (LockError, grpc.StatusCode.FAILED_PRECONDITION),
    (PreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (PoolExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (TooLargeError, grpc.StatusCode.INVALID_ARGUMENT),
    (DeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (OverLimitError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DrainingError, grpc.StatusCode.UNAVAILABLE),
)


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status code a refused request gets; INTERNAL for anything unexpected."""
    for kind, code in STATUS_TABLE:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def trailers_for(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """Trailing metadata that goes with a refusal: the epoch, when it was stale."""
    if isinstance(exc, StaleEpochError):
        return ((EPOCH_TRAILER, str(exc.epoch)),)
    return ()
