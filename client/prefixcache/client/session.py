"""ClientSession: the blocking client's leased session, renewed by a thread, that
outlives its service-side session."""

from __future__ import annotations

import threading
import weakref
from functools import partial
from types import TracebackType
from typing import Any

from . import step
from ._client_protocol import BlockingClient
from ._core import FAIL_OPEN_ERRORS, log
from ._session_state import SessionState, stand_in, take_fail_open
from .errors import NotFound, PrefixCacheError, StaleEpoch
from .results import (
    AllocReply,
    CloseReply,
    EvictReply,
    InsertReply,
    LockReply,
    MatchReply,
    SessionInfo,
    UnlockReply,
)
from .transfer import kv


class ClientSession:
    """A leased session, renewed in a background thread while it is open.

    It outlives its service-side session: when the service restarts or the lease
    lapses, the next ``match`` or ``alloc`` opens a new one, and calls naming handles
    of the old one (its lock ids, or a ``server_epoch`` that is not the session's) are
    refused without being sent (``SessionLost`` / ``StaleEpoch``; skipped when failing
    open). Pass ``server_epoch=reply.server_epoch`` with the slots of a reply so that
    slots from before a restart are refused too.

    Attributes:
        session_id, ttl, server_epoch: of the current service-side session.
        lost: why the current service-side session is gone, else None.
        reopened: how many times a new service-side session replaced a lost one.
        dropped: calls refused because they named stale handles.
        renewals: successful keep-alives so far.
    """

    def __init__(self, client: BlockingClient, info: SessionInfo | SessionState, *,
                 renew: bool = True, fail_open: bool | None = None,
                 name: str | None = None) -> None:
        self.client = client
        self._state = info if isinstance(info, SessionState) else SessionState(info)
        self.info = SessionInfo(self._state.session_id, self._state.ttl,
                                self._state.server_epoch)
        self.name = name
        self.fail_open = fail_open
        self.closed = False
        self.renewals = 0
        self._renew = renew
        self._reopen_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_renewal()

    session_id = property(lambda self: self._state.session_id)
    ttl = property(lambda self: self._state.ttl)
    server_epoch = property(lambda self: self._state.server_epoch)
    lost = property(lambda self: self._state.lost)
    reopened = property(lambda self: self._state.reopened)
    dropped = property(lambda self: self._state.dropped)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "lost" if self.lost else "open"
        return f"ClientSession({self.session_id[:8]}..., ttl={self.ttl}, {state})"

    def _start_renewal(self) -> None:
        if self._renew and self.ttl > 0 and self.session_id:
            self._stop = threading.Event()
            self._thread = threading.Thread(
                target=_renew, args=(weakref.ref(self), self.client, self.session_id,
                                     self.server_epoch, self.ttl, self._stop),
                daemon=True, name=f"prefixcache-lease-{self.session_id[:8]}")
            self._thread.start()

    def _stop_renewal(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def _reopen(self) -> None:
        """Replace the lost service-side session with a new one."""
        with self._reopen_lock:
            if self._state.lost is None:
                return  # another thread did it
            self._stop_renewal()
            info = self.client.open_session(self.ttl, self.name)
            self.info = info
            self._state.replaced_by(info)
            if self._state.reopened:
                log.warning("session reopened as %s... after losing the last one",
                            info.session_id[:8])
            else:
                log.info("session %s... opened: the service is reachable again",
                         info.session_id[:8])
            self._start_renewal()

    def close(self) -> CloseReply | None:
        """Stop renewing and close the session (releasing its locks and slots).

        Returns what the service released; an empty reply when the service had already
        forgotten the session; None when it failed open (service unreachable). Closing
        twice is a no-op (None).
        """
        if self.closed:
            return None
        self.closed = True
        self._stop_renewal()
        if self.lost is not None:
            return CloseReply()
        try:
            return self.client.close_session(self)
        except (NotFound, StaleEpoch):
            return CloseReply()
        except FAIL_OPEN_ERRORS:
            allowed = self.client.fail_open if self.fail_open is None else self.fail_open
            if allowed:
                return None
            raise

    def __enter__(self) -> ClientSession:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is None:
            self.close()
            return
        try:  # never hide the error that is leaving the block
            self.close()
        except PrefixCacheError as err:
            log.warning("closing session %s... failed: %s", self.session_id[:8], err)

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """``client.<name>`` in this session, across a lost service-side session."""
        fail_open = take_fail_open(name, kwargs, self.fail_open)
        state = self._state
        for attempt in range(2):
            if (refused := state.refusal(name, args, kwargs)) is not None:
                return self.client._stand_in(name, stand_in(name), refused, fail_open)
            if state.needs_reopen(name):
                try:
                    self._reopen()
                except FAIL_OPEN_ERRORS as err:  # a match without allocate may fail open
                    fallback = None if kwargs.get("allocate") else stand_in(name)
                    return self.client._stand_in(name, fallback, err, fail_open)
            try:
                reply = getattr(self.client, name)(*args, session=self, **kwargs)
            except StaleEpoch as err:
                if state.again(name, attempt, err=err):
                    continue  # the service restarted under us
                raise
            if state.again(name, attempt, reply):
                continue
            state.record(name, args, kwargs, reply)
            return reply
        raise AssertionError("unreachable")

    # ------------------------------------------ the client's calls, in this session

    def keep_alive(self, *, timeout: float | None = None) -> float:
        return self.client.keep_alive(self, timeout=timeout)

    def match(self, model: str, tokens: Any, **kwargs: Any) -> MatchReply:
        """``PrefixCacheClient.match`` in this session."""
        return self._call("match", model, tokens, **kwargs)

    def insert(self, model: str, tokens: Any, slots: Any, **kwargs: Any) -> InsertReply:
        """``PrefixCacheClient.insert`` in this session."""
        return self._call("insert", model, tokens, slots, **kwargs)

    def lock(self, model: str, node_id: int, **kwargs: Any) -> LockReply:
        """``PrefixCacheClient.lock`` in this session."""
        return self._call("lock", model, node_id, **kwargs)

    def unlock(self, lock_id: int, **kwargs: Any) -> UnlockReply:
        """``PrefixCacheClient.unlock`` in this session."""
        return self._call("unlock", lock_id, **kwargs)

    def alloc(self, model: str, num_slots: int, **kwargs: Any) -> AllocReply:
        """``PrefixCacheClient.alloc`` in this session (never fails open)."""
        return self._call("alloc", model, num_slots, **kwargs)

    def free(self, model: str, slots: Any = (), **kwargs: Any) -> None:
        """``PrefixCacheClient.free`` in this session."""
        self._call("free", model, slots, **kwargs)

    def step(self, model: str, *, request_id: int | None = None,
             server_epoch: int | None = None, fail_open: bool | None = None,
             timeout: float | None = None, **lists: Any) -> step.StepReply:
        """``PrefixCacheClient.step`` in this session. After the service-side session
        was lost, the items that name its handles (finishes, unlocks, frees, and lock ids
        of an earlier session) are answered ``SessionLost`` without being sent; the
        admissions and decodes go out in a new session."""
        fail_open = self.fail_open if fail_open is None else fail_open
        items = step.StepItems.of(**lists)
        state = self._state
        for attempt in range(2):
            if (refused := step.stale_fence(state, server_epoch)) is not None:
                return self.client._stand_in("step", partial(step.failed_open, items, refused),
                                             refused, fail_open)
            todo = step.plan(state, items)
            if todo.fresh and state.needs_reopen("match"):
                try:
                    self._reopen()
                except FAIL_OPEN_ERRORS as err:
                    return self.client._stand_in(
                        "step", partial(todo.failed_open, err),
                        err, fail_open)
            if not len(todo.send):
                return todo.merge(step.StepReply(server_epoch=state.server_epoch))
            op = self.client._op_step(model, todo.send, self, request_id, server_epoch)
            try:
                reply = self.client._run(op, timeout, fail_open)
            except StaleEpoch:
                if attempt == 0:
                    continue  # the service restarted under us: stale items stay here
                raise
            if reply.skipped and state.lost is not None and attempt == 0:
                continue
            step.record(state, todo.send, reply)
            return todo.merge(reply)
        raise AssertionError("unreachable")

    def write_kv(self, model: str, slots: Any = (), k: Any = None, v: Any = None,
                 **kwargs: Any) -> kv.WriteKVReply:
        """``PrefixCacheClient.write_kv`` in this session."""
        if (refused := self._state.refusal("write_kv", (), kwargs)) is not None:
            raise refused
        return self.client.write_kv(model, slots, k, v, session=self, **kwargs)

    def read_kv(self, model: str, slots: Any = (), **kwargs: Any) -> kv.KVData:
        """``PrefixCacheClient.read_kv`` of slots this session holds or has locked."""
        if (refused := self._state.refusal("read_kv", (), kwargs)) is not None:
            raise refused
        return self.client.read_kv(model, slots, session=self, **kwargs)

    def evict(self, model: str, num_tokens: int = 0, **kwargs: Any) -> EvictReply:
        """``PrefixCacheClient.evict``, attributed to this session."""
        return self.client.evict(model, num_tokens, session=self, **kwargs)


def _renew(ref: weakref.ref[ClientSession], client: BlockingClient, session_id: str,
           epoch: int, ttl: float, stop: threading.Event) -> None:
    """Keep a session's lease alive every ``ttl / 3`` until it is closed or lost.

    The thread holds the session only weakly: a session dropped without ``close`` stops
    being renewed, and its lease lapses, releasing what it held.
    """
    interval = ttl / 3
    timeout = max(min(client.timeout, interval), 0.05)
    while not stop.wait(interval):
        if ref() is None:
            return
        try:
            client._run(client._op_keep_alive(session_id, epoch), timeout)
        except (NotFound, StaleEpoch) as err:
            if (session := ref()) is not None and session.session_id == session_id:
                session._state.mark_lost(err)
            log.warning("session %s... is gone: %s", session_id[:8], err.details)
            return
        except PrefixCacheError as err:  # unreachable for now: try again next tick
            log.debug("keep-alive of session %s... failed: %s", session_id[:8], err)
        except ValueError:  # the channel was closed under us
            return
        else:
            if (session := ref()) is not None:
                session.renewals += 1
