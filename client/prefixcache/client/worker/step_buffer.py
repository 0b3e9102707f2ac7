"""StepBuffer: the Step items a cache has put off, and the model's counters.

A scheduler makes many cache calls per step whose answers it never reads: releasing a
lock, freeing slots, inserting a finished request. The buffer holds them and sends
them with the next call whose answer is needed (an admission, an allocation, a size
read), so that a whole scheduling step costs one or a few ``Step`` calls. Every Step
reply carries the model's counters, so sizes are answered from the last reply: a size
read costs a call only when something is still queued (its answer would be stale) or
when a call that carries no counters (Lock, Evict) changed them since.

A queued item's error has no caller left to raise to: it is logged and kept in
``errors`` (a queued item may name a callback, which gets its result either way).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from ..errors import PrefixCacheError
from ..results import ModelStats
from ..step import Admit, Finish, Free

log = logging.getLogger("prefixcache.client")

Callback = Callable[[Any], None]


class Sent(NamedTuple):
    """The results of the items a ``flush`` was given (not of the queued ones)."""

    admits: tuple[Any, ...]
    decodes: tuple[Any, ...]
    frees: tuple[Any, ...]


class StepBuffer:
    """Queued Step items of one model in one session (``ClientSession.step``).

    Attributes:
        counters: the model's counters as the last reply (or Stats) told them.
        fresh: whether nothing changed them since (besides the queued items).
        calls: Step and Stats calls made.
        errors: the last errors of queued items, as ``(list name, error)``.
        error_count: all such errors so far.
    """

    def __init__(self, session: Any, model: str, *, max_errors: int = 64) -> None:
        self.session = session
        self.model = model
        self._finishes: list[tuple[Finish, Callback | None]] = []
        self._unlocks: list[int] = []
        self._frees: list[Free] = []
        self._admits: list[tuple[Admit, Callback]] = []
        self.counters: ModelStats | None = None
        self.fresh = False
        self.calls = 0
        self.errors: deque[tuple[str, PrefixCacheError]] = deque(maxlen=max_errors)
        self.error_count = 0
        # Slots to ask for with every call made anyway (the allocator's reserve): an
        # object with ``wanted() -> int`` and ``took(result)``, or None.
        self.topup: Any = None

    def __len__(self) -> int:
        return len(self._finishes) + len(self._unlocks) + len(self._frees) + len(self._admits)

    @property
    def pending(self) -> bool:
        return bool(self._finishes or self._unlocks or self._frees or self._admits)

    # --------------------------------------------------------------- queueing

    def finish(self, item: Finish, on_result: Callback | None = None) -> None:
        self._finishes.append((item, on_result))

    def unlock(self, lock_id: int) -> None:
        if lock_id:
            self._unlocks.append(int(lock_id))

    def free(self, slots: Any, state_slots: Any = ()) -> None:
        if len(slots) or len(state_slots):
            self._frees.append(Free(slots, state_slots))

    def admit(self, item: Admit, on_result: Callback) -> None:
        """Queue an admission whose answer a callback takes (it runs after every
        queued finish of the same step: the service runs admissions last)."""
        self._admits.append((item, on_result))

    def clear(self) -> None:
        """Drop everything queued (after a Reset: it names state that is gone)."""
        self._finishes, self._unlocks, self._frees, self._admits = [], [], [], []
        self.fresh = False

    def changed(self) -> None:
        """A call that carries no counters changed the model (Lock, Evict, Reset)."""
        self.fresh = False

    # ------------------------------------------------------------------ sending

    def flush(
        self, admits: Sequence[Admit] = (), decodes: Sequence[int] = (), frees: Sequence[Any] = ()
    ) -> Sent:
        """Send everything queued, with ``admits``, ``decodes`` and ``frees``, in one
        Step.

        Returns:
            The results of ``admits``, ``decodes`` and ``frees`` (each a reply, or the
            typed error of that item), in order.

        Raises:
            PrefixCacheError: the service refused the whole step (nothing queued is
                kept: the session's close or lease returns what it held).
        """
        finishes, self._finishes = self._finishes, []
        unlocks, self._unlocks = self._unlocks, []
        queued_frees, self._frees = self._frees, []
        queued, self._admits = self._admits, []
        extra = self.topup.wanted() if self.topup is not None else 0
        self.calls += 1
        try:
            reply = self.session.step(
                self.model,
                finishes=[f for f, _ in finishes],
                unlocks=unlocks,
                frees=queued_frees + [f if isinstance(f, Free) else Free(f) for f in frees],
                decodes=[*decodes, extra] if extra else list(decodes),
                admits=[a for a, _ in queued] + list(admits),
            )
        except PrefixCacheError as err:
            self.fresh = False
            for _, callback in (*finishes, *queued):
                if callback is not None:
                    callback(err)
            if finishes or unlocks or queued_frees:
                self._failed("step", err)
            raise
        for (_, callback), result in zip(finishes, reply.finishes, strict=True):
            self._route("finishes", result, callback)
        for result in reply.unlocks:
            self._route("unlocks", result, None)
        for result in reply.frees[: len(queued_frees)]:
            self._route("frees", result, None)
        for (_, callback), result in zip(queued, reply.admits, strict=False):
            callback(result)
        if extra:
            self.topup.took(reply.decodes[-1])
        if reply.counters is not None:
            self.counters, self.fresh = reply.counters, True
        else:
            self.fresh = False
        return Sent(
            reply.admits[len(queued) :],
            reply.decodes[: len(decodes)],
            reply.frees[len(queued_frees) :],
        )

    def sizes(self) -> ModelStats:
        """The model's counters, current: queued items are sent first, and a Stats call
        is made only when nothing else brings fresh counters."""
        if self.pending:
            self.flush()
        if not self.fresh or self.counters is None:
            self.calls += 1
            self.counters = self.session.client.stats(self.model)[self.model]
            self.fresh = True
        return self.counters

    def _route(self, name: str, result: Any, callback: Callback | None) -> None:
        if callback is not None:
            callback(result)
        elif isinstance(result, PrefixCacheError):
            self._failed(name, result)

    def _failed(self, name: str, err: PrefixCacheError) -> None:
        self.errors.append((name, err))
        self.error_count += 1
        log.warning("a queued %s item of %r failed: %s", name, self.model, err)
