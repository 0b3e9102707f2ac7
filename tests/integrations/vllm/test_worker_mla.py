"""MLA through the connector's cores: vLLM's 3-D latent cache against an MLA pool (K
only), byte-exact through the mapped pool and through ReadKV / WriteKV, fp8 included
(vLLM allocates an fp8 cache as uint8); tensor-parallel ranks that all load and of
which rank 0 alone saves; a model and a pool of different kinds refused."""

from __future__ import annotations

import dataclasses
from array import array

import pytest
import torch
from harness import ServerThread
from integrations.vllm.test_worker import A_BLOCKS, B_BLOCKS, PROMPT, load_b, save_a
from integrations.vllm.vllm_support import (
    BLOCK,
    LATENT,
    backend_for,
    make_caches,
    make_scheduler,
    make_worker,
    token_rows,
)

from prefixcache.client import PrefixCacheClient
from prefixcache.integrations.vllm.config import ConnectorConfig
from prefixcache.integrations.vllm.layout import byte_view, split_kv
from prefixcache.integrations.vllm.meta import LoadOp, StepMeta

pytestmark = pytest.mark.usefixtures("quiet")


def latent_rows(caches: dict[str, torch.Tensor], block_ids: list[int]) -> list[torch.Tensor]:
    """Each layer's latent bytes of a request's first 16 tokens."""
    return [
        token_rows(split_kv(name, t, "mla", LATENT), block_ids, 16) for name, t in caches.items()
    ]


def assert_pool_holds(client: PrefixCacheClient, model: str, rows: list[torch.Tensor]) -> None:
    """The pool's rows of PROMPT's first 16 tokens are ``rows``, byte for byte."""
    slots = torch.tensor(list(client.match(model, PROMPT).slots), dtype=torch.int64)
    assert len(slots) == 16
    pool = client.attach_pool(model)
    try:
        assert pool.v_buffer == []
        for layer, want in enumerate(rows):
            got = byte_view(pool.k_buffer[layer][slots]).contiguous().view(torch.uint8)
            assert torch.equal(got, want[0])
    finally:
        pool.close()


@pytest.mark.parametrize("transfer", ["attach", "remote"])
@pytest.mark.parametrize(
    ("model", "dtype", "kernel_block"),
    [
        ("mla", "bfloat16", BLOCK),
        ("mla8", "float8_e4m3fn", 2),
        ("mla8", "uint8", BLOCK),  # vLLM's kv_cache_dtype fp8: the cache is uint8
    ],
)
def test_mla_round_trip_is_byte_exact(
    server: ServerThread,
    client: PrefixCacheClient,
    model: str,
    dtype: str,
    kernel_block: int,
    transfer: str,
) -> None:
    core = make_scheduler(server.address, model, transfer=transfer)
    worker = make_worker(server.address, model, transfer=transfer, kv_layout="auto")
    try:
        caches = make_caches("mla", kernel_block=kernel_block, dtype=dtype)
        worker.register(caches, backend_for("mla"))
        assert all(view.mla and view.layout == "mla" for view in worker.layers)
        saved = latent_rows(caches, A_BLOCKS)
        assert not any(
            torch.equal(a, b) for a, b in zip(saved, latent_rows(caches, B_BLOCKS), strict=True)
        )
        save_a(core, [worker])
        assert worker._access is not None and worker._access.mapped == (transfer == "attach")
        assert_pool_holds(client, model, saved)
        assert load_b(core, [worker]) == set()
        assert all(
            torch.equal(a, b) for a, b in zip(saved, latent_rows(caches, B_BLOCKS), strict=True)
        )
        assert worker.loaded_tokens == 16 and worker.saved_tokens == 16
        assert worker.failed_loads == worker.failed_saves == 0
    finally:
        core.close()
        worker.close()


