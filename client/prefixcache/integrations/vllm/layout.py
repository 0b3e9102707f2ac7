"""vLLM's per-layer KV tensors as K and V block views, and copies between them and pool
rows.

vLLM has changed the logical shape of a layer's KV cache across versions and backends:

- ``kv_first``: ``[2, num_blocks, block_size, heads, head_dim]`` (FlashAttention up to
  the 0.2x releases; the HND stride order is a physical detail under this shape);
- ``blocks_first``: ``[num_blocks, 2, block_size, heads, head_dim]`` (FlashInfer, ROCm);
- ``bhn2d``: ``[num_blocks, heads, block_size, 2 * head_dim]``, K then V in the last
  dimension (the standardised per-layer view of vLLM 0.33);
- ``mla``: ``[num_blocks, block_size, head_size]``, MLA's one latent cache (the
  compressed KV and the rope key, e.g. 512 + 64), no V.

Each becomes views of shape ``[num_blocks, block_size, heads, head_dim]`` over the same
memory (K and V; MLA's latent as K with one head and no V), so one copy routine serves
them all. The attention kernel's block may be smaller than vLLM's (a "kernel block"): a
vLLM block ``b`` is then kernel blocks ``b * r .. b * r + r - 1``. torch is imported
inside the functions only.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class LayerView:
    """One attention layer of vLLM's cache: K and V as ``[blocks, block, heads, dim]``
    (an MLA layer: its latent as K, ``heads`` 1, and ``v`` None)."""

    name: str
    k: Any
    v: Any | None
    layout: str

    @property
    def mla(self) -> bool:
        return self.v is None

    @property
    def kernel_block_size(self) -> int:
        return int(self.k.shape[1])

    @property
    def heads(self) -> int:
        return int(self.k.shape[2])

    @property
    def head_dim(self) -> int:
        return int(self.k.shape[3])


def split_kv(name: str, tensor: Any, head_dim: int | None = None,
             layout: str = "auto") -> LayerView:
    """K and V views of one layer's cache tensor (see the module docstring).

    ``head_dim`` tells the layouts apart where shapes alone could not (a 4-D tensor's
    last dimension is ``2 * head_dim``); ``layout`` forces one.

    Raises:
        ValueError: the shape fits no known layout.
    """
    shape = tuple(int(d) for d in tensor.shape)
    candidates = ("kv_first", "blocks_first", "bhn2d", "mla") if layout == "auto" \
        else (layout,)
    for kind in candidates:
        if kind == "mla" and len(shape) == 3:
            # The only 3-D layout: a view with one head, the same memory.
            return _checked(name, tensor.unsqueeze(2), None, kind, head_dim)
        if kind == "kv_first" and len(shape) == 5 and shape[0] == 2:
            return _checked(name, tensor[0], tensor[1], kind, head_dim)
        if kind == "blocks_first" and len(shape) == 5 and shape[1] == 2:
            return _checked(name, tensor[:, 0], tensor[:, 1], kind, head_dim)
        if kind == "bhn2d" and len(shape) == 4 and shape[3] % 2 == 0 and (
                head_dim is None or shape[3] == 2 * head_dim):
            half = shape[3] // 2
            x = tensor.transpose(1, 2)
            return _checked(name, x[..., :half], x[..., half:], kind, head_dim)
    raise ValueError(f"KV cache of layer {name!r} has shape {list(shape)}, which is no "
                     f"known layout ({layout}); prefixcache knows [2, blocks, block, "
                     "heads, dim], [blocks, 2, block, heads, dim], [blocks, heads, block, "
                     "2 * dim] and MLA's [blocks, block, head_size]")


def _checked(name: str, k: Any, v: Any | None, kind: str,
             head_dim: int | None) -> LayerView:
    if head_dim is not None and int(k.shape[-1]) != head_dim:
        raise ValueError(f"KV cache of layer {name!r} ({kind}) has head_dim "
                         f"{int(k.shape[-1])}, the pool {head_dim}")
    return LayerView(name, k, v, kind)


def unique_layers(kv_caches: dict[str, Any]) -> list[tuple[str, Any]]:
    """The layers in vLLM's order, once per tensor: layers that share a cache (KV
    sharing across layers) hold one pool layer between them."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    out = []
    for name, tensor in kv_caches.items():
        key = (int(tensor.data_ptr()), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        out.append((name, tensor))
    return out


def block_positions(block_ids: array, start: int, num_tokens: int, block_size: int,
                    kernel_block_size: int, device: Any = None) -> tuple[Any, Any]:
    """Kernel block and offset of tokens ``start .. start + num_tokens`` of a request
    whose vLLM blocks are ``block_ids``, as two int64 tensors.

    Raises:
        ValueError: the blocks do not cover the tokens, or the kernel block does not
            divide vLLM's block.
    """
    import torch

    if block_size % kernel_block_size:
        raise ValueError(f"kernel block size {kernel_block_size} does not divide the "
                         f"block size {block_size}")
    end = start + num_tokens
    if start < 0 or end > len(block_ids) * block_size:
        raise ValueError(f"tokens {start}..{end} are not covered by "
                         f"{len(block_ids)} blocks of {block_size}")
    ratio = block_size // kernel_block_size
    pos = torch.arange(start, end, dtype=torch.int64)
    blocks = torch.frombuffer(block_ids, dtype=torch.int64) if len(block_ids) else \
        torch.empty(0, dtype=torch.int64)
    within = pos % block_size
    kernel = blocks[pos // block_size] * ratio + within // kernel_block_size
    return kernel.to(device), (within % kernel_block_size).to(device)


def byte_view(tensor: Any) -> Any:
    """One-byte element types (fp8) as uint8, so that gathers and scatters copy bytes
    even where torch has no indexing kernel for the type."""
    import torch

    if tensor.element_size() == 1 and tensor.dtype not in (torch.uint8, torch.int8):
        return tensor.view(torch.uint8)
    return tensor


def gather_blocks(view: Any, blocks: Any, offsets: Any) -> Any:
    """Rows ``[n, heads, dim]`` of a block view at (kernel block, offset) pairs."""
    return byte_view(view)[blocks, offsets]


def scatter_blocks(view: Any, blocks: Any, offsets: Any, rows: Any) -> None:
    """Write rows ``[n, heads, dim]`` into a block view at (kernel block, offset)."""
    target = byte_view(view)
    # Only a host-to-device copy may be asynchronous: it is ordered on the stream
    # before the forward that reads it. A copy to the host must be complete on return.
    target[blocks, offsets] = byte_view(rows).to(target.device, non_blocking=target.is_cuda)
