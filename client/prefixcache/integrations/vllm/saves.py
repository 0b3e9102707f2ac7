"""The scheduler side's saves, without vLLM: a request's whole prompt blocks (or, at the
finish, prompt and output), from the locking, allocating Match through the workers'
copies to the Insert or the give-back.

Saves during the run. A request's prompt save starts at its first probe: its Match
leaves with the request's lookup. Each step then copies, after the forward
(``SaveOp.during_run``, in vLLM's ``wait_for_save``), the prompt tokens computed so far
that are still to copy, from the blocks vLLM holds for the request in that step; the
workers report each such copy with the step's output (``copied``), and once every
prompt token is copied and reported the save inserts, while the request may still run.
At its finish nothing is left to copy, so vLLM frees the request's blocks at once
(``finish`` answers keep = False): a finished request holds no block for a save, and
``reset_prefix_cache`` is not refused for one. A copy reads blocks of a running request
only; a request that finishes before the copy (its save's Match landed too late, or
the step after it never came) is saved at the finish instead, as below.

Saves at the finish. A finished request's whole blocks that no save copied while it ran
(``save: all`` saves its output this way, and what a save during the run did not get
to) are stored with one locking, allocating Match, a copy by every worker, then an
Insert that releases the lock once all workers are done; the service frees what
another request inserted meanwhile. vLLM keeps the request's blocks until then.

Sliding windows. A sliding-window request loses its blocks while it runs: vLLM frees
each block that left the window and puts the null block (``meta.NULL_BLOCK``) in its
place, so at the finish only the last blocks are left. The core then has vLLM wait for
the save's Match before the request runs (``SchedulerCore.during_run_saves``), so that
each step's copies get the blocks before vLLM frees them.

Gaps. Only tokens copied from blocks that held them are inserted, and the tree needs
every token from the first: a save stops at the first token whose block is the null
block (or beyond the table) where it is to be copied, and inserts the tokens before
it (``saves_cut``); the slots allocated beyond are given back. A block never read is
never inserted, so no token is ever cached with another block's KV.

Failed saves. A save whose copy fails in any worker comes back with the step's output
as its generation (``SaveOp.ref``); when the save concludes (its copies all reported,
or the finished request done: ``sends_done``) its slots are given back (``SaveAbort``:
unlock, free) instead of inserted, so nothing half-written is cached. The slots go back
then and only then, because that is when no rank can still copy into them. With tensor
parallelism every rank copies its own heads into the mapped pool on its own, under its
session's write fence; the fence is per session, so it keeps the slots from other
sessions only while a rank is inside its copy (or after the session ended). vLLM merges
worker metadata over the ranks of each step (a step's output is every rank's), and
names a request in ``finished_sending`` only once every rank has named it; a rank
reports a copy, and its failure, with the output of the step it ran in (the copies run
inside ``start_load_kv`` and ``wait_for_save``; CUDA copies are synchronized before the
fence is let go), so a failure is known by the time the copy is (``update_connector_output``
hands the metadata over before the sends). A rank stopped (SIGSTOP) before its copy
holds up the step, and so the give-back, until it resumes, dies or vLLM's execute-model
timeout ends the engine; if the session ends meanwhile (the engine stops, or its lease
lapses), its fence makes the late copy write nothing.

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
from enum import Enum
from itertools import count
from typing import Any

from .backend import Done, Op, Release, SaveAbort, SaveAlloc, SaveCommit
from .meta import SaveOp, Tables, as_tables, tables_live_end
from .stats import SchedulerStats

log = logging.getLogger("prefixcache.integrations.vllm")


class _Final(Enum):
    NONE = 0  # no copy at the finish (none needed, or the request still runs)
    DUE = 1  # the finished request's copy is to go out with the next step
    SENT = 2  # out: the workers name the request in ``sends_done`` once it is made
    DONE = 3


@dataclass(slots=True)
class _Save:
    req_id: str
    gen: int
    tokens: array
    extra_key: str | None
    tables: Tables
    ready: bool = False
    prefix: int = 0
    cached: array = field(default_factory=lambda: array("q"))
    allocated: array = field(default_factory=lambda: array("q"))
    lock_id: int = 0
    epoch: int = 0
    session_id: str = ""
    failed: bool = False  # a worker's copy failed: give the slots back, never insert
    matched: bool = False  # the Match answered (else the save was skipped)
    during_run: bool = False  # copied while the request runs (the module docstring)
    written: int = 0  # tokens prefix .. written are copied (or being copied)
    end: int = 0  # tokens to insert at most: a gap or the finish lowers it
    closed: bool = False  # the request finished
    final: _Final = _Final.NONE
    unreported: set[int] = field(default_factory=set)  # copies the workers owe a report
    retain: Any = None  # the request's retention hint, passed on with the insert


class Saves:
    """The saves in flight, by request id (see the module docstring). Runs on vLLM's
    scheduler thread, like the core that owns it.

    Args:
        stats: the scheduler side's counters.
        queue: queues a call to the service for the core's next dispatch.
        session_alive: whether a session id is still the backend's live session.
        block_size: vLLM's block size in tokens.
    """

    def __init__(
        self,
        stats: SchedulerStats,
        queue: Callable[[Op], None],
        session_alive: Callable[[str], bool],
        block_size: int,
    ) -> None:
        self.stats = stats
        self._queue = queue
        self._session_alive = session_alive
        self.block_size = block_size
        self._saves: dict[str, _Save] = {}
        # Running requests whose save during the run has concluded: nothing is left
        # to save of them at the finish.
        self._saved: set[str] = set()
        self._copies = count(1)

    def __bool__(self) -> bool:
        return bool(self._saves)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._saves or req_id in self._saved

    def start(
        self,
        req_id: str,
        gen: int,
        tokens: array,
        extra_key: str | None,
        *,
        during_run: bool = False,
        retain: Any = None,
    ) -> bool:
        """Start saving a request's ``tokens`` (its Match leaves with the next
        dispatch); False if it is being saved. ``during_run``: before the request
        runs, its copies made step by step (the module docstring); else the request
        has finished and ``finish`` follows at once. ``retain``: the request's retention
        hint, passed on with the insert."""
        if req_id in self:
            return False
        self._saves[req_id] = _Save(
            req_id,
            gen,
            tokens,
            extra_key,
            (),
            during_run=during_run,
            end=len(tokens),
            retain=retain,
        )
        self._queue(SaveAlloc(req_id, tokens, extra_key))
        return True

    def waiting(self, req_id: str) -> bool:
        """Whether ``req_id`` has a save whose Match has not landed yet."""
        save = self._saves.get(req_id)
        return save is not None and not save.ready

    def finish(self, req_id: str, tables: Tables, limit: int) -> bool | None:
        """The request finished with ``tables`` and at most its first ``limit``
        tokens worth saving. Whether vLLM must keep its blocks for a copy still to
        make; None where no save of it is known (``start`` one for the finish)."""
        if req_id in self._saved:
            self._saved.discard(req_id)
            return False
        save = self._saves.get(req_id)
        if save is None or save.closed:
            return None
        save.closed = True
        save.end = min(save.end, max(limit, 0))
        if save.end == 0 or (save.ready and save.written >= save.end):
            self._settle(save)  # nothing (more) to copy: the blocks may go
            return False
        save.tables, save.final = tables, _Final.DUE
        return True

    def running(self) -> set[str]:
        """The running requests whose saves still copy step by step: the requests
        ``step_ops`` needs the progress of."""
        return {
            s.req_id
            for s in self._saves.values()
            if s.during_run and not s.closed and (not s.ready or s.written < s.end)
        }

    def pending_finished(self) -> bool:
        """Whether a finished request's save is not through yet."""
        return any(s.closed for s in self._saves.values())

    def step_ops(
        self, progress: Mapping[str, tuple[int, Sequence[Any]]] | None = None
    ) -> list[SaveOp]:
        """The copies for this step's workers: every finished request's save whose Match
        landed, once; and the tokens of running requests (``progress``: request id ->
        its tokens computed once this step ran, and its block table, or one per KV
        cache group, in this step) that saves during the run can copy now."""
        out = []
        for save in list(self._saves.values()):
            if not save.ready:
                continue
            if save.final is _Final.DUE:
                save.final = _Final.SENT
                self._check_session(save)
                final = self._copy(save, save.tables, save.end, during_run=False)
                if final is not None:  # always: a finish-time copy goes out even empty
                    out.append(final)
            elif (
                not save.closed
                and save.during_run
                and progress
                and save.req_id in progress
                and save.written < save.end
            ):
                computed, table = progress[save.req_id]
                if min(computed, save.end) <= save.written or not self._check_session(save):
                    self._settle(save)
                    continue
                op = self._copy(save, as_tables(table), computed, during_run=True)
                if op is None:
                    self._settle(save)
                else:
                    out.append(op)
        return out

    def _check_session(self, save: _Save) -> bool:
        """Whether the session that holds the save's slots is alive; if not, drop them:
        writing them could overwrite somebody else's KV."""
        if len(save.allocated) and not self._session_alive(save.session_id):
            self.stats.saves_skipped += 1
            save.allocated, save.lock_id = array("q"), 0
            save.end = min(save.end, save.written)
            return False
        return True

    def _copy(self, save: _Save, tables: Tables, upto: int, *, during_run: bool) -> SaveOp | None:
        """The copy of the save's tokens from ``written`` to ``upto`` (at most its
        ``end``) out of ``tables``, up to a gap in any of them (the module docstring;
        a pool row holds every group's layers of its token): None where a copy
        during the run has nothing to copy (a finish-time copy goes out even empty: the
        workers then report the request done)."""
        hi = min(upto, save.end)
        if hi > save.written:
            live = tables_live_end(tables, save.written, hi, self.block_size)
            if live < hi:
                self.stats.saves_cut += 1
                save.end = hi = live
        lo = save.written
        if during_run and hi <= lo:
            return None
        if not during_run:
            save.end = min(save.end, max(hi, lo))
        slots = save.allocated[lo - save.prefix : hi - save.prefix] if hi > lo else array("q")
        save.written = max(hi, lo)
        report = 0
        if during_run:
            report = next(self._copies)
            save.unreported.add(report)
        first = tables[0] if tables else array("q")
        return SaveOp(
            save.req_id,
            first,
            lo,
            slots,
            save.epoch,
            save.session_id,
            save.gen,
            during_run=during_run,
            report=report,
            group_block_ids=tables if len(tables) > 1 else (),
        )

    def copied(self, reports: Iterable[int]) -> None:
        """The workers made these copies during the run (``SaveOp.report``; a failed
        one is in ``failed`` too): a save whose copies are all made and reported
        inserts."""
        reports = set(reports)
        if not reports:
            return
        for save in list(self._saves.values()):
            if save.unreported & reports:
                save.unreported -= reports
                self._settle(save)

    def sends_done(self, req_ids: Iterable[str]) -> None:
        """Every worker finished the finish-time copies of ``req_ids``: insert what they
        wrote, or give the slots back where a worker's copy failed."""
        for req_id in req_ids:
            save = self._saves.get(req_id)
            if save is not None and save.final is _Final.SENT:
                save.final = _Final.DONE
                self._settle(save)

    def _settle(self, save: _Save) -> None:
        """Conclude the save if nothing is left to copy or to hear of: insert, or give
        the slots back (``_conclude``)."""
        if not save.ready or save.final in (_Final.DUE, _Final.SENT):
            return
        if save.final is _Final.NONE and (
            save.unreported or (not save.closed and save.written < save.end)
        ):
            return
        self._conclude(save)

    def _conclude(self, save: _Save) -> None:
        del self._saves[save.req_id]
        if not save.closed and save.matched:
            self._saved.add(save.req_id)  # nothing left for the finish
        if not save.allocated:
            return
        if save.failed:
            self.stats.saves_failed += 1
            self._queue(SaveAbort(save.allocated, save.lock_id, save.epoch))
            return
        used = max(min(save.end, save.written) - save.prefix, 0)
        spare = save.allocated[used:]
        if not used:  # nothing new could be copied: nothing to insert
            self.stats.saves_skipped += 1
            self._queue(SaveAbort(spare, save.lock_id, save.epoch))
            return
        self._queue(
            SaveCommit(
                save.tokens[: save.prefix + used],
                save.extra_key,
                save.cached + save.allocated[:used],
                save.lock_id,
                save.epoch,
                len(save.cached),
                save.retain,
                save.req_id,
            )
        )
        if len(spare):
            self._queue(SaveAbort(spare, 0, save.epoch))
        self.stats.saves += 1
        self.stats.save_tokens += used

    def stop_running(self) -> None:
        """Copy nothing more for running requests (the connector is disabled): their
        saves give their slots back once the copies already out are reported."""
        for save in list(self._saves.values()):
            if not save.closed:
                save.failed = True
                save.end = min(save.end, save.written)
                self._settle(save)

    def failed(self, refs: Iterable[int]) -> None:
        """The workers' saves whose copies failed, by ``SaveOp.ref``: their slots are
        given back when the save concludes."""
        refs = set(refs)
        for save in self._saves.values():
            if save.gen in refs:
                save.failed = True

    def landed(self, op: SaveAlloc, done: Done) -> None:
        """A save's Match came back: the slots to copy into, or a skipped save."""
        reply: Any = done.reply
        save = self._saves.get(op.req_id)
        ok = done.error is None and reply is not None and not reply.skipped
        if save is None:  # cannot happen: a save leaves only once its Match landed
            if ok:
                self._queue(SaveAbort(reply.allocated, reply.lock_id, reply.server_epoch))
            return
        save.ready = True
        if not ok:
            self.stats.saves_skipped += 1
            save.end = 0
            self._settle(save)
            return
        save.matched = True
        save.prefix, save.cached, save.allocated = reply.prefix_len, reply.slots, reply.allocated
        save.lock_id, save.epoch = reply.lock_id, reply.server_epoch
        save.session_id = done.session_id
        save.written = save.prefix
        save.end = min(save.end, save.prefix + len(save.allocated))
        if not len(save.allocated):  # the tree had it all already
            self.stats.saves_skipped += 1
            if save.lock_id:
                self._queue(Release(save.lock_id, save.epoch))
            save.lock_id = 0
        self._settle(save)

    def commit_failed(self, op: SaveCommit) -> None:
        """Not inserted (the service refused): release the lock and whatever slots the
        session still holds."""
        self.stats.saves_failed += 1
        self._queue(SaveAbort(op.slots[op.owned_from :], op.lock_id, op.server_epoch))

    def drop_all(self) -> tuple[int, int]:
        """Forget every save (shutdown): how many, and their tokens."""
        count_, tokens = len(self._saves), sum(len(s.tokens) for s in self._saves.values())
        self._saves.clear()
        self._saved.clear()
        return count_, tokens
