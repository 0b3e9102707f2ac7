"""Errors raised by the cache domain; the service maps each class to one status code."""

from __future__ import annotations


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
