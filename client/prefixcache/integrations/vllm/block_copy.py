"""Copies between pool rows and vLLM's blocks in as few, as wide, copies as the layout
allows.

A request's tokens ``start .. end`` fall into up to three spans: a partial kernel block
at each edge, and the whole kernel blocks between them. The whole blocks move with one
``index_copy_`` (load) or one ``index_select`` into the pool's rows (save) per layer and
side, over all of the request's blocks; the edges with one indexing copy of their few
tokens (layout.py's ``scatter_blocks`` / ``gather_blocks``). When the pool slots are one
run (the allocator hands out whole pages, so they usually are) the pool side is a view
of the pool itself, and a layer's K or V moves in one copy, not two.

Each element is as wide as both sides allow: torch's index kernels copy element by
element, so a row of 128 bfloat16 values moves as 16 elements of 16 bytes rather than
128; loads on the CPU go through numpy, whose fancy assignment moves a head's whole row
at once. torch and numpy are imported inside the functions only.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefixcache.client.transfer.kv import wide_pair

from .layout import block_positions, byte_view, gather_blocks, scatter_blocks, to_device


@dataclass(frozen=True, slots=True)
class Span:
    """Tokens ``lo .. hi`` of a copy (indices into its slots and rows): whole kernel
    blocks ``kernel`` (one id each), or single tokens at ``(blocks, offsets)``."""

    lo: int
    hi: int
    kernel: Any = None
    blocks: Any = None
    offsets: Any = None


def spans(
    block_ids: array,
    start: int,
    num_tokens: int,
    block_size: int,
    kernel_block_size: int,
    device: Any = None,
) -> list[Span]:
    """The spans of tokens ``start .. start + num_tokens`` of a request whose vLLM
    blocks are ``block_ids`` (see the module docstring).

    Raises:
        ValueError: as ``block_positions``.
    """
    import torch

    kb = kernel_block_size
    end = start + num_tokens
    first = min(-(-start // kb) * kb, end)  # the first whole kernel block's first token
    last = max(end // kb * kb, first)
    out = []
    for lo, hi in ((start, first), (last, end)):
        if hi > lo:
            blocks, offsets = block_positions(block_ids, lo, hi - lo, block_size, kb, device)
            out.append(Span(lo - start, hi - start, blocks=blocks, offsets=offsets))
    if last > first:
        # One id per whole kernel block, from the first token of each.
        if block_size % kb:
            raise ValueError(f"kernel block size {kb} does not divide the block size {block_size}")
        if last > len(block_ids) * block_size:
            raise ValueError(
                f"tokens {start}..{end} are not covered by {len(block_ids)} blocks of {block_size}"
            )
        pos = torch.arange(first, last, kb, dtype=torch.int64)
        ids = torch.frombuffer(block_ids, dtype=torch.int64)
        kernel = ids[pos // block_size] * (block_size // kb) + (pos % block_size) // kb
        out.insert(
            1 if start < first else 0, Span(first - start, last - start, to_device(kernel, device))
        )
    return out


def whole_blocks(view: Any) -> Any | None:
    """A six-dimensional layer view (layout.py) as ``[kernel blocks, block, heads, dim]``,
    or None where a block's tokens or a head's dims are not one dimension each."""
    if int(view.shape[2]) != 1 or int(view.shape[5]) != 1:
        return None
    return view[:, :, 0, :, :, 0]


def _wide(a: Any, b: Any) -> tuple[Any, Any]:
    return wide_pair(byte_view(a), byte_view(b))


def load_span(view: Any, span: Span, rows: Any) -> None:
    """Write ``rows`` (``[hi - lo, heads, dim]``, a view of the pool's rows or a copy of
    them) into ``span`` of a layer view."""
    if span.kernel is None:
        scatter_blocks(view, span.blocks, span.offsets, rows)
        return
    blocks = whole_blocks(view)
    if blocks is None:
        kernel_block = int(view.shape[1]) * int(view.shape[2])
        scatter_blocks(view, *_tokens(span, kernel_block, view.device), rows)
        return
    kb = int(view.shape[1])
    src = rows.to(blocks.device, non_blocking=blocks.is_cuda)
    src = src.reshape(-1, kb, *src.shape[1:])
    if not blocks.is_cuda and _numpy_load(blocks, span.kernel, src):
        return
    dst, src = _wide(blocks, src)
    dst.index_copy_(0, span.kernel, src)


def _numpy_load(blocks: Any, kernel: Any, src: Any) -> bool:
    """``blocks[kernel] = src`` on the CPU through numpy, whose fancy assignment copies
    each element with one move: a head's whole row (its dims) where both sides have
    them contiguous, else one value. torch's index_copy_ runs at about half its speed
    here (profiled on the CPU backend). False where numpy cannot view the tensors."""
    import numpy as np
    import torch

    try:
        if blocks.stride(-1) == 1 and src.stride(-1) == 1:
            width = int(blocks.shape[-1]) * blocks.element_size()
            row = np.dtype((np.void, width))
            dst_np = blocks.view(torch.uint8).numpy().view(row)[..., 0]
            src_np = src.view(torch.uint8).numpy().view(row)[..., 0]
        else:
            same = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
            kind = same.get(blocks.element_size())
            if kind is None or src.element_size() != blocks.element_size():
                return False
            dst_np, src_np = blocks.view(kind).numpy(), src.view(kind).numpy()
            order = _destination_order(blocks)
            if order is not None:
                dst_np, src_np = dst_np.transpose(order), src_np.transpose(order)
    except (RuntimeError, TypeError, ValueError):  # a view numpy or torch cannot take
        return False
    try:
        dst_np[kernel.numpy()] = src_np
    except IndexError as err:  # a block vLLM's cache does not have: the load fails
        raise ValueError(f"block out of range: {err}") from None
    return True


def _destination_order(blocks: Any) -> list[int] | None:
    """The dims of ``blocks`` (after the block index) in their memory order, where its
    runs of consecutive elements fill a cache line (64 bytes) or more; else None.

    An element-wise copy walks the source's order: into a layout whose contiguous dim
    is not the last (the CPU backend's transposed K), each element then lands on
    another cache line. Walking the destination's order writes whole lines instead; the
    reads stride. Measured (bf16, 8 heads of 128): blocks of 32-128 tokens
    1.5-2.5x faster, 16 (32-byte runs) 0.8x, hence the 64-byte bar.
    """
    strides = blocks.stride()
    inner = [d for d in range(1, blocks.dim()) if strides[d] == 1 and blocks.shape[d] > 1]
    if not inner or inner[0] == blocks.dim() - 1:
        return None
    if int(blocks.shape[inner[0]]) * blocks.element_size() < 64:
        return None
    return [0, *sorted(range(1, blocks.dim()), key=lambda d: -strides[d])]


def save_span(view: Any, span: Span, out: Any) -> None:
    """Copy ``span`` of a layer view into ``out`` (``[hi - lo, heads, dim]``: the pool's
    own rows, written in place)."""
    import torch

    blocks = whole_blocks(view) if span.kernel is not None else None
    if blocks is None:
        kernel_block = int(view.shape[1]) * int(view.shape[2])
        where = (
            (span.blocks, span.offsets)
            if span.kernel is None
            else _tokens(span, kernel_block, view.device)
        )
        rows = gather_blocks(view, *where)
        # Straight into the pool's rows, also from a GPU: a copy through a fresh host
        # tensor first (``.to``) went through pageable memory at a fifteenth of the speed.
        byte_view(out).copy_(rows.reshape(byte_view(out).shape))
        return
    kb = int(view.shape[1])
    target = out.view(-1, kb, *out.shape[1:]) if out.is_contiguous() else None
    if target is not None and target.device == blocks.device:
        src, dst = _wide(blocks, target)
        torch.index_select(src, 0, span.kernel, out=dst)
        return
    rows = byte_view(blocks).index_select(0, span.kernel)
    byte_view(out).copy_(rows.reshape(byte_view(out).shape))


def _tokens(span: Span, kernel_block: int, device: Any) -> tuple[Any, Any]:
    """A whole-block span's (kernel block, offset) of each token."""
    import torch

    n = span.hi - span.lo
    pos = torch.arange(n, device=span.kernel.device)
    return (span.kernel[pos // kernel_block].to(device), (pos % kernel_block).to(device))


def slot_run(slots: array) -> int | None:
    """The first slot when ``slots`` are consecutive (one run of the pool), else None."""
    import numpy as np

    if not len(slots):
        return None
    values = np.frombuffer(slots, dtype=np.int64)
    first = int(values[0])
    if int(values[-1]) - first != len(values) - 1:
        return None
    return first if bool((np.diff(values) == 1).all()) else None


SpanMemo = dict[tuple[int, str], list[Span]]


def view_spans(
    view: Any, block_ids: array, start: int, count: int, block_size: int, memo: SpanMemo
) -> list[Span]:
    """``spans`` of one copy in ``view``'s kernel blocks: the same for every layer of one
    kernel block size and device, so ``memo`` (one per copy) keeps them."""
    key = (view.kernel_block_size, str(view.k.device))
    found = memo.get(key)
    if found is None:
        found = memo[key] = spans(
            block_ids, start, count, block_size, view.kernel_block_size, view.k.device
        )
    return found


def save_rows(
    layers: list[Any], tables: tuple[array, ...], start: int, count: int, block_size: int
) -> tuple[Callable[[int], tuple[Any, Any | None]], Callable[[int, Any, Any | None], None]]:
    """A save's two ways to the pool's rows of tokens ``start ..`` (``count`` of them):
    ``source(layer)``, the rows gathered token by token (for slots that are not one
    run), and ``fill(layer, k, v)``, which copies each span of whole kernel blocks
    straight into the pool's rows ``k``/``v`` (slots that are one run). Each layer
    reads the block table of its KV cache group (``tables[view.group]``)."""
    positions: dict[int, tuple[Any, Any]] = {}
    memos: dict[int, SpanMemo] = {}

    def source(layer: int) -> tuple[Any, Any | None]:
        view = layers[layer]
        if layer not in positions:
            positions[layer] = block_positions(
                tables[view.group], start, count, block_size, view.kernel_block_size, view.k.device
            )
        blocks, offsets = positions[layer]
        k = gather_blocks(view.k, blocks, offsets)
        return k, None if view.v is None else gather_blocks(view.v, blocks, offsets)

    def fill(layer: int, k: Any, v: Any | None) -> None:
        view = layers[layer]
        memo = memos.setdefault(view.group, {})
        for span in view_spans(view, tables[view.group], start, count, block_size, memo):
            save_span(view.k, span, k[span.lo : span.hi])
            if view.v is not None and v is not None:
                save_span(view.v, span, v[span.lo : span.hi])

    return source, fill
