"""ShadowIndex: a worker's replica of one model's cached page set, for ranking matches.

A scheduler ranks its waiting requests by how much of each the cache holds, every
step, for every request. Asking the service each time costs a round trip per request;
the shadow index answers from a local replica instead: the page keys (``page_chain``)
the model's tree caches, per namespace, kept up to date from the Subscribe stream
(``shadow_follow`` runs it). A match is a search along the request's own chain of page
keys, computed once and kept with the request (``RequestHashes``): microseconds, no call.

What it is not: an answer that hands out anything. The replica lags the service by the
stream's delay (``lag``), so a page it reports may be gone by the time the request is
admitted, or one it misses may have arrived. It ranks and estimates; the admission's own
match, at the service, is the authority.

Applying the stream (``apply``) keeps the replica exact: after an event it holds the
service's page set as of the event's ``seq``. A snapshot is collected on the side and
swapped in whole when it ends, so matches meanwhile answer from the previous replica.
Thread-safe for one writer (the follower) and any number of readers: ``match`` takes no
lock (set membership is atomic in CPython); ``pages`` copies under the lock.

The worker's own inserts reach the replica through the stream too, a step or two after
the worker queued them. ``note`` makes them visible to ``match`` at once, in a bounded
local overlay (overlay.py) that the stream's later changes reconcile; ``pages`` is the
stream's replica alone, ``local_pages`` the overlay.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from prefixcache.v1 import prefix_cache_pb2 as pb

from ..errors import InvalidArgument, PrefixCacheError
from ..page_chain import DIGEST_BYTES, RequestHashes
from .overlay import LocalOverlay

Namespace = tuple[str | None, int]

_REASONS = {
    pb.SNAPSHOT_REASON_NEW: "new",
    pb.SNAPSHOT_REASON_EPOCH: "epoch",
    pb.SNAPSHOT_REASON_BEHIND: "behind",
}


class ShadowProtocolError(PrefixCacheError):
    """The stream broke the Subscribe protocol (an event out of place, bad hash bytes);
    the follower drops the stream and starts over from a snapshot."""


@dataclass(frozen=True, slots=True)
class Lag:
    """How far the replica trails the service.

    Attributes:
        events: changes behind: the log's newest seq, as the last event reported it,
            minus the replica's.
        ms: how old the newest applied changes were when applied (the service's clock
            to this host's: meaningful on one host), 0 when not known.
    """

    events: int = 0
    ms: float = 0.0


def namespace_of(message: pb.PageNamespace) -> Namespace:
    return (message.extra_key if message.HasField("extra_key") else None, message.token_width or 1)


def _keys(data: bytes) -> list[int]:
    """The page keys of concatenated 32-byte digests: each one's first 8 bytes, native."""
    if len(data) % DIGEST_BYTES:
        raise ShadowProtocolError(
            f"page_hashes has {len(data)} bytes, not whole {DIGEST_BYTES}-byte digests"
        )
    return memoryview(data).cast("Q")[:: DIGEST_BYTES // 8].tolist()


class ShadowIndex:
    """The cached page keys of one model, per namespace, as a Subscribe stream tells.

    Attributes:
        model: the model followed.
        page_size: its tokens per page (0 until the first snapshot).
        seq: the change-log position the replica reflects (-1 before any snapshot).
        head_seq: the log's newest seq, as of the last event.
        server_epoch: the service's epoch the replica comes from.
        ready: a snapshot has been applied (before that every match is 0).
        snapshots: snapshots applied, by reason ("new", "epoch", "behind").
        events_applied: events applied in all.
    """

    def __init__(
        self, model: str, *, lag_samples: int = 4096, overlay_capacity: int = 65536
    ) -> None:
        self.model = model
        self.page_size = 0
        self.seq = -1
        self.head_seq = -1
        self.server_epoch = 0
        self.ready = False
        self.snapshots: Counter[str] = Counter()
        self.events_applied = 0
        self._pages: dict[Namespace, set[int]] = {}
        self._pending: dict[Namespace, set[int]] | None = None
        self._pending_begin: pb.SnapshotBegin | None = None
        self._resumable = False  # seq and epoch may be resumed from
        self._last_ms = 0.0
        self._samples: deque[Lag] = deque(maxlen=lag_samples)
        self._own = LocalOverlay(overlay_capacity)
        self._own_at_begin = 0  # the overlay's generation when the pending snapshot began
        # Guards writes and copies; waiters (the followers') wait on it for changes.
        self.changed = threading.Condition()

    # ------------------------------------------------------------------ reads

    def match_pages(self, request: RequestHashes) -> int:
        """Whole pages of ``request`` the replica (with the overlay) holds, from its start."""
        self._check_page_size(request)
        ns = request.namespace
        pages = self._pages.get(ns)
        own = self._own.get(ns) if self._own else None
        has: Callable[[int], bool]
        if own:  # set lookups both; a copy or a merged set would cost more per match
            stream: AbstractSet[int] = pages or frozenset()
            has = lambda key: key in stream or key in own  # noqa: E731
        elif pages:
            has = pages.__contains__
        else:
            return 0
        total = request.num_pages
        # The page set is closed under prefixes (a page is cached only with the pages
        # before it), so membership along the chain is true, then false: gallop to the
        # first miss (hashing no further than twice the hit), then bisect.
        keys = request._keys  # grown in place by _grow
        hit, probe = 0, 1
        while True:
            probe = min(probe, total)
            if probe == 0:
                return 0
            if probe > len(keys):
                request._grow(probe)
            if not has(keys[probe - 1]):
                miss = probe - 1  # the answer is below probe
                break
            hit = probe
            if probe == total:
                return total
            probe *= 2
        while hit < miss:
            mid = (hit + miss + 1) // 2
            if has(keys[mid - 1]):
                hit = mid
            else:
                miss = mid - 1
        return hit

    def match(self, request: RequestHashes) -> int:
        """Tokens of ``request`` the replica holds (whole pages), an estimate of what a
        match at the service would find (exact for radix models when the replica is
        current; SWA and Mamba models may match less there, see docs/clients.md)."""
        return self.match_pages(request) * request.page_size

    def pages(self) -> dict[Namespace, frozenset[int]]:
        """A copy of the replica: page keys by namespace (``(extra_key, token_width)``)."""
        with self.changed:
            return {ns: frozenset(keys) for ns, keys in self._pages.items()}

    def local_pages(self) -> dict[Namespace, frozenset[int]]:
        """A copy of the overlay: pages this worker noted that the stream has not told
        of yet (``match`` counts them, ``pages`` does not)."""
        with self.changed:
            return self._own.pages()

    def __len__(self) -> int:
        """Pages in the replica (the overlay's not counted)."""
        return sum(len(keys) for keys in list(self._pages.values()))

    @property
    def lag(self) -> Lag:
        return Lag(max(self.head_seq - self.seq, 0), self._last_ms)

    def lag_samples(self) -> list[Lag]:
        """The lag at each recent ``changes`` event applied (at most ``lag_samples``)."""
        with self.changed:
            return list(self._samples)

    def resume_request(
        self, namespaces: list[pb.PageNamespace] | None = None, max_pages_per_event: int = 0
    ) -> pb.SubscribeRequest:
        """The Subscribe request that continues this replica (or starts it)."""
        request = pb.SubscribeRequest(
            model=self.model, namespaces=namespaces or (), max_pages_per_event=max_pages_per_event
        )
        if self.ready and self._resumable:
            request.after_seq = self.seq
            request.server_epoch = self.server_epoch
        return request

    def forget_position(self) -> None:
        """Ask for a snapshot on the next subscription; keep answering meanwhile."""
        with self.changed:
            self._resumable = False
            self._pending = self._pending_begin = None

    # ----------------------------------------------------------------- writes

    def note(self, request: RequestHashes, pages: int | None = None, first: int = 0) -> None:
        """This worker cached (or is about to: its insert is queued) the first ``pages``
        whole pages of ``request`` (all when None): ``match`` counts them from now on,
        until the stream tells of them. Pages the replica holds are left out; so are
        those before page ``first`` (the caller knows them noted or held already)."""
        self._check_page_size(request)
        keys = request.keys(pages)[first:] if first else request.keys(pages)
        if not keys:
            return
        ns = request.namespace
        with self.changed:
            self._own.add(ns, keys, self._pages.get(ns))

    def unnote(self, request: RequestHashes, first: int = 0, end: int | None = None) -> None:
        """The pages of ``request`` from page ``first`` on (to ``end``, all when None)
        were not cached after all (a reply said so): end their overlay entries."""
        self._check_page_size(request)
        keys = request.keys(end)[first:]
        if keys:
            with self.changed:
                self._own.discard(request.namespace, keys)

    def _check_page_size(self, request: RequestHashes) -> None:
        if self.page_size and request.page_size != self.page_size:
            raise InvalidArgument(
                f"the request is hashed in pages of {request.page_size} "
                f"tokens, model {self.model!r} caches pages of "
                f"{self.page_size}"
            )

    def apply(self, event: pb.SubscribeEvent) -> None:
        """Apply one Subscribe event (in stream order).

        Raises:
            ShadowProtocolError: the event does not fit the stream so far; the replica
                keeps its last good state, and the stream must start over.
        """
        body = event.WhichOneof("body")
        with self.changed:
            if body == "changes":
                if (
                    self._pending is not None
                    or not self._resumable
                    or event.server_epoch != self.server_epoch
                    or event.seq < self.seq
                ):
                    raise ShadowProtocolError(f"changes at seq {event.seq} out of place")
                _apply_runs(self._pages, event.changes.runs, self._own)
                self.seq = event.seq
                if event.made_unix_ns:
                    self._last_ms = max(time.time_ns() - event.made_unix_ns, 0) / 1e6
                self._samples.append(Lag(max(event.head_seq - event.seq, 0), self._last_ms))
            elif body == "snapshot_begin":
                self._pending, self._pending_begin = {}, event.snapshot_begin
                self._own_at_begin = self._own.generation
            elif body == "snapshot_pages":
                if self._pending is None:
                    raise ShadowProtocolError("snapshot pages without a snapshot_begin")
                _apply_runs(self._pending, event.snapshot_pages.runs, None)
            elif body == "snapshot_end":
                begin = self._pending_begin
                if self._pending is None or begin is None:
                    raise ShadowProtocolError("snapshot_end without a snapshot_begin")
                self._pages, self._pending, self._pending_begin = self._pending, None, None
                self._own.after_snapshot(self._pages, self._own_at_begin)
                self.page_size = begin.page_size
                self.server_epoch = event.server_epoch
                self.seq = event.seq
                self.ready = self._resumable = True
                self.snapshots[_REASONS.get(begin.reason, "unknown")] += 1
                self._last_ms = 0.0
            else:
                raise ShadowProtocolError(f"unknown Subscribe event {body!r}")
            self.head_seq = max(event.head_seq, self.seq)
            self.events_applied += 1
            self.changed.notify_all()

    def __repr__(self) -> str:
        return f"ShadowIndex({self.model!r}, {len(self)} pages, seq={self.seq}, lag={self.lag})"


def _apply_runs(pages: dict[Namespace, set[int]], runs: Any, own: LocalOverlay | None) -> None:
    """Apply ``runs`` to ``pages``; every page they name ends its ``own`` entry."""
    for run in runs:
        op = run.op
        if op == pb.PAGE_OP_CLEARED:
            pages.clear()
            if own is not None:
                own.clear()
            continue
        ns = namespace_of(run.namespace)
        keys = _keys(run.page_hashes)
        if own and op in (pb.PAGE_OP_STORED, pb.PAGE_OP_REMOVED):
            own.discard(ns, keys)
        if op == pb.PAGE_OP_STORED:
            held = pages.get(ns)
            if held is None:
                pages[ns] = set(keys)
            else:
                held.update(keys)
        elif op == pb.PAGE_OP_REMOVED:
            held = pages.get(ns)
            if held is not None:
                held.difference_update(keys)
                if not held:
                    del pages[ns]
        else:
            raise ShadowProtocolError(f"unknown page op {op}")
