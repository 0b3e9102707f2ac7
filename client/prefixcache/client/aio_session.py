"""The asyncio client's sessions: the calls every session object has, and the leased
session, renewed by a task, that outlives its service-side session (see
``ClientSession``)."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Generator
from functools import partial
from types import TracebackType
from typing import Any

from . import step
from ._client_protocol import AsyncClient
from ._core import FAIL_OPEN_ERRORS, log
from ._session_state import SessionState, stand_in, take_fail_open
from .errors import NotFound, PrefixCacheError, SessionLost, StaleEpoch
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


class _SessionCalls:
    """The cache calls of a session object, passing the session for the caller."""

    client: AsyncClient
    fail_open: bool | None

    async def match(self, model: str, tokens: Any, **kwargs: Any) -> MatchReply:
        kwargs.setdefault("fail_open", self.fail_open)
        return await self._call("match", model, tokens, **kwargs)

    async def insert(self, model: str, tokens: Any, slots: Any, **kwargs: Any) -> InsertReply:
        kwargs.setdefault("fail_open", self.fail_open)
        return await self._call("insert", model, tokens, slots, **kwargs)

    async def lock(self, model: str, node_id: int, **kwargs: Any) -> LockReply:
        kwargs.setdefault("fail_open", self.fail_open)
        return await self._call("lock", model, node_id, **kwargs)

    async def unlock(self, lock_id: int, **kwargs: Any) -> UnlockReply:
        kwargs.setdefault("fail_open", self.fail_open)
        return await self._call("unlock", lock_id, **kwargs)

    async def alloc(self, model: str, num_slots: int, **kwargs: Any) -> AllocReply:
        return await self._call("alloc", model, num_slots, **kwargs)

    async def free(self, model: str, slots: Any = (), **kwargs: Any) -> None:
        await self._call("free", model, slots, **kwargs)

    async def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


class AsyncClientSession(_SessionCalls):
    """A leased session renewed by an asyncio task; like ``ClientSession`` it outlives
    its service-side session (restart, lapsed lease) and refuses stale handles."""

    def __init__(self, client: AsyncClient, ttl: float | None, *,
                 name: str | None = None, renew: bool = True, fail_open: bool | None = None,
                 timeout: float | None = None) -> None:
        self.client = client
        self.requested_ttl = ttl
        self.name = name
        self.renew = renew
        self.fail_open = fail_open
        self.timeout = timeout
        self.info: SessionInfo | None = None
        self.closed = False
        self.renewals = 0
        self._state: SessionState | None = None
        self._task: asyncio.Task[None] | None = None
        self._reopening = asyncio.Lock()

    session_id = property(lambda self: self._state.session_id if self._state else "")
    ttl = property(lambda self: self._state.ttl if self._state else 0.0)
    server_epoch = property(lambda self: self._state.server_epoch if self._state else 0)
    lost = property(lambda self: self._state.lost if self._state else None)
    reopened = property(lambda self: self._state.reopened if self._state else 0)
    dropped = property(lambda self: self._state.dropped if self._state else 0)

    def __repr__(self) -> str:
        state = ("new" if self.info is None else "closed" if self.closed
                 else "lost" if self.lost else "open")
        return f"AsyncClientSession({self.session_id[:8]}..., ttl={self.ttl}, {state})"

    async def open(self) -> AsyncClientSession:
        """Open the session and start renewing it (a no-op when already open)."""
        if self.info is None:
            try:
                self.info = await self.client.open_session(self.requested_ttl, self.name,
                                                           timeout=self.timeout)
            except FAIL_OPEN_ERRORS as err:
                # As ClientSession: raises unless failing open; then the first match
                # or alloc opens it.
                self.client._stand_in("open_session", lambda: None, err, self.fail_open)
                log.warning("session not opened (%s): failing open until the service "
                            "answers", err)
                self._state = SessionState.unopened(self.requested_ttl, err)
                self.info = SessionInfo("", self._state.ttl, 0)
            else:
                self._state = SessionState(self.info)
            self.client._sessions.add(self)
            self._start_renewal()
        return self

    def __await__(self) -> Generator[Any, None, AsyncClientSession]:
        return self.open().__await__()

    def _start_renewal(self) -> None:
        if self.renew and self.ttl > 0 and self.session_id:
            self._task = asyncio.create_task(_renew(weakref.ref(self), self.client,
                                                    self.session_id, self.server_epoch,
                                                    self.ttl))

    async def _stop_renewal(self) -> None:
        task, self._task = self._task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _reopen(self) -> None:
        async with self._reopening:
            assert self._state is not None
            if self._state.lost is None:
                return
            await self._stop_renewal()
            self.info = await self.client.open_session(self.ttl, self.name,
                                                       timeout=self.timeout)
            self._state.replaced_by(self.info)
            if self._state.reopened:
                log.warning("session reopened as %s... after losing the last one",
                            self.session_id[:8])
            else:
                log.info("session %s... opened: the service is reachable again",
                         self.session_id[:8])
            self._start_renewal()

    async def keep_alive(self, *, timeout: float | None = None) -> float:
        return await self.client.keep_alive(self, timeout=timeout)

    async def close(self) -> CloseReply | None:
        """As ``ClientSession.close``."""
        if self.closed or self.info is None:
            return None
        self.closed = True
        await self._stop_renewal()
        if self.lost is not None:
            return CloseReply()
        try:
            return await self.client.close_session(self)
        except (NotFound, StaleEpoch):
            return CloseReply()
        except FAIL_OPEN_ERRORS:
            allowed = self.client.fail_open if self.fail_open is None else self.fail_open
            if allowed:
                return None
            raise

    async def __aenter__(self) -> AsyncClientSession:
        return await self.open()

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if kind is None:
            await self.close()
            return
        try:
            await self.close()
        except PrefixCacheError as err:
            log.warning("closing session %s... failed: %s", self.session_id[:8], err)

    async def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """As ``ClientSession._call``."""
        if self._state is None:
            await self.open()
        state = self._state
        assert state is not None
        fail_open = take_fail_open(name, kwargs, self.fail_open)
        for attempt in range(2):
            if (refused := state.refusal(name, args, kwargs)) is not None:
                return self.client._stand_in(name, stand_in(name), refused, fail_open)
            if state.needs_reopen(name):
                try:
                    await self._reopen()
                except FAIL_OPEN_ERRORS as err:
                    fallback = None if kwargs.get("allocate") else stand_in(name)
                    return self.client._stand_in(name, fallback, err, fail_open)
            try:
                reply = await getattr(self.client, name)(*args, session=self, **kwargs)
            except StaleEpoch as err:
                if state.again(name, attempt, err=err):
                    continue
                raise
            if state.again(name, attempt, reply):
                continue
            state.record(name, args, kwargs, reply)
            return reply
        raise AssertionError("unreachable")

    async def step(self, model: str, *, request_id: int | None = None,
                   server_epoch: int | None = None, fail_open: bool | None = None,
                   timeout: float | None = None, **lists: Any) -> step.StepReply:
        """As ``ClientSession.step``."""
        if self._state is None:
            await self.open()
        state = self._state
        if state is None:  # open() sets it or raises
            raise SessionLost("the session did not open")
        fail_open = self.fail_open if fail_open is None else fail_open
        items = step.StepItems.of(**lists)
        for attempt in range(2):
            if (refused := step.stale_fence(state, server_epoch)) is not None:
                return self.client._stand_in("step", partial(step.failed_open, items, refused),
                                             refused, fail_open)
            todo = step.plan(state, items)
            if todo.fresh and state.needs_reopen("match"):
                try:
                    await self._reopen()
                except FAIL_OPEN_ERRORS as err:
                    return self.client._stand_in(
                        "step", partial(todo.failed_open, err),
                        err, fail_open)
            if not len(todo.send):
                return todo.merge(step.StepReply(server_epoch=state.server_epoch))
            op = self.client._op_step(model, todo.send, self, request_id, server_epoch)
            try:
                reply = await self.client._run(op, timeout, fail_open)
            except StaleEpoch:
                if attempt == 0:
                    continue
                raise
            if reply.skipped and state.lost is not None and attempt == 0:
                continue
            step.record(state, todo.send, reply)
            return todo.merge(reply)
        raise AssertionError("unreachable")

    async def write_kv(self, model: str, slots: Any = (), k: Any = None, v: Any = None,
                       **kwargs: Any) -> kv.WriteKVReply:
        """``AsyncPrefixCacheClient.write_kv`` in this session."""
        if self._state is not None and \
                (refused := self._state.refusal("write_kv", (), kwargs)) is not None:
            raise refused
        return await self.client.write_kv(model, slots, k, v, session=self, **kwargs)

    async def read_kv(self, model: str, slots: Any = (), **kwargs: Any) -> kv.KVData:
        """``AsyncPrefixCacheClient.read_kv`` of slots this session holds or has locked."""
        if self._state is not None and \
                (refused := self._state.refusal("read_kv", (), kwargs)) is not None:
            raise refused
        return await self.client.read_kv(model, slots, session=self, **kwargs)

    async def evict(self, model: str, num_tokens: int = 0, **kwargs: Any) -> EvictReply:
        """``AsyncPrefixCacheClient.evict``, attributed to this session."""
        return await self.client.evict(model, num_tokens, session=self, **kwargs)


async def _renew(ref: weakref.ref[AsyncClientSession], client: AsyncClient,
                 session_id: str, epoch: int, ttl: float) -> None:
    """As the sync client's renewal thread: holds the session weakly."""
    interval = ttl / 3
    timeout = max(min(client.timeout, interval), 0.05)
    while True:
        await asyncio.sleep(interval)
        if ref() is None:
            return
        try:
            await client._run(client._op_keep_alive(session_id, epoch), timeout)
        except (NotFound, StaleEpoch) as err:
            if (session := ref()) is not None and session._state is not None \
                    and session.session_id == session_id:
                session._state.mark_lost(err)
            log.warning("session %s... is gone: %s", session_id[:8], err.details)
            return
        except PrefixCacheError as err:
            log.debug("keep-alive of session %s... failed: %s", session_id[:8], err)
        else:
            if (session := ref()) is not None:
                session.renewals += 1
