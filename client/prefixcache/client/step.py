"""The Step call's items and reply: one scheduling step's cache work in one RPC.

``client.step(model, session=s, finishes=..., unlocks=..., frees=..., decodes=...,
admits=...)`` runs, in that order, every item as its unary call would (``insert`` plus
a free of the unaligned tail, ``unlock``, ``free``, ``alloc``, ``match`` with lock and
allocate) and answers each in its own result: the typed reply, or the typed error it
would have raised. One item's error changes nothing for it and does not stop the others.

Items may be given as the records here (:class:`Admit`, :class:`Finish`, :class:`Free`)
or plainly: an admission as its tokens (locked and allocated), a free as its slots, a
decode as its slot count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefixcache.v1 import prefix_cache_pb2 as pb

from ._wire import extra_key_of, pack_slots, pack_tokens
from .errors import InvalidArgument, PrefixCacheError, StaleEpoch, Unavailable, error_for
from .results import AllocReply, InsertReply, MatchReply, ModelStats, UnlockReply, _slots
from .retention import retention_pb

if TYPE_CHECKING:
    from array import array

    from ._session_state import SessionState


@dataclass(frozen=True, slots=True)
class Admit:
    """A new request to admit: ``match`` with ``lock`` and ``allocate`` (both on by
    default). ``hint``: the prefix length the worker expects (from its shadow index);
    the answer is always the service's, and ``StepReply.stale_hints`` counts misses.
    ``retain``: a retention hint for the matched prefix, as ``match`` takes it."""

    tokens: Any
    extra_key: str | None = None
    token_width: int | None = None
    lock: bool = True
    allocate: bool = True
    hint: int | None = None
    retain: Any = None


@dataclass(frozen=True, slots=True)
class Finish:
    """A request (or prefill chunk) done: ``insert`` of ``tokens`` with ``slots``,
    releasing ``release_lock_id`` (typically the admission's) and, unless ``keep_tail``,
    freeing the slots the insert leaves with the session (the unaligned tail). ``lock``
    keeps the new node locked, as a chunked prefill that goes on does.
    ``keep_duplicates``: the session keeps its slots for tokens the tree had already,
    instead of the service freeing them (radix, mamba and chunk models).
    ``retain``: a retention hint for the cached sequence, as ``insert`` takes it."""

    tokens: Any
    slots: Any
    release_lock_id: int = 0
    extra_key: str | None = None
    token_width: int | None = None
    lock: bool = False
    keep_tail: bool = False
    state_slot: int | None = None
    slot_version: int = 0
    keep_duplicates: bool = False
    retain: Any = None


@dataclass(frozen=True, slots=True)
class Free:
    """Slots (and Mamba state slots) to give back."""

    slots: Any = ()
    state_slots: Any = ()


@dataclass(frozen=True, slots=True)
class FreeReply:
    """A free done (``skipped``: failed open, nothing was freed)."""

    skipped: bool = False


# One item's answer: its reply, or the error its unary call would have raised.
Result = Any


@dataclass(frozen=True, slots=True)
class StepReply:
    """The answers to a step, one tuple per item list, in the order given.

    Each entry is the item's reply (``InsertReply``, ``UnlockReply``, ``FreeReply``,
    ``AllocReply``, ``MatchReply``) or a :class:`PrefixCacheError` instance.

    Attributes:
        counters: the model's counters after the step (None when ``skipped``).
        stale_hints: admissions whose ``hint`` was not the service's answer.
        replayed: the service answered a retry from its replay window.
        skipped: fail-open: the service was not reached; items that could fail open
            hold their stand-ins, the others (allocations) an error.
        server_epoch: the service's epoch; the handles above are valid only in it.
    """

    finishes: tuple[Result, ...] = ()
    unlocks: tuple[Result, ...] = ()
    frees: tuple[Result, ...] = ()
    decodes: tuple[Result, ...] = ()
    admits: tuple[Result, ...] = ()
    counters: ModelStats | None = None
    stale_hints: int = 0
    replayed: bool = False
    skipped: bool = False
    server_epoch: int = 0

    @property
    def ok(self) -> bool:
        """Whether every item succeeded (a fail-open stand-in counts as success)."""
        return not any(True for _ in self.errors())

    def errors(self) -> Iterator[tuple[str, int, PrefixCacheError]]:
        """``(list name, index, error)`` of every failed item."""
        for name in LISTS:
            for i, result in enumerate(getattr(self, name)):
                if isinstance(result, PrefixCacheError):
                    yield name, i, result

    def decoded_slots(self) -> array[int]:
        """The slots of every successful decode, in order, concatenated."""
        out = _slots()
        for result in self.decodes:
            if isinstance(result, AllocReply):
                out.extend(result.slots)
        return out


LISTS = ("finishes", "unlocks", "frees", "decodes", "admits")


@dataclass(slots=True)
class StepItems:
    """A step's items, normalised to the records above."""

    finishes: list[Finish] = field(default_factory=list)
    unlocks: list[int] = field(default_factory=list)
    frees: list[Free] = field(default_factory=list)
    decodes: list[int] = field(default_factory=list)
    admits: list[Admit] = field(default_factory=list)

    @classmethod
    def of(
        cls,
        finishes: Sequence[Finish] = (),
        unlocks: Sequence[int] = (),
        frees: Sequence[Any] = (),
        decodes: Sequence[int] | int = (),
        admits: Sequence[Any] = (),
    ) -> StepItems:
        for name, value in (
            ("finishes", finishes),
            ("unlocks", unlocks),
            ("frees", frees),
            ("admits", admits),
        ):
            if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                raise InvalidArgument(
                    f"{name} must be a sequence of items, not {type(value).__name__}"
                )
        for f in finishes:
            if not isinstance(f, Finish):
                raise InvalidArgument(f"finishes holds Finish records, not {type(f).__name__}")
        counts = [decodes] if isinstance(decodes, int) else list(decodes)
        return cls(
            [*finishes],
            [int(x) for x in unlocks],
            [f if isinstance(f, Free) else Free(f) for f in frees],
            [_count(n) for n in counts],
            [a if isinstance(a, Admit) else Admit(a) for a in admits],
        )

    def __len__(self) -> int:
        return sum(len(getattr(self, name)) for name in LISTS)


