"""Layer-wise loads on a GPU (skipped without one; needs no vLLM): vLLM's blocks in CUDA
tensors, the pool in host shared memory, pinned while mapped. The bytes are those of
whole loads, each layer's are there once its wait returned (read on the engine's
stream at once, while later layers may still be copying), and the copies overlap a
per-layer compute on the engine's stream: the times are reported
(``PREFIXCACHE_GPU_REPORT`` names a JSON file for them), not asserted."""

from __future__ import annotations

import json
import os
import shutil
import sys
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import ServerThread, running

_REPO = Path(__file__).resolve().parents[3]
if str(_REPO) not in sys.path:  # bench/ is a script folder, not an installed package
    sys.path.insert(0, str(_REPO))

from bench.kv_layerwise import overlap  # noqa: E402
from prefixcache.client import PrefixCacheClient  # noqa: E402
from prefixcache.integrations.vllm.attn_backends import BackendInfo  # noqa: E402
from prefixcache.integrations.vllm.config import ConnectorConfig  # noqa: E402
from prefixcache.integrations.vllm.meta import LoadOp, StepMeta  # noqa: E402
from prefixcache.integrations.vllm.worker import WorkerCore  # noqa: E402
from prefixcache.server.config import ModelConfig, PoolConfig  # noqa: E402

pytestmark = pytest.mark.gpu

LAYERS, HEADS, DIM, BLOCK, TOKENS = 8, 4, 128, 16, 2048  # 32 MiB of KV in the pool
MODEL = ModelConfig(
    name="g",
    page_size=BLOCK,
    pool=PoolConfig(
        size=TOKENS + 4 * BLOCK, layers=LAYERS, k_heads=HEADS, k_head_dim=DIM, dtype="bfloat16"
    ),
)
BACKEND = BackendInfo("vllm.v1.attention.backends.flash_attn.FlashAttentionBackend", DIM)
NUM_BLOCKS = 2 * TOKENS // BLOCK


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    free = shutil.disk_usage("/dev/shm").free
    if free < 96 << 20:
        pytest.skip(f"/dev/shm has {free >> 20} MiB free; the pool needs 32 MiB and room")
    with running(tmp_path_factory.mktemp("layerwise"), [MODEL]) as srv:
        yield srv


@pytest.fixture(scope="module")
def load(served: ServerThread) -> Iterator[LoadOp]:
    """A load of TOKENS random tokens from the pool into scattered blocks."""
    with PrefixCacheClient(served.address, timeout=30) as client:
        session = client.session(120, name="layerwise")
        alloc = client.alloc("g", TOKENS, session=session)
        slots = array("q", alloc.slots)
        pool = client.attach_pool("g")
        index = torch.frombuffer(slots, dtype=torch.int64)
        for buf in (*pool.k_buffer, *pool.v_buffer):
            raw = torch.randint(0, 256, (TOKENS, HEADS, 2 * DIM), dtype=torch.uint8)
            buf.view(torch.uint8).index_copy_(0, index, raw)
        pool.close()
        gen = torch.Generator().manual_seed(1)
        ids = torch.randperm(NUM_BLOCKS, generator=gen)[: TOKENS // BLOCK].tolist()
        yield LoadOp("r", array("q", ids), 0, TOKENS, slots, alloc.server_epoch, session.session_id)
        session.close()


def engine(served: ServerThread, layerwise: bool) -> tuple[WorkerCore, dict[str, Any]]:
    """A worker core with vLLM 0.32 FlashAttention caches on the GPU (zeros)."""
    config = ConnectorConfig(
        model="g",
        target=served.address,
        transfer="attach",
        verify_loads=False,
        layerwise_load=layerwise,
    )
    worker = WorkerCore(config, BLOCK)
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.zeros(
            NUM_BLOCKS, HEADS, BLOCK, 2 * DIM, dtype=torch.bfloat16, device="cuda"
        )
        for i in range(LAYERS)
    }
    worker.register(caches, BACKEND)
    return worker, caches


def test_layerwise_loads_equal_whole_loads_layer_by_layer(
    served: ServerThread, load: LoadOp
) -> None:
    whole, want = engine(served, False)
    by_layer, got = engine(served, True)
    try:
        whole.start_step(StepMeta([load]))
        torch.cuda.synchronize()
        assert whole.take_load_errors() == set() and whole.loaded_tokens == TOKENS
        by_layer.start_step(StepMeta([load]))
        seen = {}
        for name, cache in got.items():
            assert by_layer.wait_layer(name)
            seen[name] = cache.clone()  # on the engine's stream, right after its wait
        by_layer.end_step()
        torch.cuda.synchronize()
        assert by_layer.take_load_errors() == set() and by_layer.loaded_tokens == TOKENS
        assert by_layer.issued_layers == list(got)
        access = by_layer._access
        assert access is not None and access.mapped
        assert access.pool.k_buffer[0].is_pinned(), "the host pool was not pinned"
        for name in got:
            assert torch.equal(want[name].view(torch.int16), got[name].view(torch.int16))
            assert torch.equal(want[name].view(torch.int16), seen[name].view(torch.int16)), (
                f"{name}: not all there when its wait returned"
            )
        assert all(t.view(torch.int16).ne(0).any() for t in want.values())  # loaded
    finally:
        whole.close()
        by_layer.close()


def test_layerwise_loads_overlap_the_forward(
    served: ServerThread, load: LoadOp, capsys: pytest.CaptureFixture[str]
) -> None:
    whole, _ = engine(served, False)
    by_layer, _ = engine(served, True)
    try:
        report = overlap(whole, by_layer, StepMeta([load]))
        assert by_layer.failed_loads == whole.failed_loads == 0
        nbytes = TOKENS * LAYERS * 2 * HEADS * DIM * 2
        report.update(
            bytes=nbytes,
            load_gb_per_s=nbytes / report["load_s"] / 1e9,
            device=torch.cuda.get_device_name(),
        )
        with capsys.disabled():
            print("\nlayer-wise overlap:", json.dumps(report))
        out = os.environ.get("PREFIXCACHE_GPU_REPORT")
        if out:
            Path(out).write_text(json.dumps(report, indent=1) + "\n")
    finally:
        whole.close()
        by_layer.close()
