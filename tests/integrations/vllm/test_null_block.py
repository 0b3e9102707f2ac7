"""vLLM's null block (block 0) and sliding-window requests, on the engine-free cores in
vLLM's order, CPU tensors and a real server.

A sliding-window request's table gets the null block where its blocks left the window
(vLLM freed them while it ran), and a sliding-window hit's table has it where vLLM
needs no KV. The cores never save from it or load into it: a finish-time save stops at
it, a save during the run copies each step's tokens before vLLM frees their blocks, a
load skips the null blocks before the hit's live ones, and a worker refuses a copy that
would touch it. Every check is of bytes: the null block holds random bytes of its own.
"""

from __future__ import annotations

from array import array

import pytest
import torch
from harness import ServerThread
from integrations.vllm.vllm_support import (
    DIM,
    make_caches,
    make_scheduler,
    make_worker,
    settle,
    token_rows,
)

from prefixcache.client import PrefixCacheClient
from prefixcache.integrations.vllm.keys import RequestInfo
from prefixcache.integrations.vllm.layout import split_kv
from prefixcache.integrations.vllm.meta import NULL_BLOCK, LoadOp, SaveOp, StepMeta
from prefixcache.integrations.vllm.scheduler import SchedulerCore
from prefixcache.integrations.vllm.worker import WorkerCore

pytestmark = pytest.mark.usefixtures("quiet")

PROMPT = list(range(600, 618))  # 18 tokens: 4 whole blocks to save
A_BLOCKS = [2, 5, 7, 9, 11]
B_BLOCKS = [1, 3, 4, 6, 8]


def views(caches: dict[str, torch.Tensor]) -> list:  # type: ignore[type-arg]
    return [split_kv(name, t, "kv_first", DIM) for name, t in caches.items()]


def rows(caches: dict[str, torch.Tensor], blocks: list[int], n: int) -> list[torch.Tensor]:
    return [token_rows(v, blocks, n) for v in views(caches)]


