"""Per-layer K/V buffers addressed by the token slots the allocators hand out."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch

from ..errors import InvalidInputError, SlotIndexError, check_count

# Makes a zeroed buffer of (shape, dtype) on the pool's device; lets the host put the
# buffers somewhere other processes can map (shared memory), without this layer knowing.
BufferFactory = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


class KVPool:
    """Zero-initialised K and V buffers per layer, one row per token slot.

    Each buffer has ``size + page_size`` rows, so every slot that a paged
    ``TokenToKVPoolAllocator`` of the same ``size`` and ``page_size`` can hand out
    (at most ``(size // page_size + 1) * page_size - 1``) is in bounds. Row 0 is the
    padding slot: allocators never hand it out, but writes to it are allowed so that
    padded batch positions can target it as a dummy sink.

    An MLA pool (``mla=True``) keeps one latent buffer per layer, in ``k_buffer``
    (``k_head_num`` heads, usually 1, of ``k_head_dim``), and no V: ``v_buffer`` is
    empty and ``v_head_num`` / ``v_head_dim`` are 0.

    Attributes:
        size: Pool size in tokens (as given to the allocator).
        page_size: Tokens per page.
        dtype: Element type of every buffer.
        device: Device of every buffer.
        layer_num: Number of layers.
        k_head_num: K heads per token.
        k_head_dim: K head dimension.
        v_head_num: V heads per token.
        v_head_dim: V head dimension.
        num_rows: Rows per buffer (``size + page_size``).
        k_buffer: One ``[num_rows, k_head_num, k_head_dim]`` tensor per layer.
        v_buffer: One ``[num_rows, v_head_num, v_head_dim]`` tensor per layer; none
            in an MLA pool.
        mla: Whether this is an MLA pool (latent in ``k_buffer``, no V).
    """

    def __init__(
        self,
        size: int,
        page_size: int = 1,
        dtype: torch.dtype = torch.float16,
        layer_num: int = 1,
        k_head_num: int = 1,
        k_head_dim: int = 64,
        v_head_num: int | None = None,
        v_head_dim: int | None = None,
        device: str | torch.device = "cpu",
        buffer_factory: BufferFactory | None = None,
        mla: bool = False,
    ) -> None:
        """Allocates the buffers.

        Args:
            size: Pool size in tokens.
            page_size: Tokens per page; the buffers get ``page_size`` spare rows.
            dtype: Element type.
            layer_num: Number of layers.
            k_head_num: K heads per token.
            k_head_dim: K head dimension.
            v_head_num: V heads per token; defaults to ``k_head_num``.
            v_head_dim: V head dimension; defaults to ``k_head_dim``.
            device: Any torch device.
            buffer_factory: Allocates each zeroed buffer instead of ``torch.zeros``
                (it must return a contiguous tensor of the asked shape and dtype on
                ``device``); such buffers are not pinned.
            mla: One latent buffer per layer (K) and no V; ``v_head_num`` and
                ``v_head_dim`` must then be None.

        Raises:
            InvalidInputError: A size, count or dimension is not a positive int,
                ``dtype`` is not a torch dtype, or an MLA pool is given V dimensions.
        """
        self._factory = buffer_factory
        self.size = check_count(size, "size", 1)
        self.page_size = check_count(page_size, "page_size", 1)
        if not isinstance(dtype, torch.dtype):
            raise InvalidInputError(f"dtype must be a torch.dtype, got {dtype!r}")
        self.dtype = dtype
        self.device = torch.device(device)
        self.layer_num = check_count(layer_num, "layer_num", 1)
        self.k_head_num = check_count(k_head_num, "k_head_num", 1)
        self.k_head_dim = check_count(k_head_dim, "k_head_dim", 1)
        self.mla = bool(mla)
        if self.mla:
            if v_head_num is not None or v_head_dim is not None:
                raise InvalidInputError(
                    "an MLA pool has no V: leave v_head_num and v_head_dim unset"
                )
            self.v_head_num = self.v_head_dim = 0
        else:
            v_heads = self.k_head_num if v_head_num is None else v_head_num
            v_dim = self.k_head_dim if v_head_dim is None else v_head_dim
            self.v_head_num = check_count(v_heads, "v_head_num", 1)
            self.v_head_dim = check_count(v_dim, "v_head_dim", 1)
        self.num_rows = self.size + self.page_size
        # Pinning speeds host<->device copies but needs a CUDA runtime to exist.
        pin = self.device.type == "cpu" and torch.cuda.is_available()
        k_shape = (self.num_rows, self.k_head_num, self.k_head_dim)
        v_shape = (self.num_rows, self.v_head_num, self.v_head_dim)
        self.k_buffer: list[torch.Tensor] = [
            self._zeros(k_shape, pin) for _ in range(self.layer_num)
        ]
        self.v_buffer: list[torch.Tensor] = [
            self._zeros(v_shape, pin) for _ in range(0 if self.mla else self.layer_num)
        ]

    def _zeros(self, shape: tuple[int, int, int], pin: bool) -> torch.Tensor:
        """Returns a zeroed buffer of ``shape`` on the pool's device."""
        if self._factory is not None:
            return checked_buffer(self._factory, shape, self.dtype, self.device)
        return torch.zeros(shape, dtype=self.dtype, device=self.device, pin_memory=pin)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """Returns layer ``layer_id``'s K buffer (the live tensor, not a copy).

        Raises:
            InvalidInputError: ``layer_id`` is not in ``[0, layer_num)``.
        """
        return self.k_buffer[self._layer(layer_id)]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """Returns layer ``layer_id``'s V buffer (the live tensor, not a copy).

        Raises:
            InvalidInputError: ``layer_id`` is not in ``[0, layer_num)``, or the pool
                is MLA (no V).
        """
        layer = self._layer(layer_id)
        self._check_not_mla("get_value_buffer")
        return self.v_buffer[layer]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns layer ``layer_id``'s ``(K, V)`` buffers.

        Raises:
            InvalidInputError: ``layer_id`` is not in ``[0, layer_num)``, or the pool
                is MLA (no V: use ``get_key_buffer``).
        """
        layer = self._layer(layer_id)
        self._check_not_mla("get_kv_buffer")
        return self.k_buffer[layer], self.v_buffer[layer]

    def set_kv_buffer(
        self,
        layer_id: int,
        indices: torch.Tensor | Sequence[int],
        k: torch.Tensor,
        v: torch.Tensor | None,
    ) -> None:
        """Writes row ``i`` of ``k``/``v`` into slot ``indices[i]`` of the layer.

        ``k`` and ``v`` are cast to the pool's dtype and device.

        Args:
            layer_id: Layer in ``[0, layer_num)``.
            indices: n slot indices in ``[0, size + page_size)``.
            k: ``[n, k_head_num, k_head_dim]``.
            v: ``[n, v_head_num, v_head_dim]``; None in an MLA pool.

        Raises:
            InvalidInputError: Bad layer, non-integer indices or a shape mismatch.
            SlotIndexError: An index lies outside the buffer.
        """
        layer = self._layer(layer_id)
        idx = self._indices(indices)
        n = idx.numel()
        self._check_shape("k", k, (n, self.k_head_num, self.k_head_dim))
        if self.mla:
            if v is not None:
                raise InvalidInputError("an MLA pool has no V: pass v=None")
        else:
            self._check_shape("v", v, (n, self.v_head_num, self.v_head_dim))
        if n == 0:
            return
        # index_copy_ beats index_put_ (buf[idx] = rows) by ~10% on CPU; with repeated
        # indices one of the rows wins, as with plain indexing.
        rows = k.to(device=self.device, dtype=self.dtype)
        byte_view(self.k_buffer[layer]).index_copy_(0, idx, byte_view(rows))
        if v is not None:
            rows = v.to(device=self.device, dtype=self.dtype)
            byte_view(self.v_buffer[layer]).index_copy_(0, idx, byte_view(rows))

    def read_kv(
        self, layer_id: int, indices: torch.Tensor | Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns copies of the K and V rows at ``indices`` for one layer (V None in
        an MLA pool).

        Raises:
            InvalidInputError: Bad layer or non-integer indices.
            SlotIndexError: An index lies outside the buffer.
        """
        layer = self._layer(layer_id)
        idx = self._indices(indices)
        v = None if self.mla else self.v_buffer[layer].index_select(0, idx)
        return self.k_buffer[layer].index_select(0, idx), v

    def nbytes(self) -> int:
        """Returns the total size of all K and V buffers in bytes."""
        return sum(t.numel() * t.element_size() for t in (*self.k_buffer, *self.v_buffer))

    def _check_not_mla(self, what: str) -> None:
        if self.mla:
            raise InvalidInputError(f"{what}: an MLA pool has no V buffer")

    def _layer(self, layer_id: int) -> int:
        """Returns ``layer_id`` as an int in range, or raises InvalidInputError."""
        if isinstance(layer_id, bool):
            raise InvalidInputError("layer_id must be an int, got bool")
        try:
            layer = operator.index(layer_id)
        except TypeError as exc:
            raise InvalidInputError(
                f"layer_id must be an int, got {type(layer_id).__name__}"
            ) from exc
        if not 0 <= layer < self.layer_num:
            raise InvalidInputError(f"layer_id {layer} outside [0, {self.layer_num})")
        return layer

    def _indices(self, indices: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Returns ``indices`` as flat int64 on the pool's device, range-checked."""
        if not isinstance(indices, torch.Tensor):
            try:
                indices = torch.as_tensor(list(indices))
            except (TypeError, ValueError, RuntimeError) as exc:
                raise InvalidInputError(f"indices must be integers: {exc}") from exc
            if indices.numel() == 0:
                indices = indices.to(torch.int64)
        if indices.dtype == torch.bool or indices.is_floating_point() or indices.is_complex():
            raise InvalidInputError(f"indices must be an integer tensor, got {indices.dtype}")
        idx = indices.reshape(-1).to(device=self.device, dtype=torch.int64)
        if idx.numel():
            lo, hi = torch.aminmax(idx)
            if int(lo) < 0 or int(hi) >= self.num_rows:
                bad = idx[(idx < 0) | (idx >= self.num_rows)][:8].tolist()
                raise SlotIndexError(f"slot indices outside [0, {self.num_rows}): {bad}")
        return idx

    @staticmethod
    def _check_shape(name: str, tensor: object, expected: tuple[int, int, int]) -> None:
        """Raises InvalidInputError unless ``tensor`` is a tensor of shape ``expected``."""
        if not isinstance(tensor, torch.Tensor):
            raise InvalidInputError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tuple(tensor.shape) != expected:
            raise InvalidInputError(f"{name} has shape {tuple(tensor.shape)}, expected {expected}")


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """One-byte element types (fp8) as uint8, the same memory: copies of them are
    bytewise, and torch lacks some indexing kernels (CPU ``index_copy_``) for fp8."""
    if tensor.element_size() == 1 and tensor.dtype not in (torch.uint8, torch.int8):
        return tensor.view(torch.uint8)
    return tensor


def checked_buffer(
    factory: BufferFactory, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``factory``'s buffer, checked: a wrong one would corrupt KV silently later."""
    out = factory(shape, dtype)
    if (
        tuple(out.shape) != tuple(shape)
        or out.dtype != dtype
        or out.device != device
        or not out.is_contiguous()
    ):
        raise InvalidInputError(
            f"buffer_factory returned {tuple(out.shape)} {out.dtype} on "
            f"{out.device}, expected contiguous {tuple(shape)} {dtype} "
            f"on {device}"
        )
    return out
