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

The thread checks every page's seal before it returns (seals.py): a page refused there
ends the run read whole, is counted (``prefixcache_integrity_failures_total
{source="tier"}``, ``{source="disk"}`` for the disk tier) and is never inserted. The
tier's fetches hold at most ``tier.max_fetch_slots`` of a model's slots at once
(``ModelTier.fetching``), and the tier's session is not a client: no per-session quota
applies to it.

A lookup's deadline (``Deadline``) is ``tier.timeout`` from its start plus, for each
fetch, the fetch's bytes over ``tier.min_fetch_bandwidth``: a large hit has the time
its bytes need, a dead peer of a small one is noticed as fast as ever.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any

import numpy as np

from ..config.tier import MAX_TIER_TIMEOUT, TierConfig
from ..errors import LimitError, PoolExhaustedError
from .backend import PAST_DEADLINE, code_name
from .keys import Namespace
from .model_tier import ModelTier
from .seals import INTEGRITY_CODES, checked_get, page_checker, sealed

log = logging.getLogger("prefixcache.server")


def leading_run(codes: list[int] | None, ok: Any) -> int:
    """How many codes from the first pass ``ok``."""
    if not codes:
        return 0
    for i, code in enumerate(codes):
        if not ok(code):
            return i
    return len(codes)


class Deadline:
    """A lookup's deadline for its store calls, in monotonic seconds (``at``):
    ``tier.timeout`` from its start, grown by each fetch's bytes over
    ``tier.min_fetch_bandwidth``, and never more than ``MAX_TIER_TIMEOUT`` from the
    start."""

    def __init__(self, cfg: TierConfig, start: float | None = None) -> None:
        start = time.monotonic() if start is None else start
        self.at = start + cfg.timeout
        self._rate = cfg.min_fetch_bandwidth
        self._limit = start + MAX_TIER_TIMEOUT

    def grow(self, nbytes: int) -> float:
        """Make room for a fetch of ``nbytes``; returns the new deadline."""
        self.at = min(self.at + nbytes / self._rate, self._limit)
        return self.at