def _count(n: Any) -> int:
    if isinstance(n, bool) or not hasattr(n, "__index__") or n.__index__() < 0:
        raise InvalidArgument(f"a decode is a slot count >= 0, not {n!r}")
    count: int = n.__index__()
    return count


def build_request(
    model: str, items: StepItems, session_id: str, request_id: int, server_epoch: int
) -> pb.StepRequest:
    """The wire request of a step."""
    request = pb.StepRequest(
        model=model,
        session_id=session_id,
        request_id=request_id,
        server_epoch=server_epoch,
        unlocks=items.unlocks,
        decodes=items.decodes,
    )
    for f in items.finishes:
        data, width = pack_tokens(f.tokens, f.token_width)
        out = request.finishes.add(
            token_ids=data,
            token_width=width,
            slot_indices=pack_slots(f.slots),
            release_lock_id=int(f.release_lock_id),
            lock=f.lock,
            keep_tail=f.keep_tail,
            slot_version=int(f.slot_version),
            keep_duplicates=f.keep_duplicates,
            retention=retention_pb(f.retain),
        )
        if (key := extra_key_of(f.tokens, f.extra_key)) is not None:
            out.extra_key = key
        if f.state_slot is not None:
            out.state_slot = int(f.state_slot)
    for free in items.frees:
        request.frees.add(
            slot_indices=pack_slots(free.slots), state_slots=pack_slots(free.state_slots)
        )
    for a in items.admits:
        data, width = pack_tokens(a.tokens, a.token_width)
        admit = request.admits.add(
            token_ids=data,
            token_width=width,
            lock=a.lock,
            allocate=a.allocate,
            retention=retention_pb(a.retain),
        )
        if (key := extra_key_of(a.tokens, a.extra_key)) is not None:
            admit.extra_key = key
        if a.hint is not None:
            admit.expected_prefix_len = int(a.hint)
    return request


def _item(result: pb.StepResult, epoch: int, parse: Callable[[Any], Any]) -> Result:
    kind = result.WhichOneof("result")
    if kind == "error" or kind is None:
        return (
            error_for(result.error.code, result.error.message)
            if kind
            else Unavailable("the service sent no answer for this item")
        )
    body = getattr(result, kind)
    if hasattr(body, "server_epoch"):
        body.server_epoch = epoch  # item results leave it to the step's reply
    return parse(body)


_PARSERS: dict[str, Callable[[Any], Any]] = {
    "finishes": InsertReply.from_pb,
    "unlocks": lambda m: UnlockReply(),
    "frees": lambda m: FreeReply(),
    "decodes": AllocReply.from_pb,
    "admits": MatchReply.from_pb,
}


