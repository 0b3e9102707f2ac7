"""ChangeFeed: one model's change log, watched once for all its Subscribe streams, and
the snapshots they start from, shared.

A Subscribe that walked the whole tree on the event loop for its snapshot, and kept
its own copy while it was sent (a record per node, hex strings: about 7.3 MiB for a
50k-node tree), would stall everyone: about five Subscribes a second push other clients'
p99 to 4.4 s, and fifty subscribers that never read hold 716 MiB. So:

* The feed keeps the model's page set (namespace -> hex page hashes), brought up to
  date from the log, once per loop turn in which the tree changed (``_catch_up``),
  at the cost of a set update per page changed. The tree is walked only to fill it:
  on the model's first Subscribe, and again only if one loop turn changed more than
  the log keeps (a huge eviction), so that the log no longer reaches back. That walk
  goes in slices of ``WALK_SECONDS`` with the loop free between them (``SnapshotWalk``:
  exact at the change it finishes at), and the set is filled from it in slices too;
  Subscribes that come meanwhile wait for the same walk.
* A snapshot packs that set as 32-byte digests in slices of ``ENCODE_SLICE`` pages,
  the loop free between them, while the set stays as it was (its catch-up waits until
  the snapshot is packed): exactly the page set after one change-log seq, however
  large, with no one-turn copy of it.
* Snapshots are shared: every Subscribe at the same change-log position, or while one
  is packed, gets that one (``SharedSnapshot``), and the changes after it from the log;
  so a storm of Subscribes packs one snapshot at a time, however fast the tree
  changes, and a subscriber that never reads pins 32 bytes a page, shared with the
  others.

It also stamps each change with the wall clock (events report ``made_unix_ns``) and
counts the pages after each seq (``pages_after``: how far behind a subscriber is).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from itertools import islice
from typing import NamedTuple

from prefixcache.cache.index.change_log import AllCleared, Change, ChangeLog, PagesStored
from prefixcache.cache.index.snapshot_walk import SnapshotWalk

Namespace = tuple[str | None, int]
# Page hashes packed per slice of a snapshot (a few milliseconds) between loop turns.
ENCODE_SLICE = 16384
# A tree walk's slice (seconds), and the walked nodes put into the page set per slice.
WALK_SECONDS = 0.004
FILL_SLICE = 2048


class SharedSnapshot(NamedTuple):
    """The page set after change ``seq``: per namespace, its pages as packed 32-byte
    digests (in no particular order: a snapshot is a set)."""

    seq: int
    runs: tuple[tuple[Namespace, bytes], ...]
    pages: int


class ChangeFeed:
    """One model's change log, watched once for all its subscribers.

    Args:
        log: the model's change log.
        clock: wall-clock nanoseconds, stamped on each change as it is made.
    """

    def __init__(self, log: ChangeLog, clock: Callable[[], int] = time.time_ns) -> None:
        self.log = log
        self._clock = clock
        self._made: deque[int] = deque(maxlen=log.capacity)
        self._pages: deque[int] = deque(maxlen=log.capacity)  # running page count
        self._pages_total = 0
        self._last_made = -1  # the seq of the newest stamp
        self._waiter: asyncio.Future[None] | None = None
        self.subscribers = 0
        # The page set, as of change _set_seq; None until the first snapshot.
        self._set: dict[Namespace, set[str]] | None = None
        self._set_seq = -1
        self._catch_up_due = False
        self._latest: SharedSnapshot | None = None
        self._building: tuple[int, asyncio.Future[SharedSnapshot]] | None = None
        self._frozen = 0  # snapshots being packed from the page set: it waits for them
        self._filling: asyncio.Future[None] | None = None  # the walk under way
        self.walks = 0  # tree walks made to fill the page set
        self.built = 0  # snapshots built (shared by the streams at one seq)
        self._unwatch = log.watch(self._on_change)

    def close(self) -> None:
        self._unwatch()
        if self._filling is not None:
            self._filling.cancel()
        self._wake()

    def _on_change(self, change: Change) -> None:
        # Runs inside a cache operation: a stamp, a wake-up, a catch-up for later.
        self._made.append(self._clock())
        self._pages_total += len(getattr(change, "page_hashes", ()))
        self._pages.append(self._pages_total)
        self._last_made = change.seq
        if self._set is not None and not self._catch_up_due:
            try:
                asyncio.get_running_loop().call_soon(self._catch_up)
                self._catch_up_due = True
            except RuntimeError:  # no loop (a test driving the engine): caught up lazily
                pass
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def made_ns(self, seq: int) -> int:
        """When change ``seq`` was made (Unix ns), or 0 if that is no longer known."""
        index = seq - (self._last_made - len(self._made) + 1)
        return self._made[index] if 0 <= index < len(self._made) else 0

    def pages_after(self, seq: int) -> int:
        """Pages stored or removed by the changes after ``seq`` (at least: changes too
        old to remember count from the oldest remembered)."""
        if seq >= self._last_made or not self._pages:
            return 0
        index = seq - (self._last_made - len(self._pages) + 1)
        return self._pages_total - self._pages[max(index, 0)]

    async def wait_after(self, seq: int, timeout: float) -> None:
        """Return once the log holds a change after ``seq``, or after ``timeout``."""
        if self.log.last_seq > seq:
            return
        if self._waiter is None or self._waiter.done():
            self._waiter = asyncio.get_running_loop().create_future()
        # wait() leaves the shared future alone on timeout (the others still wait on it).
        await asyncio.wait((self._waiter,), timeout=timeout)

    # ---------------------------------------------------------------- snapshots

    async def snapshot(self) -> SharedSnapshot:
        """The page set after the newest change (or after that of the snapshot being
        packed, if one is), shared with every caller at that seq."""
        self._catch_up()
        while self._set is None:  # the first, or the log no longer reached back
            await self._fill()
            self._catch_up()
        if self._building is not None:
            return await asyncio.shield(self._building[1])
        latest = self._latest
        if latest is not None and latest.seq == self._set_seq:
            return latest
        seq = self._set_seq
        self._building = (seq, asyncio.ensure_future(self._encode(seq)))
        # Shielded: a subscriber that goes away does not cancel the others' snapshot.
        return await asyncio.shield(self._building[1])

    async def _encode(self, seq: int) -> SharedSnapshot:
        runs, pages = [], 0
        self._frozen += 1  # the page set stays at seq until it is packed
        try:
            page_set = self._set if self._set is not None else {}
            for ns, hashes in list(page_set.items()):
                parts, rest = [], iter(hashes)
                while chunk := list(islice(rest, ENCODE_SLICE)):
                    parts.append(bytes.fromhex("".join(chunk)))
                    await asyncio.sleep(0)  # the other calls' turn
                runs.append((ns, b"".join(parts)))
                pages += len(hashes)
        finally:
            self._frozen -= 1
            if not self._frozen:
                self._catch_up()
        snapshot = SharedSnapshot(seq, tuple(runs), pages)
        self.built += 1
        if self._latest is None or self._latest.seq <= seq:
            self._latest = snapshot
        if self._building is not None and self._building[0] == seq:
            self._building = None
        return snapshot

    async def _fill(self) -> None:
        """Fill the page set from a walk of the tree; one walk for every caller."""
        if self._filling is None:
            self._filling = asyncio.ensure_future(self._walk())
        # Shielded: a subscriber that goes away does not cancel the others' walk.
        await asyncio.shield(self._filling)

    async def _walk(self) -> None:
        try:
            while True:
                walk = SnapshotWalk(self.log)
                while not walk.step(WALK_SECONDS):
                    await asyncio.sleep(0)  # the other calls' turn
                walked = walk.finish()
                if walked is not None:
                    break  # else more changed meanwhile than the log keeps: again
            self.walks += 1
            page_set: dict[Namespace, set[str]] = {}
            records, more = walked.records(), True
            while more:
                more = False
                # One record at a time, none kept: a batch held at once would survive
                # collections into the oldest generation and set off a full one.
                for record in islice(records, FILL_SLICE):
                    page_set.setdefault(record.namespace, set()).update(record.page_hashes)
                    more = True
                await asyncio.sleep(0)
            # The set is the tree after walked.seq: _catch_up brings it forward.
            self._set, self._set_seq = page_set, walked.seq
        finally:
            self._filling = None

    def _catch_up(self) -> None:
        """Bring the page set up to the log's newest change (or drop it, for a walk to
        fill again, when the log no longer reaches back to it); not while a snapshot is
        packed from it (``_encode`` catches up once done)."""
        if self._frozen:
            return
        self._catch_up_due = False
        if self._set is None:
            return
        changes = self.log.since(self._set_seq)
        if changes is None:
            self._set = None
            return
        page_set = self._set
        for change in changes:
            if isinstance(change, AllCleared):
                page_set.clear()
            elif isinstance(change, PagesStored):
                page_set.setdefault(change.namespace, set()).update(change.page_hashes)
            else:
                held = page_set.get(change.namespace)
                if held is not None:
                    held.difference_update(change.page_hashes)
                    if not held:
                        del page_set[change.namespace]
            self._set_seq = change.seq
