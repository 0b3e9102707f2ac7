"""The asyncio client's sessions: the calls every session object has, and the leased
session, renewed by a task, that outlives its service-side session (see
``ClientSession``)."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Generator
from types import TracebackType
from typing import Any

from .. import results, step
from .._core import FAIL_OPEN_ERRORS, log
from .._flow import run_async
from .._session_state import SessionState
from ..errors import SessionLost
from ..transfer import kv
from . import _session_flow as flows
from ._client_protocol import AsyncClient


class _SessionCalls:
    """The cache calls of a session object, passing the session for the caller."""

    client: AsyncClient
    fail_open: bool | None

    async def match(self, model: str, tokens: Any, **kwargs: Any) -> results.MatchReply:
        kwargs.setdefault("fail_open", self.fail_open)
        reply: results.MatchReply = await self._call("match", model, tokens, **kwargs)
        return reply

    async def insert(
        self, model: str, tokens: Any, slots: Any, **kwargs: Any
    ) -> results.InsertReply:
        kwargs.setdefault("fail_open", self.fail_open)
        reply: results.InsertReply = await self._call("insert", model, tokens, slots, **kwargs)
        return reply

    async def lock(self, model: str, node_id: int, **kwargs: Any) -> results.LockReply:
        kwargs.setdefault("fail_open", self.fail_open)
        reply: results.LockReply = await self._call("lock", model, node_id, **kwargs)
        return reply

    async def unlock(self, lock_id: int, **kwargs: Any) -> results.UnlockReply:
        kwargs.setdefault("fail_open", self.fail_open)
        reply: results.UnlockReply = await self._call("unlock", lock_id, **kwargs)
        return reply

    async def alloc(self, model: str, num_slots: int, **kwargs: Any) -> results.AllocReply:
        reply: results.AllocReply = await self._call("alloc", model, num_slots, **kwargs)
        return reply

    async def free(self, model: str, slots: Any = (), **kwargs: Any) -> None:
        await self._call("free", model, slots, **kwargs)

    async def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


class AsyncClientSession(_SessionCalls):
    """A leased session renewed by an asyncio task; like ``ClientSession`` it outlives
    its service-side session (restart, lapsed lease) and refuses stale handles."""

    def __init__(
        self,
        client: AsyncClient,
        ttl: float | None,
        *,
        name: str | None = None,
        renew: bool = True,
        fail_open: bool | None = None,
        timeout: float | None = None,
        retain: Any = None,
    ) -> None:
        self.client = client
        self.retain = retain  # its default retention hint, also for a reopened session
        self.requested_ttl = ttl
        self.name = name
        self.renew = renew
        self.fail_open = fail_open
        self.timeout = timeout
        self.info: results.SessionInfo | None = None
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
        state = (
            "new"
            if self.info is None
            else "closed"
            if self.closed
            else "lost"
            if self.lost
            else "open"
        )
        return f"AsyncClientSession({self.session_id[:8]}..., ttl={self.ttl}, {state})"

    async def open(self) -> AsyncClientSession:
        """Open the session and start renewing it (a no-op when already open)."""
        if self.info is None:
            try:
                self.info = await self.client.open_session(
                    self.requested_ttl, self.name, timeout=self.timeout, retain=self.retain
                )
            except FAIL_OPEN_ERRORS as err:
                # As ClientSession: raises unless failing open; then the first match
                # or alloc opens it.
                self.client._stand_in("open_session", lambda: None, err, self.fail_open)
                log.warning("session not opened (%s): failing open until the service answers", err)
                self._state = SessionState.unopened(self.requested_ttl, err)
                self.info = results.SessionInfo("", self._state.ttl, 0)
            else:
                self._state = SessionState(self.info)
            self.client._sessions.add(self)
            self._start_renewal()
        return self

    def __await__(self) -> Generator[Any, None, AsyncClientSession]:
        return self.open().__await__()

    def _start_renewal(self) -> None:
        if self.renew and self.ttl > 0 and self.session_id:
            flow = flows.renewal_flow(
                weakref.ref(self),
                self.client,
                self.session_id,
                self.server_epoch,
                self.ttl,
                asyncio.sleep,
            )
            self._task = asyncio.create_task(run_async(flow))

    async def _stop_renewal(self) -> None:
        task, self._task = self._task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _reopen(self) -> None:
        async with self._reopening:
            await run_async(flows.reopen_flow(self, self.timeout))

    async def keep_alive(self, *, timeout: float | None = None) -> float:
        return await self.client.keep_alive(self, timeout=timeout)

    async def close(self) -> results.CloseReply | None:
        """As ``ClientSession.close``."""
        if self.closed or self.info is None:
            return None
        self.closed = True
        await self._stop_renewal()
        return await run_async(flows.close_flow(self))

    async def __aenter__(self) -> AsyncClientSession:
        return await self.open()

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await run_async(flows.exit_flow(self, kind is not None))

    async def _opened(self) -> SessionState:
        """The session's state, opening it first (on the first call not awaited after
        ``open``)."""
        if self._state is None:
            await self.open()
        if self._state is None:  # open() sets it or raises
            raise SessionLost("the session did not open")
        return self._state

    async def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """As ``ClientSession._call``."""
        state = await self._opened()
        return await run_async(flows.call_flow(self, state, name, args, kwargs))

    async def step(
        self,
        model: str,
        *,
        request_id: int | None = None,
        server_epoch: int | None = None,
        fail_open: bool | None = None,
        timeout: float | None = None,
        **lists: Any,
    ) -> step.StepReply:
        """As ``ClientSession.step``."""
        state = await self._opened()
        return await run_async(
            flows.step_flow(self, state, model, request_id, server_epoch, fail_open, timeout, lists)
        )

    async def write_kv(
        self, model: str, slots: Any = (), k: Any = None, v: Any = None, **kwargs: Any
    ) -> kv.WriteKVReply:
        """``AsyncPrefixCacheClient.write_kv`` in this session."""
        if (
            self._state is not None
            and (refused := self._state.refusal("write_kv", (), kwargs)) is not None
        ):
            raise refused
        return await self.client.write_kv(model, slots, k, v, session=self, **kwargs)

    async def read_kv(self, model: str, slots: Any = (), **kwargs: Any) -> kv.KVData:
        """``AsyncPrefixCacheClient.read_kv`` of slots this session holds or has locked."""
        if (
            self._state is not None
            and (refused := self._state.refusal("read_kv", (), kwargs)) is not None
        ):
            raise refused
        return await self.client.read_kv(model, slots, session=self, **kwargs)

    async def evict(self, model: str, num_tokens: int = 0, **kwargs: Any) -> results.EvictReply:
        """``AsyncPrefixCacheClient.evict``, attributed to this session."""
        return await self.client.evict(model, num_tokens, session=self, **kwargs)
