"""The scheduler side's calls to the service, off vLLM's scheduler thread.

The scheduler core queues operations while vLLM schedules a step and hands them over
as one batch (``dispatch``); a small pool of threads runs the batch's calls at once
over one leased session, so a step's lookups cost one round trip of wall time, not one
per request. Finished calls wait in a queue until the core ``drain``s them on the
scheduler thread, which alone touches the core's state.

With ``fast_miss``, a shadow index of the model's cached pages follows the service's
Subscribe stream on a thread of its own, so that the core can see a certain miss
without a call (``shadow_hit``).

Every failure is an answer, never an exception for vLLM: a lookup that fails is a
miss, a save that fails is skipped. The session (and so every lock and slot it holds)
is the service's to release when this process dies: its lease lapses.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from array import array
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from prefixcache.client import (
    ClientSession,
    DeadlineExceeded,
    ModelInfo,
    PrefixCacheClient,
    PrefixCacheError,
    ShadowFollower,
    Unavailable,
)

from .config import ConnectorConfig

log = logging.getLogger("prefixcache.integrations.vllm")


@dataclass(slots=True)
class Lookup:
    """Match and lock the longest cached prefix of ``tokens`` (a reservation)."""

    key: tuple[str, int]
    tokens: array
    extra_key: str | None
    retain: Any = None  # the request's retention hint (keys.RequestInfo.retention)


@dataclass(slots=True)
class Release:
    """Release a reservation's lock; ``unused``: why its hit went unused, for the
    service's lookup outcomes ("lease_expired"), None when it was used or dropped."""

    lock_id: int
    server_epoch: int
    unused: str | None = None


@dataclass(slots=True)
class SaveAlloc:
    """Lock what is cached of ``tokens`` and allocate slots for the rest (whole pages)."""

    req_id: str
    tokens: array
    extra_key: str | None


@dataclass(slots=True)
class SaveCommit:
    """Insert a saved request's tokens (cached prefix slots, then the written ones) and
    release the save's lock; the service frees the slots it already had."""

    tokens: array
    extra_key: str | None
    slots: array
    lock_id: int
    server_epoch: int
    # slots[owned_from:] are the session's (allocated for the save); those before
    # are the tree's own, from the save's Match.
    owned_from: int = 0
    retain: Any = None  # the request's retention hint, for what the insert caches
    req_id: str = ""  # the vLLM request saved


@dataclass(slots=True)
class SaveAbort:
    """Give back a save's slots and lock without inserting (the copy failed)."""

    slots: array
    lock_id: int
    server_epoch: int


Op = Lookup | Release | SaveAlloc | SaveCommit | SaveAbort


@dataclass(slots=True)
class Done:
    """A finished operation: its reply, or the error it failed with."""

    op: Op
    reply: Any = None
    error: BaseException | None = None
    # The service-side session the call ran in ("" when none was open).
    session_id: str = ""


