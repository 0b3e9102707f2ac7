"""The Step call: one scheduling step's cache work for one model, item by item.

A serving scheduler asks its cache for many small things every step (admit the
waiting requests it picked, cache the ones that finished, a slot per running request),
and one RPC each would cost more than the step itself. A Step carries them all; each
item is the engine call its unary RPC would make, answered in its own result, so an
item's error neither fails the others nor leaves that item half done.

Items run in the order the proto documents (finishes, unlocks, frees, decodes, admits):
what gives room back comes before what takes it.

Retries: a Step with a request id is remembered in the session's replay window, with
its request's digest, so that a retry that is not the same Step is refused
(replays.py). The
matched prefix slots of a locked admission are the bulk of a reply (up to the whole
prompt per admission) and are not kept: while the lock holds, the tree still has them,
so a replay reads them back from the tree (``peek_prefix``) with the retried items.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import numpy as np

from prefixcache.cache import InvalidInputError
from prefixcache.cache.pools.allocator import host_indices
from prefixcache.v1 import prefix_cache_pb2 as pb

from ..access.limits import Limits, check_fields, request_tokens
from ..access.tenant_stats import tenant_view
from ..codec import decode_key, decode_slots, encode_slots
from ..engine.model_engine import ModelEngine
from ..engine.outcomes import InsertOutcome, MatchOutcome
from ..engine.slot_checks import check_distinct
from ..engine.slot_engine import SlotEngine
from ..errors import OverLimitError, PreconditionError, ServiceError
from ..sessions import replays
from ..sessions.session import Session
from . import reply_caps, retention

Engine = ModelEngine | SlotEngine
# Classifies (and logs, counts) a failed item's exception: the servicer's ``_refusal``.
OnError = Callable[[Exception, str], grpc.StatusCode]
_LISTS = ("finishes", "unlocks", "frees", "decodes", "admits")
_REPLAY_OP = "step"


def model_stats(engine: Engine) -> pb.ModelStats:
    """One model's counters, as Stats and every Step reply carry them."""
    sizes = engine.sizes()
    return tenant_view(
        pb.ModelStats(
            model=engine.name,
            evictable_tokens=sizes["evictable"],
            protected_tokens=sizes["protected"],
            free_slots=sizes["free_slots"],
            match_tokens_total=engine.match_tokens,
            hit_tokens_total=engine.hit_tokens,
            pool_size=engine.pool_size,
            session_slots=engine.session_slots,
            locks=engine.num_locks,
            evicted_tokens_total=sum(engine.evicted_tokens.values()),
            swa_evictable_tokens=sizes["swa_evictable"],
            swa_protected_tokens=sizes["swa_protected"],
            mamba_evictable_slots=sizes["mamba_evictable"],
            mamba_protected_slots=sizes["mamba_protected"],
            free_state_slots=sizes["free_state_slots"],
            session_state_slots=engine.session_state_slots,
        ),
        engine,
    )  # a tenant's: its own


def fill_match(out: pb.MatchResponse, m: MatchOutcome) -> None:
    """A Match reply's fields from the engine's outcome (server_epoch left to the caller)."""
    out.prefix_len = m.prefix_len
    out.slot_indices = encode_slots(m.indices)
    out.node_id = m.node_id
    out.lock_id = m.lock_id
    out.allocated_slots = encode_slots(m.allocated)
    for name in (
        "state_slot",
        "allocated_state",
        "slot_version",
        "allocated_version",
        "branching_seqlen",
    ):
        value = getattr(m, name)
        if value is not None:
            setattr(out, _MATCH_FIELDS[name], value)


_MATCH_FIELDS = {
    "state_slot": "state_slot",
    "allocated_state": "allocated_state_slot",
    "slot_version": "slot_version",
    "allocated_version": "allocated_slot_version",
    "branching_seqlen": "mamba_branching_seqlen",
}


def fill_insert(out: pb.InsertResponse, r: InsertOutcome) -> None:
    """An Insert reply's fields from the engine's outcome (server_epoch left to the caller)."""
    out.prefix_len = r.prefix_len
    out.cached_len = r.cached_len
    out.node_id = r.node_id
    out.lock_id = r.lock_id
    out.freed_slots = encode_slots(r.freed)
    out.state_exist = r.state_exist


