"""The CPU backend's KV layouts against vLLM's own cache-write op: K and V written by
``cpu_attn_reshape_and_cache`` (the op vLLM's CPU backend writes every token with, for
each kernel ISA it picks: vec, vec16, amx) are saved through the connector's worker into
a real pool, whose rows must be each token's K and V; loaded into an engine with blocks
twice as large, the bytes must be what the op itself writes there. And every backend the
layout table names is a class of the installed vLLM."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from harness import ServerThread
from integrations.vllm.vllm_support import (
    HEADS,
    LAYERS,
    make_scheduler,
    make_worker,
    shadow_holds,
)

from prefixcache.client import PrefixCacheClient
from prefixcache.integrations.vllm import attn_backends
from prefixcache.integrations.vllm.attn_backends import BackendInfo
from prefixcache.integrations.vllm.keys import RequestInfo

ops = pytest.importorskip("vllm._custom_ops", reason="needs the vllm package")
cpu_attn = pytest.importorskip(
    "vllm.v1.attention.backends.cpu_attn", reason="needs vLLM's CPU build"
)
if not hasattr(torch.ops._C, "cpu_attn_reshape_and_cache"):
    pytest.skip("needs vLLM's CPU build (cpu_attn_reshape_and_cache)", allow_module_level=True)

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("quiet")]

DIM, BLOCKS, TOKENS = 32, 8, 128
CPU = f"{cpu_attn.CPUAttentionBackend.__module__}.{cpu_attn.CPUAttentionBackend.__qualname__}"


def op_write(cache: Any, k: Any, v: Any, slots: Any, isa: str) -> None:
    """Write tokens into a ``[blocks, heads, block, 2 * dim]`` cache the way
    cpu_attn.py's do_kv_cache_update does."""
    num_blocks, num_kv_heads, block_size, _ = cache.size()
    key_cache, value_cache = cache.view((num_blocks, num_kv_heads, block_size * 2, -1)).chunk(
        2, dim=2
    )
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)


def kv(tokens: int, layer: int) -> tuple[Any, Any]:
    """The first ``tokens`` tokens' K and V of a layer (the same for any count)."""
    g = torch.Generator().manual_seed(1000 + layer)
    k = torch.randn(TOKENS, HEADS, DIM, generator=g).to(torch.bfloat16)
    v = torch.randn(TOKENS, HEADS, DIM, generator=g).to(torch.bfloat16)
    return k[:tokens], v[:tokens]


def slots_of(blocks: list[int], block: int, tokens: int) -> Any:
    t = torch.arange(tokens)
    return torch.tensor(blocks)[t // block] * block + t % block


def step(core: Any, worker: Any, finished: set[str] = frozenset()) -> Any:  # type: ignore[assignment]
    meta = core.build_meta()
    worker.start_step(meta)
    core.saves_failed(worker.take_failed_saves())
    core.sends_done(worker.finished_sends(set(finished)))
    core.backend.wait_idle(10.0)
    return meta


@pytest.mark.parametrize("isa", ["vec", "vec16", "amx"])
def test_the_cpu_backends_own_writes_reach_the_pool_per_token(
    server: ServerThread, client: PrefixCacheClient, isa: str
) -> None:
    block = 32
    tokens = list(range(500, 500 + 2 * block + 5))  # 2 whole blocks are saved
    n = 2 * block
    saver_blocks, loader_blocks = [3, 1, 6], [2, 5]
    core = make_scheduler(server.address, "cpu", block=block)
    worker = make_worker(server.address, "cpu", block=block, kv_layout="auto")
    loader_core = make_scheduler(server.address, "cpu", block=2 * block)
    loader = make_worker(server.address, "cpu", block=2 * block, kv_layout="auto")
    try:
        caches = {
            f"l{i}": torch.zeros(BLOCKS, HEADS, block, 2 * DIM, dtype=torch.bfloat16)
            for i in range(LAYERS)
        }
        for layer, cache in enumerate(caches.values()):
            op_write(
                cache, *kv(len(tokens), layer), slots_of(saver_blocks, block, len(tokens)), isa
            )
        worker.register(caches, BackendInfo(CPU, DIM, isa))
        assert core.finished(RequestInfo("A", tokens, len(tokens)), saver_blocks, len(tokens))
        for _ in range(3):
            step(core, worker, {"A"})
        slots = torch.tensor(list(client.match("cpu", tokens).slots), dtype=torch.int64)
        assert len(slots) == n
        pool = client.attach_pool("cpu")
        try:
            for layer in range(LAYERS):
                k, v = kv(n, layer)
                assert torch.equal(pool.k_buffer[layer][slots], k), f"layer {layer} K"
                assert torch.equal(pool.v_buffer[layer][slots], v), f"layer {layer} V"
        finally:
            pool.close()

        # Blocks of 64: what the op would have written there for the same tokens.
        loaded = {
            f"l{i}": torch.zeros(BLOCKS, HEADS, 2 * block, 2 * DIM, dtype=torch.bfloat16)
            for i in range(LAYERS)
        }
        loader.register(loaded, BackendInfo(CPU, DIM, isa))
        b = RequestInfo("B", tokens, len(tokens))
        shadow_holds(loader_core, tokens[:n])  # else the probe may be a fast miss
        assert loader_core.probe(b, 0) == (None, False)
        step(loader_core, loader)
        assert loader_core.probe(b, 0) == (n, False)
        loader_core.allocated("B", loader_blocks, n)
        step(loader_core, loader)
        assert loader.take_load_errors() == set()
        for layer, cache in enumerate(loaded.values()):
            want = torch.zeros_like(cache)
            op_write(want, *kv(n, layer), slots_of(loader_blocks, 2 * block, n), isa)
            assert torch.equal(cache[loader_blocks[0]], want[loader_blocks[0]])
        loader_core.finished(b, [], 0)
        step(loader_core, loader)
    finally:
        for c in (core, loader_core):
            c.close()
        for w in (worker, loader):
            w.close()


def test_every_backend_in_the_table_is_a_class_of_this_vllm() -> None:
    for name in attn_backends._TABLE:
        module, cls = name.rsplit(".", 1)
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin, module
        with open(spec.origin) as source:
            assert f"class {cls}(" in source.read(), name
