"""KV-event replay: the ROUTER socket that answers a subscriber's request for missed batches.

Wire (vLLM's replay protocol, plus a refusal; every seq 8 bytes big-endian):

* Request ``[identity, b"", start]`` (a DEALER sends ``[b"", start]``).
* Answer ``[identity, b"", seq, payload]`` for every buffered batch from ``start``, then
  the end marker ``[identity, b"", -1 (signed), b""]``.
* ``start`` older than the buffer (the last ``buffer_steps`` batches): the answer starts
  with a snapshot, one batch stamped with the seq ``S`` it reflects (``AllBlocksCleared``
  and every cached page), followed by the batches after ``S`` and the end marker, so a
  subscriber that fell too far behind resynchronises instead of missing changes.
* Refused: ``[identity, b"", -1, b"busy"]`` (the end marker with a reason) when the
  requester already has ``max_replays_per_peer`` answers in flight or the server has
  ``max_replays``. Nothing was sent; ask again later.

What one unauthenticated peer can cost:

* Snapshots are shared. Requesters behind the buffer all get the same one, reused until
  more than ``buffer_steps`` batches followed it; requesters that come while one is
  built wait for it. Building it walks the tree in slices of a few milliseconds, the
  loop free between them (``SnapshotWalk``: the cache may change meanwhile; the walk is
  brought forward with the log's changes, so the snapshot is exactly the tree at the
  batch it is stamped with), then encodes the records in slices too. The next build
  waits ``_SNAPSHOT_INTERVAL`` seconds, or ``_WALK_SPACING`` times the loop time the
  last build took if that is longer, so snapshots take at most a tenth of the loop
  however large the tree and however fast a peer churns it. One build at a time: it
  holds the tree's records once (as the snapshot kept for reuse does).
* Answers in flight are capped per requester and in total (above), each request answered
  or refused in one loop turn's reading budget; a request frame over
  ``_MAX_REQUEST_BYTES`` disconnects its sender (ZMQ_MAXMSGSIZE).
* A requester that does not read is dropped: the socket queues at most ``_REPLAY_HWM``
  messages per peer (ROUTER_MANDATORY: a full peer fails the send instead of queueing
  more), and an answer that made no progress for ``replay_timeout`` seconds is dropped
  and counted. Payloads are sent without copying, so queued answers share the buffer's
  and the snapshot's bytes. ZMQ keeps what it already queued for a dropped peer (at most
  ``_REPLAY_HWM`` messages) until that peer disconnects.
* Malformed requests are counted, and logged once per ``_LOG_INTERVAL`` with the count.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

import zmq

from prefixcache.cache.index.change_log import ChangeLog, PagesStored
from prefixcache.cache.index.snapshot_walk import SnapshotWalk, Walked

from ..config import KvEventsConfig
from .wire import EventEncoder

log = logging.getLogger("prefixcache.server")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
BUSY = b"busy"
_REPLAY_HWM = 64  # messages queued per requester before sends to it fail
_MAX_REQUEST_BYTES = 1024
_SEND_BURST = 256  # messages sent per loop turn, all answers together
_PER_ANSWER = 32  # of which one answer sends at most this many before the next one's turn
_RECV_BURST = 256  # requests read per loop turn
_ENCODE_SECONDS = 0.004  # snapshot walking or encoding per loop turn
_SNAPSHOT_INTERVAL = 1.0
_WALK_SPACING = 10.0
_LOG_INTERVAL = 60.0
_RETRY_DELAY = 0.02  # after every answer in flight found its peer full


class _Throttled:
    """One WARNING per interval for a recurring event, carrying how often it happened."""

    def __init__(self, message: str, model: str) -> None:
        self.message = message
        self.model = model
        self.count = 0
        self._next = 0.0

    def note(self, **extra: Any) -> None:
        self.count += 1
        now = time.monotonic()
        if now >= self._next:
            log.warning(
                self.message,
                extra={
                    "model": self.model,
                    "count": self.count,
                    "interval_s": _LOG_INTERVAL,
                    **extra,
                },
            )
            self.count = 0
            self._next = now + _LOG_INTERVAL


class _Answer:
    """One requester's answer being sent: ``items``, then the end marker."""

    __slots__ = ("blocked_since", "identity", "items", "pos")

    def __init__(self, identity: bytes, items: list[tuple[int, bytes]]) -> None:
        self.identity = identity
        self.items = items
        self.pos = 0  # len(items): the end marker is next
        self.blocked_since: float | None = None

    def frames(self) -> tuple[bytes, bytes, bytes, bytes]:
        if self.pos >= len(self.items):
            return (self.identity, b"", END_SEQ, b"")
        seq, payload = self.items[self.pos]
        return (self.identity, b"", seq.to_bytes(8, "big"), payload)

    @property
    def done(self) -> bool:
        return self.pos > len(self.items)


