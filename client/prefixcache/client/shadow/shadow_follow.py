"""Followers: a ShadowIndex kept current from the Subscribe stream, in the background.

``ShadowFollower`` (blocking client) reads the stream on a daemon thread;
``AsyncShadowFollower`` (asyncio client) in a task. Both resubscribe when the stream
breaks (the service restarted, a network blip), resuming from the replica's seq, so a
short break costs only the changes missed, a long one or a restart a snapshot. A
refusal that retrying cannot fix (an unknown model, a cache kind with no pages, a
missing token) stops the follower and is kept in ``error``; waiting on it raises it.

Meanwhile the replica keeps answering matches from what it last knew: it only ranks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

import grpc

from prefixcache.v1 import prefix_cache_pb2 as pb

from ..errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    PrefixCacheError,
    Unauthenticated,
)
from ..page_chain import RequestHashes
from .shadow import Lag, ShadowIndex, ShadowProtocolError

log = logging.getLogger("prefixcache.client")

# Refusals a resubscription would only repeat.
PERMANENT = (InvalidArgument, NotFound, FailedPrecondition, Unauthenticated, PermissionDenied)

NamespaceLike = Any  # None or a str (an extra_key, width 1), or (extra_key, token_width)


def namespace_filter(namespaces: Iterable[NamespaceLike] | None) -> list[pb.PageNamespace]:
    """SubscribeRequest.namespaces from extra_keys or ``(extra_key, token_width)`` pairs."""
    out = []
    for entry in namespaces or ():
        key, width = entry if isinstance(entry, tuple) else (entry, 1)
        if key is not None and not isinstance(key, str):
            raise InvalidArgument(
                f"a namespace is an extra_key (str or None) or an "
                f"(extra_key, token_width) pair, not {entry!r}"
            )
        message = pb.PageNamespace(token_width=int(width))
        if key is not None:
            message.extra_key = key
        out.append(message)
    return out


def subscribe_request(
    model: str,
    after_seq: int | None,
    server_epoch: int,
    namespaces: Iterable[NamespaceLike] | None,
    max_pages_per_event: int,
) -> pb.SubscribeRequest:
    """The SubscribeRequest of ``subscribe`` (blocking and asyncio clients alike)."""
    request = pb.SubscribeRequest(
        model=model,
        server_epoch=int(server_epoch),
        namespaces=namespace_filter(namespaces),
        max_pages_per_event=int(max_pages_per_event),
    )
    if after_seq is not None:
        request.after_seq = int(after_seq)
    return request


class _FollowerBase:
    """What both followers share: the index, the request, the retry policy."""

    def __init__(
        self,
        client: Any,
        model: str,
        namespaces: Iterable[NamespaceLike] | None,
        max_pages_per_event: int,
        backoff: float,
        max_backoff: float,
    ) -> None:
        self.client = client
        self.index = ShadowIndex(model)
        self.error: PrefixCacheError | None = None
        self.connected = False
        self.subscriptions = 0  # streams opened (1 + reconnects)
        self._namespaces = namespace_filter(namespaces)
        self._max_pages = int(max_pages_per_event)
        self._backoff = float(backoff)
        self._max_backoff = float(max_backoff)
        self._closed = False

    # ------------------------------------------------------------- reading

    @property
    def model(self) -> str:
        return self.index.model

    @property
    def ready(self) -> bool:
        return self.index.ready

    @property
    def lag(self) -> Lag:
        return self.index.lag

    def match(self, request: RequestHashes) -> int:
        """Tokens of ``request`` the shadow holds (``ShadowIndex.match``)."""
        return self.index.match(request)

    def match_pages(self, request: RequestHashes) -> int:
        return self.index.match_pages(request)

    def note(self, request: RequestHashes, pages: int | None = None, first: int = 0) -> None:
        """This worker cached ``request``'s first ``pages`` (``ShadowIndex.note``)."""
        self.index.note(request, pages, first)

    def unnote(self, request: RequestHashes, first: int = 0, end: int | None = None) -> None:
        """They were not cached from page ``first`` on (``ShadowIndex.unnote``)."""
        self.index.unnote(request, first, end)

    def request_hashes(
        self, tokens: Any, *, extra_key: str | None = None, token_width: int | None = None
    ) -> RequestHashes:
        """A ``RequestHashes`` for ``tokens`` in this model's page size (once ready)."""
        if not self.index.page_size:
            raise FailedPrecondition(
                f"the shadow of {self.model!r} has no snapshot yet (wait_ready first)"
            )
        return RequestHashes(
            tokens, page_size=self.index.page_size, extra_key=extra_key, token_width=token_width
        )

    # ------------------------------------------------------------ machinery

    def _request(self) -> pb.SubscribeRequest:
        return self.index.resume_request(self._namespaces, self._max_pages)

    def _apply(self, event: pb.SubscribeEvent) -> None:
        self.index.apply(event)
        if event.HasField("snapshot_end") and event.server_epoch != self.client.server_epoch:
            self.client._seen_epoch(event.server_epoch)  # a restart, seen by the stream

    def _failed(self, err: PrefixCacheError, attempt: int) -> float | None:
        """The delay before resubscribing after ``err``, or None to stop for good."""
        if isinstance(err, ShadowProtocolError):
            log.error("shadow of %r: %s; resubscribing from a snapshot", self.model, err)
            self.index.forget_position()
        elif isinstance(err, FailedPrecondition):
            # A service set up without what a shadow needs (its change log): a choice of
            # its operator, not a fault; what follows the shadow falls back to lookups.
            log.warning(
                "shadow of %r stopped: %s (server.change_log_capacity, e.g. "
                "65536, turns the change log on)",
                self.model,
                err,
            )
            self.error = err
            return None
        elif isinstance(err, PERMANENT):
            log.error("shadow of %r stopped: %s", self.model, err)
            self.error = err
            return None
        return min(self._backoff * 2.0**attempt, self._max_backoff)

    def _crashed(self, exc: Exception) -> None:
        log.exception("shadow of %r stopped by an unexpected error", self.model)
        self.error = PrefixCacheError(f"the shadow follower of {self.model!r} failed: {exc!r}")

    def _delay_after(self, exc: Exception | None, attempt: int) -> float | None:
        """How long to wait before subscribing again after the stream ended (``exc``
        None) or failed with ``exc``; None: stop following."""
        if exc is None:
            return self._failed(PrefixCacheError("the stream ended"), attempt)
        if isinstance(exc, grpc.RpcError):
            return self._failed(self.client._error(exc), attempt)
        if isinstance(exc, ShadowProtocolError):
            return self._failed(exc, attempt)
        self._crashed(exc)  # a bug: stop visibly rather than hang the waiters
        return None

    def _done(self, seq: int | None) -> bool:
        if self.error is not None:
            raise self.error
        return self._closed or (self.index.ready and (seq is None or self.index.seq >= seq))


