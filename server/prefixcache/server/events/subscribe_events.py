"""The events of a Subscribe stream, built from a shared snapshot or the change log's
records, within a ``Bound`` (page hashes and bytes) each (subscriptions.py)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

from prefixcache.cache.index.change_log import AllCleared, Change, PagesStored
from prefixcache.v1 import prefix_cache_pb2 as pb

from .change_feed import ChangeFeed, SharedSnapshot

HASH_BYTES = 32
# What a run costs in an event besides its hashes and extra_key (an estimate on the high
# side); events stay within half of server.max_message_bytes, leaving room for one run's
# namespace past the estimate.
_RUN_BYTES = 32

Namespace = tuple[str | None, int]
# One change as the batcher takes it: seq, op, namespace and hex page hashes. op None
# is a change left out (another namespace): it only advances the seq.
_Item = tuple[int, "int | None", "Namespace | None", "tuple[str, ...]"]


class Bound(NamedTuple):
    """How much one event may carry: page hashes, and bytes (estimated)."""

    pages: int
    bytes: int


def _stamp(event: pb.SubscribeEvent, log: Any, epoch: int) -> None:
    event.head_seq = max(log.last_seq, 0)
    event.server_epoch = epoch


def _namespace(ns: Namespace) -> pb.PageNamespace:
    message = pb.PageNamespace(token_width=ns[1])
    if ns[0] is not None:
        message.extra_key = ns[0]
    return message


def _snapshot_events(
    snapshot: SharedSnapshot,
    reason: int,
    page_size: int,
    wanted: frozenset[Namespace] | None,
    bound: Bound,
) -> Iterator[pb.SubscribeEvent]:
    """A shared snapshot's events for one subscriber: slices of its packed hashes."""
    runs = [(ns, data) for ns, data in snapshot.runs if wanted is None or ns in wanted]
    seq = max(snapshot.seq, 0)
    yield pb.SubscribeEvent(
        seq=seq,
        snapshot_begin=pb.SnapshotBegin(
            reason=reason,
            pages=sum(len(data) for _, data in runs) // HASH_BYTES,
            page_size=page_size,
        ),
    )
    event: list[pb.PageRun] = []
    pages = size = 0
    for ns, data in runs:
        cost = _RUN_BYTES + len((ns[0] or "").encode())
        start = 0
        while start < len(data):
            room = min(bound.pages - pages, (bound.bytes - size - cost) // HASH_BYTES)
            if room <= 0 and event:
                yield pb.SubscribeEvent(seq=seq, snapshot_pages=pb.PageRuns(runs=event))
                event, pages, size = [], 0, 0
                continue
            take = max(room, 1) * HASH_BYTES
            run = pb.PageRun(
                op=pb.PAGE_OP_STORED,
                page_hashes=data[start : start + take],
                namespace=_namespace(ns),
            )
            event.append(run)
            pages += len(run.page_hashes) // HASH_BYTES
            size += cost + len(run.page_hashes)
            start += take
    if event:
        yield pb.SubscribeEvent(seq=seq, snapshot_pages=pb.PageRuns(runs=event))
    yield pb.SubscribeEvent(seq=seq, snapshot_end=pb.SnapshotEnd())


def _change_events(
    changes: list[Change],
    before: int,
    wanted: frozenset[Namespace] | None,
    bound: Bound,
    feed: ChangeFeed,
) -> Iterator[pb.SubscribeEvent]:
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
        yield pb.SubscribeEvent(
            seq=seq, made_unix_ns=feed.made_ns(first), changes=pb.PageRuns(runs=runs)
        )


def _batches(
    items: Iterable[_Item], before: int, bound: Bound
) -> Iterator[tuple[list[pb.PageRun], int, int]]:
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
                take = hashes[start : start + max(room, 1)]
                hexes.extend(take)
                pages += len(take)
                size += HASH_BYTES * len(take)
                start += len(take)
        done = seq
    if runs or open_run is not None or done != sent:
        yield flush()