class _Snapshot:
    """The page set at ``seq`` as one payload, and the batches published since."""

    def __init__(self, seq: int, walked: Walked, encoder: EventEncoder) -> None:
        self.seq = seq
        self.payload = b""  # set once encoded
        self.tail: list[tuple[int, bytes]] = []
        self._records: Iterator[PagesStored] | None = walked.records()
        self._chains = encoder.fresh_chains()
        self._encoder = encoder
        self._packed = [encoder.pack_event(encoder.all_cleared())]

    def encode_some(self) -> bool:
        """Encode records for about ``_ENCODE_SECONDS``; True once the payload is built."""
        deadline = time.perf_counter() + _ENCODE_SECONDS
        enc, chains, packed = self._encoder, self._chains, self._packed
        records = self._records
        if records is not None:
            more = True
            while more:
                more = False
                for rec in islice(records, 16):  # one at a time, none kept (change_feed)
                    packed.append(enc.pack_event(enc.stored_event(rec, chains)))
                    more = True
                if more and time.perf_counter() > deadline:
                    return False
        self.payload = enc.batch_of_packed(packed)
        self._packed = []
        self._records = None
        return True

    def items(self) -> list[tuple[int, bytes]]:
        """The answer: this snapshot, then what was published after it."""
        return [(self.seq, self.payload), *self.tail]


