"""The worker side with the scheduler side, in vLLM's order, on CPU tensors in vLLM's
layouts, against a real server: byte-exact round trips (save one request, load it into
another's blocks), load failures reported block by block, and to the service as the
lookup outcome load_failed."""

from __future__ import annotations

import logging
from array import array
from pathlib import Path

import pytest
import torch
from harness import ServerThread, pb, running, stub_for
from integrations.vllm.vllm_support import (
    BLOCK,
    DIM,
    LATENT,
    MODELS,
    backend_for,
    make_caches,
    make_scheduler,
    make_worker,
    settle,
    token_rows,
)

from prefixcache.client import PrefixCacheClient
from prefixcache.integrations.vllm.keys import RequestInfo
from prefixcache.integrations.vllm.layout import UnknownLayout, split_kv
from prefixcache.integrations.vllm.meta import LoadOp, StepMeta
from prefixcache.integrations.vllm.scheduler import SchedulerCore
from prefixcache.integrations.vllm.worker import LOAD_FAILURE_REASONS, WorkerCore

pytestmark = pytest.mark.usefixtures("quiet")

PROMPT = list(range(500, 518))  # 18 tokens: 4 whole blocks are saved and loaded
A_BLOCKS = [2, 5, 7, 9, 11]
B_BLOCKS = [1, 3, 4, 6, 8]


def step(
    core: SchedulerCore, workers: list[WorkerCore], finished: set[str] = frozenset()
) -> StepMeta:  # type: ignore[assignment]
    """One engine step: the scheduler's metadata, every worker's copies, and what vLLM
    aggregates over the workers back to the scheduler."""
    return run_step(core, workers, core.build_meta(), finished)


def run_step(
    core: SchedulerCore, workers: list[WorkerCore], meta: StepMeta, finished: set[str] = frozenset()
) -> StepMeta:  # type: ignore[assignment]
    """The workers' half of ``step``, on ``meta``: the finished sends (every rank's)
    and the failed loads and saves (any rank's) go back as vLLM's
    update_connector_output hands them over (worker metadata first, then the sends)."""
    done, loads, saves = None, set(), set()
    for worker in workers:
        worker.start_step(meta)
        sent = worker.finished_sends(set(finished))
        done = sent if done is None else done & sent
        loads |= worker.take_failed_loads()
        saves |= worker.take_failed_saves()
    core.loads_failed(loads)
    core.saves_failed(saves)
    core.sends_done(done or ())
    settle(core)
    return meta


def outcome_tokens(server: ServerThread, outcome: str) -> int:
    """The service's lookup tokens of model v with ``outcome`` (a Stats call)."""
    channel, stub = stub_for(server.address)
    with channel:
        stats = stub.Stats(pb.StatsRequest(model="v")).models[0]
    return stats.lookup_tokens_total[outcome]


def save_a(
    core: SchedulerCore, workers: list[WorkerCore], model_tokens: list[int] = PROMPT
) -> None:
    """Request A computed the prompt in A_BLOCKS and finishes: its 16 tokens are saved."""
    assert core.finished(RequestInfo("A", model_tokens, len(model_tokens)), A_BLOCKS, 18)
    for _ in range(3):
        step(core, workers, {"A"})
    assert not core.has_pending_saves()


def load_b(core: SchedulerCore, workers: list[WorkerCore]) -> set[int]:
    """Request B with A's prompt: looked up, allocated B_BLOCKS, loaded; the blocks
    the workers report as failed."""
    b = RequestInfo("B", PROMPT, len(PROMPT))
    assert core.probe(b, 0) == (None, False)
    step(core, workers)
    assert core.probe(b, 0) == (16, False)
    core.allocated("B", B_BLOCKS, 16)
    meta = step(core, workers)
    assert len(meta.loads) == 1
    errors: set[int] = set()
    for worker in workers:
        errors |= worker.take_load_errors()
    core.finished(b, B_BLOCKS, 17)  # saves nothing new: the tree has it all
    for _ in range(2):
        step(core, workers, {"B"})
    return errors


