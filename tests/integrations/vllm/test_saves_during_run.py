"""A request's prompt saved while it runs (saves.py, "Saves during the run"), on the
engine-free cores in vLLM's order, CPU tensors and a real server: the save's Match
leaves with the first probe (a miss is still answered at once), the step after it
copies the computed prompt after the forward, the save inserts once the workers report
the copy, and the finish then holds no block, so that vLLM frees it at once. A failed
copy inserts nothing and gives the slots back; a request that finishes before its
copy is saved at the finish, holding its blocks as before."""

from __future__ import annotations

import pytest
import torch
from harness import ServerThread
from integrations.vllm.vllm_support import DIM, make_caches, make_scheduler, make_worker, settle
from integrations.vllm.vllm_support import token_rows as _token_rows

from prefixcache.client import PrefixCacheClient
from prefixcache.integrations.vllm.keys import RequestInfo
from prefixcache.integrations.vllm.layout import split_kv
from prefixcache.integrations.vllm.meta import StepMeta
from prefixcache.integrations.vllm.scheduler import SchedulerCore
from prefixcache.integrations.vllm.worker import WorkerCore

pytestmark = pytest.mark.usefixtures("quiet")

PROMPT = list(range(800, 818))  # 18 tokens: 4 whole blocks to save
BLOCKS = [2, 5, 7, 9, 11]


def rows(caches: dict[str, torch.Tensor], blocks: list[int], n: int) -> list[torch.Tensor]:
    return [
        _token_rows(split_kv(name, t, "kv_first", DIM), blocks, n) for name, t in caches.items()
    ]


def step(
    core: SchedulerCore,
    workers: list[WorkerCore],
    finished: set[str] = frozenset(),  # type: ignore[assignment]
    progress: dict[str, tuple[int, list[int]]] | None = None,
    fail_saves: bool = False,
) -> StepMeta:
    """One engine step: the metadata, every worker's copies before and after the
    forward (``fail_saves``: the last worker's copies of the step fail), and what vLLM
    merges over the workers back to the scheduler side."""
    meta = core.build_meta((), progress)
    done, failed, copied = None, set(), set()
    for n, worker in enumerate(workers):
        if fail_saves and n == len(workers) - 1:
            for op in meta.saves:
                op.session_id = "not-this-session"  # the service refuses the write
        worker.start_step(meta)
        worker.end_step()
        sent = worker.finished_sends(set(finished))
        done = sent if done is None else done & sent
        failed |= worker.take_failed_saves()
        copied |= worker.take_copied()
    core.saves_failed(failed)
    core.saves_copied(copied)
    core.sends_done(done or ())
    settle(core)
    return meta


def held(client: PrefixCacheClient, tokens: list[int]) -> tuple[int, list[torch.Tensor]]:
    with client.session(10.0) as s:
        hit = s.match("v", tokens, lock=True)
        kv = s.read_kv("v", hit.slots) if hit.prefix_len else None
        s.unlock(hit.lock_id)
    if kv is None:
        return 0, []
    return hit.prefix_len, [
        torch.stack([kv.k[n], kv.v[n]]).view(torch.uint8) for n in range(len(kv.k))
    ]


def run_prompt(
    core: SchedulerCore, workers: list[WorkerCore], req: RequestInfo, **kw: object
) -> StepMeta:
    """``req`` probed (a miss, answered at once), allocated, then its prefill step
    (nothing to copy yet: the save's Match is out) and one decode step (the copy)."""
    assert core.probe(req, 0) == (0, False)
    core.allocated(req.req_id, BLOCKS, 0)
    assert core.saving_during_run() == {req.req_id}
    prefill = step(core, workers, progress={req.req_id: (18, BLOCKS)})
    assert prefill.saves == []  # its Match left with this step: nothing to copy into
    return step(core, workers, progress={req.req_id: (19, BLOCKS)}, **kw)  # type: ignore[arg-type]


