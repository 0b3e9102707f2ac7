"""The operation handlers of the gRPC adapter: decode a request, make one call into the
service, encode the reply.

Each is ``(request, session) -> response``, shared by the unary RPC and the Session
stream (servicer.py), so the two cannot drift apart. They never await: each runs whole
on the event loop, so a model stays single-writer without locks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefixcache.cache import IntegrityError, InvalidInputError
from prefixcache.cache.pages import to_page_ids
from prefixcache.v1 import prefix_cache_pb2 as pb

from ..access import tenant_stats
from ..access.limits import Limits, request_tokens
from ..access.tenants import CALLER  # who the call comes from (set by the entry points)
from ..codec import decode_key, decode_slots, encode_slots
from ..engine.lookups import unused_reason, with_lookups
from ..errors import DeniedError, PreconditionError
from ..memory.shared_pool import describe_buffers
from ..service import CacheService
from ..sessions import holdings, replays
from ..sessions.evict_policy import EvictPolicy
from ..sessions.session import Session
from . import reply_caps, retention
from .step import StepExecutor, model_stats, refuse_keep_duplicates

_KINDS = {
    "radix": pb.CACHE_KIND_RADIX,
    "swa": pb.CACHE_KIND_SWA,
    "mamba": pb.CACHE_KIND_MAMBA,
    "slot": pb.CACHE_KIND_SLOT,
    "chunk": pb.CACHE_KIND_CHUNK,
}


def _extra_key(request: Any) -> str | None:
    return request.extra_key if request.HasField("extra_key") else None


def _mamba_layout(pool: Any) -> pb.MambaPoolLayout:
    return pb.MambaPoolLayout(
        layer_num=pool.num_layers,
        conv_state_shape=pool.conv_state_shape,
        conv_dtype=str(pool.dtype).removeprefix("torch."),
        temporal_state_shape=pool.temporal_state_shape,
        temporal_dtype=str(pool.temporal_dtype).removeprefix("torch."),
        working_slots=pool.max_reqs,
        state_slots=pool.max_track_slots,
        num_rows=pool.num_slots,
    )


def _check_pages(engine: Any) -> None:
    """Refuse ``as_pages`` where slots are not token slots in pages (sequence slots)."""
    if engine.kind == "slot":
        raise InvalidInputError(
            f"as_pages: model {engine.name!r} is CACHE_KIND_SLOT, whose "
            "slots are sequences, not pages of token slots"
        )


def whole_page_ids(slots: Any, page_size: int) -> Any:
    """Freshly allocated ``slots`` as page ids. The allocator hands out whole aligned
    pages; anything else is a broken invariant, not the caller's fault."""
    try:
        return to_page_ids(slots, page_size)
    except InvalidInputError as exc:
        raise IntegrityError(
            f"the allocator handed out slots that are not whole pages: {exc}"
        ) from exc


def _needs(session: Session | None, what: str) -> Session:
    if session is None:
        raise PreconditionError(f"{what} needs a session_id (OpenSession or the Session stream)")
    return session


