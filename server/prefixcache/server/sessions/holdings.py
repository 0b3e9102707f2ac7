"""Who holds what: the sessions holding the most, for ``Stats`` (``top_sessions``).

An operator whose pool is full wants to know which client took it. Stats lists the
sessions holding the most: slots plus locked tokens (both count tokens kept from the
other clients), then locks, then streams. The list is bounded (``MAX_TOP_SESSIONS``)
and costs one pass over the open sessions plus one over each Mamba state pool, and
only when asked for. A session is named by the first 8 characters of its id (the
whole id is its holder's secret) and its client name cut to ``NAME_BYTES``.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Any

from prefixcache.cache.distinct import distinct_counts
from prefixcache.v1 import prefix_cache_pb2 as pb

from ..access.limits import truncate
from .session import Session

# The most sessions one Stats reply lists, whatever the request asks.
MAX_TOP_SESSIONS = 1000
# Client names in the list are cut to this many UTF-8 bytes.
NAME_BYTES = 64


def _state_slots(engines: Iterable[Any]) -> dict[int, int]:
    """Mamba state slots held, by session tag (state ownership is only kept per slot)."""
    held: dict[int, int] = {}
    for engine in engines:
        states = getattr(engine, "states", None)
        if states is None or not states.held:
            continue
        owners = states._owner[states._owner > 0]
        tags, counts = distinct_counts(owners)
        for tag, n in zip(tags.tolist(), counts.tolist(), strict=True):
            held[tag] = held.get(tag, 0) + n
    return held


def top_sessions(
    sessions: Iterable[Session], engines: list[Any], count: int, now: float
) -> list[pb.SessionHoldings]:
    """The ``count`` (at most ``MAX_TOP_SESSIONS``) sessions holding the most in
    ``engines``; ``now`` is the registry's lease time."""
    count = min(count, MAX_TOP_SESSIONS)
    if count <= 0:
        return []
    names = {e.name for e in engines}
    states = _state_slots(engines)
    rows = []
    for session in sessions:
        slots = sum(n for m, n in session.slots.items() if m in names)
        locked = sum(n for m, n in session.locked_tokens.items() if m in names)
        locks = sum(1 for held in session.locks.values() if held.engine.name in names)
        rank = (slots + locked + states.get(session.tag, 0), locks, session.streams)
        rows.append((rank, session.tag, session, slots, locked, locks))
    out = []
    for _rank, tag, session, slots, locked, locks in heapq.nlargest(
        count, rows, key=lambda r: (r[0], -r[1])
    ):
        left = session.expires_at - now
        out.append(
            pb.SessionHoldings(
                session=session.id[:8],
                client_name=truncate(session.name, NAME_BYTES),
                slots=slots,
                state_slots=states.get(tag, 0),
                locks=locks,
                locked_tokens=locked,
                streams=session.streams,
                stream=session.stream,
                lease_left_seconds=max(0.0, left) if left != float("inf") else 0.0,
            )
        )
    return out