class RpcBackend:
    """Runs the core's operations against the service (see the module docstring)."""

    def __init__(self, config: ConnectorConfig, *, name: str = "vllm-scheduler") -> None:
        self.config = config
        self.model = config.model
        self._name = name
        self._client = PrefixCacheClient(config.target, **config.client_kwargs(name))
        self._session: ClientSession | None = None
        self._page_size: int | None = None
        # The model as ListModels describes it (page size, a tier below it), asked once
        # off the scheduler thread; None until it answers.
        self._info: ModelInfo | None = None
        self._info_asked = False
        self._lock = threading.Lock()
        # Opening a session is a call that may take ``timeout``: never under _lock,
        # which the scheduler thread takes to dispatch.
        self._open_lock = threading.Lock()
        # While the service is down, lookups and save allocations are not sent (each
        # would wait out its deadline while vLLM holds the request back) until then.
        self._down_until = 0.0
        self._done: queue.SimpleQueue[Done] = queue.SimpleQueue()
        self._inflight = 0
        # The operations dispatched and not finished, by id (``wait_done``).
        self._out: set[int] = set()
        self._idle = threading.Condition(self._lock)
        self._pool = ThreadPoolExecutor(config.max_inflight, thread_name_prefix="prefixcache-vllm")
        self._closed = False
        # Every namespace (LoRA adapters, cache salts) of the model: a miss in any
        # of them is answered locally.
        self.shadow: ShadowFollower | None = (
            self._client.shadow(self.model) if config.fast_miss and config.load else None
        )
        if self.shadow is not None:  # whether a tier lies below the tree, meanwhile
            self._info_asked = True
            self._pool.submit(self._learn_model)
        self.batches = 0
        self.calls = 0
        self.errors = 0
        self.held_back = 0

    # ------------------------------------------------------------- the core's side

    def dispatch(self, ops: list[Op]) -> None:
        """Start every call of ``ops`` now, concurrently."""
        if not ops:
            return
        with self._lock:
            if self._closed:
                return
            self._inflight += len(ops)
            self._out.update(map(id, ops))
            self.batches += 1
        for op in ops:
            self._pool.submit(self._run, op)

    def drain(self) -> list[Done]:
        """The operations finished since the last drain."""
        out: list[Done] = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def in_flight(self) -> bool:
        """Whether a call is out, or done and not drained yet."""
        with self._lock:
            return self._inflight > 0 or not self._done.empty()

    def wait_done(self, ops: list[Op], timeout: float) -> bool:
        """Block until every one of ``ops`` (dispatched) has finished, its answer waiting
        for ``drain``; False on timeout."""
        keys = [id(op) for op in ops]
        with self._idle:
            return self._idle.wait_for(lambda: self._out.isdisjoint(keys), timeout)

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Block until no call is in flight (tests, shutdown); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout)

    @property
    def session_id(self) -> str:
        """The current service-side session ("" before it opened)."""
        session = self._session
        return session.session_id if session is not None else ""

    def session_alive(self, session_id: str) -> bool:
        """Whether ``session_id`` is still this backend's live session (its slots and
        locks still its own)."""
        session = self._session
        return (
            session is not None
            and session.session_id == session_id
            and session.lost is None
            and not session.closed
        )

    def shadow_hit(self, tokens: array, extra_key: str | None) -> int | None:
        """Tokens of ``tokens`` the shadow index holds, from the start (whole pages of
        the service's page size); None when it cannot tell: no shadow, no snapshot yet,
        the stream down, or the shadow known to be behind the service's change log."""
        shadow = self.shadow
        if shadow is None or shadow.error is not None or not shadow.connected:
            return None
        if not self._tree_is_everything():
            return None
        index = shadow.index
        if not index.ready or index.head_seq > index.seq:
            return None
        try:
            return shadow.match(shadow.request_hashes(tokens, extra_key=extra_key))
        except PrefixCacheError:  # tokens the service would refuse too: look up
            return None

    def close(self) -> None:
        """Finish the calls in flight, then close the session (the service releases
        its locks and slots) and the channel."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        session, self._session = self._session, None
        if session is not None:
            try:
                session.close()
            except PrefixCacheError as err:
                log.warning("closing the prefixcache session failed: %s", err)
        self._client.close()

    # ------------------------------------------------------------------ the calls

    def _run(self, op: Op) -> None:
        try:
            done = Done(op, self._call(op))
        except Exception as err:  # every failure is an answer (see the docstring)
            log.debug("prefixcache %s failed: %s", type(op).__name__, err)
            done = Done(op, None, err)
        done.session_id = self.session_id
        with self._lock:
            self.calls += 1
            self.errors += done.error is not None
        self._done.put(done)
        with self._idle:
            self._inflight -= 1
            self._out.discard(id(op))
            self._idle.notify_all()  # wait_done waits for single calls

    def _open(self) -> ClientSession:
        with self._open_lock:
            if self._session is None:
                self._session = self._client.session(
                    self.config.session_ttl, name=self._name, fail_open=True
                )
            return self._session

    def _down(self) -> None:
        """The service did not answer: hold new lookups back for a while."""
        self._down_until = time.monotonic() + min(max(self.config.timeout, 1.0), 5.0)

    def page_size(self) -> int:
        if self._page_size is None:
            self._page_size = self._client.list_models()[self.model].page_size
        return self._page_size

    def wait_fast_miss(self, timeout: float) -> bool:
        """Wait until misses can be answered from the shadow: its first snapshot, and
        the model described (False on timeout, or without a shadow)."""
        deadline = time.monotonic() + timeout
        if self.shadow is None or not self.shadow.wait_ready(timeout):
            return False
        while self._info is None and time.monotonic() < deadline:
            self._tree_is_everything()  # asks again if the first answer failed
            time.sleep(0.01)
        return self._info is not None

    def _tree_is_everything(self) -> bool:
        """Whether the model's tree holds every page the service could answer: not when
        a tier lies below it (a lookup would read the tier's pages), nor before the
        service said (asked once, in the background)."""
        info = self._info
        if info is None:
            if not self._info_asked:
                self._info_asked = True
                self._pool.submit(self._learn_model)
            return False
        return not info.tiered

    def _learn_model(self) -> None:
        try:
            info = self._client.list_models()[self.model]
        except (PrefixCacheError, KeyError) as err:
            log.debug("prefixcache: ListModels for %r failed: %s", self.model, err)
            self._info_asked = False  # asked again by the next shadow_hit
            return
        self._page_size = info.page_size
        self._info = info

    def _call(self, op: Op) -> Any:
        fresh = isinstance(op, Lookup | SaveAlloc)
        if fresh and time.monotonic() < self._down_until:
            self.held_back += 1
            raise Unavailable("the service did not answer lately; not asking yet")
        try:
            reply = self._dispatch_call(op)
        except (Unavailable, DeadlineExceeded):
            self._down()
            raise
        if fresh and getattr(reply, "skipped", False):
            self._down()
        return reply

    def _dispatch_call(self, op: Op) -> Any:
        session = self._open()
        if isinstance(op, Lookup):
            return session.match(
                self.model, op.tokens, extra_key=op.extra_key, lock=True, retain=op.retain
            )
        if isinstance(op, Release):
            return session.unlock(op.lock_id, server_epoch=op.server_epoch, unused=op.unused)
        if isinstance(op, SaveAlloc):
            n = len(op.tokens) // self.page_size() * self.page_size()
            if n == 0:
                return None
            return session.match(
                self.model, op.tokens[:n], extra_key=op.extra_key, lock=True, allocate=True
            )
        if isinstance(op, SaveCommit):
            return self._commit(session, op)
        if isinstance(op, SaveAbort):
            return self._abort(session, op.slots, op.lock_id, op.server_epoch)
        raise TypeError(f"unknown operation {op!r}")

    def _commit(self, session: ClientSession, op: SaveCommit) -> Any:
        reply = session.insert(
            self.model,
            op.tokens,
            op.slots,
            extra_key=op.extra_key,
            release_lock_id=op.lock_id,
            server_epoch=op.server_epoch,
            retain=op.retain,
        )
        if reply.skipped:
            # Not inserted: the slots are still the session's unless the service
            # restarted, in which case they are gone with the lock.
            self._abort(session, op.slots[op.owned_from :], op.lock_id, op.server_epoch)
        return reply

    def _abort(self, session: ClientSession, slots: array, lock_id: int, epoch: int) -> None:
        """Unlock, then free: each is tried even when the other fails (the lock may be
        gone with a Reset while the slots are still the session's)."""
        first: BaseException | None = None
        for call in (
            lambda: lock_id and session.unlock(lock_id, server_epoch=epoch),
            lambda: len(slots) and session.free(self.model, slots, server_epoch=epoch),
        ):
            try:
                call()
            except PrefixCacheError as err:
                first = first or err
        if first is not None:
            raise first
