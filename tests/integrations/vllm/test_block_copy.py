"""block_copy: whole kernel blocks in one wide copy, partial blocks at the edges, against
the token-by-token copies of layout.py (the reference), for every layout, kernel blocks
smaller than vLLM's, unaligned starts and ends, fp8 bytes."""

from __future__ import annotations

from array import array

import pytest
import torch

from prefixcache.integrations.vllm.block_copy import (
    _destination_order,
    load_span,
    save_span,
    slot_run,
    spans,
    whole_blocks,
)
from prefixcache.integrations.vllm.layout import block_positions, gather_blocks, split_kv

HEADS, DIM, BLOCK = 2, 32, 16
SHAPES = {
    "kv_first": lambda n, kb: (2, n, kb, HEADS, DIM),
    "blocks_first": lambda n, kb: (n, 2, kb, HEADS, DIM),
    "bhn2d": lambda n, kb: (n, HEADS, kb, 2 * DIM),
    "cpu_vec": lambda n, kb: (n, HEADS, kb, 2 * DIM),
    "cpu_amx": lambda n, kb: (n, HEADS, kb, 2 * DIM),
    "mla": lambda n, kb: (n, kb, DIM),
}
# (start, tokens): aligned, unaligned start, unaligned end, inside one block, empty middle.
CASES = [(0, 64), (16, 48), (5, 60), (0, 37), (3, 9), (17, 14), (32, 1)]


