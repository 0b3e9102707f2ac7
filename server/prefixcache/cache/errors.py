"""Errors raised by the cache domain; the service maps each class to one status code."""

from __future__ import annotations

import operator


class CacheError(Exception):
    """Base class of every error the cache library raises on purpose."""


class InvalidInputError(CacheError, ValueError):
    """The caller passed something malformed: a bad key, value or argument.

    Raised before any state changes, so the cache is untouched.
    """


class SlotIndexError(InvalidInputError, IndexError):
    """A slot index lies outside the pool (or is the reserved padding slot 0)."""


class DoubleFreeError(CacheError, RuntimeError):
    """A slot was freed that is not currently allocated (or twice in one call)."""


class LockError(CacheError, RuntimeError):
    """An unlock that does not balance a lock: the node is not locked, or gone."""


class TokenRangeError(InvalidInputError, OverflowError):
    """A token id does not fit in an unsigned 32-bit integer.

    Also an ``OverflowError``, which is what the reference hash raises for such ids.
    """


class IntegrityError(CacheError, AssertionError):
    """``check_integrity()`` found the cache's bookkeeping out of step with its tree."""


def check_count(value: object, name: str, minimum: int = 0) -> int:
    """``value`` as an int of at least ``minimum``; anything else is InvalidInputError.

    Accepts any integer type (``operator.index``) but not ``bool``.
    """
    if isinstance(value, bool):
        raise InvalidInputError(f"{name} must be an int, got bool")
    try:
        number = operator.index(value)  # type: ignore[arg-type]  # it decides what is an int
    except TypeError as exc:
        raise InvalidInputError(f"{name} must be an int, got {type(value).__name__}") from exc
    if number < minimum:
        raise InvalidInputError(f"{name} must be >= {minimum}, got {number}")
    return number