def parse_reply(m: pb.StepResponse) -> StepReply:
    """The typed reply of a step."""
    epoch = m.server_epoch
    # One tuple of results per item list, each list of its own result type.
    lists: dict[str, Any] = {
        name: tuple(_item(r, epoch, _PARSERS[name]) for r in getattr(m, name)) for name in LISTS
    }
    counters = ModelStats.from_pb(m.counters) if m.HasField("counters") else None
    return StepReply(
        **lists,
        counters=counters,
        stale_hints=m.stale_hints,
        replayed=m.replayed,
        server_epoch=epoch,
    )


def failed_open(items: StepItems, err: PrefixCacheError) -> StepReply:
    """The stand-in for a step the service did not answer: what each item's unary
    call answers when it fails open, or ``err`` for the items that need real slots."""
    return StepReply(
        finishes=tuple(InsertReply(skipped=True) for _ in items.finishes),
        unlocks=tuple(UnlockReply(skipped=True) for _ in items.unlocks),
        frees=tuple(FreeReply(skipped=True) for _ in items.frees),
        decodes=tuple(err for _ in items.decodes),
        admits=tuple(err if a.allocate else MatchReply(skipped=True) for a in items.admits),
        skipped=True,
    )


# ---------------------------------------------------------------- in a session


@dataclass(slots=True)
class SessionPlan:
    """A step in a client session: the items to send, and the answers of those refused
    without being sent because they name handles of a session the service no longer
    has (``local``, by list name and index)."""

    send: StepItems
    local: dict[str, dict[int, PrefixCacheError]]
    positions: dict[str, list[int]]

    @property
    def fresh(self) -> bool:
        """Whether anything to send names no handle but the session (may reopen it)."""
        return bool(self.send.admits or self.send.decodes)

    def failed_open(self, err: PrefixCacheError) -> StepReply:
        """The fail-open stand-in for the items to send, merged with the local answers."""
        return self.merge(failed_open(self.send, err))

    def merge(self, reply: StepReply) -> StepReply:
        """``reply`` (to ``send``) with the local answers put back in place."""
        lists = {}
        for name in LISTS:
            sent = iter(getattr(reply, name))
            local = self.local[name]
            total = len(local) + len(self.positions[name])
            lists[name] = tuple(local[i] if i in local else next(sent) for i in range(total))
        return StepReply(
            **lists,
            counters=reply.counters,
            stale_hints=reply.stale_hints,
            replayed=reply.replayed,
            skipped=reply.skipped,
            server_epoch=reply.server_epoch,
        )


def stale_fence(state: SessionState, server_epoch: int | None) -> StaleEpoch | None:
    """The refusal of a step fenced with an epoch that is not the session's, or None."""
    if server_epoch and server_epoch != state.server_epoch:
        state.dropped += 1
        return StaleEpoch(
            f"step names handles of epoch {server_epoch}; the session is in "
            f"epoch {state.server_epoch}",
            server_epoch=state.server_epoch,
        )
    return None


def plan(state: SessionState, items: StepItems) -> SessionPlan:
    """Split ``items`` into those to send and those ``state`` refuses (stale handles)."""
    send = StepItems()
    local: dict[str, dict[int, PrefixCacheError]] = {name: {} for name in LISTS}
    positions: dict[str, list[int]] = {name: [] for name in LISTS}
    checks: dict[str, Callable[[Any], PrefixCacheError | None]] = {
        "finishes": lambda f: state.refusal("insert", (), {"release_lock_id": f.release_lock_id}),
        "unlocks": lambda lock_id: state.refusal("unlock", (lock_id,), {}),
        "frees": lambda f: state.refusal("free", (), {}),
        "decodes": lambda n: None,
        "admits": lambda a: None,
    }
    for name in LISTS:
        for i, item in enumerate(getattr(items, name)):
            refused = checks[name](item)
            if refused is None:
                getattr(send, name).append(item)
                positions[name].append(i)
            else:
                local[name][i] = refused
    return SessionPlan(send, local, positions)


def record(state: SessionState, items: StepItems, reply: StepReply) -> None:
    """Track the locks the step took and released in ``state``, as the unary calls do."""
    for f, r in zip(items.finishes, reply.finishes, strict=True):
        if not isinstance(r, PrefixCacheError):
            state.record("insert", (), {"release_lock_id": f.release_lock_id}, r)
    for lock_id, r in zip(items.unlocks, reply.unlocks, strict=True):
        if not isinstance(r, PrefixCacheError):
            state.record("unlock", (lock_id,), {}, r)
    for r in reply.admits:
        if not isinstance(r, PrefixCacheError):
            state.record("match", (), {}, r)


__all__ = ["Admit", "Finish", "Free", "FreeReply", "StepReply"]
