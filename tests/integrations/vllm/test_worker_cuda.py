"""The GPU path: vLLM's blocks on a GPU, the pool on a GPU mapped through CUDA IPC,
device-to-device copies (whole, and layer-wise on the connector's stream),
round-tripping byte-exact (skipped without a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import serve_process
from integrations.vllm.test_worker import A_BLOCKS, B_BLOCKS, load_b, save_a
from integrations.vllm.vllm_support import (
    DIM,
    backend_for,
    make_caches,
    make_scheduler,
    make_worker,
    token_rows,
)

from prefixcache.integrations.vllm.layout import split_kv

pytestmark = pytest.mark.gpu

CONFIG = """
server: {change_log_capacity: 4096}
models:
  - name: v
    page_size: 2
    pool: {size: 256, layers: 2, k_heads: 2, k_head_dim: 8, device: "cuda:0"}
"""


@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("transfer", ["attach", "remote"])
def test_cuda_round_trip(tmp_path: Path, transfer: str, layerwise: bool) -> None:
    # CUDA IPC handles cannot be opened by the process that made them: the server runs
    # in a child process.
    with serve_process(tmp_path, CONFIG) as (_, address):
        core = make_scheduler(address, transfer=transfer)
        worker = make_worker(address, transfer=transfer, kv_layout="auto", layerwise_load=layerwise)
        try:
            caches = {n: t.cuda() for n, t in make_caches("bhn2d").items()}
            worker.register(caches, backend_for("bhn2d"))  # FlashAttention, vLLM 0.32
            save_a(core, [worker])
            assert load_b(core, [worker]) == set()
            if transfer == "attach":
                assert worker._access is not None and worker._access.mapped
            torch.cuda.synchronize()
            views = [split_kv(n, t.cpu(), "bhn2d", DIM) for n, t in caches.items()]
            assert all(
                torch.equal(token_rows(v, A_BLOCKS, 16), token_rows(v, B_BLOCKS, 16)) for v in views
            )
        finally:
            core.close()
            worker.close()
