"""AsyncStreamSession: a session carried by the bidirectional ``Session`` stream, the
asyncio client's alternative to a leased session."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import grpc

from prefixcache.v1 import prefix_cache_pb2 as pb

from .._core import FAIL_OPEN_ERRORS
from .._requests import Op, R
from ..errors import DeadlineExceeded, PrefixCacheError, Unavailable, error_for, from_rpc_error
from ..results import EvictReply, StatsReply
from ..step import StepItems, StepReply
from ._client_protocol import AsyncStreamClient
from .aio_session import _SessionCalls

_STREAM_OPS = {
    "Match": "match",
    "Insert": "insert",
    "Evict": "evict",
    "Lock": "lock",
    "Unlock": "unlock",
    "Alloc": "alloc",
    "Free": "free",
    "Stats": "stats",
    "Step": "step",
    "KeepAlive": "keep_alive",
}
# The stream's lease is renewed by any message; an idle stream sends a keep_alive once
# it has been silent for this fraction of the TTL the service told it.
KEEP_ALIVE_FRACTION = 1 / 3


class AsyncStreamSession(_SessionCalls):
    """A session carried by the bidirectional ``Session`` stream.

    It needs no lease: the service releases its locks and slots when the stream ends
    (``close``, leaving ``async with``, or the connection dropping). Calls are
    pipelined: several may be in flight, each answered in order. A call that is not
    answered within its deadline raises DeadlineExceeded (its late answer is dropped).
    Calls are not retried: a broken stream has ended the session, so every later call
    raises Unavailable (or fails open).

    The service ends a stream that sends nothing for its ``stream_ttl`` (300 s by
    default). So, unless ``keep_alive`` is False, the session sends a ``keep_alive``
    when it opens, learns the stream's TTL from the answer (``stream_ttl``), and sends
    another whenever it has sent nothing for a third of it: an idle worker keeps its
    stream, and with it its locks and slots.
    """

    session_id = ""
    client: AsyncStreamClient

    def __init__(
        self,
        client: AsyncStreamClient,
        *,
        fail_open: bool | None = None,
        timeout: float | None = None,
        keep_alive: bool = True,
    ) -> None:
        self.client = client
        self.fail_open = fail_open
        self.timeout = timeout
        self.keep_alive = keep_alive
        # The stream's TTL, once the service has told it (seconds; None until then).
        self.stream_ttl: float | None = None
        self._keeper: asyncio.Task[None] | None = None
        self._last_sent = 0.0
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
            if self.keep_alive:
                self._keeper = asyncio.create_task(self._keep_alive())
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
        # Under the write lock: cancelling the keeper in the middle of its write would
        # cancel the whole call (grpc.aio), and the reader would end in CancelledError.
        async with self._write_lock:
            if self._keeper is not None:
                self._keeper.cancel()
            with contextlib.suppress(grpc.RpcError, asyncio.InvalidStateError):
                await self._call_obj.done_writing()
        if self._reader is not None:
            try:
                await asyncio.wait_for(
                    asyncio.shield(self._reader),
                    self.client.timeout if self.timeout is None else self.timeout,
                )
            except (TimeoutError, grpc.RpcError):
                self._call_obj.cancel()
            except asyncio.CancelledError:
                if not self._reader.done():
                    raise  # this close was cancelled, not the stream
                # the call itself ended cancelled: there is nothing left to wait for
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
                future.set_exception(
                    error_for(err.code or grpc.StatusCode.UNAVAILABLE, err.details)
                )

    async def _send(self, op: Op[R], timeout: float | None) -> Any:
        if self._call_obj is None:
            await self.open()
        if self._broken is not None or self.closed:
            err = self._broken or Unavailable("the session stream is closed")
            raise error_for(err.code or grpc.StatusCode.UNAVAILABLE, err.details)
        self._seq += 1
        seq = self._seq
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[seq] = future
        # The request goes in the oneof field named after its op.
        operation: dict[str, Any] = {_STREAM_OPS[op.method]: op.request}
        request = pb.SessionRequest(seq=seq, **operation)
        timeout = self.timeout if timeout is None else timeout
        timeout = self.client.timeout if timeout is None else timeout
        try:
            async with self._write_lock:
                await asyncio.wait_for(self._call_obj.write(request), timeout)
                self._last_sent = asyncio.get_running_loop().time()
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise DeadlineExceeded(
                f"no answer to {op.method} on the session stream within {timeout} s"
            ) from None
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:
            err = from_rpc_error(exc) if isinstance(exc, grpc.RpcError) else Unavailable(str(exc))
            raise err from exc
        finally:
            self._pending.pop(seq, None)

    async def _keep_alive(self) -> None:
        """Keep an idle stream's lease: a keep_alive at open (its answer is the stream's
        TTL), then one whenever nothing was sent for a third of the TTL. Ends when the
        stream does, or when the service does not know the op (it answers an error)."""
        op = Op("KeepAlive", pb.KeepAliveRequest(), lambda reply: reply, False)
        loop = asyncio.get_running_loop()
        try:
            while not self.closed and self._broken is None:
                interval = (self.stream_ttl or 0.0) * KEEP_ALIVE_FRACTION
                idle = loop.time() - self._last_sent
                if self.stream_ttl is not None and idle < interval:
                    await asyncio.sleep(interval - idle)
                    continue
                try:
                    reply = await self._send(op, None)
                except DeadlineExceeded:
                    continue  # a slow answer: the message itself renewed the lease
                if not reply.ttl_seconds:
                    return  # no lease to keep
                self.stream_ttl = reply.ttl_seconds
        except PrefixCacheError:
            return  # the stream broke (its calls say so), or an old service

    async def _run(self, op: Op[R], timeout: float | None, fail_open: bool | None) -> R:
        try:
            reply = await self._send(op, timeout)
        except FAIL_OPEN_ERRORS as err:
            allowed = self.fail_open if fail_open is None else fail_open
            return self.client._failed_open(op, err, allowed)
        return self.client._parse(op, reply)

    async def _call(
        self,
        name: str,
        *args: Any,
        timeout: float | None = None,
        fail_open: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        op = getattr(self.client, f"_op_{name}")(*_stream_args(name, args, kwargs))
        return await self._run(op, timeout, fail_open)

    async def evict(
        self,
        model: str,
        num_tokens: int = 0,
        *,
        swa_num_tokens: int = 0,
        mamba_num: int = 0,
        timeout: float | None = None,
    ) -> EvictReply:
        op = self.client._op_evict(model, num_tokens, swa_num_tokens, mamba_num)
        return await self._run(op, timeout, False)

    async def stats(self, model: str = "", *, timeout: float | None = None) -> StatsReply:
        return await self._run(self.client._op_stats(model), timeout, False)

    async def step(
        self,
        model: str,
        *,
        timeout: float | None = None,
        fail_open: bool | None = None,
        **items: Any,
    ) -> StepReply:
        """``AsyncPrefixCacheClient.step`` on the stream (never retried: no request id)."""
        op = self.client._op_step(model, StepItems.of(**items), None, 0)
        return await self._run(op, timeout, fail_open)


def _stream_args(name: str, args: tuple[Any, ...], kw: dict[str, Any]) -> tuple[Any, ...]:
    """The ``_op_<name>`` arguments for a stream call (no session: the stream is one)."""
    if name == "match":
        model, tokens = args
        return (
            model,
            tokens,
            kw.pop("extra_key", None),
            kw.pop("token_width", None),
            None,
            kw.pop("lock", False),
            kw.pop("allocate", False),
            None,
            *_no_more(kw),
        )
    if name == "insert":
        model, tokens, slots = args
        return (
            model,
            tokens,
            slots,
            kw.pop("extra_key", None),
            kw.pop("token_width", None),
            None,
            kw.pop("lock", False),
            kw.pop("release_lock_id", 0),
            kw.pop("state_slot", None),
            kw.pop("slot_version", 0),
            None,
            *_no_more(kw),
        )
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