def same_rows(caches: dict[str, torch.Tensor], layout: str) -> bool:
    head = LATENT if layout == "mla" else DIM
    views = [split_kv(name, t, layout, head) for name, t in caches.items()]
    return all(torch.equal(token_rows(v, A_BLOCKS, 16), token_rows(v, B_BLOCKS, 16)) for v in views)


@pytest.mark.parametrize("transfer", ["attach", "remote"])
@pytest.mark.parametrize("layout", ["kv_first", "blocks_first", "bhn2d", "cpu_vec"])
def test_round_trip_is_byte_exact(
    server: ServerThread, client: PrefixCacheClient, layout: str, transfer: str
) -> None:
    core = make_scheduler(server.address, transfer=transfer)
    worker = make_worker(server.address, transfer=transfer, kv_layout="auto")
    try:
        caches = make_caches(layout)
        worker.register(caches, backend_for(layout))
        assert [v.layout for v in worker.layers] == [layout] * len(caches)
        assert not same_rows(caches, layout)
        save_a(core, [worker])
        assert client.match("v", PROMPT).prefix_len == 16
        assert load_b(core, [worker]) == set()
        assert same_rows(caches, layout)
        assert worker.loaded_tokens == 16 and worker.saved_tokens == 16
    finally:
        core.close()
        worker.close()


@pytest.mark.parametrize(
    ("model", "dtype"), [("b", "bfloat16"), ("f8", "float8_e4m3fn"), ("f8", "uint8")]
)  # vLLM's fp8 is uint8
def test_round_trip_in_other_dtypes_and_kernel_blocks(
    server: ServerThread, model: str, dtype: str
) -> None:
    core = make_scheduler(server.address, model)
    worker = make_worker(server.address, model)
    try:
        caches = make_caches("kv_first", kernel_block=2, dtype=dtype)
        worker.register(caches)
        save_a(core, [worker])
        assert load_b(core, [worker]) == set()
        assert same_rows(caches, "kv_first")
    finally:
        core.close()
        worker.close()


def test_tensor_parallel_ranks_share_one_pool(server: ServerThread) -> None:
    core = make_scheduler(server.address)
    workers = [make_worker(server.address, tp_rank=r, tp_size=2) for r in range(2)]
    try:
        caches = [make_caches("kv_first", heads=1) for _ in workers]
        for worker, c in zip(workers, caches, strict=True):
            worker.register(c)
        save_a(core, workers)
        assert load_b(core, workers) == set()
        assert all(same_rows(c, "kv_first") for c in caches)
    finally:
        core.close()
        for worker in workers:
            worker.close()


