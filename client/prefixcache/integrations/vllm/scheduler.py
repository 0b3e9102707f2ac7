"""The scheduler side of the connector, without vLLM: lookups, reservations, saves.

vLLM calls, on its scheduler thread and in this order for a request: ``probe`` (its
``get_num_new_matched_tokens``, maybe many times), ``allocated`` (after it allocated
blocks for the hit), ``build_meta`` (at the end of every step), ``finished`` (once, when
the request ends), ``sends_done`` (when every worker copied a finished request's
save), and ``loads_failed`` and ``saves_failed`` (with a step's output, before its
``sends_done``: the loads and saves its workers failed).
Everything here runs on that one thread; the calls to the service run in the backend's
threads and come back through ``backend.drain``.

Lookups. A request's first probe queues a lookup and answers ``(None, False)``: "ask
again later". The step's lookups leave together, as one batch, when the step ends
(``build_meta``); a later probe answers from the result once it has landed.

Fast misses (``fast_miss.py``). A prompt the service surely holds nothing for (its
shadow index says so) is answered ``(0, False)`` at the first probe, with no lookup.

Reservations. A lookup is a locking Match: the hit stays in the pool while vLLM decides
what to do with it. It is keyed by vLLM's request id and its preemption count, so
repeated probes get the same answer and take no second lock. It is released when the
request finishes, when vLLM preempts it (its blocks are gone; a new attempt looks up
again), when vLLM allocates without using it, or when its lease lapses: vLLM may count
a hit and never come back for it (requests that wait for blocks or are dropped).

Failed loads. A load the workers fail (the copy, the check that the tree still maps the
slots, the pool unavailable) comes back with the step's output as its reservation's
generation (``LoadOp.ref``): the reservation's release, when it comes, tells the
service ``load_failed``, so the service counts the hit under that outcome once (the
ranks' reports are one set; the release is one call, which was due anyway).

Saves (``saves.py``). A request's prompt is saved while it runs (``save: prompt``): the
save's Match leaves with the request's lookup, each step's computed prompt tokens are
copied after its forward (``build_meta``'s ``progress``), and the save inserts once the
workers report every copy, so that a finished request holds no blocks for it. What
that did not get (and ``save: all``'s output) is saved at the finish: one locking,
allocating Match, a copy by every worker, then an Insert once all workers are done; a
save whose copy failed in any worker gives its slots back instead. Where vLLM frees a
request's blocks while it runs (``during_run_saves``: a sliding-window KV cache group),
the first probe answers "ask again" until the save's Match has landed, so that no step
runs before its copies can be planned; a miss then waits a step too, as a lookup does.

Prefill/decode (``config.py``). A producer (``kv_producer``) never looks up and a
consumer (``kv_consumer``) never saves: their settings say so (``load`` off, ``save``
off). The producer also orders its saves (``ordered_saves``), because its proxy sends
the request on to the consumer as soon as the producer's output is out: a request's
first probe answers "ask again" until its save's Match has landed, so that its copies
run with the steps that compute its prompt; and the insert of a finished request's save
is acknowledged before vLLM lets the request's output go. vLLM hands a step's finished
requests to ``finished``, then the step's copies to ``saves_copied`` and
``sends_done``, then sends the step's outputs; each of these calls waits (up to the
calls' deadline) for the inserts of finished requests it has sent, or that were still
out, so the output leaves after the insert. This costs the producer's scheduler one
round trip to the service in a step that finishes requests. A save made at the finish
(a copy that could not run with the prompt's steps, ``save: all``'s output) follows the
output.

Disabled. A worker that cannot copy (an unknown KV layout, a pool that does not fit)
says so with a step's output (``disable``): from then on the core looks nothing up and
saves nothing; the saves already under way finish or are given back as usual.

Shutdown. vLLM steps on while finished requests hold blocks for a save, so a save
normally completes before the engine stops. ``close`` sends the inserts still queued
and waits for the calls in flight; a save that cannot complete then (its copy never
ran, or its insert failed) is logged as lost, with the count (``saves_lost``).
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from itertools import count
from typing import Any, Protocol

from .backend import Done, Lookup, Op, Release, SaveAlloc, SaveCommit
from .config import ConnectorConfig
from .fast_miss import FastMiss
from .keys import RequestInfo, lookup_len, save_len
from .meta import LoadOp, StepMeta, Tables, as_tables, live_from
from .saves import Saves
from .stats import SchedulerStats

log = logging.getLogger("prefixcache.integrations.vllm")


class Backend(Protocol):
    """What the core needs of the backend (``RpcBackend`` is the real one)."""

    def dispatch(self, ops: list[Op]) -> None: ...
    def drain(self) -> list[Done]: ...
    def wait_done(self, ops: list[Op], timeout: float) -> bool: ...
    def session_alive(self, session_id: str) -> bool: ...
    def shadow_hit(self, tokens: array, extra_key: str | None) -> int | None: ...


class _State(Enum):
    LOOKING = 1  # lookup queued or in flight
    READY = 2  # answer landed; vLLM may use it
    ALLOCATED = 3  # vLLM allocated blocks for the hit; the load is due
    LOADING = 4  # the load went out to the workers


@dataclass(slots=True)
class _Reservation:
    req_id: str
    attempt: int
    gen: int
    tokens: array
    extra_key: str | None
    state: _State = _State.LOOKING
    hit: int = 0
    slots: array = field(default_factory=lambda: array("q"))
    lock_id: int = 0
    epoch: int = 0
    session_id: str = ""
    touched: float = 0.0
    local: int = 0
    tables: Tables = ()  # the request's block table of each KV cache group
    num_external: int = 0
    # Why its hit goes unused, told to the service when it is released.
    unused: str | None = None


class SchedulerCore:
    """See the module docstring.

    Args:
        backend: runs the calls (``RpcBackend``).
        config: the connector's settings.
        block_size: vLLM's block size in tokens; hits and saves are whole blocks.
        clock: seconds, for leases (monotonic).
        during_run_saves: vLLM frees blocks of running requests (a sliding-window
            group): vLLM waits for each request's save before it runs (see the module
            docstring).
        ordered_saves: a request's save is inserted before its output leaves (the
            producer of prefill/decode, see the module docstring).
    """

    def __init__(
        self,
        backend: Backend,
        config: ConnectorConfig,
        block_size: int,
        clock: Callable[[], float] = time.monotonic,
        *,
        during_run_saves: bool = False,
        ordered_saves: bool = False,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.backend = backend
        self.config = config
        self.block_size = block_size
        self.clock = clock
        self.during_run_saves = during_run_saves
        self.ordered_saves = ordered_saves
        self.stats = SchedulerStats()
        self._res: dict[str, _Reservation] = {}
        self._saves = Saves(self.stats, self._queue, backend.session_alive, block_size)
        self._misses = FastMiss(
            backend.shadow_hit, block_size, clock, grace=max(2 * config.timeout, 1.0)
        )
        self._gens = count(1)
        self._queued: list[Op] = []
        # Locks of loads that may still be running: (step to release at, the
        # reservation's generation, release).
        self._steps = 0
        self._later: list[tuple[int, int, Release]] = []
        self.disabled: str | None = None
        # The inserts sent and not answered yet, by request (``ordered_saves``).
        self._inserting: dict[str, SaveCommit] = {}
        # Finished requests whose output must wait for their save's insert.
        self._replying: set[str] = set()

    # ------------------------------------------------------------ vLLM's calls

    def probe(self, info: RequestInfo, num_computed: int) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens``: tokens loadable beyond ``num_computed`` (the
        local hit), None while the lookup is out. Loads are synchronous (False)."""
        self._absorb()
        self.stats.probes += 1
        if self.disabled is not None:
            return 0, False
        if info.miss_reason() is not None:
            self.stats.misses_ineligible += 1
            self._drop(info.req_id)
            return 0, False
        waiting = self._save_before_run(info)
        answer = self._answer(info, num_computed) if self.config.load else (0, False)
        return (None, False) if waiting else answer

    def _save_before_run(self, info: RequestInfo) -> bool:
        """Start the save of a request's prompt (its whole blocks) at its first probe,
        to copy while it runs; ``save: all`` saves at the finish instead, unless vLLM
        frees blocks of running requests (``during_run_saves``). True while such a
        save's Match is out: the request must not run before its slots are known."""
        mode = self.config.save
        if mode == "off" or (mode == "all" and not self.during_run_saves):
            return False
        if info.req_id not in self._saves:
            n = info.num_prompt_tokens // self.block_size * self.block_size
            if n == 0:
                return False
            self._saves.start(
                info.req_id,
                next(self._gens),
                array("q", info.tokens[:n]),
                info.extra_key,
                during_run=True,
                retain=info.retention,
            )
        return (self.during_run_saves or self.ordered_saves) and self._saves.waiting(info.req_id)

    def _answer(self, info: RequestInfo, num_computed: int) -> tuple[int | None, bool]:
        """The lookup's answer to a probe (``probe``)."""
        res = self._res.get(info.req_id)
        if res is not None and (
            res.attempt != info.attempt or res.state not in (_State.LOOKING, _State.READY)
        ):
            # A probe after vLLM allocated: it dropped the request's blocks (preempted)
            # and starts over.
            self._drop(info.req_id)
            res = None
        length = lookup_len(info.num_tokens, self.block_size)
        if length <= num_computed:
            self._drop(info.req_id)  # vLLM has it all itself
            return 0, False
        if res is None:
            tokens = array("q", info.tokens[:length])
            if self.config.fast_miss and self._misses.certain(tokens, info.extra_key, num_computed):
                self.stats.fast_misses += 1
                return 0, False
            gen = next(self._gens)
            self._res[info.req_id] = _Reservation(
                info.req_id, info.attempt, gen, tokens, info.extra_key
            )
            self._queued.append(Lookup((info.req_id, gen), tokens, info.extra_key, info.retention))
            self.stats.lookups += 1
            self.stats.lookup_tokens += length
            return None, False
        if res.state is _State.LOOKING:
            return None, False
        res.touched = self.clock()
        res.local = num_computed
        extra = res.hit - num_computed
        return (extra, False) if extra > 0 else (0, False)

    def allocated(
        self, req_id: str, block_ids: Sequence[int] | Sequence[Sequence[int]], num_external: int
    ) -> None:
        """``update_state_after_alloc``: vLLM allocated ``block_ids`` (a table, or one
        per KV cache group) and counts ``num_external`` tokens as loaded from us (0: it
        will not load)."""
        res = self._res.get(req_id)
        if res is not None and res.state in (_State.ALLOCATED, _State.LOADING):
            return  # a second call for the same allocation (vLLM's async-load path)
        if num_external <= 0:
            self._drop(req_id)
            return
        if res is None or res.state is not _State.READY:
            # vLLM counts tokens we never offered: have every block reported failed.
            log.warning(
                "request %s: vLLM allocated %d external tokens without a ready "
                "reservation; they will be recomputed",
                req_id,
                num_external,
            )
            res = _Reservation(req_id, -1, 0, array("q"), None, _State.ALLOCATED)
            res.tables, res.hit = as_tables(block_ids), -1
            # Where vLLM's own hit ends is unknown here: every block fails.
            res.num_external = max(map(len, res.tables), default=0) * self.block_size
            self._res[req_id] = res
            return
        res.state = _State.ALLOCATED
        res.tables = as_tables(block_ids)
        res.num_external = num_external

    def build_meta(
        self,
        preempted: Iterable[str] = (),
        progress: Mapping[str, tuple[int, Sequence[Any]]] | None = None,
    ) -> StepMeta:
        """``build_connector_meta``: the step's loads and saves for the workers. The
        step's queued lookups leave now, as one batch. ``progress``: of the requests
        ``saving_during_run`` names that this step runs, each one's tokens computed
        once the step ran and its block table (or one per KV cache group) in this
        step."""
        self._absorb()
        self._steps += 1
        for req_id in preempted:
            self._drop(req_id)
        self._expire()
        due = [r for at, _, r in self._later if at <= self._steps]
        self._later = [entry for entry in self._later if entry[0] > self._steps]
        self._queued.extend(due)
        meta = StepMeta()
        for res in self._res.values():
            if res.state is _State.ALLOCATED:
                meta.loads.append(self._load_op(res))
                res.state = _State.LOADING
        meta.saves = self._saves.step_ops(progress)
        self._flush()
        return meta

    def saving_during_run(self) -> set[str]:
        """The requests whose saves copy while they run (``during_run_saves``) and
        still have tokens to copy: ``build_meta`` wants their progress."""
        return self._saves.running()

    def finished(
        self,
        info: RequestInfo,
        block_ids: Sequence[int] | Sequence[Sequence[int]],
        num_computed: int,
    ) -> bool:
        """``request_finished``: release the request's reservation and save its whole
        blocks (those the save has not copied while it ran). True: vLLM must keep the
        blocks until ``sends_done`` names it."""
        self._absorb()
        self._drop(info.req_id)
        blocks = as_tables(block_ids)
        n = save_len(
            info, num_computed, max(map(len, blocks), default=0), self.block_size, self.config.save
        )
        keep = self._saves.finish(info.req_id, blocks, n)
        if keep is None:
            keep = (
                n > 0
                and self.disabled is None
                and self._saves.start(
                    info.req_id,
                    next(self._gens),
                    array("q", info.tokens[:n]),
                    info.extra_key,
                    retain=info.retention,
                )
            )
            if keep:
                self._saves.finish(info.req_id, blocks, n)
        self._flush()
        if self.ordered_saves:
            self._replying.add(info.req_id)
            self._await_inserts()
        return keep

    def sends_done(self, req_ids: Iterable[str]) -> None:
        """Every worker finished the saves of ``req_ids``: insert what they wrote, or
        give the slots back where a worker's copy failed (``saves.py``)."""
        self._absorb()
        self._saves.sends_done(req_ids)
        self._flush()
        self._await_inserts()

    def loads_failed(self, refs: Iterable[int]) -> None:
        """The workers' loads that failed, by ``LoadOp.ref``, summed over the ranks:
        their reservations are released as ``load_failed`` (see the module docstring),
        each once however many ranks or steps report it."""
        refs = set(refs)
        refs.discard(0)
        if not refs:
            return
        for res in self._res.values():
            if res.gen in refs and res.state is _State.LOADING:
                # Still held by the running request: its release, at finish or
                # preemption, says why.
                self.stats.loads_failed += res.unused != "load_failed"
                res.unused = "load_failed"
        for _, gen, release in self._later:
            if gen in refs:  # dropped since (the load may run a step late)
                self.stats.loads_failed += release.unused != "load_failed"
                release.unused = "load_failed"

    def saves_copied(self, reports: Iterable[int]) -> None:
        """The copies of running requests the workers made (``SaveOp.report``, over the
        ranks of a step): a save whose copies are all made inserts."""
        self._saves.copied(reports)
        self._flush()
        self._await_inserts()

    def saves_failed(self, refs: Iterable[int]) -> None:
        """The workers' saves whose copies failed, by ``SaveOp.ref``, summed over the
        ranks: their slots are given back when ``sends_done`` names their requests,
        once every rank is done with them (``saves.py``)."""
        self._saves.failed(refs)

    def disable(self, reason: str) -> None:
        """A worker disabled the connector (see the module docstring): look nothing up
        and save nothing from now on. The reservations not yet loading are released,
        and the saves of running requests given back once no copy into them is out."""
        if self.disabled is not None:
            return
        self.disabled = reason
        log.info("prefixcache: a worker disabled the connector; no more lookups or saves")
        for req_id in [
            k for k, r in self._res.items() if r.state in (_State.LOOKING, _State.READY)
        ]:
            self._drop(req_id)
        self._saves.stop_running()
        self._flush()

    def close(self) -> None:
        """Stop (see the module docstring); the backend's session close releases
        every lock and slot left."""
        self._absorb()
        self._flush()
        wait_idle = getattr(self.backend, "wait_idle", None)
        if wait_idle is not None and not wait_idle(max(self.config.timeout * 2, 1.0)):
            log.warning("prefixcache: calls to the service still in flight at shutdown")
        failed = self.stats.saves_failed
        self._absorb()  # inserts that landed, or failed, while waiting
        left, tokens = self._saves.drop_all()
        lost = left + self.stats.saves_failed - failed
        if lost:
            self.stats.saves_lost += lost
            log.warning(
                "prefixcache: %d save(s) in flight at shutdown were lost "
                "(%d tokens of unfinished copies); the next engine recomputes "
                "them",
                lost,
                tokens,
            )
        self._queued.clear()  # the session's close releases the locks and slots
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()

    def has_pending_saves(self) -> bool:
        """Whether a finished request's save is not through."""
        return self._saves.pending_finished()

    def has_pending_work(self) -> bool:
        """Whether vLLM must step on with no request left (its
        ``has_pending_push_work``): a finished request's save is not through, a release
        waits for its step (``_later``) or for the next dispatch, or a call is out whose
        answer may need one (a lock nobody wants any more). Each step absorbs and
        dispatches; none of these outlives the calls' deadline."""
        self._absorb()
        in_flight = getattr(self.backend, "in_flight", None)
        return (
            self._saves.pending_finished()
            or bool(self._later)
            or bool(self._queued)
            or (in_flight is not None and in_flight())
        )

    def reservations(self) -> dict[str, str]:
        """Request id -> reservation state, for tests and debugging."""
        return {k: v.state.name.lower() for k, v in self._res.items()}

    # ---------------------------------------------------------------- internals

    def _load_op(self, res: _Reservation) -> LoadOp:
        end = res.local + res.num_external
        first, groups = (
            (res.tables[0] if res.tables else array("q")),
            (res.tables if len(res.tables) > 1 else ()),
        )
        # Tokens in the null block (where vLLM needs no KV: sliding-window blocks
        # before the window) are not loaded; a null block after a live one is a table
        # this side does not understand.
        starts = [live_from(t, res.local, end, self.block_size) for t in res.tables]
        if any(start is None for start in starts):
            log.warning(
                "request %s: vLLM's block table for the hit has the null block "
                "after a block to load; it will be recomputed",
                res.req_id,
            )
            res.unused = "load_failed"
            return LoadOp(
                res.req_id,
                first,
                res.local,
                res.num_external,
                fail=True,
                ref=res.gen,
                group_block_ids=groups,
            )
        if res.hit < 0 or end > res.hit:
            log.warning(
                "request %s: vLLM counts %d external tokens from %d, the "
                "reservation has %d; they will be recomputed",
                res.req_id,
                res.num_external,
                res.local,
                res.hit,
            )
            res.unused = "load_failed"  # the service counts the reserved hit so
            return LoadOp(
                res.req_id,
                first,
                res.local,
                res.num_external,
                fail=True,
                ref=res.gen,
                group_block_ids=groups,
            )
        start = min((s for s in starts if s is not None), default=res.local)
        self.stats.loads += 1
        self.stats.load_tokens += res.num_external
        return LoadOp(
            res.req_id,
            first,
            start,
            end - start,
            res.slots[start:end],
            res.epoch,
            res.session_id,
            res.tokens[:end],
            res.extra_key,
            ref=res.gen,
            group_block_ids=groups,
        )

    def _drop(self, req_id: str, unused: str | None = None) -> None:
        """Forget a request's reservation and release its lock (a lookup still out is
        released when it lands: its generation is gone); ``unused``: why its hit was
        never used, for the service's lookup outcomes."""
        res = self._res.pop(req_id, None)
        if res is None or not res.lock_id:
            return
        release = Release(res.lock_id, res.epoch, unused or res.unused)
        if res.state is _State.LOADING:
            # The load went out with a step that may not have run yet (vLLM schedules
            # the next step while the last one runs): keep the slots two steps more.
            self._later.append((self._steps + 2, res.gen, release))
        else:
            self._queued.append(release)

    def _expire(self) -> None:
        deadline = self.clock() - self.config.lease_ttl
        for req_id in [
            k for k, r in self._res.items() if r.state is _State.READY and r.touched < deadline
        ]:
            self.stats.leases_expired += 1
            self._drop(req_id, "lease_expired")

    def _queue(self, op: Op) -> None:
        if isinstance(op, SaveCommit):
            self._misses.inserting(op)
            if self.ordered_saves:
                self._inserting[op.req_id] = op
        self._queued.append(op)

    def _await_inserts(self) -> None:
        """``ordered_saves``: wait (up to the calls' deadline) for the inserts of the
        finished requests whose output is about to leave (see the module docstring)."""
        if not self._replying:
            return
        ops: list[Op] = [op for r, op in self._inserting.items() if r in self._replying]
        if ops and not self.backend.wait_done(ops, 2 * self.config.timeout):
            self.stats.inserts_unordered += len(ops)
            log.warning(
                "prefixcache: %d insert(s) of finished requests not answered in %.1f s; "
                "their outputs leave before them",
                len(ops),
                2 * self.config.timeout,
            )
            # Their outputs go now: a later call need not wait for them again.
            self._replying.difference_update(op.req_id for op in ops if isinstance(op, SaveCommit))
        self._absorb()
        # Requests whose save is through (or that saved nothing) are done with.
        self._replying = {r for r in self._replying if r in self._saves or r in self._inserting}

    def _flush(self) -> None:
        ops, self._queued = self._queued, []
        self.backend.dispatch(ops)

    def _absorb(self) -> None:
        for done in self.backend.drain():
            op = done.op
            if isinstance(op, Lookup):
                self._landed(op, done)
            elif isinstance(op, SaveAlloc):
                self._saves.landed(op, done)
            elif isinstance(op, SaveCommit):
                if self._inserting.get(op.req_id) is op:
                    del self._inserting[op.req_id]
                ok = done.error is None and not getattr(done.reply, "skipped", False)
                self._misses.inserted(op, ok)
                if done.error is not None:
                    self._saves.commit_failed(op)
            elif done.error is not None:
                log.debug("prefixcache %s failed: %s", type(op).__name__, done.error)

    def _landed(self, op: Lookup, done: Done) -> None:
        req_id, gen = op.key
        reply: Any = done.reply
        lock_id = getattr(reply, "lock_id", 0) if done.error is None else 0
        epoch = getattr(reply, "server_epoch", 0) if done.error is None else 0
        res = self._res.get(req_id)
        if res is None or res.gen != gen or res.state is not _State.LOOKING:
            if lock_id:  # nobody wants it any more
                self._queued.append(Release(lock_id, epoch))
            return
        res.state, res.touched = _State.READY, self.clock()
        if done.error is not None or reply is None or reply.skipped:
            # A skipped reply is the client failing open: the service did not answer.
            self.stats.lookup_errors += done.error is not None or reply is not None
            return
        hit = reply.prefix_len // self.block_size * self.block_size
        if hit == 0:
            if lock_id:
                self._queued.append(Release(lock_id, epoch))
            return
        res.hit, res.slots, res.lock_id, res.epoch = hit, reply.slots, lock_id, epoch
        res.session_id = done.session_id
        self.stats.hit_tokens += hit