def _extra_key(item: Any) -> str | None:
    return item.extra_key if item.HasField("extra_key") else None


class StepExecutor:
    """Runs Step requests against a service's engines.

    Args:
        service: The ``CacheService`` (engines, and ``unlock`` across models).
        limits: ``max_step_items``, ``max_step_bytes`` and the per-item limits.
        on_error: Turns a failed item's exception into its status code.
    """

    def __init__(self, service: Any, limits: Limits, on_error: OnError) -> None:
        self.service = service
        self.limits = limits
        self.on_error = on_error

    def run(self, req: pb.StepRequest, session: Session) -> pb.StepResponse:
        """Every item of ``req`` in order, or the answer to an earlier try of it."""
        engine = self.service.engine(req.model)
        self._check_size(req, engine)
        stored = replays.replayed(session, _REPLAY_OP, req)  # refuses a changed retry
        if stored is not None:
            return self._replay(stored, req, engine, session)
        cap = request_tokens(self.limits, engine.config)
        reply = pb.StepResponse(server_epoch=self.service.epoch)
        for item in req.finishes:
            self._item(reply.finishes.add(), "finish", self._finish, engine, session, item, cap)
        for lock_id in req.unlocks:
            self._item(reply.unlocks.add(), "unlock", self._unlock, engine, session, lock_id, cap)
        for item in req.frees:
            self._item(reply.frees.add(), "free", self._free, engine, session, item, cap)
        if not _decode_at_once(reply, engine, session, req.decodes):
            for count in req.decodes:
                self._item(reply.decodes.add(), "decode", self._decode, engine, session, count, cap)
        stale = 0
        for item in req.admits:
            result = reply.admits.add()
            self._item(result, "admit", self._admit, engine, session, item, cap)
            if (
                item.HasField("expected_prefix_len")
                and result.HasField("admit")
                and result.admit.prefix_len != item.expected_prefix_len
            ):
                stale += 1
        reply.stale_hints = stale
        if req.request_id:
            replays.remember(session, _REPLAY_OP, req, _compact(reply, engine))
        reply.counters.CopyFrom(model_stats(engine))
        return reply

    # ------------------------------------------------------------------ items

    def _item(self, result: pb.StepResult, kind: str, run: Callable[..., None], *args: Any) -> None:
        """``run`` one item into ``result``; its refusal becomes the item's Error."""
        try:
            run(result, *args)
        except Exception as exc:
            code = self.on_error(exc, f"Step/{kind}")
            result.Clear()
            result.error.code = code.value[0]
            result.error.message = str(exc)

    def _key(self, item: pb.StepAdmit | pb.StepFinish, engine: Engine, cap: int) -> Any:
        """An item's key, checked as the unary call's request is (extra_key's size is
        checked as a request is decoded; an item's only here)."""
        if item.HasField("extra_key"):
            check_fields(item, self.limits)
        return decode_key(
            item.token_ids, item.token_width, _extra_key(item), engine.config.vocab_size, cap
        )

    def _admit(
        self, result: pb.StepResult, engine: Engine, session: Session, item: pb.StepAdmit, cap: int
    ) -> None:
        key = self._key(item, engine, cap)
        hint = retention.of_call(item, session, self.limits.retention)
        fill_match(result.admit, engine.match(key, session, item.lock, item.allocate))
        if hint is not None:
            retention.apply(engine, result.admit.node_id, hint, result.admit)

    def _finish(
        self, result: pb.StepResult, engine: Engine, session: Session, item: pb.StepFinish, cap: int
    ) -> None:
        key = self._key(item, engine, cap)
        slots = decode_slots(item.slot_indices, max_count=cap)
        state = item.state_slot if item.HasField("state_slot") else None
        # The tail is checked before the insert, so that a finish whose free would be
        # refused is refused whole, instead of inserting and then failing.
        tail = None if item.keep_tail else _tail(engine, session, len(key), slots)
        hint = retention.of_call(item, session, self.limits.retention)
        if engine.kind == "slot":
            refuse_keep_duplicates(item, engine)
            out = engine.insert(
                key,
                slots,
                session,
                item.lock,
                item.release_lock_id,
                state,
                slot_version=item.slot_version,
            )
        else:
            out = engine.insert(
                key,
                slots,
                session,
                item.lock,
                item.release_lock_id,
                state,
                keep_duplicates=item.keep_duplicates,
            )
        if tail is not None and len(tail):
            engine.free(session, tail)
        fill_insert(result.finish, out)
        if hint is not None:
            retention.apply(engine, out.node_id, hint, result.finish)

    def _unlock(
        self, result: pb.StepResult, engine: Engine, session: Session, lock_id: int, cap: int
    ) -> None:
        # As the Unlock RPC: a lock of any model the session holds.
        self.service.unlock(session, lock_id)
        result.unlock.SetInParent()

    def _free(
        self, result: pb.StepResult, engine: Engine, session: Session, item: pb.StepFree, cap: int
    ) -> None:
        engine.free(
            session,
            decode_slots(item.slot_indices, max_count=cap),
            decode_slots(item.state_slots, "state_slots", cap),
        )
        result.free.SetInParent()

    def _decode(
        self, result: pb.StepResult, engine: Engine, session: Session, count: int, cap: int
    ) -> None:
        slots, _ = engine.alloc(session, count)
        result.decode.slot_indices = encode_slots(slots)
        if engine.kind == "slot":
            result.decode.slot_versions = encode_slots(engine.versions(slots))

    # ----------------------------------------------------------------- limits

    def _check_size(self, req: pb.StepRequest, engine: Engine) -> None:
        """Refuse a Step over ``max_step_items`` or ``max_step_bytes``, or one whose
        reply may not fit a message (reply_caps.py), before any work."""
        items = sum(len(getattr(req, name)) for name in _LISTS)
        cap = self.limits.max_step_items
        if items > cap:
            raise OverLimitError(
                f"the step carries {items} items, more than the {cap} one "
                "Step may carry (server.max_step_items)",
                "max_step_items",
            )
        cap = self.limits.max_step_bytes
        if cap:
            size = (
                sum(len(a.token_ids) for a in req.admits)
                + sum(len(f.token_ids) + len(f.slot_indices) for f in req.finishes)
                + sum(len(f.slot_indices) + len(f.state_slots) for f in req.frees)
            )
            if size > cap:
                raise OverLimitError(
                    f"the step carries {size} bytes of token ids and slot "
                    f"indices, more than the {cap} one Step may carry "
                    "(server.max_step_bytes)",
                    "max_step_bytes",
                )
        reply_caps.check(self.limits, "Step", reply_caps.step_size(engine, req))

    # ----------------------------------------------------------------- replay

    def _replay(
        self, stored: pb.StepResponse, req: pb.StepRequest, engine: Engine, session: Session
    ) -> pb.StepResponse:
        """The first answer to this request id again, its prefixes read from the tree."""
        for name in _LISTS:
            if len(getattr(stored, name)) != len(getattr(req, name)):
                raise PreconditionError(
                    f"request_id {req.request_id} was used by a different step in this "
                    f"session ({len(getattr(stored, name))} {name} then, "
                    f"{len(getattr(req, name))} now)"
                )
        reply = pb.StepResponse()
        reply.CopyFrom(stored)
        if _strips(engine):
            cap = request_tokens(self.limits, engine.config)
            for result, item in zip(reply.admits, req.admits, strict=True):
                if result.HasField("admit") and result.admit.lock_id:
                    self._item(result, "admit", _restore, engine, session, item, cap)
        reply.server_epoch = self.service.epoch
        reply.replayed = True
        reply.counters.CopyFrom(model_stats(engine))
        return reply