def test_a_reset_between_lookup_and_load_fails_every_block(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    core = make_scheduler(server.address)
    worker = make_worker(server.address)
    try:
        worker.register(make_caches("kv_first"))
        save_a(core, [worker])
        b = RequestInfo("B", PROMPT, len(PROMPT))
        core.probe(b, 0)
        step(core, [worker])
        assert core.probe(b, 0) == (16, False)
        client.reset("v")  # e.g. new weights: the locked slots are freed
        before = outcome_tokens(server, "load_failed")
        core.allocated("B", B_BLOCKS, 16)
        step(core, [worker])
        assert worker.take_load_errors() == set(B_BLOCKS[:4])
        assert worker.take_load_errors() == set()  # reported once
        assert worker.load_failures == {"moved": 1}
        core.finished(b, [], 0)
        for _ in range(3):
            step(core, [worker])
        # The Reset dropped the lock: its release is refused, and the load is counted
        # by vLLM only (docs/vllm.md).
        assert outcome_tokens(server, "load_failed") == before
    finally:
        core.close()
        worker.close()


def test_a_load_the_workers_fail_reaches_the_service_as_load_failed_once(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    """Both ranks copy, then find the tree no longer maps the tokens to the slots they
    copied from (moved): the failure goes back with the step's output and the
    reservation's release, the call that was due anyway, tells the service; its 16
    tokens are counted load_failed once, not once per rank or per report."""
    core = make_scheduler(server.address)
    workers = [make_worker(server.address, tp_rank=r, tp_size=2) for r in range(2)]
    try:
        for worker in workers:
            worker.register(make_caches("kv_first", heads=1))
        save_a(core, workers)
        b = RequestInfo("B", PROMPT, len(PROMPT))
        core.probe(b, 0)
        step(core, workers)
        assert core.probe(b, 0) == (16, False)
        before = outcome_tokens(server, "load_failed")
        core.allocated("B", B_BLOCKS, 16)
        meta = core.build_meta()
        (load,) = meta.loads
        load.slots = load.slots[::-1]  # the same locked slots, in another order
        run_step(core, workers, meta)
        assert all(w.load_failures == {"moved": 1} for w in workers)
        assert core.stats.loads_failed == 1
        core.loads_failed({load.ref})  # reported again (a later step): nothing new
        assert core.stats.loads_failed == 1
        core.finished(b, B_BLOCKS, 17)  # saves nothing new: the tree has it all
        for _ in range(3):
            step(core, workers, {"B"})
        assert client.stats("v")["v"].locks == 0
        assert outcome_tokens(server, "load_failed") == before + 16
    finally:
        core.close()
        for worker in workers:
            worker.close()


def test_a_load_with_only_part_to_copy_fails_only_its_blocks(server: ServerThread) -> None:
    core = make_scheduler(server.address)
    worker = make_worker(server.address)
    try:
        worker.register(make_caches("kv_first"))
        save_a(core, [worker])
        b = RequestInfo("B", PROMPT, len(PROMPT))
        core.probe(b, 4)
        step(core, [worker])
        assert core.probe(b, 4) == (12, False)  # vLLM had the first block itself
        core.allocated("B", B_BLOCKS, 12)
        meta = core.build_meta()
        (load,) = meta.loads
        load.server_epoch += 1  # slots of another start of the service
        worker.start_step(meta)
        assert worker.take_load_errors() == set(B_BLOCKS[1:4])
        worker.start_step(StepMeta([LoadOp("C", array("q", B_BLOCKS), 8, 4, fail=True)]))
        assert worker.take_load_errors() == {B_BLOCKS[2]}
        assert worker.load_failures == {"restarted": 1, "scheduler": 1}
        core.finished(b, [], 0)
        step(core, [worker])
    finally:
        core.close()
        worker.close()


@pytest.mark.parametrize("transfer", ["attach", "remote"])
def test_a_killed_service_fails_the_load_and_nothing_raises(
    tmp_path: Path, transfer: str, caplog: pytest.LogCaptureFixture
) -> None:
    with running(tmp_path, MODELS) as srv:
        core = make_scheduler(srv.address, transfer=transfer, timeout=0.5)
        worker = make_worker(srv.address, transfer=transfer, timeout=0.5)
        worker.register(make_caches("kv_first"))
        save_a(core, [worker])
        b = RequestInfo("B", PROMPT, len(PROMPT))
        core.probe(b, 0)
        step(core, [worker])
        assert core.probe(b, 0) == (16, False)
        if transfer == "remote":
            worker._pool()  # describe the pool while the service is up
    try:
        core.allocated("B", B_BLOCKS, 16)
        with caplog.at_level(logging.WARNING, "prefixcache.integrations.vllm"):
            step(core, [worker])
        assert worker.take_load_errors() == set(B_BLOCKS[:4])
        # Said as it is: the service could not be reached, or (the mapped pool
        # outlives the service) the check that the slots still hold the tokens got no
        # answer; never "the slots no longer hold these tokens".
        reason = {"attach": "unverified", "remote": "unavailable"}[transfer]
        assert worker.load_failures == {reason: 1}
        assert LOAD_FAILURE_REASONS[reason] in caplog.text
        assert "no longer hold" not in caplog.text
        # B's save, at its first probe, found its prompt in the tree: nothing to save.
        assert not core.finished(b, B_BLOCKS, 18)
        for _ in range(3):
            step(core, [worker], {"B"})
        assert not core.has_pending_saves()
    finally:
        core.close()
        worker.close()


def test_a_restarted_service_is_mapped_anew(tmp_path: Path) -> None:
    with running(tmp_path, MODELS) as srv:
        core = make_scheduler(srv.address)
        worker = make_worker(srv.address)
        caches = make_caches("kv_first")
        worker.register(caches)
        save_a(core, [worker])
        first = worker._access
        assert first is not None and first.mapped
    try:
        with running(tmp_path, MODELS):  # same address, new epoch, empty pool
            save_a(core, [worker])
            assert load_b(core, [worker]) == set()
            assert same_rows(caches, "kv_first")
            assert worker._access is not first
    finally:
        core.close()
        worker.close()


def test_a_failed_save_caches_nothing_and_gives_everything_back(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    core = make_scheduler(server.address)
    # A rank of two cannot save through WriteKV (whole rows): its copy fails.
    worker = make_worker(server.address, transfer="remote", tp_size=2)
    try:
        worker.register(make_caches("kv_first", heads=1))
        save_a(core, [worker])
        for _ in range(2):
            step(core, [worker])
        assert worker.failed_saves == 1 and core.stats.saves_failed == 1
        assert client.match("v", PROMPT).prefix_len == 0
    finally:
        core.close()
        worker.close()


def test_the_service_down_at_start_loads_nothing_and_saves_nothing(tmp_path: Path) -> None:
    core = make_scheduler(f"unix:{tmp_path}/none.sock", timeout=0.3, wait_shadow=False)
    worker = make_worker(f"unix:{tmp_path}/none.sock", timeout=0.3)
    try:
        worker.register(make_caches("kv_first"))
        worker.start_step(
            StepMeta([LoadOp("C", array("q", B_BLOCKS), 0, 8, array("q", range(8)), 1, "nobody")])
        )
        assert worker.take_load_errors() == set(B_BLOCKS[:2])
        assert worker.load_failures == {"unavailable": 1}
        save_a(core, [worker])  # finishes: the request is reported done
    finally:
        core.close()
        worker.close()


def test_a_pool_that_does_not_fit_disables_the_connector(server: ServerThread) -> None:
    worker = make_worker(server.address)
    try:
        caches = make_caches("kv_first")
        caches["extra"] = caches[next(iter(caches))].clone()  # one layer too many
        worker.register(caches)
        worker.start_step(
            StepMeta(
                [LoadOp("C", array("q", B_BLOCKS), 0, 4, array("q", range(1, 5)), 1, "nobody")]
            )
        )
        assert worker.take_load_errors() == {B_BLOCKS[0]}
        assert "layers" in (worker._disabled or "")
        assert worker.load_failures == {"disabled": 1}
    finally:
        worker.close()


def test_unknown_layouts_are_refused() -> None:
    with pytest.raises(UnknownLayout, match="not"):
        split_kv("odd", torch.zeros(4, BLOCK * 16), "bhn2d", 8)
    with pytest.raises(UnknownLayout, match="not"):
        split_kv("odd", torch.zeros(4, BLOCK, 16), "kv_first", 8)
    with pytest.raises(UnknownLayout, match="not one of"):
        split_kv("odd", torch.zeros(4, 2, BLOCK, 16), "guess", 8)
    # The same tensor in two layouts: the name decides, never the shape.
    t = torch.zeros(2, 2, BLOCK, 2, 8)
    assert split_kv("x", t, "kv_first", 8).layout == "kv_first"
    assert split_kv("y", t, "blocks_first", 8).layout == "blocks_first"