def null_block(caches: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    # kv_first: [2, blocks, ...]; bytes: random bits hold NaNs
    return [t[:, NULL_BLOCK].clone().view(torch.uint8) for t in caches.values()]


def step(
    core: SchedulerCore,
    worker: WorkerCore,
    finished: set[str] = frozenset(),  # type: ignore[assignment]
    progress: dict[str, tuple[int, list[int]]] | None = None,
) -> StepMeta:
    """One engine step: the metadata, the worker's copies before and after the
    forward, its reports back."""
    meta = core.build_meta((), progress)
    worker.start_step(meta)
    worker.end_step()
    sent = worker.finished_sends(set(finished))
    core.loads_failed(worker.take_failed_loads())
    core.saves_failed(worker.take_failed_saves())
    core.saves_copied(worker.take_copied())
    core.sends_done(sent)
    settle(core)
    return meta


def pool_rows(client: PrefixCacheClient, tokens: list[int]) -> tuple[int, list]:  # type: ignore[type-arg]
    """How many of ``tokens`` the tree holds, and their K/V rows per layer."""
    with client.session(10.0) as s:
        hit = s.match("v", tokens, lock=True)
        kv = s.read_kv("v", hit.slots) if hit.prefix_len else None
        s.unlock(hit.lock_id)
    if kv is None:
        return 0, []
    return hit.prefix_len, [
        torch.stack([kv.k[layer], kv.v[layer]]).view(torch.uint8) for layer in range(len(kv.k))
    ]


def test_a_finish_time_save_stops_at_the_null_block(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    """The finished request's table [2, 5, null, 9, 11]: tokens 0..7 are saved, from
    their blocks; nothing at or after the null block, whose bytes are nobody's KV."""
    core = make_scheduler(server.address)
    worker = make_worker(server.address)
    try:
        caches = make_caches("kv_first")
        worker.register(caches)
        table = [2, 5, NULL_BLOCK, 9, 11]
        assert core.finished(RequestInfo("A", PROMPT, len(PROMPT)), table, 18)
        for _ in range(3):
            step(core, worker, {"A"})
        assert not core.has_pending_saves()
        held, got = pool_rows(client, PROMPT)
        assert held == 8 and core.stats.saves_cut == 1
        assert all(torch.equal(g, w) for g, w in zip(got, rows(caches, table, 8), strict=True))
        # The blocks before the window are gone: nothing is saved...
        lost = [1] * 18
        assert core.finished(RequestInfo("C", lost, 18), [NULL_BLOCK, NULL_BLOCK, 9, 11], 18)
        # ... but where the tree has them, the live blocks after them are.
        more = PROMPT[:8] + [2] * 10
        assert core.finished(RequestInfo("D", more, 18), [NULL_BLOCK, NULL_BLOCK, 9, 11], 18)
        for _ in range(3):
            step(core, worker, {"C", "D"})
        assert pool_rows(client, lost)[0] == 0
        held, got = pool_rows(client, more)
        assert held == 16
        assert all(
            torch.equal(g[:, 8:], w[:, 8:])
            for g, w in zip(got, rows(caches, [1, 1, 9, 11], 16), strict=True)
        )
        assert worker.saved_tokens == 16 and worker.failed_saves == 0
    finally:
        core.close()
        worker.close()


def test_a_sliding_window_request_is_saved_while_it_runs(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    """With ``during_run_saves``: the first probe waits for the save's Match; each
    step's computed tokens are copied after its forward (end_step), from the blocks of
    that step's table, though vLLM frees the first blocks meanwhile (null in later
    tables); once the workers report the copies, the save inserts all 16 tokens, equal
    to the blocks that computed them, and the finish holds no block."""
    core = make_scheduler(server.address, during_run_saves=True)
    worker = make_worker(server.address)
    try:
        caches = make_caches("kv_first")
        worker.register(caches)
        a = RequestInfo("A", PROMPT, len(PROMPT))
        assert core.probe(a, 0) == (None, False)  # a miss: it waits for the save
        assert core.saving_during_run() == {"A"}
        step(core, worker)
        assert core.probe(a, 0) == (0, False)
        core.allocated("A", A_BLOCKS[:3], 0)
        want = rows(caches, A_BLOCKS, 16)
        meta = core.build_meta((), {"A": (10, A_BLOCKS[:3])})  # a chunk of 10 tokens
        (op,) = meta.saves
        assert (op.during_run, op.start, len(op.slots)) == (True, 0, 10)
        worker.start_step(meta)
        assert worker.saved_tokens == 0  # before the forward: nothing copied yet
        worker.end_step()
        assert worker.saved_tokens == 10
        assert worker.finished_sends({"A"}) == set()  # A runs on
        core.saves_failed(worker.take_failed_saves())
        core.saves_copied(worker.take_copied())
        settle(core)
        # The next chunk: vLLM freed block 2 meanwhile.
        (op,) = step(core, worker, progress={"A": (18, [NULL_BLOCK, *A_BLOCKS[1:]])}).saves
        assert (op.start, len(op.slots)) == (10, 6)
        assert core.saving_during_run() == set()  # all 16 copied
        for blocks in (A_BLOCKS[:3], [NULL_BLOCK] * 3):  # the freed blocks are reused
            for part in caches.values():
                part[:, blocks] = torch.randint_like(part[:, blocks], 0, 100)
        held, got = pool_rows(client, PROMPT)  # A still runs
        assert held == 16
        assert not core.finished(a, [NULL_BLOCK] * 3 + A_BLOCKS[3:], 20)
        step(core, worker, {"A"})
        assert not core.has_pending_saves()
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        assert worker.failed_saves == 0 and core.stats.saves_cut == 0
    finally:
        core.close()
        worker.close()


def test_a_sliding_window_hit_loads_only_its_live_blocks(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    """A hit of 16 whose table is [null, null, 4, 6, ...] (vLLM needs no KV before the
    window): the load copies tokens 8..15 into blocks 4 and 6 and leaves the null
    block's bytes as they were."""
    core = make_scheduler(server.address)
    worker = make_worker(server.address)
    try:
        caches = make_caches("kv_first")
        worker.register(caches)
        assert core.finished(RequestInfo("A", PROMPT, len(PROMPT)), A_BLOCKS, 18)
        for _ in range(3):
            step(core, worker, {"A"})
        null_before = null_block(caches)
        b = RequestInfo("B", PROMPT, len(PROMPT))
        assert core.probe(b, 0) == (None, False)
        step(core, worker)
        assert core.probe(b, 0) == (16, False)
        table = [NULL_BLOCK, NULL_BLOCK, 4, 6, 8]
        core.allocated("B", table, 16)
        (load,) = step(core, worker).loads
        assert (load.start, load.num_tokens) == (8, 8)
        assert worker.take_load_errors() == set() and worker.loaded_tokens == 8
        got, want = rows(caches, [1, 1, 4, 6], 16), rows(caches, A_BLOCKS, 16)
        assert all(torch.equal(g[:, 8:], w[:, 8:]) for g, w in zip(got, want, strict=True))
        assert all(torch.equal(x, y) for x, y in zip(null_block(caches), null_before, strict=True))
        core.finished(b, table, 17)
        for _ in range(2):
            step(core, worker, {"B"})
    finally:
        core.close()
        worker.close()


def test_a_worker_refuses_copies_that_touch_the_null_block(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    """A load or save the scheduler side would never plan: the load fails (its other
    blocks reported, never block 0) and writes nothing; the save fails and writes
    nothing into the slots."""
    worker = make_worker(server.address)
    try:
        caches = make_caches("kv_first")
        worker.register(caches)
        before = {name: t.clone().view(torch.uint8) for name, t in caches.items()}
        with client.session(10.0) as s:
            reply = s.match("v", PROMPT[:8], allocate=True, lock=True)
            slots = reply.allocated
            worker.start_step(
                StepMeta(
                    [
                        LoadOp(
                            "L",
                            array("q", [3, NULL_BLOCK]),
                            0,
                            8,
                            slots,
                            reply.server_epoch,
                            s.session_id,
                            array("q", PROMPT[:8]),
                            ref=7,
                        )
                    ]
                )
            )
            assert worker.take_load_errors() == {3}
            assert worker.take_failed_loads() == {7}
            assert worker.load_failures == {"null_block": 1}
            assert all(torch.equal(caches[n].view(torch.uint8), before[n]) for n in caches)
            worker.start_step(
                StepMeta(
                    saves=[
                        SaveOp(
                            "S",
                            array("q", [NULL_BLOCK, 3]),
                            0,
                            slots,
                            reply.server_epoch,
                            s.session_id,
                            ref=9,
                        )
                    ]
                )
            )
            assert worker.take_failed_saves() == {9} and worker.saved_tokens == 0
            assert worker.finished_sends({"S"}) == {"S"}
            s.free("v", slots)
            s.unlock(reply.lock_id)
    finally:
        worker.close()
