"""The gRPC adapter: decode a request, make one call into the service, encode the reply.

Every operation has one handler ``(request, session) -> response`` (servicer_ops.py)
that both the unary RPC and the Session stream call, so the two cannot drift apart.
Errors become status codes through ``status.status_for`` only.

Concurrency: this servicer runs on a ``grpc.aio`` server, so every handler runs on the
one event loop thread and no handler awaits in the middle of a cache operation. That
makes each model single-writer without locks.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from prefixcache.cache import InvalidInputError
from prefixcache.v1 import prefix_cache_pb2 as pb
from prefixcache.v1 import prefix_cache_pb2_grpc as pb_grpc

from ..access.limits import Limits
from ..access.tenants import ANYONE, PEER, Caller, Callers, check_request
from ..access.turns import Turns
from ..errors import DeniedError, DrainingError, LimitError, NotFoundError, PoolExhaustedError
from ..events.subscriptions import DROP_WAIT, Subscriptions
from ..memory import write_fence
from ..metrics import Metrics
from ..service import CacheService
from ..sessions import keepalive
from ..sessions.evict_policy import EvictCollector, EvictPolicy
from ..sessions.quotas import StreamQuota
from ..sessions.session import Session
from . import explain, kv_access, kv_transfer, page_rpcs
from .registration import Refused, parsed
from .servicer_ops import CALLER, CacheOps
from .session_stream import SessionStream, is_mutating
from .status import status_for, trailers_for
from .step import StepExecutor

log = logging.getLogger("prefixcache.server")

_OK = grpc.StatusCode.OK
# Room for a KVChunk's other fields within a message of max_message_bytes.
CHUNK_OVERHEAD = 1024


class PrefixCacheServicer(SessionStream, CacheOps, pb_grpc.PrefixCacheServicer):
    """Serves ``prefixcache.v1.PrefixCache`` over a ``CacheService``.

    Args:
        check_integrity: Invariant mode: run the service's integrity check after every
            call that can change a cache or a pool; a failure answers INTERNAL.
        limits: Sizes and counts one request may carry (limits.py); the service's if None.
        callers: Tells callers apart by token (admin, tenants); None: all alike.
    """

    def __init__(
        self,
        service: CacheService,
        metrics: Metrics | None = None,
        check_integrity: bool = False,
        max_message_bytes: int = 64 * 1024 * 1024,
        limits: Limits | None = None,
        callers: Callers | None = None,
    ) -> None:
        self.service = service
        self.limits = service.limits if limits is None else limits
        self.callers = Callers() if callers is None else callers
        # Reading the caller's token costs a little per call: only when it matters.
        self._identify = self.callers.has_tenants or self.limits.max_evict_tokens > 0
        self.evict_policy = EvictPolicy(
            self.limits.max_evict_tokens, list(service.engines), self.limits.evict_interval
        )
        if metrics is not None:
            metrics.registry.register(EvictCollector(self.evict_policy))
        self.write_budget = kv_access.WriteBudget(
            self.limits.max_inflight_write_bytes, self.limits.max_inflight_write_bytes_total
        )
        self.metrics = metrics
        # The shared cross-node tier (tier/), set by the server once started; None: off.
        self.tier: Any = None
        self.check_integrity = check_integrity
        # ReadKV chunks never exceed this, whatever the client asks for.
        self.max_chunk_bytes = max(max_message_bytes - CHUNK_OVERHEAD, 1)
        # Subscribe streams (subscriptions.py), one change feed per model.
        self.subscriptions = Subscriptions(service, self.limits, max_message_bytes)
        self._stream_ops: dict[str, Callable[[Any, Session | None], Any]] = {
            "match": self._match,
            "insert": self._insert,
            "evict": self._evict,
            "lock": self._lock,
            "unlock": self._unlock,
            "alloc": self._alloc,
            "free": self._free,
            "stats": self._stats,
            "step": self._step,
            "keep_alive": self._stream_keep_alive,
        }
        self._steps = StepExecutor(service, self.limits, self._refusal)
        # ReadKV and WriteKV streams in flight per session (quotas.py).
        self.streams = StreamQuota(self.limits.max_session_streams)
        # Explain and ExistsPages take turns, slice by slice, client by client.
        self.turns = Turns()
        # KeepAlives that renew no lease (unknown ids) share one pace (keepalive.py).
        self._unleased = keepalive.Unleased()

    # ------------------------------------------------------------- unary RPCs

    def _refusal(self, exc: Exception, method: str) -> grpc.StatusCode:
        """The status a failed call answers; a bug (INTERNAL) is logged with its trace."""
        code = status_for(exc)
        if code is grpc.StatusCode.INTERNAL:
            log.exception("internal error in %s", method)
        elif isinstance(exc, LimitError) and self.metrics is not None:
            self.metrics.refused(exc.limit)
        elif isinstance(exc, PoolExhaustedError) and self.metrics is not None:
            self.metrics.allocation_refused(exc.model, exc.reason)
        return code

    def _observe(self, method: str, code: grpc.StatusCode, start: float) -> None:
        if self.metrics is not None:
            self.metrics.observe_rpc(method, code, time.perf_counter() - start)

    async def _unary(
        self,
        method: str,
        context: grpc.aio.ServicerContext,
        handler: Callable[..., Any],
        *args: Any,
        mutates: bool = False,
        prepare: Callable[[Any], Any] | None = None,
    ) -> Any:
        start = time.perf_counter()
        code = _OK
        try:
            for arg in args:
                parsed(arg)
            if self.service.draining:
                raise DrainingError("the service is shutting down")
            caller = self._enter(context)
            if args:
                if caller.bound:
                    check_request(caller, args[0], self.service)
                self.service.check_epoch(getattr(args[0], "server_epoch", 0))
            if prepare is not None:  # awaits (the tier's fetch), then the handler runs whole
                await prepare(args[0])
            reply = handler(*args)
            if inspect.isawaitable(reply):  # a handler that yields between slices
                reply = await reply
            if self.check_integrity and (mutates or (args and is_mutating(args[0]))):
                self.service.check_integrity()
            return reply
        except Exception as exc:
            code = self._refusal(exc, method)
            await context.abort(code, str(exc), trailers_for(exc))
        finally:
            self._observe(method, code, start)

    def _enter(self, context: Any) -> Caller:
        """Who this call comes from (tenants.py), made known to its handlers."""
        caller = self.callers.of(context.invocation_metadata()) if self._identify else ANYONE
        CALLER.set(caller)
        if self._identify:  # an Evict without a session is charged to its peer
            PEER.set(context.peer())
        return caller

    def _session_of(self, session_id: str) -> Session | None:
        return self.service.session(session_id) if session_id else None

    def _attributed(self, handler: Callable[[Any, Session | None], Any]) -> Callable[[Any], Any]:
        """As ``_with_session``, for a call that only names its session (Evict): one
        that is gone makes the call anonymous rather than refused."""

        def call(req: Any) -> Any:
            try:
                session = self._session_of(req.session_id)
            except NotFoundError:
                session = None
            return handler(req, session)

        return call

    def _with_session(self, handler: Callable[[Any, Session | None], Any]) -> Callable[[Any], Any]:
        return lambda req: handler(req, self._session_of(req.session_id))

    async def Match(self, request: pb.MatchRequest, context: Any) -> pb.MatchResponse:
        return await self._unary(
            "Match",
            context,
            self._with_session(self._match),
            request,
            prepare=self.tier.before_match if self.tier else None,
        )

    async def Insert(self, request: pb.InsertRequest, context: Any) -> pb.InsertResponse:
        return await self._unary("Insert", context, self._with_session(self._insert), request)

    async def Evict(self, request: pb.EvictRequest, context: Any) -> pb.EvictResponse:
        return await self._unary("Evict", context, self._attributed(self._evict), request)

    async def Lock(self, request: pb.LockRequest, context: Any) -> pb.LockResponse:
        return await self._unary("Lock", context, self._with_session(self._lock), request)

    async def Unlock(self, request: pb.UnlockRequest, context: Any) -> pb.UnlockResponse:
        return await self._unary("Unlock", context, self._with_session(self._unlock), request)

    async def Alloc(self, request: pb.AllocRequest, context: Any) -> pb.AllocResponse:
        return await self._unary("Alloc", context, self._with_session(self._alloc), request)

    async def Free(self, request: pb.FreeRequest, context: Any) -> pb.FreeResponse:
        return await self._unary("Free", context, self._with_session(self._free), request)

    async def Step(self, request: pb.StepRequest, context: Any) -> pb.StepResponse:
        return await self._unary(
            "Step",
            context,
            self._with_session(self._step),
            request,
            prepare=self.tier.before_step if self.tier else None,
        )

    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        return await self._unary("Stats", context, self._stats, request, None)

    async def ListModels(
        self, request: pb.ListModelsRequest, context: Any
    ) -> pb.ListModelsResponse:
        return await self._unary("ListModels", context, self._list_models)

    async def DescribePool(
        self, request: pb.DescribePoolRequest, context: Any
    ) -> pb.DescribePoolResponse:
        return await self._unary("DescribePool", context, self._describe_pool, request)

    async def WriteFence(
        self, request: pb.WriteFenceRequest, context: Any
    ) -> pb.WriteFenceResponse:
        return await self._unary(
            "WriteFence",
            context,
            lambda req: write_fence.reply(
                self.service.fences, self.service.session(req.session_id), self.service.epoch
            ),
            request,
        )

    async def OpenSession(
        self, request: pb.OpenSessionRequest, context: Any
    ) -> pb.OpenSessionResponse:
        PEER.set(context.peer())  # sessions are counted per client (tenants.client_identity)
        return await self._unary("OpenSession", context, self._open_session, request)

    async def KeepAlive(self, request: pb.KeepAliveRequest, context: Any) -> pb.KeepAliveResponse:
        # Paced per session (keepalive.py): a renewal storm waits instead of spinning.
        sessions = self.service.sessions
        session = None if isinstance(request, Refused) else sessions.find(request.session_id)
        wait = keepalive.wait(session, time.monotonic(), self._unleased)
        if wait > 0:
            try:
                await asyncio.sleep(wait)
            except asyncio.CancelledError:
                keepalive.give_back(session, self._unleased)
                raise
        return await self._unary("KeepAlive", context, self._keep_alive, request)

    async def CloseSession(
        self, request: pb.CloseSessionRequest, context: Any
    ) -> pb.CloseSessionResponse:
        return await self._unary(
            "CloseSession", context, self._close_session, request, mutates=True
        )

    async def Reset(self, request: pb.ResetRequest, context: Any) -> pb.ResetResponse:
        return await self._unary("Reset", context, self._reset, request, mutates=True)

    # ------------------------------------------------------------ KV transfer

    async def ReadKV(self, request: pb.ReadKVRequest, context: Any) -> AsyncIterator[pb.KVChunk]:
        start = time.perf_counter()
        code = _OK
        streaming = None
        try:
            if self.service.draining:
                raise DrainingError("the service is shutting down")
            caller = self._enter(context)
            parts, chunk, grant = kv_access.open_read(
                self.service, parsed(request), self.limits, caller.bound, self.max_chunk_bytes
            )
            streaming = self.streams.open(self._session_of(request.session_id))
            # Each yield lets the loop serve other calls between chunks; the grant is
            # checked again before each, since the session may release what it read by.
            for reply in kv_transfer.read_chunks(parts, chunk, grant.check):
                yield reply
        except Exception as exc:
            code = self._refusal(exc, "ReadKV")
            await context.abort(code, str(exc), trailers_for(exc))
        finally:
            self.streams.close(streaming)
            self._observe("ReadKV", code, start)

    async def WriteKV(
        self, request_iterator: AsyncIterator[pb.KVChunk], context: Any
    ) -> pb.WriteKVResponse:
        start = time.perf_counter()
        code = _OK
        writer = streaming = None
        try:
            async for chunk in request_iterator:
                parsed(chunk)
                if writer is None:
                    opened = kv_transfer.open_writer(self.service, chunk, self.write_budget.hold)
                    # Counted before its first row is written: a refusal writes nothing.
                    streaming = self.streams.open(self.service.session(chunk.header.session_id))
                    writer = opened
                else:
                    writer.add(chunk)
            if writer is None:
                raise InvalidInputError("WriteKV stream carried no header")
            buffers = writer.finish()
            if self.check_integrity:
                self.service.check_integrity()
            return pb.WriteKVResponse(bytes_written=writer.bytes_written, buffers_written=buffers)
        except Exception as exc:
            code = self._refusal(exc, "WriteKV")
            await context.abort(code, str(exc), trailers_for(exc))
        finally:
            if writer is not None:
                writer.close()  # its partial rows' bytes go back to the budget
            self.streams.close(streaming)
            self._observe("WriteKV", code, start)

    # --------------------------------------------------------------- Subscribe

    async def Subscribe(self, request: pb.SubscribeRequest, context: Any) -> None:
        # Written with context.write, not yielded: a subscriber the watchdog drops is
        # cancelled in this handler's own await, so it can end with its status.
        start = time.perf_counter()
        code = _OK
        try:
            PEER.set(context.peer())  # streams are counted per client too
            if self._enter(context).bound:  # the feed names every namespace's pages
                raise DeniedError(
                    "Subscribe follows every namespace: not for a tenant's token",
                    "tenant_namespaces",
                )
            # Checked before the first event: a refusal starts nothing.
            opened = self.subscriptions.stream(parsed(request))
            await self.subscriptions.run(opened, context.write)
        except Exception as exc:
            code = self._refusal(exc, "Subscribe")
            # A dropped subscriber may not be reading: its status waits behind the events
            # it has not read, so the call ends without waiting long for it.
            try:
                await asyncio.wait_for(context.abort(code, str(exc), trailers_for(exc)), DROP_WAIT)
            except TimeoutError:
                raise asyncio.CancelledError from None
        finally:
            self._observe("Subscribe", code, start)

    # ------------------------------------------- pages by hash (page_rpcs.py)

    async def ExistsPages(
        self, request: pb.ExistsPagesRequest, context: Any
    ) -> pb.ExistsPagesResponse:
        PEER.set(context.peer())  # long calls take turns per client (access/turns.py)
        return await self._unary(
            "ExistsPages",
            context,
            self._attributed(
                lambda req, session: page_rpcs.exists(
                    self.service, self.limits, self.turns, req, session
                )
            ),
            request,
            prepare=self.tier.before_exists_pages if self.tier else None,
        )

    async def GetPages(self, request: pb.GetPagesRequest, context: Any) -> pb.GetPagesResponse:
        return await self._unary(
            "GetPages",
            context,
            self._with_session(self._pages(page_rpcs.get)),
            request,
            mutates=True,
        )

    async def SetPages(self, request: pb.SetPagesRequest, context: Any) -> pb.SetPagesResponse:
        return await self._unary(
            "SetPages",
            context,
            self._with_session(self._pages(page_rpcs.set_pages)),
            request,
            mutates=True,
        )

    async def Retain(self, request: pb.RetainRequest, context: Any) -> pb.RetainResponse:
        return await self._unary("Retain", context, self._retain, request, mutates=True)

    async def Explain(self, request: pb.ExplainRequest, context: Any) -> pb.ExplainResponse:
        PEER.set(context.peer())  # long calls take turns per client (access/turns.py)
        return await self._unary(
            "Explain",
            context,
            lambda req: explain.explain(self.service, self.limits, self.turns, req, self.tier),
            request,
        )
