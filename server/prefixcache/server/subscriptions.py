"""Subscribe: a model's change log streamed to the workers' shadow indexes.

A stream is a snapshot of the cached pages (``ChangeLog.snapshot``), then the log's
records after it (``ChangeLog.since``), each event stamped with the seq the replica
reaches by applying it. The wire shapes are documented in the proto (SubscribeEvent).

Bounded per subscriber, never blocking the loop:

* A subscriber owns no queue. It keeps a cursor (the last seq it sent) and reads the
  change log's own bounded buffer from there, so a slow subscriber costs nothing while
  it lags. Each ``yield`` waits for gRPC's flow control (a few MiB in flight at most),
  so a subscriber that reads slowly, or not at all, stops this generator instead of
  piling events up in memory. When it is further behind than the log reaches
  (``since`` answers None) it gets a fresh snapshot: never a silent gap.
* Events carry at most 8192 page hashes (32 bytes each) and stay within half of
  ``server.max_message_bytes``, so each is built in bounded time and fits any client
  that accepts the service's message size; the loop serves other calls between events.
* The snapshot walk itself runs in one go (its page set must be one instant's), costing
  a pass over the tree's nodes; encoding it is spread over its events.

One ``ChangeFeed`` per model (made on the first Subscribe) watches the log once for all
its subscribers: it wakes the idle ones and notes when each change was made, which
events report as ``made_unix_ns`` (the subscriber's lag in milliseconds).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any, NamedTuple

from prefixcache.cache import InvalidInputError
from prefixcache.cache.change_log import AllCleared, Change, ChangeLog, PagesStored, Snapshot
from prefixcache.v1 import prefix_cache_pb2 as pb

from .codec import MAX_TOKEN_WIDTH
from .errors import DrainingError, PreconditionError, TooLargeError
from .limits import Limits
from .service import CacheService

MAX_PAGES_PER_EVENT = 8192
MAX_NAMESPACES = 1024
HASH_BYTES = 32
# What a run costs in an event besides its hashes and extra_key (an estimate on the high
# side); events stay within half of server.max_message_bytes, leaving room for one run's
# namespace past the estimate.
_RUN_BYTES = 32


class Bound(NamedTuple):
    """How much one event may carry: page hashes, and bytes (estimated)."""

    pages: int
    bytes: int
# An idle subscriber looks at the draining flag this often, so shutdown ends it
# (UNAVAILABLE) instead of waiting out the grace period.
IDLE_POLL = 0.25

Namespace = tuple[str | None, int]
# One change as the batcher takes it: seq, op, namespace and hex page hashes. op None
# is a change left out (another namespace): it only advances the seq.
_Item = tuple[int, "int | None", "Namespace | None", "tuple[str, ...]"]


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
        self._last_made = -1  # the seq of the newest stamp
        self._waiter: asyncio.Future[None] | None = None
        self.subscribers = 0
        self._unwatch = log.watch(self._on_change)

    def close(self) -> None:
        self._unwatch()
        self._wake()

    def _on_change(self, change: Change) -> None:
        # Runs inside a cache operation: a stamp and a wake-up, nothing more.
        self._made.append(self._clock())
        self._last_made = change.seq
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def made_ns(self, seq: int) -> int:
        """When change ``seq`` was made (Unix ns), or 0 if that is no longer known."""
        index = seq - (self._last_made - len(self._made) + 1)
        return self._made[index] if 0 <= index < len(self._made) else 0

    async def wait_after(self, seq: int, timeout: float) -> None:
        """Return once the log holds a change after ``seq``, or after ``timeout``."""
        if self.log.last_seq > seq:
            return
        if self._waiter is None or self._waiter.done():
            self._waiter = asyncio.get_running_loop().create_future()
        # wait() leaves the shared future alone on timeout (the others still wait on it).
        await asyncio.wait((self._waiter,), timeout=timeout)


class Subscriptions:
    """Validates Subscribe requests and runs their streams (see the module docstring).

    Args:
        service: the models (their engines' ``change_log``) and the draining flag.
        limits: ``max_extra_key_bytes`` bounds a namespace filter's keys.
        max_message_bytes: events stay below it.
    """

    def __init__(self, service: CacheService, limits: Limits, max_message_bytes: int) -> None:
        self.service = service
        self.limits = limits
        self.max_bytes = max(max_message_bytes // 2, 1024)
        self.max_pages = max(1, min(MAX_PAGES_PER_EVENT, self.max_bytes // HASH_BYTES))
        self.feeds: dict[str, ChangeFeed] = {}

    def close(self) -> None:
        for feed in self.feeds.values():
            feed.close()
        self.feeds.clear()

    def stream(self, request: pb.SubscribeRequest) -> AsyncIterator[pb.SubscribeEvent]:
        """The events for ``request``; every check runs here, before the first event.

        Raises:
            DrainingError, NotFoundError, PreconditionError, InvalidInputError,
            TooLargeError: refusals, with nothing started.
        """
        if self.service.draining:
            raise DrainingError("the service is shutting down")
        engine = self.service.engine(request.model)
        log = getattr(engine, "change_log", None)
        if log is None:
            if engine.kind in ("slot", "chunk"):
                raise PreconditionError(f"model {engine.name!r} (kind {engine.kind}) caches "
                                        "no pages to subscribe to")
            raise PreconditionError("the service runs without change logs "
                                    "(server.change_log_capacity 0): nothing to subscribe to")
        wanted = self._namespaces(request.namespaces)
        after = request.after_seq if request.HasField("after_seq") else None
        epoch = self.service.epoch
        reason = pb.SNAPSHOT_REASON_NEW
        if after is not None:
            if request.server_epoch != epoch:
                after, reason = None, pb.SNAPSHOT_REASON_EPOCH
            elif after > log.last_seq:
                raise InvalidInputError(f"after_seq {after} is past the newest change "
                                        f"({log.last_seq}) of model {engine.name!r}")
            else:  # a snapshot only if the log no longer reaches back to it
                reason = pb.SNAPSHOT_REASON_BEHIND
        feed = self.feeds.get(engine.name)
        if feed is None:
            feed = self.feeds[engine.name] = ChangeFeed(log)
        bound = Bound(min(request.max_pages_per_event or self.max_pages, self.max_pages),
                      self.max_bytes)
        return self._events(feed, engine.page_size, epoch, after, reason, wanted, bound)

    def _namespaces(self, entries: Iterable[pb.PageNamespace]) -> frozenset[Namespace] | None:
        entries = list(entries)
        if not entries:
            return None
        if len(entries) > MAX_NAMESPACES:
            raise InvalidInputError(f"namespaces has {len(entries)} entries, more than "
                                    f"{MAX_NAMESPACES}")
        cap = self.limits.max_extra_key_bytes
        wanted = set()
        for entry in entries:
            key = entry.extra_key if entry.HasField("extra_key") else None
            if key is not None and len(key.encode()) > cap:
                raise TooLargeError(f"namespaces: an extra_key is longer than {cap} bytes, "
                                    "the limit server.max_extra_key_bytes",
                                    "max_extra_key_bytes")
            width = entry.token_width or 1
            if width > MAX_TOKEN_WIDTH:
                raise InvalidInputError(f"namespaces: token_width {width} is above the "
                                        f"supported {MAX_TOKEN_WIDTH}")
            wanted.add((key, width))
        return frozenset(wanted)

    async def _events(self, feed: ChangeFeed, page_size: int, epoch: int, cursor: int | None,
                      reason: int, wanted: frozenset[Namespace] | None,
                      bound: Bound) -> AsyncIterator[pb.SubscribeEvent]:
        log = feed.log
        feed.subscribers += 1
        try:
            while True:
                if cursor is None:
                    snapshot = log.snapshot()
                    for event in _snapshot_events(snapshot, reason, page_size, wanted,
                                                  bound):
                        _stamp(event, log, epoch)
                        yield event
                    cursor, reason = snapshot.seq, pb.SNAPSHOT_REASON_BEHIND
                changes = log.since(cursor)
                if changes is None:  # fell behind the log: start over from the tree
                    cursor = None
                    continue
                if not changes:
                    if self.service.draining:
                        raise DrainingError("the service is shutting down")
                    await feed.wait_after(cursor, IDLE_POLL)
                    continue
                for event in _change_events(changes, cursor, wanted, bound, feed):
                    _stamp(event, log, epoch)
                    yield event
                cursor = changes[-1].seq
        finally:
            feed.subscribers -= 1


def _stamp(event: pb.SubscribeEvent, log: ChangeLog, epoch: int) -> None:
    event.head_seq = max(log.last_seq, 0)
    event.server_epoch = epoch


def _namespace(ns: Namespace) -> pb.PageNamespace:
    message = pb.PageNamespace(token_width=ns[1])
    if ns[0] is not None:
        message.extra_key = ns[0]
    return message


def _snapshot_events(snapshot: Snapshot, reason: int, page_size: int,
                     wanted: frozenset[Namespace] | None,
                     bound: Bound) -> Iterator[pb.SubscribeEvent]:
    records = [r for r in snapshot.pages if wanted is None or r.namespace in wanted]
    seq = max(snapshot.seq, 0)
    yield pb.SubscribeEvent(seq=seq, snapshot_begin=pb.SnapshotBegin(
        reason=reason, pages=sum(len(r.page_hashes) for r in records), page_size=page_size))
    items = ((seq, pb.PAGE_OP_STORED, r.namespace, r.page_hashes) for r in records)
    for runs, _, _ in _batches(items, seq, bound):
        yield pb.SubscribeEvent(seq=seq, snapshot_pages=pb.PageRuns(runs=runs))
    yield pb.SubscribeEvent(seq=seq, snapshot_end=pb.SnapshotEnd())


def _change_events(changes: list[Change], before: int, wanted: frozenset[Namespace] | None,
                   bound: Bound, feed: ChangeFeed) -> Iterator[pb.SubscribeEvent]:
    def items() -> Iterator[_Item]:
        for change in changes:
            if isinstance(change, AllCleared):
                yield change.seq, pb.PAGE_OP_CLEARED, None, ()
            elif wanted is not None and change.namespace not in wanted:
                yield change.seq, None, None, ()
            else:
                op = pb.PAGE_OP_STORED if isinstance(change, PagesStored) else pb.PAGE_OP_REMOVED
                yield change.seq, op, change.namespace, change.page_hashes

    for runs, seq, first in _batches(items(), before, bound):
        yield pb.SubscribeEvent(seq=seq, made_unix_ns=feed.made_ns(first),
                                changes=pb.PageRuns(runs=runs))


def _batches(items: Iterable[_Item], before: int,
             bound: Bound) -> Iterator[tuple[list[pb.PageRun], int, int]]:
    """Group changes into events of at most ``bound.pages`` hashes and about
    ``bound.bytes`` bytes (one run's namespace may go over).

    Yields ``(runs, seq, first)``: the event's runs (consecutive changes of one op and
    namespace merged into one run), the seq of the last change wholly in this event or
    before it (``before`` if none), and the seq of the first change it touches. A change
    larger than an event is split over several.
    """
    runs: list[pb.PageRun] = []
    hexes: list[str] = []  # the open run's hashes
    open_run: tuple[Any, Any] | None = None  # (op, namespace) of the open run
    pages = size = 0
    done, first, sent = before, None, before

    def close_run() -> None:
        nonlocal open_run
        if open_run is not None:
            op, ns = open_run
            run = pb.PageRun(op=op, page_hashes=bytes.fromhex("".join(hexes)))
            if ns is not None:
                run.namespace.CopyFrom(_namespace(ns))
            runs.append(run)
            hexes.clear()
            open_run = None

    def flush() -> tuple[list[pb.PageRun], int, int]:
        nonlocal runs, pages, size, first, sent
        close_run()
        out = (runs, done, first if first is not None else done)
        runs, pages, size, first, sent = [], 0, 0, None, done
        return out

    for seq, op, ns, hashes in items:
        if first is None:
            first = seq
        if op == pb.PAGE_OP_CLEARED:
            close_run()
            if size + _RUN_BYTES > bound.bytes:
                yield flush()
                first = seq
            runs.append(pb.PageRun(op=op))
            size += _RUN_BYTES
        elif op is not None:
            start = 0
            while start < len(hashes):
                if open_run != (op, ns):
                    close_run()
                    cost = _RUN_BYTES + len((ns[0] or "").encode())
                    if size and size + cost + HASH_BYTES > bound.bytes:
                        yield flush()
                        first = seq
                    open_run = (op, ns)
                    size += cost
                room = min(bound.pages - pages, (bound.bytes - size) // HASH_BYTES)
                if room <= 0 and pages:  # full: the rest of this change goes on
                    yield flush()
                    first = seq
                    continue
                take = hashes[start:start + max(room, 1)]
                hexes.extend(take)
                pages += len(take)
                size += HASH_BYTES * len(take)
                start += len(take)
        done = seq
    if runs or open_run is not None or done != sent:
        yield flush()