class ShadowFollower(_FollowerBase):
    """A ShadowIndex of ``model`` kept current on a daemon thread (``client.shadow``).

    Use it as a context manager, or ``close()`` it; closing the client closes it too.
    """

    def __init__(
        self,
        client: Any,
        model: str,
        *,
        namespaces: Iterable[NamespaceLike] | None = None,
        max_pages_per_event: int = 0,
        backoff: float = 0.05,
        max_backoff: float = 1.0,
    ) -> None:
        super().__init__(client, model, namespaces, max_pages_per_event, backoff, max_backoff)
        self._call: Any = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, daemon=True, name=f"prefixcache-shadow-{model}"
        )
        self._thread.start()

    def _run(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            try:
                self._call = self.client._stub.Subscribe(
                    self._request(), metadata=self.client._metadata
                )
                self.subscriptions += 1
                if self._stop.is_set():
                    break
                for event in self._call:
                    self.connected = True
                    self._apply(event)
                    attempt = 0
                delay = self._delay_after(None, attempt)
            except Exception as exc:
                if isinstance(exc, grpc.RpcError) and self._stop.is_set():
                    break  # cancelled by close()
                delay = self._delay_after(exc, attempt)
            finally:
                self.connected = False
                if self._call is not None:
                    self._call.cancel()
            if delay is None:
                break
            attempt += 1
            self._stop.wait(delay)
        with self.index.changed:
            self.index.changed.notify_all()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait for the first snapshot; False on timeout. Raises the follower's error."""
        return self.wait_for_seq(None, timeout)

    def wait_for_seq(self, seq: int | None, timeout: float | None = None) -> bool:
        """Wait until the replica reflects change ``seq`` (of the current epoch)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.index.changed:
            while not self._done(seq):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.index.changed.wait(left)
        return not self._closed

    def close(self) -> None:
        """Stop following (the replica keeps its last state)."""
        self._closed = True
        self._stop.set()
        if self._call is not None:
            self._call.cancel()
        if self._thread is not threading.current_thread():
            self._thread.join(5)

    def __enter__(self) -> ShadowFollower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncShadowFollower(_FollowerBase):
    """The asyncio twin of :class:`ShadowFollower`: the stream is read by a task of the
    running loop (``client.shadow`` in a coroutine)."""

    def __init__(
        self,
        client: Any,
        model: str,
        *,
        namespaces: Iterable[NamespaceLike] | None = None,
        max_pages_per_event: int = 0,
        backoff: float = 0.05,
        max_backoff: float = 1.0,
    ) -> None:
        super().__init__(client, model, namespaces, max_pages_per_event, backoff, max_backoff)
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        attempt = 0
        try:
            while True:
                call = self.client._stub.Subscribe(self._request(), metadata=self.client._metadata)
                self.subscriptions += 1
                try:
                    async for event in call:
                        self.connected = True
                        self._apply(event)
                        self._notify()
                        attempt = 0
                    delay = self._delay_after(None, attempt)
                except Exception as exc:
                    delay = self._delay_after(exc, attempt)
                finally:
                    self.connected = False
                    call.cancel()
                if delay is None:
                    break
                attempt += 1
                await asyncio.sleep(delay)
        finally:
            self._notify()

    def _notify(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    async def wait_ready(self, timeout: float | None = None) -> bool:
        """See ``ShadowFollower.wait_ready``."""
        return await self.wait_for_seq(None, timeout)

    async def wait_for_seq(self, seq: int | None, timeout: float | None = None) -> bool:
        """See ``ShadowFollower.wait_for_seq``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done(seq):
            if self._task.done():
                return False
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except TimeoutError:
                return False
        return not self._closed

    async def close(self) -> None:
        """Stop following (the replica keeps its last state)."""
        self._closed = True
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def __aenter__(self) -> AsyncShadowFollower:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
