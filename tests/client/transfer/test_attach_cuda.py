"""Pool attach of a CUDA pool through CUDA IPC handles (skipped without a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import serve_process

from prefixcache.client import PrefixCacheClient

pytestmark = pytest.mark.gpu

CONFIG = """
models:
  - name: g
    pool: {size: 256, layers: 2, k_heads: 2, k_head_dim: 8, device: "cuda:0"}
  - name: h
    kind: mamba
    pool: {size: 64, k_heads: 1, k_head_dim: 4, device: "cuda:0"}
    mamba: {state_slots: 4, layers: 1, conv_state_shape: [3, 2],
            temporal_state_shape: [2, 2, 2]}
"""


def test_cuda_pool_attach_across_processes(tmp_path: Path) -> None:
    # CUDA IPC handles cannot be opened by the process that made them: the server runs
    # in a child process.
    with (
        serve_process(tmp_path, CONFIG) as (_, address),
        PrefixCacheClient(address, timeout=10) as client,
    ):
        info = client.describe_pool("g")
        assert info.device == "cuda:0" and all(b.cuda and not b.shm_path for b in info.buffers)
        pool = client.attach_pool("g")
        assert pool.k_buffer[1].device.type == "cuda" and pool.k_buffer[1].shape == (257, 2, 8)
        with client.session(10) as s:
            slots = torch.tensor(list(s.alloc("g", 5).slots), device="cuda:0")
            k = torch.randn(5, 2, 8, device="cuda:0").half()
            pool.k_buffer[1][slots] = k
            pool.v_buffer[0][slots] = k * 3
            torch.cuda.synchronize()
            back = s.read_kv("g", slots.cpu())
            assert torch.equal(back.k[1], k.cpu()) and torch.equal(back.v[0], (k * 3).cpu())
            s.write_kv("g", slots.cpu(), [k * 2, k * 2], [k, k])
            assert torch.equal(pool.k_buffer[0][slots], k * 2)
            s.free("g", slots.cpu())

            mamba = client.attach_pool("h")
            got = s.alloc("h", 1, num_state_slots=1)
            state = torch.tensor(list(got.state_slots), device="cuda:0")
            mamba.temporal_state[0][state] = 7.0
            torch.cuda.synchronize()
            assert bool((s.read_kv("h", state_slots=got.state_slots).temporal[0] == 7).all())
            s.free("h", got.slots, state_slots=got.state_slots)