class ReplayServer:
    """Answers replay requests for one publisher on its ROUTER socket.

    Args:
        model: for log lines.
        sock: the bound ROUTER socket (this object sets its options and owns it).
        buffer: the publisher's ``(seq, payload)`` batches, oldest first.
        newest: the seq of the newest batch published (-1 before any).
        flush: publish what is pending, so the buffer (or a snapshot) is current.
        log: the model's change log (its tree, walked for snapshots).
        encoder: the publisher's encoder (its format and tenant policy).

    Counters: ``served``, ``refused``, ``dropped``, ``invalid``, ``snapshots``; ``peak``:
    the most answers ever in flight at once.
    """

    def __init__(
        self,
        model: str,
        sock: zmq.Socket[bytes],
        cfg: KvEventsConfig,
        *,
        buffer: deque[tuple[int, bytes]],
        newest: Callable[[], int],
        flush: Callable[[], None],
        log: ChangeLog,
        encoder: EventEncoder,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.model = model
        self.served = self.refused = self.dropped = self.invalid = self.snapshots = 0
        self.peak = 0
        self._sock: zmq.Socket[bytes] | None = sock
        self._cfg = cfg
        self._buffer = buffer
        self._newest = newest
        self._flush = flush
        self._log = log
        self._walk: SnapshotWalk | None = None  # the walk of the snapshot being built
        self._build_seconds = 0.0  # loop time the build took so far
        self._encoder = encoder
        self._loop = loop
        self._sending: deque[_Answer] = deque()
        self._waiting: list[bytes] = []  # requesters waiting for a snapshot
        self._per_peer: dict[bytes, int] = {}
        self._ready: _Snapshot | None = None
        self._building: _Snapshot | None = None
        self._build_timer: asyncio.TimerHandle | None = None
        self._step_handle: asyncio.Handle | None = None
        self._next_walk = 0.0  # monotonic time before which no snapshot is built
        self._started = 0.0  # when the build under way began
        self._pump_handle: asyncio.Handle | None = None
        self._serve_handle: asyncio.Handle | None = None
        self._bad = _Throttled("ignoring malformed KV-event replay requests", model)
        self._lost = _Throttled(
            "KV-event replay answers dropped (requester not reading or gone)", model
        )

    @staticmethod
    def configure(sock: zmq.Socket[bytes]) -> None:
        """The socket options, set before it binds."""
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or gone peer fails the send
        sock.setsockopt(zmq.SNDHWM, _REPLAY_HWM)
        sock.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST_BYTES)

    @property
    def in_flight(self) -> int:
        return len(self._sending) + len(self._waiting)

    def start(self) -> None:
        if self._sock is not None:
            self._loop.add_reader(self._sock.getsockopt(zmq.FD), self._serve)

    def close(self) -> None:
        for handle in (self._pump_handle, self._serve_handle, self._build_timer, self._step_handle):
            if handle is not None:
                handle.cancel()
        if self._sock is not None:
            if not self._loop.is_closed():
                self._loop.remove_reader(self._sock.getsockopt(zmq.FD))
            self._sock.close(linger=0)
            self._sock = None
        self._sending.clear()
        self._waiting.clear()
        self._per_peer.clear()
        self._ready = self._building = self._walk = None

    def published(self, seq: int, payload: bytes) -> None:
        """A batch went out: it follows the snapshot being built or kept."""
        if self._building is not None:
            self._building.tail.append((seq, payload))
        ready = self._ready
        if ready is not None:
            ready.tail.append((seq, payload))
            if len(ready.tail) > self._cfg.buffer_steps:
                self._ready = None  # a requester behind would rather get a fresh one

    # ------------------------------------------------------------- requests

    def _serve(self) -> None:
        self._serve_handle = None
        sock = self._sock
        for _ in range(_RECV_BURST):
            if sock is None or not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                break
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._request(frames)
        else:  # more may be queued, and the FD's edge is spent: continue next turn
            self._serve_handle = self._loop.call_soon(self._serve)
        self._pump_soon()

    def _request(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self.invalid += 1
            self._bad.note(frames=len(frames))
            return
        identity = frames[0]
        peer = self._per_peer.get(identity, 0)
        if peer >= self._cfg.max_replays_per_peer or self.in_flight >= self._cfg.max_replays:
            self.refused += 1
            try:
                if self._sock is not None:
                    self._sock.send_multipart((identity, b"", END_SEQ, BUSY), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # full or gone: the refusal is dropped too
            return
        self._per_peer[identity] = peer + 1
        self.peak = max(self.peak, self.in_flight + 1)
        self._flush()  # so the buffer (or a snapshot) is current
        start = int.from_bytes(frames[2], "big")
        oldest = self._buffer[0][0] if self._buffer else self._newest() + 1
        if start >= oldest:
            items = list(islice(self._buffer, start - oldest, None))  # references only
            self._sending.append(_Answer(identity, items))
        elif self._ready is not None:
            self._sending.append(_Answer(identity, self._ready.items()))
        else:
            self._waiting.append(identity)
            self._want_snapshot()

    # ------------------------------------------------------------ snapshots

    def _want_snapshot(self) -> None:
        if self._walk is not None or self._building is not None or self._build_timer is not None:
            return  # the snapshot under way serves this requester too
        delay = self._next_walk - time.monotonic()
        if delay > 0:
            self._build_timer = self._loop.call_later(delay, self._build)
        else:
            self._build()

    def _build(self) -> None:
        self._build_timer = None
        if self._sock is None:
            return
        self._started = time.monotonic()
        self._build_seconds = 0.0
        self._walk = SnapshotWalk(self._log)
        self._step()

    def _step(self) -> None:
        """One slice of the walk, or of the encoding once the walk is done."""
        self._step_handle = None
        if self._sock is None:
            return
        started = time.perf_counter()
        walk = self._walk
        if walk is not None and walk.step(_ENCODE_SECONDS):
            self._flush()  # every change the walk is brought forward with is published
            records = walk.finish()
            if records is None:  # more changed meanwhile than the log keeps: again
                self._walk = SnapshotWalk(self._log)
            else:
                self._walk = None
                self._building = _Snapshot(self._newest(), records, self._encoder)
        elif walk is None and self._building is not None and self._building.encode_some():
            self._built()
        self._build_seconds += time.perf_counter() - started
        if self._walk is not None or self._building is not None:
            self._step_handle = self._loop.call_soon(self._step)

    def _built(self) -> None:
        snap, self._building = self._building, None
        if snap is None:
            return
        self._next_walk = self._started + max(
            _SNAPSHOT_INTERVAL, _WALK_SPACING * self._build_seconds
        )
        self._ready = snap
        self.snapshots += 1
        for identity in self._waiting:
            self._sending.append(_Answer(identity, snap.items()))
        self._waiting.clear()
        self._pump_soon()

    # -------------------------------------------------------------- sending

    def _pump_soon(self, delay: float = 0.0) -> None:
        if self._pump_handle is None and self._sending and self._sock is not None:
            self._pump_handle = (
                self._loop.call_later(delay, self._pump)
                if delay
                else self._loop.call_soon(self._pump)
            )

    def _pump(self) -> None:
        self._pump_handle = None
        sock = self._sock
        if sock is None:
            return
        budget = _SEND_BURST
        now = time.monotonic()
        moved = False
        for _ in range(len(self._sending)):
            if budget <= 0:
                break
            answer = self._sending.popleft()
            sent, outcome = self._send_some(sock, answer, min(budget, _PER_ANSWER), now)
            budget -= sent
            moved = moved or sent > 0
            if outcome == "done":
                self.served += 1
                self._release(answer.identity)
            elif outcome == "drop":
                self.dropped += 1
                self._lost.note()
                self._release(answer.identity)
            else:
                self._sending.append(answer)
        # Everything blocked on full peers: look again shortly, not on every loop turn.
        self._pump_soon(0.0 if moved else _RETRY_DELAY)
        # Sending may have consumed the FD's edge for a request that came meanwhile.
        if self._serve_handle is None and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._serve_handle = self._loop.call_soon(self._serve)

    def _send_some(
        self, sock: zmq.Socket[bytes], answer: _Answer, limit: int, now: float
    ) -> tuple[int, str]:
        sent = 0
        while sent < limit:
            try:
                sock.send_multipart(answer.frames(), zmq.NOBLOCK, copy=False)
            except zmq.Again:  # the requester's queue is full: it is not reading
                if answer.blocked_since is None:
                    answer.blocked_since = now
                elif now - answer.blocked_since > self._cfg.replay_timeout:
                    return sent, "drop"
                return sent, "wait"
            except zmq.ZMQError:  # EHOSTUNREACH: the requester left
                return sent, "drop"
            answer.blocked_since = None
            answer.pos += 1
            sent += 1
            if answer.done:
                return sent, "done"
        return sent, "more"

    def _release(self, identity: bytes) -> None:
        left = self._per_peer.get(identity, 1) - 1
        if left > 0:
            self._per_peer[identity] = left
        else:
            self._per_peer.pop(identity, None)
