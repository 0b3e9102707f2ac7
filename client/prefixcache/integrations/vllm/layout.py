"""vLLM's per-layer KV tensors as per-token K and V views, and copies between them and
pool rows (``[token, heads, dim]``, the pool's NHD layout).

A layer's tensor does not say how K and V lie in it: vLLM 0.32's CPU backend and its
FlashAttention backend both hand over ``[blocks, heads, block, 2 * head_dim]``, and
read it differently. So a layout is never guessed from a shape: ``attn_backends``
names it from the attention backend vLLM reports (or the ``kv_layout`` setting names
it), and the shape is only checked against it. The layouts:

- ``kv_first``: ``[2, blocks, block, heads, dim]`` (FlashAttention before 0.32);
- ``blocks_first``: ``[blocks, 2, block, heads, dim]`` (FlashInfer, Triton before 0.32);
- ``bhn2d``: ``[blocks, heads, block, 2 * dim]``, K then V in the last dimension
  (0.32's standard per-layer view, read by FlashAttention, FlashInfer and Triton as
  ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``);
- ``cpu_vec``: the same shape, read by the CPU backend (ISA ``vec`` / ``vec16``) as
  ``view(blocks, heads, 2 * block, dim).chunk(2, dim=2)``: per block and head, K
  transposed (``[dim, block]``), then V (``[block, dim]``);
- ``cpu_amx``: the same, read by the CPU backend's AMX kernels (16-bit types): K in
  tiles of 16 tokens, each in pairs of dims (``[block / 16, dim / 2, 16, 2]``), V in
  groups of 16 dims, each in pairs of tokens (``[dim / 16, block / 2, 16, 2]``);
- ``mla``: ``[blocks, 1, block, head_size]`` (0.32) or ``[blocks, block, head_size]``,
  MLA's one latent per token (the compressed KV and the rope key), no V.

Each becomes views of shape ``[blocks, t1, t2, heads, d1, d2]`` over the same memory:
token ``o`` of a block is ``(o // t2, o % t2)`` and a head's ``d1 * d2`` values are its
dims in order. One advanced-indexing copy per layer and side then moves a whole
request, whatever the layout (no loop over blocks). The attention kernel's block may
be smaller than vLLM's (a "kernel block"): vLLM block ``b`` is kernel blocks
``b * r .. b * r + r - 1``. torch is imported inside the functions only.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# Layouts ``kv_layout`` may name (``auto``: the attention backend's, see attn_backends).
KNOWN_LAYOUTS = ("kv_first", "blocks_first", "bhn2d", "cpu_vec", "cpu_amx", "mla")


class UnknownLayout(ValueError):
    """A layer's KV tensor does not fit the layout it should have (or no layout is
    known for it): the connector must not copy it."""


@dataclass(frozen=True, slots=True)
class LayerView:
    """One attention layer of vLLM's cache: K and V as ``[blocks, t1, t2, heads, d1,
    d2]`` views (see the module docstring; MLA: the latent as K, one head, no V)."""

    name: str
    k: Any
    v: Any | None
    layout: str
    group: int = 0  # the layer's KV cache group: which of a request's block tables

    @property
    def mla(self) -> bool:
        return self.v is None

    @property
    def kernel_block_size(self) -> int:
        return int(self.k.shape[1]) * int(self.k.shape[2])

    @property
    def heads(self) -> int:
        return int(self.k.shape[3])

    @property
    def head_dim(self) -> int:
        return int(self.k.shape[4]) * int(self.k.shape[5])

    @property
    def v_head_dim(self) -> int:
        return 0 if self.v is None else int(self.v.shape[4]) * int(self.v.shape[5])

    @property
    def dtype(self) -> Any:
        return self.k.dtype

    @property
    def device(self) -> Any:
        return self.k.device


def _std(x: Any) -> Any:
    """``[blocks, block, heads, dim]`` as the six-dimensional view."""
    return x.unsqueeze(2).unsqueeze(-1)


def _kv_first(t: Any, dim: int) -> tuple[Any, Any | None]:
    _need(t, 5, lambda: t.shape[0] == 2 and t.shape[4] == dim, "[2, blocks, block, heads, dim]")
    return _std(t[0]), _std(t[1])


def _blocks_first(t: Any, dim: int) -> tuple[Any, Any | None]:
    _need(t, 5, lambda: t.shape[1] == 2 and t.shape[4] == dim, "[blocks, 2, block, heads, dim]")
    return _std(t[:, 0]), _std(t[:, 1])


def _bhn2d(t: Any, dim: int) -> tuple[Any, Any | None]:
    _need(t, 4, lambda: t.shape[3] == 2 * dim, "[blocks, heads, block, 2 * dim]")
    x = t.transpose(1, 2)  # flash_attn.py: kv_cache.transpose(1, 2).split(head_size, -1)
    return _std(x[..., :dim]), _std(x[..., dim:])


def _cpu_halves(t: Any, dim: int) -> tuple[Any, Any, int, int, int]:
    _need(t, 4, lambda: t.shape[3] == 2 * dim, "[blocks, heads, block, 2 * dim]")
    blocks, heads, block, _ = (int(d) for d in t.shape)
    # cpu_attn.py: kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1)) then
    # chunk(2, dim=2): each (block, head) holds block * dim values of K, then of V.
    key, value = t.view(blocks, heads, 2 * block, dim).chunk(2, dim=2)
    return key, value, blocks, heads, block


def _cpu_vec(t: Any, dim: int) -> tuple[Any, Any | None]:
    key, value, blocks, heads, block = _cpu_halves(t, dim)
    # The vec / vec16 kernels store K transposed: value (dim i, token o) at i * block + o.
    k = key.view(blocks, heads, dim, block).permute(0, 3, 1, 2)
    return _std(k), _std(value.transpose(1, 2))


def _cpu_amx(t: Any, dim: int) -> tuple[Any, Any | None]:
    key, value, blocks, heads, block = _cpu_halves(t, dim)
    if t.element_size() != 2 or dim % 16 or block % 16:
        raise UnknownLayout(
            f"the CPU backend's AMX layout is known for 16-bit types, "
            f"dims and blocks in multiples of 16 only (got {t.dtype}, "
            f"dim {dim}, block {block})"
        )
    # K in tiles of 16 tokens, each in VNNI pairs of dims: (token 16T + u, dim 2p + j)
    # at ((T * dim / 2 + p) * 16 + u) * 2 + j.
    k = key.view(blocks, heads, block // 16, dim // 2, 16, 2).permute(0, 2, 4, 1, 3, 5)
    # V in groups of 16 dims, each in pairs of tokens: (token 2q + j, dim 16I + u) at
    # ((I * block / 2 + q) * 16 + u) * 2 + j.
    v = value.view(blocks, heads, dim // 16, block // 2, 16, 2).permute(0, 3, 5, 1, 2, 4)
    return k, v


def _mla(t: Any, dim: int) -> tuple[Any, Any | None]:
    if t.dim() == 4:  # [blocks, 1, block, head_size]: mla_attention.py squeezes dim 1
        _need(t, 4, lambda: t.shape[1] == 1 and t.shape[3] == dim, "[blocks, 1, block, head_size]")
        return _std(t.transpose(1, 2)), None
    _need(t, 3, lambda: t.shape[2] == dim, "[blocks, block, head_size]")
    return _std(t.unsqueeze(2)), None


_BUILDERS: dict[str, Callable[[Any, int], tuple[Any, Any | None]]] = {
    "kv_first": _kv_first,
    "blocks_first": _blocks_first,
    "bhn2d": _bhn2d,
    "cpu_vec": _cpu_vec,
    "cpu_amx": _cpu_amx,
    "mla": _mla,
}


def _need(t: Any, rank: int, ok: Callable[[], Any], shape: str) -> None:
    if t.dim() != rank or not ok():
        raise UnknownLayout(f"shape {list(t.shape)} is not {shape}")


def split_kv(name: str, tensor: Any, layout: str, head_dim: int) -> LayerView:
    """Per-token K and V views of one layer's cache tensor in ``layout``, whose K (MLA:
    latent) rows are ``head_dim`` wide.

    Raises:
        UnknownLayout: ``layout`` is not a known one, or the tensor does not fit it.
    """
    build = _BUILDERS.get(layout)
    if build is None:
        raise UnknownLayout(f"KV layout {layout!r} is not one of {', '.join(KNOWN_LAYOUTS)}")
    try:
        k, v = build(tensor, int(head_dim))
    except UnknownLayout as err:
        raise UnknownLayout(f"KV cache of layer {name!r} ({layout}): {err}") from None
    except RuntimeError as err:  # a view the tensor's strides do not allow
        raise UnknownLayout(
            f"KV cache of layer {name!r} ({layout}): shape "
            f"{list(tensor.shape)}, strides {list(tensor.stride())}: "
            f"{err}"
        ) from None
    return LayerView(name, k, v, layout)


def unique_layers(
    kv_caches: dict[str, Any], groups: Mapping[str, int] | None = None
) -> list[tuple[str, Any]]:
    """The layers in vLLM's order, once per tensor and KV cache group (``groups``: each
    layer's): layers of one group that share a cache (KV sharing across layers) hold
    one pool layer between them; layers of different groups that share a tensor (the
    hybrid manager's one buffer under a layer of each group) keep their KV in blocks of
    their own groups, one pool layer each."""
    numbers = layer_numbers(kv_caches, groups)
    seen: set[int] = set()
    out = []
    for name, tensor in kv_caches.items():
        if numbers[name] not in seen:
            seen.add(numbers[name])
            out.append((name, tensor))
    return out


def layer_numbers(
    kv_caches: dict[str, Any], groups: Mapping[str, int] | None = None
) -> dict[str, int]:
    """Every layer's name and the index of its cache in ``unique_layers``: layers of
    one group that share a cache share its index."""
    first: dict[tuple[int, tuple[int, ...], int], int] = {}
    out = {}
    for name, tensor in kv_caches.items():
        group = groups.get(name, 0) if groups else 0
        key = (int(tensor.data_ptr()), tuple(tensor.shape), group)
        out[name] = first.setdefault(key, len(first))
    return out


def block_positions(
    block_ids: array,
    start: int,
    num_tokens: int,
    block_size: int,
    kernel_block_size: int,
    device: Any = None,
) -> tuple[Any, Any]:
    """Kernel block and offset of tokens ``start .. start + num_tokens`` of a request
    whose vLLM blocks are ``block_ids``, as two int64 tensors. Each token goes to its
    own block and offset, whatever page or block sizes the pool was filled with.

    Raises:
        ValueError: the blocks do not cover the tokens, or the kernel block does not
            divide vLLM's block.
    """
    import torch

    if block_size % kernel_block_size:
        raise ValueError(
            f"kernel block size {kernel_block_size} does not divide the block size {block_size}"
        )
    end = start + num_tokens
    if start < 0 or end > len(block_ids) * block_size:
        raise ValueError(
            f"tokens {start}..{end} are not covered by {len(block_ids)} blocks of {block_size}"
        )
    ratio = block_size // kernel_block_size
    pos = torch.arange(start, end, dtype=torch.int64)
    blocks = (
        torch.frombuffer(block_ids, dtype=torch.int64)
        if len(block_ids)
        else torch.empty(0, dtype=torch.int64)
    )
    within = pos % block_size
    kernel = blocks[pos // block_size] * ratio + within // kernel_block_size
    return to_device(kernel, device), to_device(within % kernel_block_size, device)


def to_device(index: Any, device: Any) -> Any:
    """A host index tensor on ``device``; to a GPU through page-locked memory, so that
    the upload is queued on the current stream without the host waiting for the work
    queued before it (a pageable copy would)."""
    if device is None or not str(device).startswith("cuda"):
        return index.to(device)
    return index.pin_memory().to(device, non_blocking=True)


def byte_view(tensor: Any) -> Any:
    """One-byte element types (fp8) as uint8, so that gathers and scatters copy bytes
    even where torch has no indexing kernel for the type."""
    import torch

    if tensor.element_size() == 1 and tensor.dtype not in (torch.uint8, torch.int8):
        return tensor.view(torch.uint8)
    return tensor


def _index(view: Any, blocks: Any, offsets: Any) -> tuple[Any, Any, Any]:
    t2 = int(view.shape[2])
    if t2 == 1:
        return blocks, offsets, 0
    return blocks, offsets // t2, offsets % t2


def gather_blocks(view: Any, blocks: Any, offsets: Any) -> Any:
    """Rows ``[n, heads, dim]`` of a six-dimensional view at (kernel block, offset)
    pairs: one indexing copy."""
    rows = byte_view(view)[_index(view, blocks, offsets)]
    return rows.reshape(rows.shape[0], rows.shape[1], -1)


def scatter_blocks(view: Any, blocks: Any, offsets: Any, rows: Any) -> None:
    """Write rows ``[n, heads, dim]`` into a six-dimensional view at (kernel block,
    offset): one indexing copy."""
    target = byte_view(view)
    # Only a host-to-device copy may be asynchronous: it is ordered on the stream
    # before the forward that reads it. A copy to the host must be complete on return.
    src = byte_view(rows).to(target.device, non_blocking=target.is_cuda)
    target[_index(view, blocks, offsets)] = src.reshape(src.shape[0], src.shape[1], *view.shape[4:])
