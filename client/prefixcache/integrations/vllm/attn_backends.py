"""Which KV layout (``layout``) each of vLLM's attention backends reads: the connector
learns a layer's layout from the backend vLLM reports for it, never from the tensor's
shape (two backends read one shape differently).

Each entry was read from the backend's source in vLLM 0.32 (the code that splits the
cache into K and V, and the cache-write op it calls), keyed by the backend's class,
module included (``rocm_aiter_fa`` also calls itself ``FLASH_ATTN``). vLLM 0.32 hands
every backend's layer the logical view ``[blocks, heads, block, content]``; earlier
releases handed the backend's own ``get_kv_cache_shape``, five-dimensional for
FlashAttention, FlashInfer and Triton, and three-dimensional for MLA: the entry maps
the tensor's rank to the layout that release's backend reads. A backend, rank, kernel
ISA or content size not listed here is refused (the connector is disabled) rather than
guessed. The CPU layouts were checked against vLLM's own cache-write op
(``cpu_attn_reshape_and_cache``, every ISA it builds on x86) in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .layout import KNOWN_LAYOUTS, UnknownLayout

_V1 = "vllm.v1.attention.backends."

# Backend class -> {tensor rank: layout}. "cpu" is resolved by the kernel ISA below.
_TABLE: dict[str, dict[int, str]] = {
    # flash_attn.py: kv_cache.transpose(1, 2).split(self.head_size, dim=-1);
    # before 0.32 get_kv_cache_shape was (2, num_blocks, block_size, heads, head_size).
    _V1 + "flash_attn.FlashAttentionBackend": {4: "bhn2d", 5: "kv_first"},
    # flashinfer.py: kv_cache.permute(*stride_order).split(hs, dim=-1) (the permute
    # is the physical order, the logical view is the same); before 0.32
    # (num_blocks, 2, block_size, heads, head_size). NVFP4 caches do not fit bhn2d's
    # content size and are refused.
    _V1 + "flashinfer.FlashInferBackend": {4: "bhn2d", 5: "blocks_first"},
    # triton_attn.py: kv_cache.transpose(1, 2).split(hs, dim=-1); per-token-head
    # quantized caches carry inline scales (another content size: refused).
    _V1 + "triton_attn.TritonAttentionBackend": {4: "bhn2d", 5: "blocks_first"},
    # cpu_attn.py: view(num_blocks, num_kv_heads, block_size * 2, -1).chunk(2, dim=2),
    # the K half packed by the kernel ISA (see _CPU_ISA).
    _V1 + "cpu_attn.CPUAttentionBackend": {4: "cpu"},
}
# MLA backends: one latent per token, [blocks, 1, block, head_size] in 0.32
# (mla_attention.py: bind_kv_cache squeezes dim 1; concat_and_cache_mla, or the CPU
# backends' own writes, store token slot % block of block slot // block), and
# [blocks, block, head_size] before. Sparse and fp8_ds_mla caches are not listed.
for _cls in (
    "mla.flashmla.FlashMLABackend",
    "mla.flashattn_mla.FlashAttnMLABackend",
    "mla.cutlass_mla.CutlassMLABackend",
    "mla.triton_mla.TritonMLABackend",
    "mla.flashinfer_mla.FlashInferMLABackend",
    "mla.cpu_mla.CPUMLABackend",
    "mla.amx_mla.AMXMLABackend",
):
    _TABLE[_V1 + _cls] = {4: "mla", 3: "mla"}

# The CPU backend's kernel ISA (the layer's ``isa``, cpu_attn.py _get_attn_isa) ->
# layout, for caches of 2- or 4-byte types; "amx" only with 2-byte types. NEON,
# RVV, VXE, VSX and fp8 caches are not checked here: refused.
_CPU_ISA = {"vec": "cpu_vec", "vec16": "cpu_vec", "amx": "cpu_amx"}


@dataclass(frozen=True, slots=True)
class BackendInfo:
    """What the adapter reports of one layer's attention backend.

    Attributes:
        cls_name: the backend class, ``module.QualName``.
        head_size: the layer's K head size (MLA: the latent's size).
        isa: the CPU backend's kernel ISA for the layer, None elsewhere.
    """

    cls_name: str
    head_size: int
    isa: str | None = None


def layout_for(info: BackendInfo | None, tensor: Any, override: str = "auto") -> str:
    """The layout of a layer's cache ``tensor`` read by the backend ``info``, or the
    ``override`` named in the settings.

    Raises:
        UnknownLayout: no layout is known for this backend (with why).
    """
    if override != "auto":
        if override not in KNOWN_LAYOUTS:
            raise UnknownLayout(f"kv_layout {override!r} is not one of {', '.join(KNOWN_LAYOUTS)}")
        return override
    if info is None:
        raise UnknownLayout(
            "vLLM did not report the layer's attention backend; set kv_layout to the layout it uses"
        )
    by_rank = _TABLE.get(info.cls_name)
    if by_rank is None:
        raise UnknownLayout(
            f"attention backend {info.cls_name} is not one whose KV layout prefixcache knows"
        )
    layout = by_rank.get(int(tensor.dim()))
    if layout is None:
        raise UnknownLayout(
            f"attention backend {info.cls_name} with a "
            f"{tensor.dim()}-dimensional KV cache is not known"
        )
    if layout != "cpu":
        return layout
    size = int(tensor.element_size())
    cpu = _CPU_ISA.get(info.isa or "")
    if cpu is None or size == 1 or (cpu == "cpu_amx" and size != 2):
        raise UnknownLayout(
            f"the CPU backend's layout with ISA {info.isa!r} and {tensor.dtype} is not known"
        )
    return cpu