def _decode_at_once(reply: pb.StepResponse, engine: Engine, session: Session, counts: Any) -> bool:
    """Allocate every decode with one call when that is what the calls one by one would
    do, only cheaper (a slot per running request is most of a step otherwise): page size
    1, so no item shares or splits a page, and room on the free list as it stands, so
    none evicts for another and none merges the freed pages in (a merge in the middle
    would reorder the slots the later items get). The slots are the pool's next free
    ones either way. False: do them one by one (a short pool then fails exactly the
    items it cannot serve)."""
    if len(counts) < 2 or engine.page_size != 1 or engine.kind not in ("radix", "mamba"):
        return False
    total = sum(counts)
    if total > engine.allocator.ready_size():
        return False
    try:
        slots, _ = engine.alloc(session, total)
    except ServiceError:  # a refusal changes nothing: the items say why, one by one
        return False
    engine.ops["alloc"] += len(counts) - 1  # counted as the calls one by one would be
    data, start = encode_slots(slots), 0
    for count in counts:
        reply.decodes.add().decode.slot_indices = data[8 * start : 8 * (start + count)]
        start += count
    return True


def _tail(engine: Engine, session: Session, n: int, slots: np.ndarray) -> np.ndarray | None:
    """The slots a finish frees after its insert, checked to be the session's; None when
    the insert will refuse the item anyway (its own message is the one to give)."""
    if engine.kind == "slot":
        return slots  # insert checks that the session holds it, and leaves it held
    if len(slots) != n:
        return None
    aligned = 0 if engine.kind == "chunk" else n - n % engine.page_size
    tail, head = slots[aligned:], slots[:aligned]
    if not len(tail):
        return tail
    engine._check_range(tail)
    held = engine._owner[tail] == session.tag
    if not held.all():
        bad = aligned + int(np.argmin(held))
        raise PreconditionError(
            f"slot_indices[{bad}] = {int(slots[bad])}, in the unaligned "
            "tail that the finish frees, is not held by this session "
            "(set keep_tail to leave the tail alone)"
        )
    check_distinct(tail)
    # The insert checks the aligned part's slots, not that the tail repeats none of them:
    # a repeated slot would go to the tree, and then the tail's free would fail.
    if _shares_a_slot(tail, head):
        raise InvalidInputError("a slot of the unaligned tail is named in the aligned part too")
    return tail


