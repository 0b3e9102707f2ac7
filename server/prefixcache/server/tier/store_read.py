"""One store read into fresh slots of the tier's session: the bookkeeping both fetches
(fetch.py for token pages, fetch_pages.py for hash pages) share.

The store call (``get_into``) cannot be cancelled: past its deadline the lookup gives
up, but the thread may write into the slots long after. So the slots are moved into the
model's quarantine (engine/slots.py: allocated, held by no session, in no tree) as soon
as they are taken, and leave it only once that thread has returned: back to the session
for the insert, or freed when the read timed out or failed. No timeout, session close or
Reset in between hands them out.

A Reset or the session's close while the read is in flight (``void``) took the session's
lock and slots already, and left the quarantined ones alone: the read is dropped, its
slots freed once the thread has returned, and nothing else is released.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import numpy as np

from .backend import code_name
from .model_tier import ModelTier

log = logging.getLogger("prefixcache.server")


def leading_run(codes: list[int] | None, ok: Any) -> int:
    """How many codes from the first pass ``ok``."""
    if not codes:
        return 0
    for i, code in enumerate(codes):
        if not ok(code):
            return i
    return len(codes)


def safely(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except Exception:
        log.exception("tier fetch cleanup failed")


class StoreRead:
    """Slots a store read fills, from their allocation to their release.

    ``take`` allocates and quarantines them (locking the local hit they follow, if
    any); ``read`` runs the store call and, once its thread has returned, gives the
    slots back to the session; ``release`` frees what the caller did not keep and
    unlocks. Runs on the loop; only ``read`` awaits.
    """

    def __init__(self, tier: Any, mt: ModelTier) -> None:
        self.tier, self.mt = tier, mt
        self.engine, self.session = mt.engine, tier.session
        self.generation = mt.generation  # a Reset bumps it: see ``void``
        self.lock_id = 0
        self.slots = np.zeros(0, dtype=np.int64)
        self._returned = False  # the slots are the session's again (the read came back)
        # The store call failed, timed out or was not made, or its first page came back
        # short: the lookup counts an error, not a miss.
        self.failed = False

    @property
    def void(self) -> bool:
        """A Reset or the session's close came in between: it took the lock and the
        session's slots already."""
        return self.generation != self.mt.generation or self.session.closed

    def take(self, pages: int, node: Any = None) -> bool:
        """Lock ``node`` (the local hit the pages follow; None for none) for the session
        and quarantine fresh slots for ``pages`` pages. False (counted) when there is no
        room or a quota says no: a miss, nothing held."""
        engine, session = self.engine, self.session
        try:
            if node is not None:
                self.lock_id = engine.lock(session, engine._handle(node))
            self.slots, _ = engine.alloc(session, pages * self.mt.page_size)
            engine.quarantine(session, self.slots)  # until the store call's thread returns
        except Exception as exc:
            if self.lock_id:
                engine.unlock(session, self.lock_id)
                self.lock_id = 0
            self.tier.error("fetch", type(exc).__name__)
            return False
        return True

    async def read(self, keys: list[str], deadline: float) -> int:
        """Read ``keys`` into the slots, a page each; returns how many pages from the
        first were read whole, their slots (all of them) the session's again. On 0
        (a failure, a timeout, a Reset meanwhile, the first page short) everything is
        released already or will be once the thread returns."""
        tier, mt, engine, slots = self.tier, self.mt, self.engine, self.slots
        start = time.perf_counter()
        backend = tier.backend
        codes: list[int] | None = None
        fut: asyncio.Future[Any] | None = None
        if backend is not None:  # else closed while we asked
            ptrs, sizes = mt.layout.parts(slots)
            codes, fut = await tier.call("get", backend.get_into, keys, ptrs, sizes,
                                         deadline=deadline)
        if codes is None:
            self.failed = True
            safely(self.release)  # the lock; the slots are not the session's
            if fut is not None and not fut.done():
                # Timed out: the thread may still write into the slots; free them after.
                fut.add_done_callback(lambda _f: safely(engine.unquarantine, slots))
            else:
                safely(engine.unquarantine, slots)
            return 0
        # The thread has returned: nothing writes into the slots any more.
        if self.void:
            safely(engine.unquarantine, slots)  # freed
            return 0
        engine.unquarantine(slots, self.session)
        self._returned = True
        whole = leading_run(codes, lambda c: c == mt.layout.page_bytes)
        if whole < len(codes):
            code = codes[whole]
            tier.error("get", code_name(code) if code < 0 else "SIZE_MISMATCH")
        if whole == 0:
            self.failed = bool(codes)
            safely(self.release)
            return 0
        # Bytes and seconds of fetches that brought pages (their ratio is the fetch's
        # GB/s): a read that brought none counts as an error above, not as slow bytes.
        mt.fetch_seconds += time.perf_counter() - start
        mt.fetch_bytes += whole * mt.layout.page_bytes
        return whole

    def release(self, kept: int = 0) -> None:
        """Free the session's slots past the first ``kept`` (those the caller inserted
        or stored) and unlock; nothing when a Reset or close took them already."""
        if self.void:
            return
        if self._returned:
            rest = self.slots[kept:]
            if len(rest):
                self.engine.free(self.session, rest)
        if self.lock_id:
            self.engine.unlock(self.session, self.lock_id)
            self.lock_id = 0
