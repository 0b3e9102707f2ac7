"""Errors the service raises for requests it refuses (the cache library has its own).

Each class stands for one answer a client can act on; ``status.py`` maps them, and the
cache library's errors, to gRPC status codes in a single table.
"""

from __future__ import annotations


class ServiceError(Exception):
    """A request the service refuses without changing any state."""


class NotFoundError(ServiceError):
    """An unknown model, node, lock or session (or one that no longer exists)."""


class PreconditionError(ServiceError):
    """The request is well formed but the state does not allow it (a slot not held by
    the session, an operation the model's cache kind lacks, a lock without a session)."""


class StaleEpochError(PreconditionError):
    """The request names handles (or a session) of an earlier start of the service.

    Attributes:
        epoch: the service's current epoch, which the refusal reports to the client.
    """

    def __init__(self, message: str, epoch: int) -> None:
        super().__init__(message)
        self.epoch = epoch


class PoolExhaustedError(ServiceError):
    """The pool cannot supply the slots even after evicting every unlocked entry.

    Attributes:
        model: the model whose pool refused.
        reason: ``pool_exhausted`` (locks and sessions pin the slots) or
            ``larger_than_pool`` (the request alone asks for more than the whole pool:
            an over-long prompt, which no eviction or operator can help). The alert keys
            on the first only.
    """

    REASONS = ("pool_exhausted", "larger_than_pool")

    def __init__(self, message: str, model: str = "", reason: str = "pool_exhausted") -> None:
        super().__init__(message)
        self.model = model
        self.reason = reason


class DrainingError(ServiceError):
    """The service is shutting down and takes no new work."""


class LimitError(ServiceError):
    """A request over one of the configured limits, refused before any work.

    Attributes:
        limit: the setting that refused it (``max_sessions``, ...), the label of
            ``prefixcache_refusals_total``.
    """

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


class TooLargeError(LimitError):
    """A field of the request is larger than its limit (INVALID_ARGUMENT)."""


class OverLimitError(LimitError):
    """The request asks for more than a limit allows (RESOURCE_EXHAUSTED)."""


class DeniedError(LimitError):
    """The caller may not do this: a namespace its token is not bound to, or an
    eviction beyond what a caller without the admin token may ask (PERMISSION_DENIED)."""