def safely(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except Exception:
        log.exception("tier fetch cleanup failed")


class StoreRead:
    """Slots a store read fills, from their allocation to their release.

    ``take`` allocates and quarantines them (locking the local hit they follow, if
    any) and takes their seal slots; ``read`` runs the store call and the seal checks
    and, once its thread has returned, gives the slots back to the session; ``release``
    frees what the caller did not keep and unlocks. Runs on the loop; only ``read``
    awaits.
    """

    def __init__(self, tier: Any, mt: ModelTier) -> None:
        self.tier, self.mt = tier, mt
        self.engine, self.session = mt.engine, tier.session
        self.generation = mt.generation  # a Reset bumps it: see ``void``
        self.lock_id = 0
        self.slots = np.zeros(0, dtype=np.int64)
        self.seals = np.zeros(0, dtype=np.int64)
        self._returned = False  # the slots are the session's again (the read came back)
        self._landed = True  # nothing of the fetch is held (seal slots, max_fetch_slots)
        # The store call failed, timed out or was not made, or its first page came back
        # short: the lookup counts an error, not a miss.
        self.failed = False
        # Why the first page was refused (its seal did not check), or None.
        self.refused: str | None = None
        # The read missed the lookup's deadline (not made, timed out, or the first
        # page not read by then).
        self.late = False

    @property
    def void(self) -> bool:
        """A Reset or the session's close came in between: it took the lock and the
        session's slots already."""
        return self.generation != self.mt.generation or self.session.closed

    @property
    def outcome(self) -> str:
        """The lookup's result when the read brought nothing: ``refused`` (the first
        page's seal did not check), ``timeout`` (the read missed the lookup's
        deadline), ``error`` (the read failed) or ``miss``."""
        if self.refused:
            return "refused"
        if self.late:
            return "timeout"
        return "error" if self.failed else "miss"

    def take(self, pages: int, node: Any = None) -> str | None:
        """Lock ``node`` (the local hit the pages follow; None for none) for the session,
        quarantine fresh slots for ``pages`` pages and take their seal slots. None when
        done; else nothing is held and the lookup's result says why: ``capacity`` (no
        room in the pool, in ``tier.max_fetch_slots`` or in the seal slots) or ``error``
        (counted)."""
        engine, session, mt = self.engine, self.session, self.mt
        n = pages * mt.page_size
        if mt.fetching + n > mt.max_fetch_slots:
            return "capacity"
        seals = mt.seal_slots.take(pages)
        if seals is None:
            return "capacity"
        try:
            if node is not None:
                self.lock_id = engine.lock(session, engine._handle(node))
            self.slots, _ = engine.alloc(session, n)
            engine.quarantine(session, self.slots)  # until the store call's thread returns
        except Exception as exc:
            mt.seal_slots.release(seals)
            if self.lock_id:
                engine.unlock(session, self.lock_id)
                self.lock_id = 0
            if isinstance(exc, PoolExhaustedError | LimitError):
                return "capacity"
            self.tier.error("fetch", type(exc).__name__)
            return "error"
        self.seals = seals
        mt.fetching += n
        self._landed = False
        return None

    def _land(self) -> None:
        """The store call's thread has returned (or none was made): the seal slots and
        the fetch's share of ``max_fetch_slots`` are free again."""
        if self._landed:
            return
        self._landed = True
        self.mt.seal_slots.release(self.seals)
        self.mt.fetching -= len(self.slots)

    def _after_thread(self, _fut: Any) -> None:
        safely(self.engine.unquarantine, self.slots)
        self._land()

    async def read(
        self, ns: Namespace, hashes: list[str], keys: list[str], deadline: Deadline
    ) -> int:
        """Read ``keys`` (the pages ``hashes`` of namespace ``ns``) into the slots, a
        page each, and check their seals; returns how many pages from the first were
        read whole and checked, their slots (all of them) the session's again. On 0 (a
        failure, a timeout, a Reset meanwhile, the first page short or refused)
        everything is released already or will be once the thread returns."""
        tier, mt, engine, slots = self.tier, self.mt, self.engine, self.slots
        start = time.perf_counter()
        backend = mt.backend if tier.ready else None
        codes: list[int] | None = None
        fut: asyncio.Future[Any] | None = None
        if backend is not None:  # else closed while we asked
            ptrs, sizes = sealed(*mt.layout.parts(slots), mt.seal_slots.ptrs(self.seals))
            idents = [ns.ident(h) for h in hashes]
            check = page_checker(ns.seal, idents, ptrs, sizes, mt.memory, mt.seal_slots, self.seals)
            until = deadline.grow(len(keys) * mt.object_bytes)
            fetch = functools.partial(
                checked_get, backend, keys, ptrs, sizes, check, mt.object_bytes, until
            )
            codes, fut = await tier.call("get", fetch, deadline=until)
        if codes is None:
            self.failed = True
            # Not made for lack of time, or made and not back in time.
            self.late = (fut is None and time.monotonic() >= deadline.at) or (
                fut is not None and not fut.done()
            )
            safely(self.release)  # the lock; the slots are not the session's
            if fut is not None and not fut.done():
                # Timed out: the thread may still write into the slots; free them after.
                fut.add_done_callback(self._after_thread)
            else:
                self._after_thread(fut)
            return 0
        # The thread has returned: nothing writes into the slots any more.
        self._land()
        if self.void:
            safely(engine.unquarantine, slots)  # freed
            return 0
        engine.unquarantine(slots, self.session)
        self._returned = True
        whole = leading_run(codes, lambda c: c == mt.object_bytes)
        for i in range(whole, len(codes)):
            reason = INTEGRITY_CODES.get(codes[i])
            if reason is not None:
                mt.refused += 1
                tier.service.integrity.count(tier.kind.source, reason, model=mt.name, key=keys[i])
        if whole < len(codes):
            code = codes[whole]
            if code in INTEGRITY_CODES:
                self.refused = INTEGRITY_CODES[code]
            else:
                self.late = code == PAST_DEADLINE
                tier.error("get", code_name(code) if code < 0 else "SIZE_MISMATCH")
        if whole == 0:
            self.failed = bool(codes) and self.refused is None
            safely(self.release)
            return 0
        # Bytes and seconds of fetches that brought pages (their ratio is the fetch's
        # GB/s, seal checks included): a read that brought none counts as an error
        # above, not as slow bytes.
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