@pytest.mark.parametrize("transfer", ["attach", "remote"])
def test_mla_ranks_all_load_and_rank_0_alone_saves(
    server: ServerThread, client: PrefixCacheClient, transfer: str
) -> None:
    core = make_scheduler(server.address, "mla", transfer=transfer)
    workers = [
        make_worker(server.address, "mla", tp_rank=r, tp_size=2, transfer=transfer, kv_layout="mla")
        for r in range(2)
    ]
    try:
        # Ranks hold the same latent in vLLM; here they differ, so that what the pool
        # got shows who wrote it. WriteKV writes whole rows: remote saves work at TP 2.
        caches = [make_caches("mla", dtype="bfloat16") for _ in workers]
        for worker, c in zip(workers, caches, strict=True):
            worker.register(c)
        saved = latent_rows(caches[0], A_BLOCKS)
        save_a(core, workers)
        assert_pool_holds(client, "mla", saved)
        assert load_b(core, workers) == set()
        for c in caches:  # every rank loaded rank 0's latent
            assert all(
                torch.equal(a, b) for a, b in zip(saved, latent_rows(c, B_BLOCKS), strict=True)
            )
        assert [w.loaded_tokens for w in workers] == [16, 16]
        assert [w.failed_saves for w in workers] == [0, 0]
    finally:
        core.close()
        for worker in workers:
            worker.close()


@pytest.mark.parametrize(
    ("model", "layout", "dtype", "why"),
    [
        ("v", "mla", "float16", "configure its pool with mla: true, k_heads: 1, k_head_dim: 12"),
        ("mla", "kv_first", "bfloat16", "is an MLA pool"),
        ("mla8", "mla", "float8_e5m2", "dtype"),
    ],
)
def test_a_model_and_pool_of_different_kinds_are_refused(
    server: ServerThread, client: PrefixCacheClient, model: str, layout: str, dtype: str, why: str
) -> None:
    core = make_scheduler(server.address, model)
    worker = make_worker(server.address, model, kv_layout=layout)
    try:
        kw = {"heads": 1} if layout == "kv_first" else {}
        worker.register(make_caches(layout, dtype=dtype, **kw))
        worker.start_step(
            StepMeta(
                [LoadOp("C", array("q", B_BLOCKS), 0, 4, array("q", range(1, 5)), 1, "nobody")]
            )
        )
        assert worker.take_load_errors() == {B_BLOCKS[0]}
        assert why in (worker._disabled or "")
        save_a(core, [worker])  # the save fails, gives its slots back: nothing cached
        assert worker.failed_saves == 1
        assert client.match(model, PROMPT).prefix_len == 0
    finally:
        core.close()
        worker.close()


def test_a_latent_of_another_size_is_refused(server: ServerThread) -> None:
    worker = make_worker(server.address, "mla", kv_layout="auto")
    try:
        worker.register(
            {
                "l0": torch.zeros(8, BLOCK, LATENT + 4, dtype=torch.bfloat16),
                "l1": torch.zeros(8, BLOCK, LATENT + 4, dtype=torch.bfloat16),
            },
            dataclasses.replace(backend_for("mla"), head_size=LATENT + 4),
        )
        assert worker._pool() is None
        assert "k_head_dim: 16" in (worker._disabled or "")
    finally:
        worker.close()


def test_the_mla_layout_is_a_view_of_the_latent() -> None:
    latent = torch.zeros(4, BLOCK, LATENT)
    view = split_kv("l", latent, "mla", LATENT)
    assert view.mla and view.v is None and (view.heads, view.head_dim) == (1, LATENT)
    view.k[1, 2, 0, 0, 3, 0] = 7.0
    assert latent[1, 2, 3] == 7.0  # the same memory
    # vLLM 0.32's [blocks, 1, block, head_size] view: the same.
    flat = torch.zeros(4, 1, BLOCK, LATENT)
    split_kv("l", flat, "mla", LATENT).k[1, 2, 0, 0, 3, 0] = 7.0
    assert flat[1, 0, 2, 3] == 7.0
    with pytest.raises(ValueError, match="is not"):
        split_kv("l", torch.zeros(2, 4, BLOCK, 1, LATENT), "mla", LATENT)
    assert ConnectorConfig(model="m", kv_layout="mla").kv_layout == "mla"
