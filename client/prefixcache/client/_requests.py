"""Every operation's request: what it sends, how its reply is read, whether it may be
retried and what it answers when it fails open (an :class:`Op`), and the request ids
and epoch fences the requests carry. Shared by both clients through ``ClientBase``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, TypeVar

from google.protobuf.message import Message

from prefixcache.v1 import prefix_cache_pb2 as pb

from . import results, step
from ._wire import extra_key_of, pack_slots, pack_tokens
from .errors import InvalidArgument, PrefixCacheError
from .retention import retention_pb

SessionLike = Any  # a session object (with .session_id), a SessionInfo, or an id string
R = TypeVar("R")


@dataclass(slots=True)
class Op(Generic[R]):
    """One call: ``method`` of the stub with ``request``; ``parse`` reads the reply.

    ``retry``: the call may be repeated after UNAVAILABLE (it is a read, or carries a
    request id). ``fallback``: the fail-open answer, or None when the call cannot fail
    open (it would have to hand out something real, like slots).
    """

    method: str
    request: Message
    # The reply is the stub's (generated without types): the message ``method`` answers.
    parse: Callable[[Any], R]
    retry: bool
    fallback: Callable[[], R] | None = None
    # A fail-open answer that depends on the error (Step: per-item stand-ins or errors).
    fallback_for: Callable[[PrefixCacheError], R] | None = None


def session_id_of(session: SessionLike) -> str:
    if session is None:
        return ""
    if isinstance(session, str):
        return session
    sid = getattr(session, "session_id", None)
    if not isinstance(sid, str):
        raise InvalidArgument(
            f"session must be a session, SessionInfo or id string, not {type(session).__name__}"
        )
    return sid


class Requests:
    """The request builders of ``ClientBase``, which sets what they read."""

    client_name: str
    server_epoch: int
    counters: dict[str, Any]
    _pools: dict[str, results.PoolInfo]
    _request_ids: Iterator[int]

    def _next_request_id(self, request_id: int | None, needed: bool) -> int:
        if request_id is not None:
            return int(request_id)
        return next(self._request_ids) if needed else 0

    def _fence(self, session: SessionLike, server_epoch: int | None) -> int:
        """The epoch a call's handles come from: given, the session's own, or the
        newest this client has seen."""
        if server_epoch is not None:
            return int(server_epoch)
        own = getattr(session, "server_epoch", None)
        return own if isinstance(own, int) and own else self.server_epoch

    def _op_list_models(self) -> Op[results.ModelList]:
        return Op("ListModels", pb.ListModelsRequest(), results.ModelList.from_pb, True)

    def _op_describe_pool(self, model: str) -> Op[results.PoolInfo]:
        def parse(m: pb.DescribePoolResponse) -> results.PoolInfo:
            info = results.PoolInfo.from_pb(m)
            self._pools[model] = info
            return info

        return Op("DescribePool", pb.DescribePoolRequest(model=model), parse, True)

    def _op_stats(self, model: str) -> Op[results.StatsReply]:
        return Op("Stats", pb.StatsRequest(model=model), results.StatsReply.from_pb, True)

    def _op_open_session(
        self, ttl: float | None, name: str | None, retain: Any = None
    ) -> Op[results.SessionInfo]:
        request = pb.OpenSessionRequest(
            ttl_seconds=float(ttl or 0.0),
            client_name=self.client_name if name is None else name,
            retention=retention_pb(retain),
        )
        # Not retried: a lost reply would leave a session behind (until its lease lapses).
        return Op("OpenSession", request, results.SessionInfo.from_pb, False)

    def _op_keep_alive(self, session: SessionLike, server_epoch: int | None = None) -> Op[float]:
        request = pb.KeepAliveRequest(
            session_id=session_id_of(session), server_epoch=self._fence(session, server_epoch)
        )
        return Op("KeepAlive", request, lambda m: m.ttl_seconds, True)

    def _op_close_session(self, session: SessionLike) -> Op[results.CloseReply]:
        request = pb.CloseSessionRequest(
            session_id=session_id_of(session), server_epoch=self._fence(session, None)
        )
        return Op("CloseSession", request, results.CloseReply.from_pb, False)

    def _op_match(
        self,
        model: str,
        tokens: Any,
        extra_key: str | None,
        token_width: int | None,
        session: SessionLike,
        lock: bool,
        allocate: bool,
        request_id: int | None,
        as_pages: bool = False,
        retain: Any = None,
    ) -> Op[results.MatchReply]:
        data, width = pack_tokens(tokens, token_width)
        sid = session_id_of(session)
        rid = self._next_request_id(request_id, bool(sid) and (lock or allocate))
        # Only the session is a handle here: a match without one is never stale.
        request = pb.MatchRequest(
            model=model,
            token_ids=data,
            token_width=width,
            session_id=sid,
            lock=lock,
            allocate=allocate,
            request_id=rid,
            as_pages=bool(as_pages),
            server_epoch=self._fence(session, None) if sid else 0,
            retention=retention_pb(retain),
        )
        key = extra_key_of(tokens, extra_key)
        if key is not None:
            request.extra_key = key
        # An allocation cannot fail open: the worker needs real slots.
        fallback = None if allocate else (lambda: results.MatchReply(skipped=True))
        return Op(
            "Match",
            request,
            results.MatchReply.from_pb,
            not (lock or allocate) or bool(rid),
            fallback,
        )

    def _op_insert(
        self,
        model: str,
        tokens: Any,
        slots: Any,
        extra_key: str | None,
        token_width: int | None,
        session: SessionLike,
        lock: bool,
        release_lock_id: int,
        state_slot: int | None,
        slot_version: int,
        request_id: int | None,
        server_epoch: int | None = None,
        retain: Any = None,
    ) -> Op[results.InsertReply]:
        data, width = pack_tokens(tokens, token_width)
        sid = session_id_of(session)
        rid = self._next_request_id(request_id, bool(sid))
        request = pb.InsertRequest(
            model=model,
            token_ids=data,
            token_width=width,
            slot_indices=pack_slots(slots),
            session_id=sid,
            lock=lock,
            release_lock_id=int(release_lock_id),
            request_id=rid,
            slot_version=int(slot_version),
            server_epoch=self._fence(session, server_epoch),
            retention=retention_pb(retain),
        )
        key = extra_key_of(tokens, extra_key)
        if key is not None:
            request.extra_key = key
        if state_slot is not None:
            request.state_slot = int(state_slot)
        # Without a session an insert can only re-insert the tree's own slots: a no-op
        # when repeated. With one, the request id makes the retry replay the answer.
        return Op(
            "Insert",
            request,
            results.InsertReply.from_pb,
            bool(rid) or not sid,
            lambda: results.InsertReply(skipped=True),
        )

    def _op_retain(
        self, model: str, tokens: Any, retain: Any, extra_key: str | None, token_width: int | None
    ) -> Op[results.RetainReply]:
        data, width = pack_tokens(tokens, token_width)
        hint = retention_pb(retain)
        request = pb.RetainRequest(
            model=model,
            token_ids=data,
            token_width=width,
            retention=hint if hint is not None else pb.Retention(),
        )
        key = extra_key_of(tokens, extra_key)
        if key is not None:
            request.extra_key = key
        # The same hint again does the same: safe to retry.
        return Op(
            "Retain",
            request,
            results.RetainReply.from_pb,
            True,
            lambda: results.RetainReply(skipped=True),
        )

    def _op_evict(
        self,
        model: str,
        num_tokens: int,
        swa_num_tokens: int,
        mamba_num: int,
        session: SessionLike = None,
    ) -> Op[results.EvictReply]:
        request = pb.EvictRequest(
            model=model,
            num_tokens=int(num_tokens),
            swa_num_tokens=int(swa_num_tokens),
            mamba_num=int(mamba_num),
            session_id=session_id_of(session),
        )
        return Op("Evict", request, results.EvictReply.from_pb, False)

    def _op_lock(
        self,
        model: str,
        node_id: int,
        session: SessionLike,
        request_id: int | None,
        server_epoch: int | None = None,
    ) -> Op[results.LockReply]:
        sid = session_id_of(session)
        rid = self._next_request_id(request_id, bool(sid))
        request = pb.LockRequest(
            model=model,
            node_id=int(node_id),
            session_id=sid,
            request_id=rid,
            server_epoch=self._fence(session, server_epoch),
        )
        return Op(
            "Lock",
            request,
            lambda m: results.LockReply(m.lock_id, server_epoch=m.server_epoch),
            bool(rid),
            lambda: results.LockReply(skipped=True),
        )

    def _op_unlock(
        self,
        lock_id: int,
        session: SessionLike,
        request_id: int | None,
        server_epoch: int | None = None,
        unused: str | None = None,
    ) -> Op[results.UnlockReply]:
        sid = session_id_of(session)
        rid = self._next_request_id(request_id, bool(sid))
        request = pb.UnlockRequest(
            lock_id=int(lock_id),
            session_id=sid,
            request_id=rid,
            server_epoch=self._fence(session, server_epoch),
            unused_outcome=unused_outcome(unused),
        )
        return Op(
            "Unlock",
            request,
            lambda m: results.UnlockReply(),
            bool(rid),
            lambda: results.UnlockReply(skipped=True),
        )

    def _op_alloc(
        self,
        model: str,
        num_slots: int,
        num_state_slots: int,
        session: SessionLike,
        as_pages: bool = False,
    ) -> Op[results.AllocReply]:
        request = pb.AllocRequest(
            model=model,
            num_slots=int(num_slots),
            num_state_slots=int(num_state_slots),
            as_pages=bool(as_pages),
            session_id=session_id_of(session),
            server_epoch=self._fence(session, None),
        )
        return Op("Alloc", request, results.AllocReply.from_pb, False)

    def _op_free(
        self,
        model: str,
        slots: Any,
        state_slots: Any,
        session: SessionLike,
        server_epoch: int | None = None,
    ) -> Op[None]:
        request = pb.FreeRequest(
            model=model,
            slot_indices=pack_slots(slots),
            state_slots=pack_slots(state_slots),
            session_id=session_id_of(session),
            server_epoch=self._fence(session, server_epoch),
        )
        # Failing open leaves the slots with the session: its close or lease frees them.
        return Op("Free", request, lambda m: None, False, lambda: None)

    def _op_reset(self, model: str) -> Op[results.ResetReply]:
        return Op("Reset", pb.ResetRequest(model=model), results.ResetReply.from_pb, False)

    def _op_step(
        self,
        model: str,
        items: step.StepItems,
        session: SessionLike,
        request_id: int | None,
        server_epoch: int | None = None,
    ) -> Op[step.StepReply]:
        sid = session_id_of(session)
        rid = self._next_request_id(request_id, bool(sid))
        request = step.build_request(model, items, sid, rid, self._fence(session, server_epoch))

        def parse(m: pb.StepResponse) -> step.StepReply:
            reply = step.parse_reply(m)
            if reply.counters is not None:
                self.counters[model] = reply.counters
            return reply

        # The request id makes a retry replay the first answer instead of redoing it.
        return Op("Step", request, parse, bool(rid), fallback_for=partial(step.failed_open, items))


def unused_outcome(unused: str | None) -> str | None:
    """``unlock``'s ``unused`` ("load_failed", "lease_expired", or None) as the
    UnlockRequest's ``unused_outcome``: the service counts the lock's tokens under it
    in prefixcache_lookup_tokens_total."""
    if unused is None:
        return None  # left unset: the service counts nothing
    if unused not in ("load_failed", "lease_expired"):
        raise ValueError(f"unused must be 'load_failed', 'lease_expired' or None, not {unused!r}")
    return "LOOKUP_OUTCOME_" + unused.upper()  # the enum value, by its name
