"""KeepAlive pacing: renewing a lease in a loop must not cost the other clients.

A KeepAlive does almost nothing in the handler; what it costs is the call itself
(about half a millisecond of the one event loop, in gRPC's own code). A client that
keeps many KeepAlives in flight in a loop gets that many turns of the loop for each
turn of everyone else: 64 of them moved a victim's prefill p50 from 2 ms to 56 ms,
whatever the handler did. Answering such calls "without work" would not help, since
the work is the call; slowing the caller down does.

So a session's KeepAlives are paced, as a leaky bucket (GCRA): each one is given the
next free *slot*, a tenth of the session's TTL (at most ``MAX_GAP``) after the previous
one's, less a tolerance of ``BURST`` slots, and is answered (renewing the lease) only
when its slot comes. A client renewing every third of its TTL, as the clients do, never
waits, and one renewing by hand a few times in a row does not either. One renewing in a
loop, however many calls it keeps in flight, gets one answer per slot in all, and its
calls wait without costing the loop anything: the lease it holds is at most a slot old,
so it never lapses meanwhile. A call that gives up while waiting hands its slot back.

Slots are kept on the monotonic clock, not the sessions' lease time: lease time runs
slow while the loop stalls (reaper.py), and a wait computed on it but slept in real
time would push every later slot further out.

KeepAlives that renew no lease (ids that name no open session, stream sessions, requests
refused before parsing) cost the loop just the same, and a storm of them with made-up
ids took a victim's p99 to 271 ms: they are paced too, by one bucket they all share
(``Unleased``), ``UNLEASED_GAP`` apart after a burst of ``UNLEASED_BURST``. It is much
faster than a session's pace, since it is shared: a few hundred workers whose sessions
died with a restarted server still learn it (NOT_FOUND) within a second or two, while a
storm gets a few hundred answers a second at most, a small part of the loop.
"""

from __future__ import annotations

import math

from .session import Session

# The pace: one answered KeepAlive per this fraction of the session's TTL, and at least
# one per MAX_GAP seconds (a long lease must not make a second renewal wait long).
PACE = 0.1
MAX_GAP = 1.0
# Slots a session may run ahead of the pace before its calls wait.
BURST = 3
# The pace of the KeepAlives that renew no lease, all of them together.
UNLEASED_GAP = 0.005
UNLEASED_BURST = 20


class Unleased:
    """The one bucket that the KeepAlives renewing no lease share (one per server)."""

    def __init__(self, gap: float = UNLEASED_GAP, burst: int = UNLEASED_BURST) -> None:
        self.gap = gap
        self.burst = burst
        self.slot = -math.inf


def gap(session: Session) -> float:
    """The pace's interval for ``session`` (which has a lease)."""
    return min(session.ttl * PACE, MAX_GAP) if session.ttl is not None else 0.0


def wait(session: Session | None, now: float, unleased: Unleased | None = None) -> float:
    """Seconds the KeepAlive of ``session`` arriving at ``now`` (monotonic) waits before
    it is answered; takes its slot (``give_back`` returns it). A KeepAlive that renews
    no lease (``session`` None or without a TTL) takes its slot in ``unleased``; without
    one it is answered at once."""
    if session is None or session.ttl is None:
        if unleased is None:
            return 0.0
        slot = max(now - unleased.burst * unleased.gap, unleased.slot + unleased.gap)
        unleased.slot = slot
    else:
        step = gap(session)
        slot = max(now - BURST * step, session.keepalive_slot + step)
        session.keepalive_slot = slot
    late = slot - now
    return late if late > 1e-9 else 0.0  # float sums of steps: not a real wait


def give_back(session: Session | None, unleased: Unleased | None = None) -> None:
    """A call that waited for its slot gave up (cancelled): free the slot."""
    if session is not None and session.ttl is not None:
        session.keepalive_slot -= gap(session)
    elif unleased is not None:
        unleased.slot -= unleased.gap
