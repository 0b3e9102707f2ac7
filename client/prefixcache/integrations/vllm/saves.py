"""The scheduler side's saves, without vLLM: a finished request's whole blocks, from the
locking, allocating Match through the workers' copies to the Insert or the give-back.

Saves. A finished request's whole blocks are stored with one locking, allocating Match
(what the tree already has is not copied again), a copy by every worker, then an Insert
that releases the lock once all workers are done; the service frees what another
request inserted meanwhile. vLLM keeps the request's blocks until then.

Failed saves. A save whose copy fails in any worker comes back with the step's output
as its generation (``SaveOp.ref``); when the request is done (``sends_done``) its slots
are given back (``SaveAbort``: unlock, free) instead of inserted, so nothing
half-written is cached. The slots go back then and only then, because that is when no
rank can still copy into them. With tensor parallelism every rank copies its own heads
into the mapped pool on its own, under its session's write fence; the fence is per
session, so it keeps the slots from other sessions only while a rank is inside its copy
(or after the session ended). vLLM's ``KVOutputAggregator`` names a request in
``finished_sending`` only once every rank has named it, and a rank names it only after
its copy returned (the copies run inside ``start_load_kv``; CUDA copies are
synchronized before the fence is let go). Worker metadata is merged over the ranks of
each step, and a rank reports a failure in the step that reports the request done, so
the failure is known by the time the request is (``update_connector_output`` hands the
metadata over before the sends). A rank stopped (SIGSTOP) before its copy holds up the
step, and so the give-back, until it resumes, dies or vLLM's execute-model timeout ends
the engine; if the session ends meanwhile (the engine stops, or its lease lapses), its
fence makes the late copy write nothing.

Before, the failing worker freed the slots itself at once, so that the Insert would be
refused; a rank that had not started its copy yet (stopped, or merely slower) then
wrote into slots another session may have taken meanwhile. The other way to close that
window, an owner per slot that the service keeps in shared memory and every rank checks
under its fence before it copies, costs a write on every allocation, free and insert of
every model kind (every client's hot path) for one connector's window, and new state
whose every change must be ordered against the fence; waiting for the ranks costs
nothing new: the Insert waits for them already, and the give-back now waits with it.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .backend import Done, Op, Release, SaveAbort, SaveAlloc, SaveCommit
from .meta import SaveOp
from .stats import SchedulerStats

log = logging.getLogger("prefixcache.integrations.vllm")


@dataclass(slots=True)
class _Save:
    req_id: str
    gen: int
    tokens: array
    extra_key: str | None
    block_ids: array
    ready: bool = False
    sent: bool = False
    prefix: int = 0
    cached: array = field(default_factory=lambda: array("q"))
    allocated: array = field(default_factory=lambda: array("q"))
    lock_id: int = 0
    epoch: int = 0
    session_id: str = ""
    failed: bool = False  # a worker's copy failed: give the slots back, never insert
    retain: Any = None  # the request's retention hint, passed on with the insert


class Saves:
    """The saves in flight, by request id (see the module docstring). Runs on vLLM's
    scheduler thread, like the core that owns it.

    Args:
        stats: the scheduler side's counters.
        queue: queues a call to the service for the core's next dispatch.
        session_alive: whether a session id is still the backend's live session.
    """

    def __init__(self, stats: SchedulerStats, queue: Callable[[Op], None],
                 session_alive: Callable[[str], bool]) -> None:
        self.stats = stats
        self._queue = queue
        self._session_alive = session_alive
        self._saves: dict[str, _Save] = {}

    def __bool__(self) -> bool:
        return bool(self._saves)

    def start(self, req_id: str, gen: int, tokens: array, extra_key: str | None,
              block_ids: array, retain: Any = None) -> bool:
        """Start saving a finished request's ``tokens``; False if it is being saved."""
        if req_id in self._saves:
            return False
        self._saves[req_id] = _Save(req_id, gen, tokens, extra_key, block_ids, retain=retain)
        self._queue(SaveAlloc(req_id, tokens, extra_key))
        return True

    def step_ops(self) -> list[SaveOp]:
        """The copies for this step's workers: every save whose Match landed, once."""
        out = []
        for save in self._saves.values():
            if save.ready and not save.sent:
                save.sent = True
                if len(save.allocated) and not self._session_alive(save.session_id):
                    # The session that held the slots is gone, and the slots with it:
                    # writing them could overwrite somebody else's KV.
                    self.stats.saves_skipped += 1
                    save.allocated, save.lock_id = array("q"), 0
                out.append(SaveOp(save.req_id, save.block_ids, save.prefix,
                                  save.allocated, save.epoch, save.session_id, save.gen))
        return out

    def sends_done(self, req_ids: Iterable[str]) -> None:
        """Every worker finished the saves of ``req_ids``: insert what they wrote, or
        give the slots back where a worker's copy failed."""
        for req_id in req_ids:
            save = self._saves.pop(req_id, None)
            if save is None or not save.allocated:
                continue
            if save.failed:
                self.stats.saves_failed += 1
                self._queue(SaveAbort(save.allocated, save.lock_id, save.epoch))
                continue
            self._queue(SaveCommit(save.tokens[:save.prefix + len(save.allocated)],
                                   save.extra_key, save.cached + save.allocated,
                                   save.lock_id, save.epoch, len(save.cached), save.retain))
            self.stats.saves += 1
            self.stats.save_tokens += len(save.allocated)

    def failed(self, refs: Iterable[int]) -> None:
        """The workers' saves whose copies failed, by ``SaveOp.ref``: their slots are
        given back when ``sends_done`` names their requests."""
        refs = set(refs)
        for save in self._saves.values():
            if save.gen in refs:
                save.failed = True

    def landed(self, op: SaveAlloc, done: Done) -> None:
        """A save's Match came back: the slots to copy into, or a skipped save."""
        reply: Any = done.reply
        save = self._saves.get(op.req_id)
        ok = done.error is None and reply is not None and not reply.skipped
        if save is None:  # cannot happen: saves leave only through sends_done
            if ok:
                self._queue(SaveAbort(reply.allocated, reply.lock_id, reply.server_epoch))
            return
        save.ready = True
        if not ok:
            self.stats.saves_skipped += 1
            return
        save.prefix, save.cached, save.allocated = reply.prefix_len, reply.slots, \
            reply.allocated
        save.lock_id, save.epoch = reply.lock_id, reply.server_epoch
        save.session_id = done.session_id
        if not len(save.allocated):  # the tree had it all already
            self.stats.saves_skipped += 1
            if save.lock_id:
                self._queue(Release(save.lock_id, save.epoch))
            save.lock_id = 0

    def commit_failed(self, op: SaveCommit) -> None:
        """Not inserted (a worker's copy failed, or the service refused): release the
        lock and whatever slots the session still holds."""
        self.stats.saves_failed += 1
        self._queue(SaveAbort(op.slots[op.owned_from:], op.lock_id, op.server_epoch))

    def drop_all(self) -> tuple[int, int]:
        """Forget every save (shutdown): how many, and their tokens."""
        count, tokens = len(self._saves), sum(len(s.tokens) for s in self._saves.values())
        self._saves.clear()
        return count, tokens
