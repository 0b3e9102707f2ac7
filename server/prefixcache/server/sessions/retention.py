"""Retention hints as the service takes them: seconds and a priority, lowered to the
configured bounds (config/retention.py). A session keeps one as the default of its calls
(an agent's conversation); the cache library keeps what a hint makes of a prefix."""

from __future__ import annotations

import math
from dataclasses import dataclass

from prefixcache.cache import InvalidInputError
from prefixcache.cache.retention import MAX_PRIORITY

from ..config import RetentionConfig

# The priority of a hint that names none.
DEFAULT_PRIORITY = 50


@dataclass(frozen=True, slots=True)
class Hint:
    """A retention as granted: ``seconds`` (0 ends one) and ``priority`` (1 to 99);
    ``clipped``: lowered to the bounds from what the client asked."""

    seconds: float
    priority: int
    clipped: bool = False


def granted(seconds: float, priority: int, config: RetentionConfig) -> Hint:
    """The hint a client's ``seconds`` and ``priority`` (0: the default) are granted.

    Raises:
        InvalidInputError: seconds negative, infinite or nan, or priority negative.
    """
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidInputError(f"retention seconds must be a finite number >= 0, got {seconds}")
    if priority < 0:
        raise InvalidInputError(f"retention priority must be 0 to {MAX_PRIORITY}, got {priority}")
    clipped = seconds > config.max_seconds or priority > MAX_PRIORITY
    return Hint(
        min(seconds, config.max_seconds), min(priority or DEFAULT_PRIORITY, MAX_PRIORITY), clipped
    )
