"""The scheduler side's saves, without vLLM: a finished request's whole blocks, from the
locking, allocating Match through the workers' copies to the Insert or the give-back.

Saves. A finished request's whole blocks are stored with one locking, allocating Match
(what the tree already has is not copied again), a copy by every worker, then an Insert
that releases the lock once all workers are done; the service frees what another
request inserted meanwhile. vLLM keeps the request's blocks until then.

Saves during the run. A sliding-window request loses its blocks while it runs: vLLM
frees each block that left the window and puts the null block (``meta.NULL_BLOCK``) in
its place, so at the finish only the last blocks are left. Such a save starts before
the request runs (its Match leaves with the request's lookup, and vLLM is told to wait
for it), and each step copies, after the forward, the prompt tokens the step computed
(``SaveOp.during_run``), from blocks vLLM holds for the request in that step. The finish
then copies what is still to copy and inserts, as above.

Gaps. Only tokens copied from blocks that held them are inserted, and the tree needs
every token from the first: a save stops at the first token whose block is the null
block (or beyond the table) where it is to be copied, and inserts the tokens before
it (``saves_cut``); the slots allocated beyond are given back. A block never read is
never inserted, so no token is ever cached with another block's KV.

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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .backend import Done, Op, Release, SaveAbort, SaveAlloc, SaveCommit
from .meta import SaveOp, live_end
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
    during_run: bool = False  # started before the request ran (the module docstring)
    written: int = 0      # tokens prefix .. written are copied (or being copied)
    end: int = 0          # tokens to insert at most: a gap or the finish lowers it
    closed: bool = False  # the request finished: the last copy, then the insert


class Saves:
    """The saves in flight, by request id (see the module docstring). Runs on vLLM's
    scheduler thread, like the core that owns it.

    Args:
        stats: the scheduler side's counters.
        queue: queues a call to the service for the core's next dispatch.
        session_alive: whether a session id is still the backend's live session.
        block_size: vLLM's block size in tokens.
    """

    def __init__(self, stats: SchedulerStats, queue: Callable[[Op], None],
                 session_alive: Callable[[str], bool], block_size: int) -> None:
        self.stats = stats
        self._queue = queue
        self._session_alive = session_alive
        self.block_size = block_size
        self._saves: dict[str, _Save] = {}

    def __bool__(self) -> bool:
        return bool(self._saves)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._saves

    def start(self, req_id: str, gen: int, tokens: array, extra_key: str | None, *,
              during_run: bool = False) -> bool:
        """Start saving a request's ``tokens`` (its Match leaves with the next
        dispatch); False if it is being saved. ``during_run``: before the request
        runs, its copies made step by step (the module docstring); else the request
        has finished and ``close`` follows at once."""
        if req_id in self._saves:
            return False
        self._saves[req_id] = _Save(req_id, gen, tokens, extra_key, array("q"),
                                    during_run=during_run, end=len(tokens))
        self._queue(SaveAlloc(req_id, tokens, extra_key))
        return True

    def waiting(self, req_id: str) -> bool:
        """Whether ``req_id`` has a save whose Match has not landed yet."""
        save = self._saves.get(req_id)
        return save is not None and not save.ready

    def close(self, req_id: str, block_ids: array, limit: int) -> bool:
        """The request finished with ``block_ids`` and at most its first ``limit``
        tokens worth saving: copy what is left, then insert. False: no save."""
        save = self._saves.get(req_id)
        if save is None or save.closed:
            return False
        save.closed, save.block_ids = True, block_ids
        save.end = min(save.end, max(limit, 0))
        return True

    def running(self) -> set[str]:
        """The running requests whose saves still copy step by step: the requests
        ``step_ops`` needs the progress of."""
        return {s.req_id for s in self._saves.values()
                if s.during_run and not s.closed and (not s.ready or s.written < s.end)}

    def pending_finished(self) -> bool:
        """Whether a finished request's save is not through yet."""
        return any(s.closed for s in self._saves.values())

    def step_ops(self, progress: Mapping[str, tuple[int, Sequence[int]]] | None = None
                 ) -> list[SaveOp]:
        """The copies for this step's workers: every finished request's save whose Match
        landed, once; and the tokens of running requests (``progress``: request id ->
        its tokens computed once this step ran, and its block table in this step) that
        saves during the run can copy now."""
        out = []
        for save in self._saves.values():
            if not save.ready or save.sent:
                continue
            if save.closed:
                save.sent = True
                self._check_session(save)
                out.append(self._copy(save, save.block_ids, save.end, during_run=False))
            elif progress and save.req_id in progress and len(save.allocated):
                computed, table = progress[save.req_id]
                if min(computed, save.end) <= save.written or not self._check_session(save):
                    continue
                out.append(self._copy(save, array("q", table), computed, during_run=True))
        return [op for op in out if op is not None]

    def _check_session(self, save: _Save) -> bool:
        """Whether the session that holds the save's slots is alive; if not, drop them:
        writing them could overwrite somebody else's KV."""
        if len(save.allocated) and not self._session_alive(save.session_id):
            self.stats.saves_skipped += 1
            save.allocated, save.lock_id = array("q"), 0
            save.end = min(save.end, save.written)
            return False
        return True

    def _copy(self, save: _Save, table: array, upto: int, *, during_run: bool
              ) -> SaveOp | None:
        """The copy of the save's tokens from ``written`` to ``upto`` (at most its
        ``end``) out of ``table``, up to a gap (the module docstring): None where there
        is nothing to copy and nothing to report."""
        hi = min(upto, save.end)
        if hi > save.written:
            live = live_end(table, save.written, hi, self.block_size)
            if live < hi:
                self.stats.saves_cut += 1
                save.end = hi = live
        lo = save.written
        if during_run and hi <= lo:
            return None
        if not during_run:
            save.end = min(save.end, max(hi, lo))
        slots = save.allocated[lo - save.prefix:hi - save.prefix] if hi > lo else array("q")
        save.written = max(hi, lo)
        return SaveOp(save.req_id, table, lo, slots, save.epoch, save.session_id, save.gen,
                      during_run=during_run)

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
            used = max(min(save.end, save.written) - save.prefix, 0)
            spare = save.allocated[used:]
            if not used:  # nothing new could be copied: nothing to insert
                self.stats.saves_skipped += 1
                self._queue(SaveAbort(spare, save.lock_id, save.epoch))
                continue
            self._queue(SaveCommit(save.tokens[:save.prefix + used], save.extra_key,
                                   save.cached + save.allocated[:used], save.lock_id,
                                   save.epoch, len(save.cached)))
            if len(spare):
                self._queue(SaveAbort(spare, 0, save.epoch))
            self.stats.saves += 1
            self.stats.save_tokens += used

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
            save.end = 0
            return
        save.prefix, save.cached, save.allocated = reply.prefix_len, reply.slots, \
            reply.allocated
        save.lock_id, save.epoch = reply.lock_id, reply.server_epoch
        save.session_id = done.session_id
        save.written = save.prefix
        save.end = min(save.end, save.prefix + len(save.allocated))
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
