"""Subscribe: a model's change log streamed to the workers' shadow indexes.

A stream is a snapshot of the cached pages, then the log's records after it
(``ChangeLog.since``), each event stamped with the seq the replica reaches by applying
it. The wire shapes are documented in the proto (SubscribeEvent).

Bounded per subscriber and in all, never blocking the loop:

* Snapshots come from the model's ``ChangeFeed`` (change_feed.py): copied from a page
  set kept up to date from the log, packed in slices that yield to the loop, and shared
  by every stream at the same change-log position.
* A subscriber owns no queue. It keeps a cursor (the last seq it sent) and reads the
  change log's own bounded buffer from there, at most ``CHANGES_PER_PASS`` records at a
  time. When it is further behind than the log reaches (``since`` answers None) it gets
  a fresh snapshot: never a silent gap.
* Events carry at most 8192 page hashes (32 bytes each), and at least
  ``MIN_PAGES_PER_EVENT`` (a smaller ``max_pages_per_event`` is raised to it: tiny
  events cost about ten times the CPU per page), and stay within half of
  ``server.max_message_bytes``.
* Streams are counted: at most ``server.max_subscribe_streams`` in all,
  ``server.max_session_subscribes`` per session (a request names its session_id to
  count against it) and ``server.max_subscribes_per_client`` per client (the
  session's client, else ``tenants.client_identity`` of the caller: one peer without
  a session could otherwise take every stream), RESOURCE_EXHAUSTED beyond any.
* A subscriber that is more than ``server.max_subscriber_pending_bytes`` behind (32
  bytes per page hash of its snapshot not yet sent and of the changes after its
  cursor) and has not taken an event for a whole watchdog period (``WATCH_EVERY``
  seconds) is dropped: the watchdog cancels its stream, which ends RESOURCE_EXHAUSTED.
  One that never reads stops at its first blocked write (once gRPC's buffers are full)
  and is dropped once the tree has changed by that much since; until then it pins at
  most its snapshot, shared. One that reads is never dropped for a burst of changes.
  A stream whose session ends is ended too (NOT_FOUND).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

from prefixcache.cache import InvalidInputError
from prefixcache.v1 import prefix_cache_pb2 as pb

from ..access.limits import Limits
from ..access.tenants import CALLER, PEER, client_identity
from ..codec import MAX_TOKEN_WIDTH
from ..errors import DrainingError, NotFoundError, OverLimitError, PreconditionError, TooLargeError
from ..service import CacheService
from ..sessions.session import Session
from .change_feed import ChangeFeed
from .subscribe_events import (  # noqa: F401 - _batches: tests check the batcher itself
    HASH_BYTES,
    Bound,
    Namespace,
    _batches,
    _change_events,
    _snapshot_events,
    _stamp,
)

MAX_PAGES_PER_EVENT = 8192
MIN_PAGES_PER_EVENT = 256
MAX_NAMESPACES = 1024
# Change records a stream takes from the log at a time (and so may pin, if it stalls).
CHANGES_PER_PASS = 1024
# The watchdog's period, and how long a dropped stream's status may wait to be sent
# (behind the events its subscriber has not read) before the call is cancelled.
WATCH_EVERY = 0.5
DROP_WAIT = 1.0
# max_subscriber_pending_bytes 0: this, or twice the largest model's pages, if more.
DEFAULT_PENDING_BYTES = 64 << 20
# An idle subscriber looks at the draining flag this often, so shutdown ends it
# (UNAVAILABLE) instead of waiting out the grace period.
IDLE_POLL = 0.25


class Stream:
    """One open Subscribe stream: what the watchdog needs to judge it."""

    def __init__(self, feed: ChangeFeed, session: Session | None, client: str, seq: int) -> None:
        self.feed = feed
        self.session = session
        self.client = client
        self.seq = seq  # the seq of the last event written
        self.snapshot_left = 0  # bytes of its snapshot's page hashes not yet written
        self.task: asyncio.Task[Any] | None = None
        self.dropped: Exception | None = None
        self.events: AsyncIterator[pb.SubscribeEvent] | None = None
        self.writes = 0  # events written
        self.watched = -1  # ``writes`` when the watchdog last looked

    def stalled(self) -> bool:
        """Whether no event was written since the watchdog last looked (it notes now)."""
        stalled, self.watched = self.writes == self.watched, self.writes
        return stalled

    def pending(self) -> int:
        """Bytes of page hashes this subscriber has yet to be sent."""
        return self.snapshot_left + HASH_BYTES * self.feed.pages_after(self.seq)

    def written(self, event: pb.SubscribeEvent) -> None:
        self.writes += 1
        self.seq = event.seq
        body = event.WhichOneof("body")
        if body == "snapshot_begin":
            self.snapshot_left = HASH_BYTES * event.snapshot_begin.pages
        elif body == "snapshot_pages":
            self.snapshot_left -= sum(len(run.page_hashes) for run in event.snapshot_pages.runs)
        elif body == "snapshot_end":
            self.snapshot_left = 0


class Subscriptions:
    """Validates Subscribe requests and runs their streams (see the module docstring).

    Args:
        service: the models (their engines' ``change_log``), sessions, draining flag.
        limits: ``max_extra_key_bytes`` bounds a namespace filter's keys; the stream
            caps and ``max_subscriber_pending_bytes``.
        max_message_bytes: events stay below it.
    """

    def __init__(self, service: CacheService, limits: Limits, max_message_bytes: int) -> None:
        self.service = service
        self.limits = limits
        self.max_bytes = max(max_message_bytes // 2, 1024)
        self.max_pages = max(1, min(MAX_PAGES_PER_EVENT, self.max_bytes // HASH_BYTES))
        self.min_pages = min(MIN_PAGES_PER_EVENT, self.max_pages)
        self.feeds: dict[str, ChangeFeed] = {}
        self.streams: set[Stream] = set()
        self.per_session: dict[str, int] = {}
        self.per_client: dict[str, int] = {}
        self.dropped = 0  # streams the watchdog ended
        self._watch: asyncio.TimerHandle | None = None
        pages = max(
            (e.pool_size // max(e.page_size, 1) for e in service.engines.values()), default=0
        )
        self.max_pending = limits.max_subscriber_pending_bytes or max(
            DEFAULT_PENDING_BYTES, 2 * HASH_BYTES * pages
        )

    def close(self) -> None:
        for feed in self.feeds.values():
            feed.close()
        self.feeds.clear()
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def stream(self, request: pb.SubscribeRequest) -> Stream:
        """Open a stream for ``request`` (counted until ``run`` ends it); every check runs
        here, before the first event.

        Raises:
            DrainingError, NotFoundError, PreconditionError, InvalidInputError,
            TooLargeError, OverLimitError: refusals, with nothing started.
        """
        if self.service.draining:
            raise DrainingError("the service is shutting down")
        engine = self.service.engine(request.model)
        log = getattr(engine, "change_log", None)
        if log is None:
            if engine.kind in ("slot", "chunk"):
                raise PreconditionError(
                    f"model {engine.name!r} (kind {engine.kind}) caches no pages to subscribe to"
                )
            raise PreconditionError(
                "the service runs without change logs "
                "(server.change_log_capacity 0): nothing to subscribe to"
            )
        wanted = self._namespaces(request.namespaces)
        after = request.after_seq if request.HasField("after_seq") else None
        epoch = self.service.epoch
        reason = pb.SNAPSHOT_REASON_NEW
        if after is not None:
            if request.server_epoch != epoch:
                after, reason = None, pb.SNAPSHOT_REASON_EPOCH
            elif after > log.last_seq:
                raise InvalidInputError(
                    f"after_seq {after} is past the newest change "
                    f"({log.last_seq}) of model {engine.name!r}"
                )
            else:  # a snapshot only if the log no longer reaches back to it
                reason = pb.SNAPSHOT_REASON_BEHIND
        session = self.service.session(request.session_id) if request.session_id else None
        client = (
            session.client
            if session is not None and session.client
            else client_identity(CALLER.get(), PEER.get(), "")
        )
        self._check_caps(session, client)
        feed = self.feeds.get(engine.name)
        if feed is None:
            feed = self.feeds[engine.name] = ChangeFeed(log)
        asked = request.max_pages_per_event or self.max_pages
        bound = Bound(max(min(asked, self.max_pages), self.min_pages), self.max_bytes)
        opened = Stream(feed, session, client, log.last_seq if after is None else after)
        opened.events = self._events(feed, engine.page_size, epoch, after, reason, wanted, bound)
        self._count(opened, 1)
        return opened

    def _check_caps(self, session: Session | None, client: str) -> None:
        cap = self.limits.max_subscribe_streams
        if len(self.streams) >= cap:
            raise OverLimitError(
                f"{len(self.streams)} Subscribe streams are open, the {cap} "
                "the service allows (server.max_subscribe_streams)",
                "max_subscribe_streams",
            )
        cap = self.limits.max_session_subscribes
        if session is not None and self.per_session.get(session.id, 0) >= cap:
            raise OverLimitError(
                f"this session has {cap} Subscribe streams open, the most "
                "one session may (server.max_session_subscribes)",
                "max_session_subscribes",
            )
        cap = self.limits.max_subscribes_per_client
        if cap and self.per_client.get(client, 0) >= cap:
            raise OverLimitError(
                f"this client has {cap} Subscribe streams open, the most "
                "one client may (server.max_subscribes_per_client)",
                "max_subscribes_per_client",
            )

    def _count(self, opened: Stream, step: int) -> None:
        feed, session = opened.feed, opened.session
        feed.subscribers += step
        if step > 0:
            self.streams.add(opened)
        else:
            self.streams.discard(opened)
        if session is not None:
            _add(self.per_session, session.id, step)
        _add(self.per_client, opened.client, step)
        if self.streams and self._watch is None:
            self._watch = asyncio.get_running_loop().call_later(WATCH_EVERY, self._watchdog)

    async def run(
        self, opened: Stream, write: Callable[[pb.SubscribeEvent], Awaitable[None]]
    ) -> None:
        """Write ``opened``'s events until it ends: the client goes, the service drains,
        or the watchdog drops it (its reason raised here)."""
        events = opened.events
        if events is None:
            raise RuntimeError("a stream runs once")
        opened.events = None
        opened.task = asyncio.current_task()
        try:
            async for event in events:
                await write(event)
                opened.written(event)
        except asyncio.CancelledError:
            if opened.dropped is None:
                raise
            if opened.task is not None:
                opened.task.uncancel()  # the drop is an answer, not a cancellation
            raise opened.dropped from None
        finally:
            self._count(opened, -1)
            await events.aclose()

    def _watchdog(self) -> None:
        """Drop the streams too far behind, or whose session ended."""
        self._watch = None
        sessions = self.service.sessions
        for opened in list(self.streams):
            if opened.dropped is not None or opened.task is None:
                continue
            session = opened.session
            if session is not None and sessions.find(session.id) is not session:
                opened.dropped = NotFoundError(
                    "the session this Subscribe stream counted "
                    "against has ended (closed or expired)"
                )
            elif opened.stalled() and (pending := opened.pending()) > self.max_pending:
                opened.dropped = OverLimitError(
                    f"this subscriber is {pending} bytes of page hashes behind, more than "
                    f"the {self.max_pending} allowed (server.max_subscriber_pending_bytes): "
                    "dropped; read faster, or subscribe again for a fresh snapshot",
                    "max_subscriber_pending_bytes",
                )
            else:
                continue
            self.dropped += 1
            opened.task.cancel()
        if self.streams:
            self._watch = asyncio.get_running_loop().call_later(WATCH_EVERY, self._watchdog)

    def _namespaces(self, entries: Iterable[pb.PageNamespace]) -> frozenset[Namespace] | None:
        entries = list(entries)
        if not entries:
            return None
        if len(entries) > MAX_NAMESPACES:
            raise InvalidInputError(
                f"namespaces has {len(entries)} entries, more than {MAX_NAMESPACES}"
            )
        cap = self.limits.max_extra_key_bytes
        wanted = set()
        for entry in entries:
            key = entry.extra_key if entry.HasField("extra_key") else None
            if key is not None and len(key.encode()) > cap:
                raise TooLargeError(
                    f"namespaces: an extra_key is longer than {cap} bytes, "
                    "the limit server.max_extra_key_bytes",
                    "max_extra_key_bytes",
                )
            width = entry.token_width or 1
            if width > MAX_TOKEN_WIDTH:
                raise InvalidInputError(
                    f"namespaces: token_width {width} is above the supported {MAX_TOKEN_WIDTH}"
                )
            wanted.add((key, width))
        return frozenset(wanted)

    async def _events(
        self,
        feed: ChangeFeed,
        page_size: int,
        epoch: int,
        cursor: int | None,
        reason: int,
        wanted: frozenset[Namespace] | None,
        bound: Bound,
    ) -> AsyncIterator[pb.SubscribeEvent]:
        log = feed.log
        while True:
            if cursor is None:
                snapshot = await feed.snapshot()
                for event in _snapshot_events(snapshot, reason, page_size, wanted, bound):
                    _stamp(event, log, epoch)
                    yield event
                cursor, reason = snapshot.seq, pb.SNAPSHOT_REASON_BEHIND
                del snapshot  # pinned no longer than it is sent
            changes = log.since(cursor)
            if changes is None:  # fell behind the log: start over from a snapshot
                cursor = None
                continue
            if not changes:
                if self.service.draining:
                    raise DrainingError("the service is shutting down")
                await feed.wait_after(cursor, IDLE_POLL)
                continue
            changes = changes[:CHANGES_PER_PASS]
            for event in _change_events(changes, cursor, wanted, bound, feed):
                _stamp(event, log, epoch)
                yield event
            cursor = changes[-1].seq


def _add(counts: dict[str, int], key: str, step: int) -> None:
    """Count ``step`` more for ``key``; a key at zero has no entry (bounded by the
    streams open)."""
    left = counts.get(key, 0) + step
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)
