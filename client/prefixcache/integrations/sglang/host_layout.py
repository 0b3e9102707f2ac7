"""SGLang's HiCache host pool, seen one page of one layer at a time.

SGLang keeps the host (L2) copy of the KV in one of several layouts
(``--hicache-mem-layout``); per component (K, V, or the MLA latent) the buffer is:

==================  ====================================  =============================
layout              buffer shape                          token ``t`` of layer ``l``
==================  ====================================  =============================
layer_first         ``[layers, size, heads, dim]``        ``[l, t]``
page_first          ``[size, layers, heads, dim]``        ``[t, l]``
page_first_direct   ``[pages, layers, page, heads, dim]`` ``[t // P, l, t % P]``
page_head           ``[pages, heads, page, layers, dim]`` ``[t // P, :, t % P, l]``
==================  ====================================  =============================

An MHA pool keeps K and V (``k_buffer``, ``v_buffer``); an MLA pool one latent buffer
(``kv_buffer``, heads = 1) and no V. ``page_view`` is one page of one layer as a
``[page, heads, dim]`` view, the row layout of the prefixcache pool, so a page moves
between the two pools as one block copy per layer.

A *flat page* (SGLang's ``get_data_page(flat=True)``, used by its non-zero-copy storage
path) is one page of the same layout, flattened: ``flat_page`` views it as a one-page
buffer, whose page starts at position 0.

torch is imported by the caller; this module only handles the tensors it is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
K, V = "k", "v"


@dataclass(frozen=True, slots=True)
class HostLayout:
    """One host pool's geometry and buffers (``v`` is None for MLA)."""

    layout: str
    page_size: int
    layer_num: int
    head_num: int
    head_dim: int
    v_head_num: int
    v_head_dim: int
    k: Any
    v: Any

    @property
    def is_mla(self) -> bool:
        return self.v is None

    @property
    def dtype(self) -> Any:
        return self.k.dtype

    @classmethod
    def of_pool(cls, pool: Any) -> HostLayout:
        """From an SGLang host pool (``MHATokenToKVPoolHost`` or ``MLATokenToKVPoolHost``,
        or anything with their attributes)."""
        layout = str(getattr(pool, "layout", ""))
        page_size = int(getattr(pool, "page_size", 0) or 0)
        if hasattr(pool, "kv_lora_rank"):  # MLA: one latent buffer, no V
            return cls.of_buffers(layout, page_size, pool.kv_buffer, None)
        return cls.of_buffers(layout, page_size, pool.k_buffer, pool.v_buffer)

    @classmethod
    def of_buffers(cls, layout: str, page_size: int, k: Any, v: Any) -> HostLayout:
        """From per-component buffers in one of ``LAYOUTS``.

        Raises:
            ValueError: an unsupported layout, or buffers of the wrong rank or shape.
        """
        if layout not in LAYOUTS:
            raise ValueError(
                f"HiCache host layout {layout!r} is not supported (supported: {', '.join(LAYOUTS)})"
            )
        if page_size < 1:
            raise ValueError(f"HiCache host pool page_size must be >= 1, got {page_size}")
        layers, heads, dim = _geometry(layout, page_size, k, "K")
        v_heads, v_dim = 0, 0
        if v is not None:
            v_layers, v_heads, v_dim = _geometry(layout, page_size, v, "V")
            if v_layers != layers:
                raise ValueError(f"HiCache host pool: K has {layers} layers, V {v_layers}")
        return cls(layout, page_size, layers, heads, dim, v_heads, v_dim, k, v)

    def flat_page(self, flat: Any) -> HostLayout:
        """A flat page of this pool (SGLang's ``get_data_page(flat=True)`` format) as a
        one-page buffer of the same layout: token positions ``0 .. page_size - 1``."""
        dims = self.page_dims(self.head_num, self.head_dim)
        if self.v is None:
            return HostLayout(
                self.layout,
                self.page_size,
                self.layer_num,
                self.head_num,
                self.head_dim,
                0,
                0,
                flat.view(*dims),
                None,
            )
        both = flat.view(2, *dims)
        return HostLayout(
            self.layout,
            self.page_size,
            self.layer_num,
            self.head_num,
            self.head_dim,
            self.v_head_num,
            self.v_head_dim,
            both[0],
            both[1],
        )

    def page_dims(self, heads: int, dim: int) -> tuple[int, ...]:
        """The shape of one page of one component in this layout."""
        p, lyr = self.page_size, self.layer_num
        return {
            "layer_first": (lyr, p, heads, dim),
            "page_first": (p, lyr, heads, dim),
            "page_first_direct": (1, lyr, p, heads, dim),
            "page_head": (1, heads, p, lyr, dim),
        }[self.layout]

    def page_view(self, part: str, layer: int, start: int) -> Any:
        """The ``[page_size, heads, dim]`` rows of ``layer`` of component ``part`` ("k"
        or "v") for the page whose first token position is ``start`` (a view: writing
        it writes the pool).

        Raises:
            ValueError: ``start`` is not where a page starts, or an MLA pool's V.
        """
        buf = self.k if part == K else self.v
        if buf is None:
            raise ValueError("an MLA host pool has no V buffer")
        size = self.page_size
        if start % size:
            raise ValueError(f"host position {start} does not start a page of {size}")
        if self.layout == "layer_first":
            return buf[layer, start : start + size]
        if self.layout == "page_first":
            return buf[start : start + size, layer]
        if self.layout == "page_first_direct":
            return buf[start // size, layer]
        return buf[start // size, :, :, layer].transpose(0, 1)  # page_head: [heads, page, dim]

    def pages_view(self, part: str, layer: int) -> Any | None:
        """Every page of ``layer`` of component ``part`` as ``[pages, page_size, heads,
        dim]`` (a view: page ``i`` starts at host position ``i * page_size``), so that a
        batch of pages moves with one indexing copy; None for an MLA pool's V, or a
        buffer whose size is not whole pages."""
        buf = self.k if part == K else self.v
        if buf is None:
            return None
        size = self.page_size
        if self.layout == "layer_first":
            rows = buf[layer]
        elif self.layout == "page_first":
            rows = buf[:, layer]
        elif self.layout == "page_first_direct":
            return buf[:, layer]
        else:
            return buf[:, :, :, layer].transpose(1, 2)  # page_head: [pages, heads, page, dim]
        if rows.shape[0] % size:
            return None
        return (
            rows.view(rows.shape[0] // size, size, *rows.shape[1:])
            if rows.is_contiguous()
            else rows.unflatten(0, (rows.shape[0] // size, size))
        )


def _geometry(layout: str, page_size: int, buf: Any, what: str) -> tuple[int, int, int]:
    """(layers, heads, dim) of one component buffer; checks its rank and page dim."""
    shape = tuple(buf.shape)
    want = 4 if layout in ("layer_first", "page_first") else 5
    if len(shape) != want:
        raise ValueError(
            f"HiCache host {what} buffer has shape {shape}; layout {layout} has {want} dims"
        )
    if layout == "layer_first":
        return shape[0], shape[2], shape[3]
    if layout == "page_first":
        return shape[1], shape[2], shape[3]
    page_dim = 2
    if shape[page_dim] != page_size:
        raise ValueError(
            f"HiCache host {what} buffer has shape {shape}: its page dim is "
            f"not page_size {page_size}"
        )
    if layout == "page_first_direct":
        return shape[1], shape[3], shape[4]
    return shape[3], shape[1], shape[4]  # page_head: [pages, heads, page, layers, dim]


def bitcast(tensor: Any, dtype: Any) -> Any:
    """``tensor`` as ``dtype`` bit for bit when the element sizes agree (fp8 KV that one
    side stores as uint8), else converted."""
    if tensor.dtype == dtype:
        return tensor
    if tensor.dtype.itemsize == dtype.itemsize:
        return tensor.view(dtype)
    return tensor.to(dtype)
