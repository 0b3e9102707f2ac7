"""Retention hints: how long a cached prefix matters to the client (the proto's
``Retention``). The service keeps a retained prefix after unretained ones while the
retention lasts, renews it on every hit, and answers each hint with what it did
(``results.Retained``): accepted, clipped to its limits, or rejected. Never a pin."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prefixcache.v1 import prefix_cache_pb2 as pb

from .errors import InvalidArgument

# Priorities by name; numbers 1 to 99 are taken as they are (0: the service's, 50).
PRIORITIES = {"low": 25, "normal": 50, "high": 75}


@dataclass(frozen=True, slots=True)
class Retention:
    """Keep the prefix for ``seconds`` after the call and after each hit (0 ends the
    caller's retention of it), at ``priority``: 1 to 99 or "low", "normal", "high"."""

    seconds: float
    priority: int | str = 0

    @classmethod
    def of(cls, value: Any) -> Retention | None:
        """A Retention from a number of seconds, a mapping (``{"retain_seconds": 600,
        "priority": "high"}``, as vLLM's ``kv_transfer_params`` carry it; ``seconds``
        also names them) or a Retention; None stays None."""
        if value is None or isinstance(value, Retention):
            return value
        if isinstance(value, Mapping):
            unknown = set(value) - {"retain_seconds", "seconds", "priority"}
            if unknown:
                raise InvalidArgument(
                    f"a retention has retain_seconds and priority, not "
                    f"{', '.join(sorted(map(str, unknown)))}"
                )
            seconds = value.get("retain_seconds", value.get("seconds"))
            if seconds is None:
                raise InvalidArgument("a retention needs retain_seconds")
            return cls(_seconds(seconds), value.get("priority", 0))
        return cls(_seconds(value))

    def to_pb(self) -> pb.Retention:
        return pb.Retention(seconds=_seconds(self.seconds), priority=_priority(self.priority))


def retention_pb(value: Any) -> pb.Retention | None:
    """``value`` (anything ``Retention.of`` takes) as the wire message, or None."""
    hint = Retention.of(value)
    return None if hint is None else hint.to_pb()


def _seconds(value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise InvalidArgument(f"retention seconds must be a finite number >= 0, not {value!r}")
    return float(value)


def _priority(value: Any) -> int:
    if isinstance(value, str):
        if value not in PRIORITIES:
            raise InvalidArgument(
                f"retention priority must be 1 to 99 or one of "
                f"{', '.join(PRIORITIES)}, not {value!r}"
            )
        return PRIORITIES[value]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 99:
        raise InvalidArgument(
            f"retention priority must be 1 to 99 or one of {', '.join(PRIORITIES)}, not {value!r}"
        )
    return value
