"""The scheduler side's counters (cumulative), shared by its lookups and its saves."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerStats:
    """Counters of the scheduler side (cumulative)."""

    probes: int = 0
    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    lookup_errors: int = 0
    misses_ineligible: int = 0
    # Requests answered "no hit" at their first probe from the shadow index, without
    # a lookup (``fast_miss``).
    fast_misses: int = 0
    leases_expired: int = 0
    loads: int = 0
    load_tokens: int = 0
    loads_failed: int = 0  # by the workers, beyond those the scheduler side failed
    saves: int = 0
    save_tokens: int = 0
    saves_skipped: int = 0
    saves_failed: int = 0  # a worker's copy, or the Insert, failed
    saves_lost: int = 0
    # Saves that stopped at a block vLLM had freed (the null block) before they could
    # copy it: they insert the tokens before it (saves.py, "Gaps").
    saves_cut: int = 0
    # A producer's inserts (``ordered_saves``) whose request's output left before the
    # service answered them: the call was slower than its deadline.
    inserts_unordered: int = 0