def test_the_prompt_is_saved_while_the_request_runs(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    core = make_scheduler(server.address)
    worker = make_worker(server.address)
    try:
        caches = make_caches("kv_first")
        worker.register(caches)
        a = RequestInfo("A", PROMPT, len(PROMPT))
        (op,) = run_prompt(core, [worker], a).saves
        assert (op.during_run, op.start, len(op.slots)) == (True, 0, 16)
        assert core.saving_during_run() == set()
        n, got = held(client, PROMPT)  # inserted while A runs
        assert n == 16
        assert all(torch.equal(g, w) for g, w in zip(got, rows(caches, BLOCKS, 16), strict=True))
        assert not core.finished(a, BLOCKS, 22)  # nothing to copy: vLLM frees the blocks
        assert not core.has_pending_saves()
        assert (core.stats.saves, core.stats.save_tokens) == (1, 16)
    finally:
        core.close()
        worker.close()


def test_a_failed_copy_inserts_nothing_and_gives_the_slots_back(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    """Two ranks; one fails its copy: the save gives its slots back once both reported
    it, and the finish holds no block either."""
    core = make_scheduler(server.address)
    workers = [make_worker(server.address, tp_rank=r, tp_size=2) for r in range(2)]
    try:
        for worker in workers:
            worker.register(make_caches("kv_first", heads=1))
        a = RequestInfo("A", PROMPT, len(PROMPT))
        run_prompt(core, workers, a, fail_saves=True)
        assert held(client, PROMPT)[0] == 0
        assert core.stats.saves_failed == 1 and core.stats.saves == 0
        assert not core.finished(a, BLOCKS, 22)
        step(core, workers)
        assert client.stats("v")["v"].session_slots == 0
    finally:
        core.close()
        for worker in workers:
            worker.close()


def test_a_request_that_finishes_before_its_copy_is_saved_at_the_finish(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    """One token of output: the request finishes in its prefill step, before any step
    could copy it; vLLM keeps its blocks for the finish-time copy, as before."""
    core = make_scheduler(server.address)
    worker = make_worker(server.address)
    try:
        caches = make_caches("kv_first")
        worker.register(caches)
        a = RequestInfo("A", PROMPT, len(PROMPT))
        assert core.probe(a, 0) == (0, False)
        core.allocated("A", BLOCKS, 0)
        step(core, [worker], progress={"A": (18, BLOCKS)})
        assert core.finished(a, BLOCKS, 18)  # keep the blocks
        (op,) = step(core, [worker], {"A"}).saves
        assert (op.during_run, op.start, len(op.slots)) == (False, 0, 16)
        assert not core.has_pending_saves()
        n, got = held(client, PROMPT)
        assert n == 16
        assert all(torch.equal(g, w) for g, w in zip(got, rows(caches, BLOCKS, 16), strict=True))
    finally:
        core.close()
        worker.close()


def test_a_copy_not_yet_reported_at_the_finish_inserts_once_it_is(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    """The copy ran in the step the request finished in (vLLM hands the step's output
    to the connector after the finish): the blocks go at once, the insert follows the
    workers' report."""
    core = make_scheduler(server.address)
    worker = make_worker(server.address)
    try:
        worker.register(make_caches("kv_first"))
        a = RequestInfo("A", PROMPT, len(PROMPT))
        assert core.probe(a, 0) == (0, False)
        core.allocated("A", BLOCKS, 0)
        step(core, [worker], progress={"A": (18, BLOCKS)})
        meta = core.build_meta((), {"A": (19, BLOCKS)})
        worker.start_step(meta)
        worker.end_step()
        assert not core.finished(a, BLOCKS, 20)  # copied, not yet reported
        assert core.has_pending_saves() and held(client, PROMPT)[0] == 0
        core.saves_copied(worker.take_copied())
        settle(core)
        assert held(client, PROMPT)[0] == 16 and not core.has_pending_saves()
    finally:
        core.close()
        worker.close()