class CacheOps:
    """The handlers, as a mixin of PrefixCacheServicer, which sets these attributes."""

    service: CacheService
    limits: Limits
    evict_policy: EvictPolicy
    _steps: StepExecutor
    tier: Any  # the shared tier (tier/), None when off

    def _match(self, req: pb.MatchRequest, session: Session | None) -> pb.MatchResponse:
        if session is not None and (reply := replays.replayed(session, "match", req)):
            return reply
        engine = self.service.engine(req.model)
        key = decode_key(
            req.token_ids,
            req.token_width,
            _extra_key(req),
            engine.config.vocab_size,
            request_tokens(self.limits, engine.config),
        )
        reply_caps.check(self.limits, "Match", reply_caps.match_size(engine, req))
        hint = retention.of_call(req, session, self.limits.retention)
        if req.as_pages:
            _check_pages(engine)
            out = engine.match(key, session, req.lock, req.allocate, as_pages=True)
        else:
            out = engine.match(key, session, req.lock, req.allocate)
        reply = pb.MatchResponse(
            prefix_len=out.prefix_len,
            node_id=out.node_id,
            lock_id=out.lock_id,
            state_slot=out.state_slot,
            mamba_branching_seqlen=out.branching_seqlen,
            allocated_state_slot=out.allocated_state,
            slot_version=out.slot_version,
            allocated_slot_version=out.allocated_version,
            server_epoch=self.service.epoch,
        )
        if req.as_pages:
            reply.page_ids = encode_slots(to_page_ids(out.indices, engine.page_size))
            reply.allocated_page_ids = encode_slots(to_page_ids(out.allocated, engine.page_size))
        else:
            reply.slot_indices = encode_slots(out.indices)
            reply.allocated_slots = encode_slots(out.allocated)
        if hint is not None:
            retention.apply(engine, out.node_id, hint, reply)
        if session is not None and (req.lock or req.allocate):
            replays.remember(session, "match", req, reply)
        return reply

    def _insert(self, req: pb.InsertRequest, session: Session | None) -> pb.InsertResponse:
        if session is not None and (reply := replays.replayed(session, "insert", req)):
            return reply
        engine = self.service.engine(req.model)
        key = decode_key(
            req.token_ids,
            req.token_width,
            _extra_key(req),
            engine.config.vocab_size,
            request_tokens(self.limits, engine.config),
        )
        slots = decode_slots(req.slot_indices, max_count=request_tokens(self.limits, engine.config))
        state = req.state_slot if req.HasField("state_slot") else None
        hint = retention.of_call(req, session, self.limits.retention)
        if engine.kind == "slot":
            refuse_keep_duplicates(req, engine)
            out = engine.insert(
                key,
                slots,
                session,
                req.lock,
                req.release_lock_id,
                state,
                slot_version=req.slot_version,
            )
        else:
            out = engine.insert(
                key,
                slots,
                session,
                req.lock,
                req.release_lock_id,
                state,
                keep_duplicates=req.keep_duplicates,
            )
        reply = pb.InsertResponse(
            prefix_len=out.prefix_len,
            cached_len=out.cached_len,
            node_id=out.node_id,
            lock_id=out.lock_id,
            freed_slots=encode_slots(out.freed),
            state_exist=out.state_exist,
            server_epoch=self.service.epoch,
        )
        if hint is not None:
            retention.apply(engine, out.node_id, hint, reply)
        if session is not None:
            replays.remember(session, "insert", req, reply)
        return reply

    def _evict(self, req: pb.EvictRequest, session: Session | None) -> pb.EvictResponse:
        engine = self.service.engine(req.model)
        caller = CALLER.get()
        self.evict_policy.check(req, caller, session)
        result = engine.evict(req.num_tokens, req.swa_num_tokens, req.mamba_num)
        self.evict_policy.record(engine, req, result.full_evicted, caller, session)
        return pb.EvictResponse(
            evicted_tokens=result.full_evicted,
            swa_evicted_tokens=result.swa_evicted,
            mamba_evicted=result.mamba_evicted,
        )

    def _lock(self, req: pb.LockRequest, session: Session | None) -> pb.LockResponse:
        session = _needs(session, "Lock")
        if reply := replays.replayed(session, "lock", req):
            return reply
        reply = pb.LockResponse(
            lock_id=self.service.engine(req.model).lock(session, req.node_id),
            server_epoch=self.service.epoch,
        )
        replays.remember(session, "lock", req, reply)
        return reply

    def _unlock(self, req: pb.UnlockRequest, session: Session | None) -> pb.UnlockResponse:
        session = _needs(session, "Unlock")
        if reply := replays.replayed(session, "unlock", req):
            return reply
        self.service.unlock(session, req.lock_id, unused_reason(req.unused_outcome))
        reply = pb.UnlockResponse()
        replays.remember(session, "unlock", req, reply)
        return reply

    def _alloc(self, req: pb.AllocRequest, session: Session | None) -> pb.AllocResponse:
        session = _needs(session, "Alloc")
        engine = self.service.engine(req.model)
        if req.as_pages:
            _check_pages(engine)
        reply_caps.check(
            self.limits, "Alloc", reply_caps.alloc_size(engine, req.num_slots, req.num_state_slots)
        )
        slots, states = engine.alloc(session, req.num_slots, req.num_state_slots)
        versions = engine.versions(slots) if engine.kind == "slot" else slots[:0]
        reply = pb.AllocResponse(
            state_slots=encode_slots(states),
            slot_versions=encode_slots(versions),
            server_epoch=self.service.epoch,
        )
        if req.as_pages:
            reply.page_ids = encode_slots(whole_page_ids(slots, engine.page_size))
        else:
            reply.slot_indices = encode_slots(slots)
        return reply

    def _free(self, req: pb.FreeRequest, session: Session | None) -> pb.FreeResponse:
        session = _needs(session, "Free")
        engine = self.service.engine(req.model)
        cap = request_tokens(self.limits, engine.config)
        engine.free(
            session,
            decode_slots(req.slot_indices, max_count=cap),
            decode_slots(req.state_slots, "state_slots", cap),
        )
        return pb.FreeResponse()

    def _stats(self, req: pb.StatsRequest, session: Session | None = None) -> pb.StatsResponse:
        engines = (
            [self.service.engine(req.model)] if req.model else list(self.service.engines.values())
        )
        top = []
        if req.top_sessions:
            if CALLER.get().bound:  # the list names every tenant's clients
                raise DeniedError(
                    "top_sessions lists every tenant's sessions: not for a tenant's token",
                    "tenant_namespaces",
                )
            sessions = self.service.sessions
            top = holdings.top_sessions(sessions, engines, req.top_sessions, sessions.now())
        return pb.StatsResponse(
            models=[with_lookups(model_stats(e), e) for e in engines],
            sessions=tenant_stats.sessions_seen(self.service.sessions),
            server_epoch=self.service.epoch,
            top_sessions=top,
        )

    def _step(self, req: pb.StepRequest, session: Session | None) -> pb.StepResponse:
        return self._steps.run(req, _needs(session, "Step"))

    def _list_models(self) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(
            server_epoch=self.service.epoch,
            models=[
                pb.ModelInfo(
                    name=e.name,
                    cache_kind=_KINDS[e.kind],
                    page_size=e.page_size,
                    pool_size=e.pool_size,
                    sliding_window_size=e.config.sliding_window_size or 0,
                    vocab_size=e.config.vocab_size,
                    state_pool_size=e.mamba_pool.max_track_slots if e.mamba_pool else 0,
                    tiered=self.tier is not None and e.name in self.tier.models,
                )
                for e in self.service.engines.values()
            ],
        )

    def _describe_pool(self, req: pb.DescribePoolRequest) -> pb.DescribePoolResponse:
        engine = self.service.engine(req.model)
        kv = engine.kv_pool
        if kv is None:  # a slot model: [slot, position, layer, heads, dim] tensors
            k, v = engine.k_cache, engine.v_cache
            return pb.DescribePoolResponse(
                model=engine.name,
                layer_num=k.shape[2],
                k_head_num=k.shape[3],
                k_head_dim=k.shape[4],
                v_head_num=v.shape[3],
                v_head_dim=v.shape[4],
                dtype=str(k.dtype).removeprefix("torch."),
                device=str(k.device),
                page_size=1,
                pool_size=engine.pool_size,
                num_rows=engine.pool_size,
                max_seq_len=engine.max_seq_len,
                buffers=describe_buffers(engine, self.service.shared),
                server_epoch=self.service.epoch,
            )
        return pb.DescribePoolResponse(
            model=engine.name,
            layer_num=kv.layer_num,
            k_head_num=kv.k_head_num,
            k_head_dim=kv.k_head_dim,
            v_head_num=kv.v_head_num,
            v_head_dim=kv.v_head_dim,
            dtype=str(kv.dtype).removeprefix("torch."),
            device=str(kv.device),
            page_size=kv.page_size,
            pool_size=engine.pool_size,
            num_rows=kv.num_rows,
            mla=kv.mla,
            swa_pool_size=engine.swa_kv_pool.size if engine.swa_kv_pool else 0,
            mamba=_mamba_layout(engine.mamba_pool) if engine.mamba_pool else None,
            buffers=describe_buffers(engine, self.service.shared),
            server_epoch=self.service.epoch,
        )

    def _open_session(self, req: pb.OpenSessionRequest) -> pb.OpenSessionResponse:
        if req.ttl_seconds < 0 or req.ttl_seconds != req.ttl_seconds:
            raise InvalidInputError(f"ttl_seconds must be >= 0, got {req.ttl_seconds}")
        default = retention.hint(req, self.limits.retention)
        session = self.service.open_session(req.ttl_seconds, req.client_name)
        session.retention = default
        return pb.OpenSessionResponse(
            session_id=session.id,
            ttl_seconds=session.ttl or 0.0,
            server_epoch=self.service.epoch,
            retention=retention.of_session(default) if default is not None else None,
        )

    def _keep_alive(self, req: pb.KeepAliveRequest) -> pb.KeepAliveResponse:
        session = self.service.session(req.session_id)
        return pb.KeepAliveResponse(ttl_seconds=session.ttl or 0.0)

    def _stream_keep_alive(
        self, req: pb.KeepAliveRequest, session: Session | None
    ) -> pb.KeepAliveResponse:
        # The message itself renewed the stream's lease; the reply tells its TTL.
        return pb.KeepAliveResponse(ttl_seconds=_needs(session, "keep_alive").ttl or 0.0)

    def _close_session(self, req: pb.CloseSessionRequest) -> pb.CloseSessionResponse:
        locks, slots = self.service.close_session(self.service.session(req.session_id))
        return pb.CloseSessionResponse(locks_released=locks, slots_freed=slots)

    def _reset(self, req: pb.ResetRequest) -> pb.ResetResponse:
        tokens, locks = self.service.reset(req.model)
        return pb.ResetResponse(dropped_tokens=tokens, dropped_locks=locks)

    def _retain(self, req: pb.RetainRequest) -> pb.RetainResponse:
        return retention.retain(self.service, self.limits, req)

    def _pages(self, handler: Callable[..., Any]) -> Callable[[Any, Session | None], Any]:
        return lambda req, session: handler(self.service, self.limits, req, session)
