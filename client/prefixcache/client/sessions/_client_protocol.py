"""What a session object needs of its client, as Protocols.

The clients (``sync.PrefixCacheClient``, ``aio.AsyncPrefixCacheClient``) create their
sessions, so they import the session modules; the sessions call back into the client.
Naming the client classes here would make that a cycle, so the sessions name these
Protocols instead, and the clients satisfy them by their shape.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

from .. import step
from .._flow import Flow
from .._requests import Op, R, SessionLike
from ..errors import PrefixCacheError
from ..results import CloseReply, EvictReply, SessionInfo, StatsReply
from ..transfer import kv


class ClientCalls(Protocol):
    """The request building and fail-open rules both clients share (``ClientBase``)."""

    timeout: float
    fail_open: bool
    _sessions: weakref.WeakSet[Any]

    def _stand_in(
        self,
        what: str,
        fallback: Callable[[], R] | None,
        err: PrefixCacheError,
        fail_open: bool | None,
    ) -> R: ...

    def _run_flow(self, op: Op[R], timeout: float | None, fail_open: bool | None) -> Flow[R]: ...

    def _op_step(
        self,
        model: str,
        items: step.StepItems,
        session: SessionLike,
        request_id: int | None,
        server_epoch: int | None = None,
    ) -> Op[step.StepReply]: ...

    def _op_keep_alive(
        self, session: SessionLike, server_epoch: int | None = None
    ) -> Op[float]: ...


class BlockingClient(ClientCalls, Protocol):
    """What a ``ClientSession`` calls on its ``PrefixCacheClient``."""

    def _run(self, op: Op[R], timeout: float | None = None, fail_open: bool | None = None) -> R: ...

    def open_session(
        self,
        ttl: float | None = None,
        name: str | None = None,
        *,
        timeout: float | None = None,
        retain: Any = None,
    ) -> SessionInfo: ...

    def keep_alive(self, session: SessionLike, *, timeout: float | None = None) -> float: ...

    def close_session(
        self, session: SessionLike, *, timeout: float | None = None
    ) -> CloseReply: ...

    # The sessions pass the clients' keyword arguments through (hence *args, **kwargs).
    def read_kv(self, model: str, slots: Any = (), *args: Any, **kwargs: Any) -> kv.KVData: ...

    def write_kv(
        self, model: str, slots: Any = (), k: Any = None, v: Any = None, *args: Any, **kwargs: Any
    ) -> kv.WriteKVReply: ...

    def evict(self, model: str, num_tokens: int = 0, *args: Any, **kwargs: Any) -> EvictReply: ...


class AsyncClient(ClientCalls, Protocol):
    """What an ``AsyncClientSession`` calls on its ``AsyncPrefixCacheClient``."""

    async def _run(
        self, op: Op[R], timeout: float | None = None, fail_open: bool | None = None
    ) -> R: ...

    async def open_session(
        self,
        ttl: float | None = None,
        name: str | None = None,
        *,
        retain: Any = None,
        timeout: float | None = None,
    ) -> SessionInfo: ...

    async def keep_alive(self, session: SessionLike, *, timeout: float | None = None) -> float: ...

    async def close_session(
        self, session: SessionLike, *, timeout: float | None = None
    ) -> CloseReply: ...

    async def read_kv(
        self, model: str, slots: Any = (), *args: Any, **kwargs: Any
    ) -> kv.KVData: ...

    async def write_kv(
        self, model: str, slots: Any = (), k: Any = None, v: Any = None, *args: Any, **kwargs: Any
    ) -> kv.WriteKVReply: ...

    async def evict(
        self, model: str, num_tokens: int = 0, *args: Any, **kwargs: Any
    ) -> EvictReply: ...


class AsyncStreamClient(AsyncClient, Protocol):
    """What an ``AsyncStreamSession`` also uses: the stub, to open its stream, and the
    reply handling the unary calls go through."""

    @property
    def _stub(self) -> Any: ...  # the generated stub (untyped)

    @property
    def _metadata(self) -> Any: ...

    def _failed_open(self, op: Op[R], err: PrefixCacheError, fail_open: bool | None) -> R: ...

    def _parse(self, op: Op[R], reply: Any) -> R: ...

    def _op_evict(
        self,
        model: str,
        num_tokens: int,
        swa_num_tokens: int,
        mamba_num: int,
        session: SessionLike = None,
    ) -> Op[EvictReply]: ...

    def _op_stats(self, model: str) -> Op[StatsReply]: ...