def cache(layout: str, kernel_block: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    n = 12 * (BLOCK // kernel_block)
    shape = SHAPES[layout](n, kernel_block)
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), dtype=torch.uint8, generator=g
    )
    return raw.view(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("kernel_block", [16, 8])
@pytest.mark.parametrize("layout", list(SHAPES))
def test_spans_copy_what_the_token_copies_copy(
    layout: str, kernel_block: int, dtype: torch.dtype
) -> None:
    if layout == "cpu_amx" and (kernel_block % 16 or dtype.itemsize != 2):
        pytest.skip("AMX packs 16-bit types in tiles of 16 tokens")
    view = split_kv("l", cache(layout, kernel_block, dtype, 1), layout, DIM)
    sides = [view.k] + ([] if view.v is None else [view.v])
    block_ids = array("q", [7, 2, 9, 0, 4, 11])
    for start, count in CASES:
        parts = spans(block_ids, start, count, BLOCK, kernel_block)
        assert [(p.lo, p.hi) for p in parts] == sorted((p.lo, p.hi) for p in parts)
        assert sum(p.hi - p.lo for p in parts) == count
        assert sum(p.kernel is not None for p in parts) <= 1
        blocks, offsets = block_positions(block_ids, start, count, BLOCK, kernel_block)
        for side in sides:
            g = torch.Generator().manual_seed(start * 100 + count)
            heads = 1 if view.v is None else HEADS
            rows = torch.randint(
                0, 256, (count, heads, DIM * dtype.itemsize), dtype=torch.uint8, generator=g
            ).view(dtype)
            for part in parts:
                load_span(side, part, rows[part.lo : part.hi])
            got = gather_blocks(side, blocks, offsets)  # the reference, token by token
            assert torch.equal(got.view(torch.uint8), rows.view(torch.uint8))
            out = torch.zeros_like(rows)
            for part in parts:
                save_span(side, part, out[part.lo : part.hi])
            assert torch.equal(out.view(torch.uint8), rows.view(torch.uint8))


def test_whole_blocks_only_where_a_block_is_one_dimension() -> None:
    t = cache("cpu_amx", 16, torch.bfloat16, 0)
    assert whole_blocks(split_kv("l", t, "cpu_amx", DIM).k) is None
    for layout in ("kv_first", "bhn2d", "cpu_vec"):
        view = split_kv("l", cache(layout, 16, torch.bfloat16, 0), layout, DIM)
        assert tuple(whole_blocks(view.k).shape) == (12, 16, HEADS, DIM)


def test_save_into_rows_of_a_head_slice() -> None:
    """A tensor-parallel rank writes its heads only: the pool's rows are not contiguous
    there, and the copy still lands in them alone."""
    view = split_kv("l", cache("bhn2d", 16, torch.bfloat16, 3), "bhn2d", DIM)
    pool = torch.zeros(40, 2 * HEADS, DIM, dtype=torch.bfloat16)
    parts = spans(array("q", [3, 1]), 0, 32, BLOCK, 16)
    for part in parts:
        save_span(view.k, part, pool[part.lo : part.hi, HEADS:])
    blocks, offsets = block_positions(array("q", [3, 1]), 0, 32, BLOCK, 16)
    want = gather_blocks(view.k, blocks, offsets)
    assert torch.equal(pool[:32, HEADS:].contiguous().view(torch.uint8), want.view(torch.uint8))
    assert not pool[:, :HEADS].view(torch.uint8).any() and not pool[32:].view(torch.uint8).any()


def test_slot_run() -> None:
    assert slot_run(array("q", [5, 6, 7, 8])) == 5
    assert slot_run(array("q", [9])) == 9
    assert slot_run(array("q")) is None
    assert slot_run(array("q", [5, 7, 6, 8])) is None  # same span, not one run
    assert slot_run(array("q", [5, 6, 8, 9])) is None


def test_a_block_outside_the_cache_fails_the_copy() -> None:
    """The worker counts a ValueError as a failed load ("copy"), not a crash."""
    view = split_kv("l", cache("bhn2d", 16, torch.bfloat16, 4), "bhn2d", DIM)
    (span,) = spans(array("q", [40]), 0, 16, BLOCK, 16)
    with pytest.raises(ValueError, match="out of"):
        load_span(view.k, span, torch.zeros(16, HEADS, DIM, dtype=torch.bfloat16))


# vLLM 0.32's KVCacheLayout: stride permutations of the logical [layers, blocks, heads,
# block, content] cache (kv_cache_layout.py). Every layer is handed over as the logical
# [blocks, heads, block, content] view of one of them.
STRIDE_ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


@pytest.mark.parametrize("order", list(STRIDE_ORDERS))
def test_bhn2d_copies_follow_every_physical_stride_order(order: str) -> None:
    """A layer's bhn2d view in any of vLLM's physical orders (NHD and HND blocks,
    layers interleaved in a block): saves read and loads write each token's K/V where
    FlashAttention reads it (``kv_cache.transpose(1, 2).split(head_size, -1)``), and a
    load touches no other layer's bytes."""
    perm = STRIDE_ORDERS[order]
    logical = (3, 12, HEADS, BLOCK, 2 * DIM)
    g = torch.Generator().manual_seed(5)
    physical = torch.randn([logical[i] for i in perm], generator=g).to(torch.bfloat16)
    full = physical.permute(*[perm.index(i) for i in range(5)])
    before = full.clone()
    layer = full[1]
    view = split_kv("l", layer, "bhn2d", DIM)
    ref_k, ref_v = layer.transpose(1, 2).split(DIM, dim=-1)
    block_ids = array("q", [7, 2, 9, 0, 4, 11])
    for start, count in CASES:
        t = torch.arange(start, start + count)
        b, o = torch.tensor(block_ids)[t // BLOCK], t % BLOCK
        for side, ref in ((view.k, ref_k), (view.v, ref_v)):
            out = torch.empty(count, HEADS, DIM, dtype=torch.bfloat16)
            for span in spans(block_ids, start, count, BLOCK, BLOCK):
                save_span(side, span, out[span.lo : span.hi])
            assert torch.equal(out, ref[b, o]), (start, count)
            rows = torch.randn(count, HEADS, DIM, generator=g).to(torch.bfloat16)
            for span in spans(block_ids, start, count, BLOCK, BLOCK):
                load_span(side, span, rows[span.lo : span.hi])
            assert torch.equal(ref[b, o], rows), (start, count)
    assert torch.equal(full[0], before[0]) and torch.equal(full[2], before[2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("kernel_block", [16, 32, 64])
def test_transposed_blocks_load_in_the_destinations_order(
    kernel_block: int, dtype: torch.dtype
) -> None:
    """cpu_vec keeps K with tokens innermost: where a block's token run fills a cache
    line, the load walks the destination's order (_destination_order), and still puts
    every token where the token-by-token copy does; bhn2d and short runs keep the
    source's order."""
    n = 6
    t = torch.randint(
        0,
        256,
        (n, HEADS, kernel_block, 2 * DIM * dtype.itemsize),
        dtype=torch.uint8,
        generator=torch.Generator().manual_seed(5),
    ).view(dtype)
    view = split_kv("l", t, "cpu_vec", DIM)
    walks_destination = kernel_block * dtype.itemsize >= 64
    assert (_destination_order(whole_blocks(view.k)) is not None) == walks_destination
    assert _destination_order(whole_blocks(view.v)) is None
    bhn2d = split_kv("l", cache("bhn2d", 16, dtype, 0), "bhn2d", DIM)
    assert _destination_order(whole_blocks(bhn2d.k)) is None
    block_ids = array("q", [4, 1, 5])
    count = len(block_ids) * kernel_block
    (span,) = spans(block_ids, 0, count, kernel_block, kernel_block)
    assert span.kernel is not None  # whole blocks: the numpy path
    blocks, offsets = block_positions(block_ids, 0, count, kernel_block, kernel_block)
    before = t.clone()
    for side in (view.k, view.v):
        rows = torch.randint(
            0,
            256,
            (count, HEADS, DIM * dtype.itemsize),
            dtype=torch.uint8,
            generator=torch.Generator().manual_seed(kernel_block),
        ).view(dtype)
        load_span(side, span, rows)
        got = gather_blocks(side, blocks, offsets)
        assert torch.equal(got.view(torch.uint8), rows.view(torch.uint8))
    untouched = [b for b in range(n) if b not in block_ids]
    assert torch.equal(t[untouched].view(torch.uint8), before[untouched].view(torch.uint8))
