"""The gRPC adapter: decode a request, make one call into the service, encode the reply.

Every operation has one handler ``(request, session) -> response`` that both the unary
RPC and the Session stream call, so the two cannot drift apart. Errors become status
codes through ``status.status_for`` only.

Concurrency: this servicer runs on a ``grpc.aio`` server, so every handler runs on the
one event loop thread and no handler awaits in the middle of a cache operation. That
makes each model single-writer without locks (DESIGN §3).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from prefixcache.cache import InvalidInputError
from prefixcache.v1 import prefix_cache_pb2 as pb
from prefixcache.v1 import prefix_cache_pb2_grpc as pb_grpc

from . import kv_transfer
from .codec import decode_key, decode_slots, encode_slots
from .errors import DrainingError, PreconditionError
from .metrics import Metrics
from .registration import Malformed, parsed
from .service import CacheService
from .sessions import Session
from .shared_pool import describe_buffers
from .status import status_for, trailers_for

log = logging.getLogger("prefixcache.server")

_KINDS = {
    "radix": pb.CACHE_KIND_RADIX,
    "swa": pb.CACHE_KIND_SWA,
    "mamba": pb.CACHE_KIND_MAMBA,
    "slot": pb.CACHE_KIND_SLOT,
    "chunk": pb.CACHE_KIND_CHUNK,
}
_OK = grpc.StatusCode.OK
# Room for a KVChunk's other fields within a message of max_message_bytes.
CHUNK_OVERHEAD = 1024


_MUTATING = (pb.InsertRequest, pb.EvictRequest, pb.LockRequest, pb.UnlockRequest,
             pb.AllocRequest, pb.FreeRequest)


def _mutates(request: Any) -> bool:
    """Whether a cache operation can change a cache or a pool (Match only with lock or
    allocate). Reset and CloseSession say so themselves."""
    if isinstance(request, pb.MatchRequest):
        return request.lock or request.allocate
    return isinstance(request, _MUTATING)


def _extra_key(request: Any) -> str | None:
    return request.extra_key if request.HasField("extra_key") else None


def _mamba_layout(pool: Any) -> pb.MambaPoolLayout:
    return pb.MambaPoolLayout(
        layer_num=pool.num_layers, conv_state_shape=pool.conv_state_shape,
        conv_dtype=str(pool.dtype).removeprefix("torch."),
        temporal_state_shape=pool.temporal_state_shape,
        temporal_dtype=str(pool.temporal_dtype).removeprefix("torch."),
        working_slots=pool.max_reqs, state_slots=pool.max_track_slots,
        num_rows=pool.num_slots)


def _needs(session: Session | None, what: str) -> Session:
    if session is None:
        raise PreconditionError(f"{what} needs a session_id (OpenSession or the Session stream)")
    return session


class PrefixCacheServicer(pb_grpc.PrefixCacheServicer):
    """Serves ``prefixcache.v1.PrefixCache`` over a ``CacheService``.

    Args:
        check_integrity: Invariant mode: run the service's integrity check after every
            call that can change a cache or a pool; a failure answers INTERNAL.
    """

    def __init__(self, service: CacheService, metrics: Metrics | None = None,
                 check_integrity: bool = False,
                 max_message_bytes: int = 64 * 1024 * 1024) -> None:
        self.service = service
        self.metrics = metrics
        self.check_integrity = check_integrity
        # ReadKV chunks never exceed this, whatever the client asks for.
        self.max_chunk_bytes = max(max_message_bytes - CHUNK_OVERHEAD, 1)
        self._stream_ops: dict[str, Callable[[Any, Session | None], Any]] = {
            "match": self._match, "insert": self._insert, "evict": self._evict,
            "lock": self._lock, "unlock": self._unlock, "alloc": self._alloc,
            "free": self._free, "stats": self._stats,
        }

    # --------------------------------------------------------- shared handlers

    def _match(self, req: pb.MatchRequest, session: Session | None) -> pb.MatchResponse:
        if session is not None and (reply := session.replay("match", req.request_id)):
            return reply
        engine = self.service.engine(req.model)
        key = decode_key(req.token_ids, req.token_width, _extra_key(req),
                         engine.config.vocab_size)
        out = engine.match(key, session, req.lock, req.allocate)
        reply = pb.MatchResponse(
            prefix_len=out.prefix_len, slot_indices=encode_slots(out.indices),
            node_id=out.node_id, lock_id=out.lock_id,
            allocated_slots=encode_slots(out.allocated), state_slot=out.state_slot,
            mamba_branching_seqlen=out.branching_seqlen,
            allocated_state_slot=out.allocated_state, slot_version=out.slot_version,
            allocated_slot_version=out.allocated_version, server_epoch=self.service.epoch)
        if session is not None and (req.lock or req.allocate):
            session.remember("match", req.request_id, reply)
        return reply

    def _insert(self, req: pb.InsertRequest, session: Session | None) -> pb.InsertResponse:
        if session is not None and (reply := session.replay("insert", req.request_id)):
            return reply
        engine = self.service.engine(req.model)
        key = decode_key(req.token_ids, req.token_width, _extra_key(req),
                         engine.config.vocab_size)
        slots = decode_slots(req.slot_indices)
        state = req.state_slot if req.HasField("state_slot") else None
        if engine.kind == "slot":
            out = engine.insert(key, slots, session, req.lock, req.release_lock_id, state,
                                slot_version=req.slot_version)
        else:
            out = engine.insert(key, slots, session, req.lock, req.release_lock_id, state)
        reply = pb.InsertResponse(
            prefix_len=out.prefix_len, cached_len=out.cached_len, node_id=out.node_id,
            lock_id=out.lock_id, freed_slots=encode_slots(out.freed),
            state_exist=out.state_exist, server_epoch=self.service.epoch)
        if session is not None:
            session.remember("insert", req.request_id, reply)
        return reply

    def _evict(self, req: pb.EvictRequest, session: Session | None) -> pb.EvictResponse:
        result = self.service.engine(req.model).evict(req.num_tokens, req.swa_num_tokens,
                                                      req.mamba_num)
        return pb.EvictResponse(evicted_tokens=result.full_evicted,
                                swa_evicted_tokens=result.swa_evicted,
                                mamba_evicted=result.mamba_evicted)

    def _lock(self, req: pb.LockRequest, session: Session | None) -> pb.LockResponse:
        session = _needs(session, "Lock")
        if reply := session.replay("lock", req.request_id):
            return reply
        reply = pb.LockResponse(lock_id=self.service.engine(req.model).lock(session, req.node_id),
                                server_epoch=self.service.epoch)
        session.remember("lock", req.request_id, reply)
        return reply

    def _unlock(self, req: pb.UnlockRequest, session: Session | None) -> pb.UnlockResponse:
        session = _needs(session, "Unlock")
        if reply := session.replay("unlock", req.request_id):
            return reply
        self.service.unlock(session, req.lock_id)
        reply = pb.UnlockResponse()
        session.remember("unlock", req.request_id, reply)
        return reply

    def _alloc(self, req: pb.AllocRequest, session: Session | None) -> pb.AllocResponse:
        session = _needs(session, "Alloc")
        engine = self.service.engine(req.model)
        slots, states = engine.alloc(session, req.num_slots, req.num_state_slots)
        versions = engine.versions(slots) if engine.kind == "slot" else slots[:0]
        return pb.AllocResponse(slot_indices=encode_slots(slots),
                                state_slots=encode_slots(states),
                                slot_versions=encode_slots(versions),
                                server_epoch=self.service.epoch)

    def _free(self, req: pb.FreeRequest, session: Session | None) -> pb.FreeResponse:
        session = _needs(session, "Free")
        engine = self.service.engine(req.model)
        engine.free(session, decode_slots(req.slot_indices),
                    decode_slots(req.state_slots, "state_slots"))
        return pb.FreeResponse()

    def _stats(self, req: pb.StatsRequest, session: Session | None = None) -> pb.StatsResponse:
        engines = ([self.service.engine(req.model)] if req.model
                   else list(self.service.engines.values()))
        models = []
        for e in engines:
            sizes = e.sizes()
            models.append(pb.ModelStats(
                model=e.name, evictable_tokens=sizes["evictable"],
                protected_tokens=sizes["protected"], free_slots=sizes["free_slots"],
                match_tokens_total=e.match_tokens, hit_tokens_total=e.hit_tokens,
                pool_size=e.pool_size, session_slots=e.session_slots, locks=e.num_locks,
                evicted_tokens_total=sum(e.evicted_tokens.values()),
                swa_evictable_tokens=sizes["swa_evictable"],
                swa_protected_tokens=sizes["swa_protected"],
                mamba_evictable_slots=sizes["mamba_evictable"],
                mamba_protected_slots=sizes["mamba_protected"],
                free_state_slots=sizes["free_state_slots"],
                session_state_slots=e.session_state_slots))
        return pb.StatsResponse(models=models, sessions=len(self.service.sessions),
                                server_epoch=self.service.epoch)

    # ------------------------------------------------------------- unary RPCs

    def _refusal(self, exc: Exception, method: str) -> grpc.StatusCode:
        """The status a failed call answers; a bug (INTERNAL) is logged with its trace."""
        code = status_for(exc)
        if code is grpc.StatusCode.INTERNAL:
            log.exception("internal error in %s", method)
        return code

    def _observe(self, method: str, code: grpc.StatusCode, start: float) -> None:
        if self.metrics is not None:
            self.metrics.observe_rpc(method, code, time.perf_counter() - start)

    async def _unary(self, method: str, context: grpc.aio.ServicerContext,
                     handler: Callable[..., Any], *args: Any, mutates: bool = False) -> Any:
        start = time.perf_counter()
        code = _OK
        try:
            for arg in args:
                parsed(arg)
            if self.service.draining:
                raise DrainingError("the service is shutting down")
            if args:
                self.service.check_epoch(getattr(args[0], "server_epoch", 0))
            reply = handler(*args)
            if self.check_integrity and (mutates or (args and _mutates(args[0]))):
                self.service.check_integrity()
            return reply
        except Exception as exc:
            code = self._refusal(exc, method)
            await context.abort(code, str(exc), trailers_for(exc))
        finally:
            self._observe(method, code, start)

    def _session_of(self, session_id: str) -> Session | None:
        return self.service.session(session_id) if session_id else None

    def _with_session(self, handler: Callable[[Any, Session | None], Any]
                      ) -> Callable[[Any], Any]:
        return lambda req: handler(req, self._session_of(req.session_id))

    async def Match(self, request: pb.MatchRequest, context: Any) -> pb.MatchResponse:
        return await self._unary("Match", context, self._with_session(self._match), request)

    async def Insert(self, request: pb.InsertRequest, context: Any) -> pb.InsertResponse:
        return await self._unary("Insert", context, self._with_session(self._insert), request)

    async def Evict(self, request: pb.EvictRequest, context: Any) -> pb.EvictResponse:
        return await self._unary("Evict", context, self._evict, request, None)

    async def Lock(self, request: pb.LockRequest, context: Any) -> pb.LockResponse:
        return await self._unary("Lock", context, self._with_session(self._lock), request)

    async def Unlock(self, request: pb.UnlockRequest, context: Any) -> pb.UnlockResponse:
        return await self._unary("Unlock", context, self._with_session(self._unlock), request)

    async def Alloc(self, request: pb.AllocRequest, context: Any) -> pb.AllocResponse:
        return await self._unary("Alloc", context, self._with_session(self._alloc), request)

    async def Free(self, request: pb.FreeRequest, context: Any) -> pb.FreeResponse:
        return await self._unary("Free", context, self._with_session(self._free), request)

    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        return await self._unary("Stats", context, self._stats, request, None)

    async def ListModels(self, request: pb.ListModelsRequest,
                         context: Any) -> pb.ListModelsResponse:
        return await self._unary("ListModels", context, self._list_models)

    async def DescribePool(self, request: pb.DescribePoolRequest,
                           context: Any) -> pb.DescribePoolResponse:
        return await self._unary("DescribePool", context, self._describe_pool, request)

    async def OpenSession(self, request: pb.OpenSessionRequest,
                          context: Any) -> pb.OpenSessionResponse:
        return await self._unary("OpenSession", context, self._open_session, request)

    async def KeepAlive(self, request: pb.KeepAliveRequest,
                        context: Any) -> pb.KeepAliveResponse:
        return await self._unary("KeepAlive", context, self._keep_alive, request)

    async def CloseSession(self, request: pb.CloseSessionRequest,
                           context: Any) -> pb.CloseSessionResponse:
        return await self._unary("CloseSession", context, self._close_session, request,
                                 mutates=True)

    async def Reset(self, request: pb.ResetRequest, context: Any) -> pb.ResetResponse:
        return await self._unary("Reset", context, self._reset, request, mutates=True)

    def _list_models(self) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(server_epoch=self.service.epoch, models=[
            pb.ModelInfo(name=e.name, cache_kind=_KINDS[e.kind], page_size=e.page_size,
                         pool_size=e.pool_size,
                         sliding_window_size=e.config.sliding_window_size or 0,
                         vocab_size=e.config.vocab_size,
                         state_pool_size=e.mamba_pool.max_track_slots if e.mamba_pool else 0)
            for e in self.service.engines.values()])

    def _describe_pool(self, req: pb.DescribePoolRequest) -> pb.DescribePoolResponse:
        engine = self.service.engine(req.model)
        kv = engine.kv_pool
        if kv is None:  # a slot model: [slot, position, layer, heads, dim] tensors
            k, v = engine.k_cache, engine.v_cache
            return pb.DescribePoolResponse(
                model=engine.name, layer_num=k.shape[2], k_head_num=k.shape[3],
                k_head_dim=k.shape[4], v_head_num=v.shape[3], v_head_dim=v.shape[4],
                dtype=str(k.dtype).removeprefix("torch."), device=str(k.device),
                page_size=1, pool_size=engine.pool_size, num_rows=engine.pool_size,
                max_seq_len=engine.max_seq_len,
                buffers=describe_buffers(engine, self.service.shared),
                server_epoch=self.service.epoch)
        return pb.DescribePoolResponse(
            model=engine.name, layer_num=kv.layer_num, k_head_num=kv.k_head_num,
            k_head_dim=kv.k_head_dim, v_head_num=kv.v_head_num, v_head_dim=kv.v_head_dim,
            dtype=str(kv.dtype).removeprefix("torch."), device=str(kv.device),
            page_size=kv.page_size, pool_size=engine.pool_size, num_rows=kv.num_rows,
            swa_pool_size=engine.swa_kv_pool.size if engine.swa_kv_pool else 0,
            mamba=_mamba_layout(engine.mamba_pool) if engine.mamba_pool else None,
            buffers=describe_buffers(engine, self.service.shared),
            server_epoch=self.service.epoch)

    def _open_session(self, req: pb.OpenSessionRequest) -> pb.OpenSessionResponse:
        if req.ttl_seconds < 0 or req.ttl_seconds != req.ttl_seconds:
            raise InvalidInputError(f"ttl_seconds must be >= 0, got {req.ttl_seconds}")
        session = self.service.open_session(req.ttl_seconds, req.client_name)
        return pb.OpenSessionResponse(session_id=session.id, ttl_seconds=session.ttl or 0.0,
                                      server_epoch=self.service.epoch)

    def _keep_alive(self, req: pb.KeepAliveRequest) -> pb.KeepAliveResponse:
        session = self.service.session(req.session_id)
        return pb.KeepAliveResponse(ttl_seconds=session.ttl or 0.0)

    def _close_session(self, req: pb.CloseSessionRequest) -> pb.CloseSessionResponse:
        locks, slots = self.service.close_session(self.service.session(req.session_id))
        return pb.CloseSessionResponse(locks_released=locks, slots_freed=slots)

    def _reset(self, req: pb.ResetRequest) -> pb.ResetResponse:
        tokens, locks = self.service.reset(req.model)
        return pb.ResetResponse(dropped_tokens=tokens, dropped_locks=locks)

    # ------------------------------------------------------------ KV transfer

    async def ReadKV(self, request: pb.ReadKVRequest,
                     context: Any) -> AsyncIterator[pb.KVChunk]:
        start = time.perf_counter()
        code = _OK
        try:
            if self.service.draining:
                raise DrainingError("the service is shutting down")
            engine = self.service.engine(parsed(request).model)
            self.service.check_epoch(request.server_epoch)
            parts = kv_transfer.plan(engine, decode_slots(request.slot_indices),
                                     list(request.layers),
                                     decode_slots(request.state_slots, "state_slots"))
            chunk = min(request.max_chunk_bytes or self.max_chunk_bytes,
                        self.max_chunk_bytes)
            # Each yield lets the loop serve other calls between chunks.
            for reply in kv_transfer.read_chunks(parts, chunk):
                yield reply
        except Exception as exc:
            code = self._refusal(exc, "ReadKV")
            await context.abort(code, str(exc), trailers_for(exc))
        finally:
            self._observe("ReadKV", code, start)

    async def WriteKV(self, request_iterator: AsyncIterator[pb.KVChunk],
                      context: Any) -> pb.WriteKVResponse:
        start = time.perf_counter()
        code = _OK
        try:
            writer = None
            async for chunk in request_iterator:
                parsed(chunk)
                if writer is None:
                    writer = kv_transfer.open_writer(self.service, chunk)
                else:
                    writer.add(chunk)
            if writer is None:
                raise InvalidInputError("WriteKV stream carried no header")
            buffers = writer.finish()
            if self.check_integrity:
                self.service.check_integrity()
            return pb.WriteKVResponse(bytes_written=writer.bytes_written,
                                      buffers_written=buffers)
        except Exception as exc:
            code = self._refusal(exc, "WriteKV")
            await context.abort(code, str(exc), trailers_for(exc))
        finally:
            self._observe("WriteKV", code, start)

    # ---------------------------------------------------------- Session stream

    async def Session(self, request_iterator: AsyncIterator[pb.SessionRequest],
                      context: Any) -> AsyncIterator[pb.SessionResponse]:
        if self.service.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the service is shutting down")
        session = self.service.open_stream_session(context.peer())
        try:
            async for request in request_iterator:
                yield self._stream_op(request, session)
        finally:
            locks, slots = self.service.close_session(session)
            if self.check_integrity and (locks or slots):
                try:
                    self.service.check_integrity()
                except Exception:
                    log.exception("integrity check failed after closing a session stream")
            if locks or slots:
                log.info("session stream closed", extra={
                    "session": session.id[:8], "locks_released": locks, "slots_freed": slots})

    def _stream_op(self, request: pb.SessionRequest, session: Session) -> pb.SessionResponse:
        start = time.perf_counter()
        op = None if isinstance(request, Malformed) else request.WhichOneof("op")
        seq = 0 if isinstance(request, Malformed) else request.seq
        code = _OK
        try:
            parsed(request)
            if op is None:
                raise InvalidInputError("SessionRequest carries no operation")
            if self.service.draining:
                raise DrainingError("the service is shutting down")
            body = getattr(request, op)
            self.service.check_epoch(getattr(body, "server_epoch", 0))
            reply = self._stream_ops[op](body, session)
            if self.check_integrity and _mutates(body):
                self.service.check_integrity()
            return pb.SessionResponse(seq=seq, **{op: reply})
        except Exception as exc:
            code = self._refusal(exc, f"Session/{op}")
            return pb.SessionResponse(seq=seq, error=pb.Error(
                code=code.value[0], message=str(exc)))
        finally:
            self._observe(f"Session/{op}", code, start)

