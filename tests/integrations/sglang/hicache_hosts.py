"""Host pools built the way SGLang builds them (its buffer shapes per
``--hicache-mem-layout``), on the CPU, and a backend core as SGLang would make one."""

from __future__ import annotations

from typing import Any

import torch

from prefixcache.integrations.sglang import HiCacheCore, HostLayout, Ranks, Settings
from prefixcache.server.config import MambaConfig, ModelConfig, PoolConfig

PAGE = 4
LAYERS = 2
MHA = PoolConfig(size=256, layers=LAYERS, k_heads=2, k_head_dim=8, dtype="float16")
MLA = PoolConfig(
    size=256, layers=LAYERS, k_heads=1, k_head_dim=12, v_heads=1, v_head_dim=12, dtype="bfloat16"
)
MODELS = (
    ModelConfig(name="kv", page_size=PAGE, pool=MHA),
    ModelConfig(name="mla", page_size=PAGE, pool=MLA),
    ModelConfig(
        name="mamba-kind",
        kind="mamba",
        page_size=PAGE,
        pool=MHA,
        mamba=MambaConfig(
            state_slots=4,
            working_slots=2,
            layers=1,
            conv_state_shape=(2,),
            temporal_state_shape=(2,),
        ),
    ),
)
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


class HostPool:
    """A host pool with SGLang's attributes and buffer shapes (``init_kv_buffer``)."""

    def __init__(
        self,
        layout: str,
        pages: int = 16,
        *,
        mla: bool = False,
        heads: int = 2,
        dim: int = 8,
        dtype: torch.dtype = torch.float16,
        page_size: int = PAGE,
        layers: int = LAYERS,
        seed: int = 0,
    ) -> None:
        self.layout, self.page_size, self.page_num = layout, page_size, pages
        self.size = pages * page_size
        self.layer_num = layers
        p, n = page_size, self.size
        g = torch.Generator().manual_seed(seed)
        if mla:
            dims = {
                "layer_first": (layers, n, 1, dim),
                "page_first": (n, layers, 1, dim),
                "page_first_direct": (pages, layers, p, 1, dim),
            }[layout]
            self.kv_buffer = torch.randn(dims, generator=g).to(dtype)
            self.kv_lora_rank = dim - 4
            return
        dims = {
            "layer_first": (2, layers, n, heads, dim),
            "page_first": (2, n, layers, heads, dim),
            "page_first_direct": (2, pages, layers, p, heads, dim),
            "page_head": (2, pages, heads, p, layers, dim),
        }[layout]
        self.kv_buffer = torch.randn(dims, generator=g).to(dtype)

    @property
    def k_buffer(self) -> torch.Tensor:
        return self.kv_buffer[0]

    @property
    def v_buffer(self) -> torch.Tensor:
        return self.kv_buffer[1]

    @property
    def is_mla(self) -> bool:
        return hasattr(self, "kv_lora_rank")

    def row(self, part: str, layer: int, t: int) -> torch.Tensor:
        """Token ``t``'s row of one layer, indexed as SGLang's transfer kernels do."""
        p = self.page_size
        if self.is_mla:
            if part == "v":
                raise ValueError("MLA has no V")
            buf = self.kv_buffer
        else:
            buf = self.kv_buffer[0 if part == "k" else 1]
        return {
            "layer_first": lambda: buf[layer, t],
            "page_first": lambda: buf[t, layer],
            "page_first_direct": lambda: buf[t // p, layer, t % p],
            "page_head": lambda: buf[t // p, :, t % p, layer],
        }[self.layout]()

    def page_bytes(self, first: int) -> list[bytes]:
        """Every row of the page at host position ``first``, as bytes (to compare)."""
        parts = ("k",) if self.is_mla else ("k", "v")
        return [
            self.row(part, layer, first + i).contiguous().view(torch.uint8).numpy().tobytes()
            for layer in range(self.layer_num)
            for part in parts
            for i in range(self.page_size)
        ]

    def flat_page(self, first: int) -> torch.Tensor:
        """SGLang's ``get_data_page(first, flat=True)`` (a copy)."""
        p = self.page_size
        if self.is_mla:
            buf = self.kv_buffer
            page = {
                "layer_first": lambda: buf[:, first : first + p],
                "page_first": lambda: buf[first : first + p],
                "page_first_direct": lambda: buf[first // p : first // p + 1],
            }[self.layout]()
        else:
            buf = self.kv_buffer
            page = {
                "layer_first": lambda: buf[:, :, first : first + p],
                "page_first": lambda: buf[:, first : first + p],
                "page_first_direct": lambda: buf[:, first // p : first // p + 1],
                "page_head": lambda: buf[:, first // p : first // p + 1],
            }[self.layout]()
        return page.flatten().clone()

    def dummy_flat_page(self) -> torch.Tensor:
        return torch.zeros_like(self.flat_page(0))


class StatePool:
    """A host pool as SGLang's Mamba / SWA / indexer host pools show themselves to a
    storage backend: ``page_size`` positions a page, flat pages in and out."""

    def __init__(
        self,
        pages: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        *,
        page_size: int = 1,
        seed: int = 0,
    ) -> None:
        self.page_size, self.shape = page_size, shape
        g = torch.Generator().manual_seed(seed)
        count = pages * page_size * dtype.itemsize * int(torch.tensor(shape).prod())
        raw = torch.randint(0, 256, (count,), generator=g, dtype=torch.uint8)
        self.buf = raw.view(dtype).view(pages * page_size, *shape)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self.buf[index : index + self.page_size].flatten().clone()

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros_like(self.get_data_page(0))

    def set_from_flat_data_page(self, index: int, data: torch.Tensor) -> None:
        self.buf[index : index + self.page_size] = data.view(self.page_size, *self.shape)

    def page_bytes(self, index: int) -> bytes:
        return self.get_data_page(index).view(torch.uint8).numpy().tobytes()


def host_indices(pages: list[int], page_size: int = PAGE) -> torch.Tensor:
    """The host token positions of host pages ``pages``, as SGLang passes them."""
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in pages])


def make_core(
    address: str,
    pool: HostPool,
    *,
    model: str | None = None,
    transfer: str = "auto",
    ranks: Ranks | None = None,
    **extra: Any,
) -> HiCacheCore:
    """A backend core as SGLang would build it, with ``pool`` registered."""
    model = model or ("mla" if pool.is_mla else "kv")
    settings = Settings.parse(
        {"target": address, "model": model, "transfer": transfer, "timeout": 5, **extra},
        ranks or Ranks(is_mla=pool.is_mla),
    )
    core = HiCacheCore(settings)
    core.register_host_pool(HostLayout.of_pool(pool))
    return core
