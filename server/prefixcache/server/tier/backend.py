"""The store interface the tier needs, and the store's error codes.

A backend is a blocking client: the tier calls it from worker threads only, never on
the event loop. Each batch call answers one int per key; negative ints are the store's
error codes (Mooncake's, which errors are named after), never exceptions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

# Mooncake Store's codes (mooncake-store/include/types.h) as seen on this machine type.
ERROR_NAMES = {
    -200: "NO_AVAILABLE_HANDLE",  # the store is full (eviction lags a burst of puts)
    -600: "INVALID_PARAMS",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -800: "TRANSFER_FAIL",  # the peer that held the bytes is gone
    -900: "RPC_FAIL",  # the master is unreachable
    # The disk tier's own (never Mooncake's).
    -2001: "TIMEOUT",  # not read: the lookup's deadline came first
    -2002: "DISK_FULL",  # the file system is full (ENOSPC, EDQUOT, EFBIG)
    -2003: "IO_ERROR",  # any other OSError of a read or write
}
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
TRANSFER_FAIL = -800
RPC_FAIL = -900
PAST_DEADLINE = -2001
DISK_FULL = -2002
IO_ERROR = -2003


def code_name(code: int) -> str:
    """A metric label for a store code: its name, or ``E<code>`` for one not listed."""
    return ERROR_NAMES.get(code, f"E{code}")


class TierUnavailable(Exception):
    """The store could not be reached or set up (the tier answers misses meanwhile)."""


Parts = list[list[int]]


@dataclass(frozen=True, slots=True)
class PageRetention:
    """A page's retention (prefixcache.cache.retention) as it leaves the pool for a store
    that keeps one (the disk tier): its priority (1 to 99), the seconds each hit renews
    it for, when it lapses (``time.time()`` seconds: a store outlives the pool's
    monotonic clock) and the owner it counts against (the tenant; None: the callers
    without a tenant's token)."""

    priority: int
    seconds: float
    until: float
    owner: str | None


class TierBackend(Protocol):
    """A distributed object store holding one object per page.

    ``ptrs[i]`` and ``sizes[i]`` are the parts of object ``i`` in registered memory
    (the pool's buffers), in order: the object is their concatenation.
    """

    def exists(self, keys: list[str]) -> list[int]:
        """1 (held), 0 (not held) or a negative code, per key."""
        ...

    def get_into(
        self,
        keys: list[str],
        ptrs: Parts,
        sizes: Parts,
        deadline: float | None = None,
        check: Callable[[int], None] | None = None,
    ) -> list[int]:
        """Read each object into its parts: bytes read, or a negative code, per key.
        A store that can stops before ``deadline`` (monotonic seconds; None: none) and
        answers ``PAST_DEADLINE`` for the objects it did not read, and calls
        ``check(i)`` for object ``i`` as soon as it is read whole (on any of its
        threads), so that checks overlap the reads."""
        ...

    def put_from(self, keys: list[str], ptrs: Parts, sizes: Parts) -> list[int]:
        """Store each object from its parts: 0, or a negative code, per key."""
        ...

    def remove(self, keys: list[str]) -> list[int]:
        """Drop objects (those written from memory that changed under the write, and
        those whose seal did not check), leases or not."""
        ...

    def object_size(self, key: str) -> int:
        """The object's size in bytes, or a negative code."""
        ...

    def register(self, ptr: int, size: int) -> None:
        """Make ``[ptr, ptr + size)`` usable as parts (raises TierUnavailable)."""
        ...

    def close(self) -> None: ...
