"""The Session stream: a bidirectional stream that is a session for as long as it stays
open, carrying the same operations as the unary RPCs (one handler each, servicer_ops.py),
answered in order with their errors in-band. Its lease (server.stream_ttl) is renewed by
every message; a lapse ends the stream and releases what its session held."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from prefixcache.cache import InvalidInputError
from prefixcache.v1 import prefix_cache_pb2 as pb

from ..access.limits import Limits, truncate
from ..access.tenants import PEER, Caller, check_request
from ..errors import DrainingError, LimitError
from ..service import CacheService
from ..sessions.session import Session
from .registration import Refused, parsed
from .servicer_ops import CALLER

log = logging.getLogger("prefixcache.server")

_OK = grpc.StatusCode.OK


_MUTATING = (
    pb.InsertRequest,
    pb.EvictRequest,
    pb.LockRequest,
    pb.UnlockRequest,
    pb.AllocRequest,
    pb.FreeRequest,
    pb.StepRequest,
)


def is_mutating(request: Any) -> bool:
    """Whether a cache operation can change a cache or a pool (Match only with lock or
    allocate). Reset and CloseSession say so themselves."""
    if isinstance(request, pb.MatchRequest):
        return request.lock or request.allocate
    return isinstance(request, _MUTATING)


class SessionStream:
    """The Session RPC of ``PrefixCacheServicer``, which sets what it reads."""

    service: CacheService
    limits: Limits
    check_integrity: bool
    tier: Any
    _stream_ops: dict[str, Callable[[Any, Session], Any]]
    _enter: Callable[[Any], Caller]
    _refusal: Callable[[Exception, str], grpc.StatusCode]
    _observe: Callable[[str, grpc.StatusCode, float], None]

    async def Session(
        self, request_iterator: AsyncIterator[pb.SessionRequest], context: Any
    ) -> AsyncIterator[pb.SessionResponse]:
        if self.service.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the service is shutting down")
        # Its operations are the caller's (tenants, Evict's cap), and so is its session.
        self._enter(context)
        PEER.set(context.peer())
        try:
            session = self.service.open_stream_session(
                truncate(context.peer(), self.limits.max_client_name_bytes)
            )
        except LimitError as exc:
            await context.abort(self._refusal(exc, "Session"), str(exc))
        # The stream's lease lapsing (reaper.py) cancels this handler, ending the stream.
        session.on_lapse = asyncio.current_task().cancel
        try:
            async for request in request_iterator:
                self.service.sessions.touch(session)
                if self.tier is not None:  # the tier's fetch for a match or step (tier/)
                    await self.tier.before_stream_op(request)
                yield self._stream_op(request, session)
        except asyncio.CancelledError:
            if not session.lapsed:
                raise
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                (
                    f"the session stream sent nothing for {session.ttl} s (server.stream_ttl): "
                    "its session ended and its locks and slots were released"
                ),
            )
        finally:
            locks, slots = self.service.close_session(session)
            if self.check_integrity and (locks or slots):
                try:
                    self.service.check_integrity()
                except Exception:
                    log.exception("integrity check failed after closing a session stream")
            if locks or slots:
                log.info(
                    "session stream closed",
                    extra={
                        "session": session.id[:8],
                        "locks_released": locks,
                        "slots_freed": slots,
                    },
                )

    def _stream_op(self, request: pb.SessionRequest, session: Session) -> pb.SessionResponse:
        start = time.perf_counter()
        op = None if isinstance(request, Refused) else request.WhichOneof("op")
        seq = request.seq
        code = _OK
        try:
            parsed(request)
            if op is None:
                raise InvalidInputError("SessionRequest carries no operation")
            if self.service.draining:
                raise DrainingError("the service is shutting down")
            body = getattr(request, op)
            caller = CALLER.get()
            if caller.bound:
                check_request(caller, body, self.service)
            self.service.check_epoch(getattr(body, "server_epoch", 0))
            reply = self._stream_ops[op](body, session)
            if self.check_integrity and is_mutating(body):
                self.service.check_integrity()
            response = pb.SessionResponse(seq=seq)
            # CopyFrom into the oneof costs a third of passing the reply as a keyword
            # (a Match reply carries ~100 KB of slots).
            getattr(response, op).CopyFrom(reply)
            return response
        except Exception as exc:
            code = self._refusal(exc, f"Session/{op}")
            return pb.SessionResponse(seq=seq, error=pb.Error(code=code.value[0], message=str(exc)))
        finally:
            self._observe(f"Session/{op}", code, start)
