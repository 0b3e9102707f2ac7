"""The lease reaper: ends the sessions whose lease lapsed, judged by the loop's progress.

Wall time alone would be unfair to clients. While the event loop cannot run (a long
call, the process stopped by SIGSTOP or a debugger, a host swapping), the clients'
KeepAlives wait unread in their sockets. Judged by the clock alone, every lease would
lapse at the first tick after the stall, before those KeepAlives are read: a 9 s stop
once expired every healthy client. So each tick measures how late it fired, and that
lateness is credited to every lease (``SessionRegistry.credit_stall``): a lease lapses
only when its holder had its whole TTL of running loop in which to renew. After a
stall, the next tick reaps nothing, so that the calls queued during it run first.

Reaping goes in bounded batches with a yield to the loop between them, so that many
leases lapsing at once (100k took 4.8 s in one go) do not stall the other clients, and
each batch logs one line (``CacheService.expire_sessions``) instead of one per session.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .service import CacheService

# Sessions closed per batch: about a millisecond of work each at most.
BATCH = 256
# A tick later than this was a stall, not timer jitter.
STALL_SECONDS = 0.05
# The shortest sleep between ticks.
MIN_SLEEP = 0.01

log = logging.getLogger("prefixcache.server")


async def reap_leases(service: CacheService, poll: float, batch: int = BATCH) -> None:
    """Run until cancelled: expire lapsed leases, waking at least every ``poll`` seconds
    (so a lease opened while it sleeps lapses on time, give or take ``poll``)."""
    sessions = service.sessions
    settled = True
    while True:
        delay = min(max(sessions.next_expiry(), MIN_SLEEP), poll)
        due = sessions.clock() + delay
        await asyncio.sleep(delay)
        late = sessions.clock() - due
        sessions.credit_stall(late)
        if late > STALL_SECONDS and settled:
            # Let the calls that queued up during the stall, renewals among them, run
            # before anything is judged lapsed. Only once in a row: a loop that stays
            # busy must still reap.
            settled = False
            continue
        settled = True
        try:
            while service.expire_sessions(batch) >= batch:
                await asyncio.sleep(0)
            # Retentions whose time passed with no eviction or hint to find them.
            while service.lapse_retentions(batch) >= batch:
                await asyncio.sleep(0)
        except Exception:
            # A bug while releasing must not end the reaper in silence: every later
            # lease would then be kept forever. Said each tick until it is fixed.
            log.exception("the lease reaper failed to expire sessions")
