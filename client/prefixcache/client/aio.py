"""AsyncPrefixCacheClient: the asyncio client (grpc.aio), its leased sessions, and the
Session stream as an alternative transport."""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import Generator
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc

from prefixcache.v1 import prefix_cache_pb2 as pb
from prefixcache.v1 import prefix_cache_pb2_grpc as pb_grpc

from . import kv
from ._core import DEFAULT_TARGET, FAIL_OPEN_ERRORS, ClientBase, Op, SessionLike, log, session_id_of
from ._session_state import SessionState, stand_in, take_fail_open
from .attach import AttachedPool, attach
from .errors import (
    DeadlineExceeded,
    NotFound,
    PrefixCacheError,
    StaleEpoch,
    Unavailable,
    error_for,
    from_rpc_error,
)
from .results import (
    AllocReply,
    CloseReply,
    EvictReply,
    InsertReply,
    LockReply,
    MatchReply,
    ModelList,
    PoolInfo,
    ResetReply,
    SessionInfo,
    StatsReply,
    UnlockReply,
)


class AsyncPrefixCacheClient(ClientBase):
    """The asyncio twin of :class:`~prefixcache.client.PrefixCacheClient`: the same
    arguments, methods and semantics (deadlines, retries, fail-open), awaited.

    The channel is made on first use, inside the running event loop; use the client
    from that one loop. ``async with client.session(ttl) as s`` keeps a lease renewed by
    a task; ``async with client.stream_session() as s`` uses the bidirectional Session
    stream instead (no lease: the session lives as long as the stream).
    """

    def __init__(self, target: str | Path = DEFAULT_TARGET, **kwargs: Any) -> None:
        super().__init__(target, **kwargs)
        self._channel: grpc.aio.Channel | None = None
        self._stub_obj: pb_grpc.PrefixCacheStub | None = None
        self._closed = False

    @property
    def _stub(self) -> pb_grpc.PrefixCacheStub:
        if self._stub_obj is None:
            if self._closed:
                raise Unavailable("the client is closed")
            if self._credentials is not None:
                self._channel = grpc.aio.secure_channel(self.target, self._credentials,
                                                        self._options)
            else:
                self._channel = grpc.aio.insecure_channel(self.target, self._options)
            self._stub_obj = pb_grpc.PrefixCacheStub(self._channel)
        return self._stub_obj

    async def close(self) -> None:
        """Close the sessions opened through this client, then the channel."""
        if self._closed:
            return
        self._closed = True
        for session in list(self._sessions):
            with contextlib.suppress(PrefixCacheError):
                await session.close()
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stub_obj = None

    async def __aenter__(self) -> AsyncPrefixCacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -------------------------------------------------------------- machinery

    async def _invoke(self, op: Op, timeout: float | None) -> Any:
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        call = getattr(self._stub, op.method)
        attempt = 0
        while True:
            try:
                return await call(op.request, timeout=max(deadline - time.monotonic(), 0.001),
                                  metadata=self._metadata)
            except grpc.RpcError as exc:
                err = self._error(exc)
                delay = self._delay(attempt)
                if not (op.retry and isinstance(err, Unavailable) and attempt < self.retries
                        and deadline - time.monotonic() > delay):
                    raise err from exc
            await asyncio.sleep(delay)
            attempt += 1

    async def _run(self, op: Op, timeout: float | None = None,
                   fail_open: bool | None = None) -> Any:
        try:
            reply = await self._invoke(op, timeout)
        except FAIL_OPEN_ERRORS as err:
            return self._failed_open(op, err, fail_open)
        return self._parse(op, reply)

    # ----------------------------------------------------------------- reads

    async def list_models(self, *, timeout: float | None = None) -> ModelList:
        return await self._run(self._op_list_models(), timeout)

    async def describe_pool(self, model: str, *, timeout: float | None = None) -> PoolInfo:
        return await self._run(self._op_describe_pool(model), timeout)

    async def stats(self, model: str = "", *, timeout: float | None = None) -> StatsReply:
        return await self._run(self._op_stats(model), timeout)

    # ------------------------------------------------------------- KV data

    async def attach_pool(self, model: str, *,
                          timeout: float | None = None) -> AttachedPool:
        """See ``PrefixCacheClient.attach_pool``."""
        return attach(await self.describe_pool(model, timeout=timeout))

    async def _pool_info(self, model: str, timeout: float | None) -> PoolInfo:
        return self._pools.get(model) or await self.describe_pool(model, timeout=timeout)

    async def read_kv(self, model: str, slots: Any = (), *, layers: Any = None,
                      state_slots: Any = (), chunk_bytes: int | None = None,
                      server_epoch: int | None = None,
                      timeout: float | None = None) -> kv.KVData:
        """See ``PrefixCacheClient.read_kv``."""
        reader = kv.Reader(await self._pool_info(model, timeout), slots, layers,
                           state_slots, kv.chunk_limit(chunk_bytes, self.max_message_bytes))
        reader.request.server_epoch = self._fence(None, server_epoch)
        try:
            call = self._stub.ReadKV(reader.request, timeout=timeout or self.timeout,
                                     metadata=self._metadata)
            async for chunk in call:
                reader.add(chunk)
        except grpc.RpcError as exc:
            raise self._error(exc) from exc
        return reader.result()

    async def write_kv(self, model: str, slots: Any = (), k: Any = None, v: Any = None, *,
                       session: SessionLike, layers: Any = None, state_slots: Any = (),
                       conv: Any = None, temporal: Any = None,
                       chunk_bytes: int | None = None, server_epoch: int | None = None,
                       timeout: float | None = None) -> kv.WriteKVReply:
        """See ``PrefixCacheClient.write_kv``."""
        chunks = kv.write_chunks(await self._pool_info(model, timeout),
                                 session_id_of(session), slots, k, v, layers, state_slots,
                                 conv, temporal,
                                 kv.chunk_limit(chunk_bytes, self.max_message_bytes),
                                 self._fence(session, server_epoch))
        try:
            reply = await self._stub.WriteKV(chunks, timeout=timeout or self.timeout,
                                             metadata=self._metadata)
        except grpc.RpcError as exc:
            raise self._error(exc) from exc
        return kv.WriteKVReply(reply.bytes_written, reply.buffers_written)

    # --------------------------------------------------------------- sessions

    async def open_session(self, ttl: float | None = None, name: str | None = None, *,
                           timeout: float | None = None) -> SessionInfo:
        return await self._run(self._op_open_session(ttl, name), timeout)

    async def keep_alive(self, session: SessionLike, *, timeout: float | None = None) -> float:
        return await self._run(self._op_keep_alive(session), timeout)

    async def close_session(self, session: SessionLike, *,
                            timeout: float | None = None) -> CloseReply:
        return await self._run(self._op_close_session(session), timeout)

    def session(self, ttl: float | None = None, *, name: str | None = None,
                renew: bool = True, fail_open: bool | None = None,
                timeout: float | None = None) -> AsyncClientSession:
        """A leased session renewed by a task every ``ttl / 3``; opened by
        ``async with`` (which closes it on exit) or by ``await``."""
        return AsyncClientSession(self, ttl, name=name, renew=renew, fail_open=fail_open,
                                  timeout=timeout)

    def stream_session(self, *, fail_open: bool | None = None,
                       timeout: float | None = None) -> AsyncStreamSession:
        """A session carried by the bidirectional Session stream (``async with``)."""
        return AsyncStreamSession(self, fail_open=fail_open, timeout=timeout)

    # ------------------------------------------------------------ cache calls

    async def match(self, model: str, tokens: Any, *, extra_key: str | None = None,
                    token_width: int | None = None, session: SessionLike = None,
                    lock: bool = False, allocate: bool = False,
                    request_id: int | None = None, fail_open: bool | None = None,
                    timeout: float | None = None) -> MatchReply:
        op = self._op_match(model, tokens, extra_key, token_width, session, lock, allocate,
                            request_id)
        return await self._run(op, timeout, fail_open)

    async def insert(self, model: str, tokens: Any, slots: Any, *,
                     extra_key: str | None = None, token_width: int | None = None,
                     session: SessionLike = None, lock: bool = False,
                     release_lock_id: int = 0, state_slot: int | None = None,
                     slot_version: int = 0, request_id: int | None = None,
                     server_epoch: int | None = None, fail_open: bool | None = None,
                     timeout: float | None = None) -> InsertReply:
        op = self._op_insert(model, tokens, slots, extra_key, token_width, session, lock,
                             release_lock_id, state_slot, slot_version, request_id,
                             server_epoch)
        return await self._run(op, timeout, fail_open)

    async def evict(self, model: str, num_tokens: int = 0, *, swa_num_tokens: int = 0,
                    mamba_num: int = 0, timeout: float | None = None) -> EvictReply:
        return await self._run(self._op_evict(model, num_tokens, swa_num_tokens, mamba_num),
                               timeout)

    async def lock(self, model: str, node_id: int, *, session: SessionLike = None,
                   request_id: int | None = None, server_epoch: int | None = None,
                   fail_open: bool | None = None, timeout: float | None = None) -> LockReply:
        return await self._run(self._op_lock(model, node_id, session, request_id,
                                             server_epoch), timeout, fail_open)

    async def unlock(self, lock_id: int, *, session: SessionLike = None,
                     request_id: int | None = None, server_epoch: int | None = None,
                     fail_open: bool | None = None,
                     timeout: float | None = None) -> UnlockReply:
        return await self._run(self._op_unlock(lock_id, session, request_id, server_epoch),
                               timeout, fail_open)

    async def alloc(self, model: str, num_slots: int, *, num_state_slots: int = 0,
                    session: SessionLike = None, timeout: float | None = None) -> AllocReply:
        return await self._run(self._op_alloc(model, num_slots, num_state_slots, session),
                               timeout)

    async def free(self, model: str, slots: Any = (), *, state_slots: Any = (),
                   session: SessionLike = None, server_epoch: int | None = None,
                   fail_open: bool | None = None, timeout: float | None = None) -> None:
        await self._run(self._op_free(model, slots, state_slots, session, server_epoch),
                        timeout, fail_open)

    async def reset(self, model: str, *, timeout: float | None = None) -> ResetReply:
        return await self._run(self._op_reset(model), timeout)


