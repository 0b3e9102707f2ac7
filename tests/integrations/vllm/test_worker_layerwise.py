"""Layer-wise loads (``layerwise_load``) on CPU tensors, against a real server: the same
bytes as whole loads, layers issued in order, waits for layers the step does not load
are no-ops, and failures reported block by block as whole loads report them.
(test_worker_layerwise_cuda.py runs the GPU stream and its overlap.)"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from harness import ServerThread
from integrations.vllm.test_worker import (
    B_BLOCKS,
    PROMPT,
    load_b,
    run_step,
    same_rows,
    save_a,
    step,
)
from integrations.vllm.vllm_support import backend_for, make_caches, make_scheduler, make_worker

from prefixcache.integrations.vllm.config import ConnectorConfig
from prefixcache.integrations.vllm.keys import RequestInfo
from prefixcache.integrations.vllm.layerwise import HostCopies, StepLayers
from prefixcache.integrations.vllm.meta import LoadOp, StepMeta
from prefixcache.integrations.vllm.scheduler import SchedulerCore
from prefixcache.integrations.vllm.worker import WorkerCore

pytestmark = pytest.mark.usefixtures("quiet")


def names(caches: dict[str, torch.Tensor]) -> list[str]:
    return list(caches)


@contextmanager
def b_reserved(
    server: ServerThread, caches: dict[str, torch.Tensor]
) -> Iterator[tuple[SchedulerCore, WorkerCore, RequestInfo]]:
    """A layer-wise worker over ``caches`` whose scheduler side saved A and reserved B's
    16-token hit (B_BLOCKS), nothing loaded yet; B finishes and both close after."""
    core = make_scheduler(server.address)
    worker = make_worker(server.address, layerwise_load=True)
    try:
        worker.register(caches)
        save_a(core, [worker])
        b = RequestInfo("B", PROMPT, len(PROMPT))
        core.probe(b, 0)
        step(core, [worker])
        assert core.probe(b, 0) == (16, False)
        core.allocated("B", B_BLOCKS, 16)
        yield core, worker, b
        core.finished(b, B_BLOCKS, 17)
        for _ in range(3):
            step(core, [worker], {"B"})
    finally:
        core.close()
        worker.close()


@pytest.mark.parametrize("transfer", ["attach", "remote"])
@pytest.mark.parametrize("layout", ["kv_first", "bhn2d", "cpu_vec"])
def test_layerwise_loads_the_same_bytes_as_whole_loads(
    server: ServerThread, layout: str, transfer: str
) -> None:
    core = make_scheduler(server.address, transfer=transfer)
    whole = make_worker(server.address, transfer=transfer, kv_layout="auto")
    by_layer = make_worker(server.address, transfer=transfer, kv_layout="auto", layerwise_load=True)
    try:
        caches = make_caches(layout)
        twin = {n: t.clone() for n, t in caches.items()}
        whole.register(caches, backend_for(layout))
        by_layer.register(twin, backend_for(layout))
        save_a(core, [whole, by_layer])  # rank 0 of two identical engines saves once
        assert load_b(core, [whole, by_layer]) == set()
        assert same_rows(twin, layout)
        assert all(
            torch.equal(caches[n].view(torch.uint8), twin[n].view(torch.uint8)) for n in caches
        )
        assert by_layer.loaded_tokens == whole.loaded_tokens == 16
    finally:
        core.close()
        whole.close()
        by_layer.close()


def test_layers_are_issued_in_order_and_waits_only_for_this_steps_loads(
    server: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    caches = make_caches("kv_first")
    # A third layer that shares layer 1's cache (vLLM's KV sharing): its wait is
    # layer 1's.
    caches["model.layers.2.self_attn.attn"] = caches["model.layers.1.self_attn.attn"]
    with b_reserved(server, caches) as (core, worker, _):
        assert worker.issued_layers == []
        assert not any(worker.wait_layer(n) for n in caches)  # no loads yet: no-ops
        meta = core.build_meta()
        run_step(core, [worker], meta)
        assert worker.take_load_errors() == set()
        unique = names(caches)[:2]
        assert worker.issued_layers == unique
        assert all(worker.wait_layer(n) for n in caches)
        assert worker.wait_layer(unique[0])  # twice (a second forward pass): still fine
        # Not a layer vLLM registered: which cache it reads is not known, so it waits
        # for them all, and says so once.
        with caplog.at_level(logging.WARNING, "prefixcache.integrations.vllm"):
            for _ in range(2):
                assert worker.wait_layer("model.layers.9.self_attn.attn")
        assert caplog.text.count("not a layer vLLM registered") == 1
        worker.end_step()
        assert same_rows({n: caches[n] for n in unique}, "kv_first")
        run_step(core, [worker], StepMeta())  # the next step loads nothing
        assert worker.issued_layers == []
        assert not worker.wait_layer(unique[0])
        assert not worker.wait_layer("model.layers.9.self_attn.attn")


def test_without_layer_waits_the_step_loads_whole(server: ServerThread) -> None:
    """vLLM replays a step as one full CUDA graph, which calls no wait: the loads are
    whole, as without the setting."""
    caches = make_caches("kv_first")
    with b_reserved(server, caches) as (core, worker, _):
        worker.start_step(core.build_meta(), by_layer=False)
        assert worker.issued_layers == []
        assert worker.take_load_errors() == set() and worker.loaded_tokens == 16
        assert same_rows(caches, "kv_first")
        core.sends_done(worker.finished_sends(set()))


def test_a_failed_load_reports_its_blocks_and_the_others_load(server: ServerThread) -> None:
    """Three loads in one layer-wise step: one whose copy fails (a block vLLM's cache
    does not have), one the scheduler side could not serve, one sound. The sound one
    loads; each failed one reports exactly its blocks, once."""
    caches = make_caches("kv_first")
    with b_reserved(server, caches) as (core, worker, _):
        meta = core.build_meta()
        (load,) = meta.loads
        bad = LoadOp(
            "X",
            array("q", [1000, 1001, 1002, 1003]),
            0,
            16,
            load.slots,
            load.server_epoch,
            load.session_id,
            load.tokens,
            load.extra_key,
        )
        meta.loads[:0] = [bad, LoadOp("Y", array("q", [12, 13]), 0, 8, fail=True)]
        run_step(core, [worker], meta)
        assert worker.take_load_errors() == {1000, 1001, 1002, 1003, 12, 13}
        assert worker.take_load_errors() == set()
        assert worker.load_failures == {"copy": 1, "scheduler": 1}
        assert worker.loaded_tokens == 16 and same_rows(caches, "kv_first")
        assert worker.issued_layers == names(caches)


@pytest.mark.parametrize("change", ["moved", "restarted"])
def test_a_load_the_check_refuses_fails_every_block(server: ServerThread, change: str) -> None:
    """The check that the slots still hold the tokens (``verify_loads``) and the epoch
    check fail a layer-wise load as they fail a whole one."""
    with b_reserved(server, make_caches("kv_first")) as (core, worker, _):
        meta = core.build_meta()
        (load,) = meta.loads
        if change == "moved":
            load.slots = load.slots[::-1]  # the same locked slots, in another order
        else:
            load.server_epoch += 1  # slots of another start of the service
        run_step(core, [worker], meta)
        assert worker.take_load_errors() == set(B_BLOCKS[:4])
        assert worker.load_failures == {change: 1} and worker.loaded_tokens == 0


def test_step_layers_bookkeeping() -> None:
    """The bookkeeping alone: marks by cache index, names mapped to their cache."""
    layers = StepLayers({"a": 0, "b": 1, "b2": 1}, HostCopies())
    assert not layers.wait("a")
    for i in range(2):
        layers.issued(i)
    assert layers.order == [0, 1]
    assert layers.wait("b2") and layers.wait("a") and layers.wait("c")
    layers.wait_all()
    layers.begin()
    assert layers.order == [] and not layers.wait("a") and not layers.wait("c")


def test_the_setting_is_a_boolean() -> None:
    assert ConnectorConfig.from_extra({"model": "v", "layerwise_load": True}).layerwise_load
    assert not ConnectorConfig(model="v").layerwise_load
    with pytest.raises(ValueError, match="layerwise_load"):
        ConnectorConfig.from_extra({"model": "v", "layerwise_load": "auto"})