def _shares_a_slot(tail: np.ndarray, head: np.ndarray) -> bool:
    """Whether a slot of ``tail`` (under a page of slots) is also in ``head`` (up to the
    whole prompt's). One comparison pass over ``head`` keeps only its slots within the
    tail's span, which are few (usually none: the tail's page is its own); ``np.isin``
    over all of ``head`` sorts it, ~1 ms per finish of a few thousand tokens."""
    near = head[(head >= tail.min()) & (head <= tail.max())]
    return len(near) > 0 and bool(np.isin(tail, near).any())


def _strips(engine: Engine) -> bool:
    """Whether a locked admission's prefix slots are left out of the replay window
    (a slot model's prefix is one slot: nothing to save)."""
    return engine.kind not in ("slot", "chunk")


def _compact(reply: pb.StepResponse, engine: Engine) -> pb.StepResponse:
    """What the replay window keeps of ``reply``: all but the prefix slots of locked
    admissions (the tree keeps them while the lock holds) and the counters."""
    stored = pb.StepResponse()
    stored.CopyFrom(reply)
    if _strips(engine):
        for result in stored.admits:
            if result.HasField("admit") and result.admit.lock_id:
                result.admit.slot_indices = b""
    return stored


def _restore(
    result: pb.StepResult, engine: Engine, session: Session, item: pb.StepAdmit, cap: int
) -> None:
    """Put back a replayed admission's prefix slots, read from the tree under its lock."""
    match = result.admit
    held = session.locks.get(match.lock_id)
    if held is None or held.engine is not engine:
        raise PreconditionError(
            f"the lock {match.lock_id} this admission took has been "
            "released since (a reset?): its answer cannot be replayed; "
            "admit the request again with a new request_id"
        )
    key = decode_key(
        item.token_ids, item.token_width, _extra_key(item), engine.config.vocab_size, cap
    )
    indices = host_indices(engine.cache.peek_prefix(key))[: match.prefix_len]
    if len(indices) != match.prefix_len:
        raise PreconditionError(
            f"the retried admission's tokens are not the ones that took "
            f"lock {match.lock_id}: request_id reused for another step?"
        )
    match.slot_indices = encode_slots(indices)


def refuse_keep_duplicates(item: pb.InsertRequest | pb.StepFinish, engine: Engine) -> None:
    """A slot model keeps no duplicates to give back: ``keep_duplicates`` is refused."""
    if item.keep_duplicates:
        raise PreconditionError(
            f"keep_duplicates is for radix, mamba and chunk models; "
            f"{engine.name!r} is {engine.kind}"
        )