class _SessionCalls:
    """The cache calls of a session object, passing the session for the caller."""

    client: AsyncPrefixCacheClient
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

    def __init__(self, client: AsyncPrefixCacheClient, ttl: float | None, *,
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
            self.info = await self.client.open_session(self.requested_ttl, self.name,
                                                       timeout=self.timeout)
            self._state = SessionState(self.info)
            self.client._sessions.add(self)
            self._start_renewal()
        return self

    def __await__(self) -> Generator[Any, None, AsyncClientSession]:
        return self.open().__await__()

    def _start_renewal(self) -> None:
        if self.renew and self.ttl > 0:
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
            log.warning("session reopened as %s... after losing the last one",
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

    async def write_kv(self, model: str, slots: Any = (), k: Any = None, v: Any = None,
                       **kwargs: Any) -> kv.WriteKVReply:
        """``AsyncPrefixCacheClient.write_kv`` in this session."""
        if self._state is not None and \
                (refused := self._state.refusal("write_kv", (), kwargs)) is not None:
            raise refused
        return await self.client.write_kv(model, slots, k, v, session=self, **kwargs)


async def _renew(ref: weakref.ref[AsyncClientSession], client: AsyncPrefixCacheClient,
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


_STREAM_OPS = {"Match": "match", "Insert": "insert", "Evict": "evict", "Lock": "lock",
               "Unlock": "unlock", "Alloc": "alloc", "Free": "free", "Stats": "stats"}


class AsyncStreamSession(_SessionCalls):
    """A session carried by the bidirectional ``Session`` stream.

    It needs no lease: the service releases its locks and slots when the stream ends
    (``close``, leaving ``async with``, or the connection dropping). Calls are
    pipelined: several may be in flight, each answered in order. A call that is not
    answered within its deadline raises DeadlineExceeded (its late answer is dropped).
    Calls are not retried: a broken stream has ended the session, so every later call
    raises Unavailable (or fails open).
    """

    session_id = ""

    def __init__(self, client: AsyncPrefixCacheClient, *, fail_open: bool | None = None,
                 timeout: float | None = None) -> None:
        self.client = client
        self.fail_open = fail_open
        self.timeout = timeout
        self._call_obj: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._seq = 0
        self._write_lock = asyncio.Lock()
        self._broken: PrefixCacheError | None = None
        self.closed = False

    async def open(self) -> AsyncStreamSession:
        if self._call_obj is None:
            self._call_obj = self.client._stub.Session(metadata=self.client._metadata)
            self._reader = asyncio.create_task(self._read())
            self.client._sessions.add(self)
        return self

    async def __aenter__(self) -> AsyncStreamSession:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """End the stream; the service releases everything the session holds."""
        if self.closed or self._call_obj is None:
            return
        self.closed = True
        with contextlib.suppress(grpc.RpcError, asyncio.InvalidStateError):
            await self._call_obj.done_writing()
        if self._reader is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._reader),
                                       self.client.timeout if self.timeout is None
                                       else self.timeout)
            except (TimeoutError, grpc.RpcError):
                self._call_obj.cancel()
        self._fail_pending(Unavailable("the session stream is closed"))

    async def _read(self) -> None:
        try:
            while True:
                reply = await self._call_obj.read()
                if reply is grpc.aio.EOF:
                    self._fail_pending(Unavailable("the service ended the session stream"))
                    return
                future = self._pending.pop(reply.seq, None)
                if future is None or future.done():
                    continue  # the caller gave up on it (deadline)
                kind = reply.WhichOneof("result")
                if kind == "error":
                    future.set_exception(error_for(reply.error.code, reply.error.message))
                else:
                    future.set_result(getattr(reply, kind))
        except grpc.RpcError as exc:
            self._fail_pending(from_rpc_error(exc))
        except asyncio.CancelledError:
            self._fail_pending(Unavailable("the session stream is closed"))
            raise

    def _fail_pending(self, err: PrefixCacheError) -> None:
        if self._broken is None:
            self._broken = err
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(error_for(err.code or grpc.StatusCode.UNAVAILABLE,
                                               err.details))

    async def _send(self, op: Op, timeout: float | None) -> Any:
        if self._call_obj is None:
            await self.open()
        if self._broken is not None or self.closed:
            err = self._broken or Unavailable("the session stream is closed")
            raise error_for(err.code or grpc.StatusCode.UNAVAILABLE, err.details)
        self._seq += 1
        seq = self._seq
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[seq] = future
        request = pb.SessionRequest(seq=seq, **{_STREAM_OPS[op.method]: op.request})
        timeout = self.timeout if timeout is None else timeout
        timeout = self.client.timeout if timeout is None else timeout
        try:
            async with self._write_lock:
                await asyncio.wait_for(self._call_obj.write(request), timeout)
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise DeadlineExceeded(f"no answer to {op.method} on the session stream "
                                   f"within {timeout} s") from None
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:
            err = from_rpc_error(exc) if isinstance(exc, grpc.RpcError) \
                else Unavailable(str(exc))
            raise err from exc
        finally:
            self._pending.pop(seq, None)

    async def _run(self, op: Op, timeout: float | None, fail_open: bool | None) -> Any:
        try:
            reply = await self._send(op, timeout)
        except FAIL_OPEN_ERRORS as err:
            allowed = self.fail_open if fail_open is None else fail_open
            return self.client._failed_open(op, err, allowed)
        return self.client._parse(op, reply)

    async def _call(self, name: str, *args: Any, timeout: float | None = None,
                    fail_open: bool | None = None, **kwargs: Any) -> Any:
        op = getattr(self.client, f"_op_{name}")(*_stream_args(name, args, kwargs))
        return await self._run(op, timeout, fail_open)

    async def evict(self, model: str, num_tokens: int = 0, *, swa_num_tokens: int = 0,
                    mamba_num: int = 0, timeout: float | None = None) -> EvictReply:
        op = self.client._op_evict(model, num_tokens, swa_num_tokens, mamba_num)
        return await self._run(op, timeout, False)

    async def stats(self, model: str = "", *, timeout: float | None = None) -> StatsReply:
        return await self._run(self.client._op_stats(model), timeout, False)


def _stream_args(name: str, args: tuple[Any, ...], kw: dict[str, Any]) -> tuple[Any, ...]:
    """The ``_op_<name>`` arguments for a stream call (no session: the stream is one)."""
    if name == "match":
        model, tokens = args
        return (model, tokens, kw.pop("extra_key", None), kw.pop("token_width", None), None,
                kw.pop("lock", False), kw.pop("allocate", False), None, *_no_more(kw))
    if name == "insert":
        model, tokens, slots = args
        return (model, tokens, slots, kw.pop("extra_key", None), kw.pop("token_width", None),
                None, kw.pop("lock", False), kw.pop("release_lock_id", 0),
                kw.pop("state_slot", None), kw.pop("slot_version", 0), None, *_no_more(kw))
    if name == "lock":
        model, node_id = args
        return (model, node_id, None, None, *_no_more(kw))
    if name == "unlock":
        (lock_id,) = args
        return (lock_id, None, None, *_no_more(kw))
    if name == "alloc":
        model, num_slots = args
        return (model, num_slots, kw.pop("num_state_slots", 0), None, *_no_more(kw))
    if name == "free":
        model, slots = args
        return (model, slots, kw.pop("state_slots", ()), None, *_no_more(kw))
    raise AssertionError(name)


def _no_more(kw: dict[str, Any]) -> tuple[()]:
    kw.pop("request_id", None)  # a stream answers in order and is never retried
    if kw:
        raise TypeError(f"unexpected arguments: {', '.join(kw)}")
    return ()
