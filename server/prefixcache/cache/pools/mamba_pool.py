"""MambaPool: per-layer conv and temporal (SSM) state of Mamba/GDN layers, one row per slot."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import DoubleFreeError, InvalidInputError, SlotIndexError, check_count
from .kv_pool import BufferFactory, checked_buffer


class MambaPool:
    """Recurrent state for the linear-attention layers of a hybrid model.

    A Mamba layer carries its whole history in a fixed-size state instead of per-token
    KV, so the pool holds one state per *slot*: ``conv_state[layer, slot]`` (the last
    ``kernel - 1`` inputs of the short convolution, in the model dtype) and
    ``temporal_state[layer, slot]`` (the SSM / gated-delta-rule matrix, float32 by
    default, since it accumulates over the whole sequence).

    Slots, ``num_slots = 1 + max_reqs + max_track_slots`` in all:

    * ``0``: padding. Never handed out; copies and resets may target it as a sink.
    * ``1 .. max_reqs``: working slots, one per request (``working_slot(r)``), which
      the model updates as it runs. They are the caller's; the pool does not track them.
    * ``max_reqs + 1 ..``: track slots, handed out by ``alloc_track_slot`` to hold
      snapshots that a ``MambaRadixCache`` node owns (``copy_states(working, track)``
      after a prefill; ``copy_states(track, working)`` to resume from a hit).

    Slot 0 is never a working slot (the reference's state pool let request 0 use it),
    and a track slot freed twice, or a working slot freed as a track slot, raises.

    Attributes:
        max_reqs: Requests that can run at once (working slots).
        max_track_slots: Snapshots the tree can hold (track slots).
        num_layers: Mamba layers.
        num_slots: Rows per layer (including the padding slot).
        conv_state: ``[num_layers, num_slots, *conv_state_shape]``.
        temporal_state: ``[num_layers, num_slots, *temporal_state_shape]``.
        device: Device of both tensors.
    """

    def __init__(
        self,
        max_reqs: int,
        max_track_slots: int,
        num_layers: int = 1,
        conv_state_shape: Sequence[int] = (4, 3),
        temporal_state_shape: Sequence[int] = (1, 4, 4),
        dtype: torch.dtype = torch.float16,
        temporal_dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        buffer_factory: BufferFactory | None = None,
    ) -> None:
        """Allocate zeroed state for every slot, with every track slot free.

        Args:
            max_reqs: Working slots (one per concurrent request).
            max_track_slots: Track slots for tree snapshots.
            num_layers: Mamba layers.
            conv_state_shape: Per-slot conv state, e.g. ``(conv_dim, kernel - 1)``.
            temporal_state_shape: Per-slot SSM state, e.g. ``(heads, v_dim, k_dim)``.
            dtype: Conv state element type (the model dtype).
            temporal_dtype: Temporal state element type.
            device: Any torch device.
            buffer_factory: Allocates each zeroed state tensor instead of
                ``torch.zeros`` (see ``KVPool``); such tensors are not pinned.

        Raises:
            InvalidInputError: A count or dimension is not a positive int (``max_reqs``
                and ``max_track_slots`` may be 0), or a dtype is not a torch dtype.
        """
        self.max_reqs = check_count(max_reqs, "max_reqs")
        self.max_track_slots = check_count(max_track_slots, "max_track_slots")
        self.num_layers = check_count(num_layers, "num_layers", 1)
        self.conv_state_shape = _shape(conv_state_shape, "conv_state_shape")
        self.temporal_state_shape = _shape(temporal_state_shape, "temporal_state_shape")
        for name, value in (("dtype", dtype), ("temporal_dtype", temporal_dtype)):
            if not isinstance(value, torch.dtype):
                raise InvalidInputError(f"{name} must be a torch.dtype, got {value!r}")
        self.dtype = dtype
        self.temporal_dtype = temporal_dtype
        self.device = torch.device(device)
        self.num_slots = 1 + self.max_reqs + self.max_track_slots
        self.first_track_slot = 1 + self.max_reqs
        # Pinning speeds host<->device copies but needs a CUDA runtime to exist.
        pin = self.device.type == "cpu" and torch.cuda.is_available()
        rows = (self.num_layers, self.num_slots)
        if buffer_factory is not None:
            self.conv_state = checked_buffer(
                buffer_factory, rows + self.conv_state_shape, dtype, self.device
            )
            self.temporal_state = checked_buffer(
                buffer_factory, rows + self.temporal_state_shape, temporal_dtype, self.device
            )
        else:
            self.conv_state = torch.zeros(
                rows + self.conv_state_shape, dtype=dtype, device=self.device, pin_memory=pin
            )
            self.temporal_state = torch.zeros(
                rows + self.temporal_state_shape,
                dtype=temporal_dtype,
                device=self.device,
                pin_memory=pin,
            )
        self._track_in_use = bytearray(self.num_slots)
        self.clear()

    def clear(self) -> None:
        """Free every track slot (the states themselves are left as they are)."""
        # A stack whose top is the highest slot: the highest is handed out first, as in
        # the reference, and a slot just freed is the next one reused while still warm.
        self._free_track = list(range(self.first_track_slot, self.num_slots))
        self._track_in_use[:] = bytes(self.num_slots)

    def working_slot(self, req_index: int) -> int:
        """The working slot of request ``req_index`` (in ``[0, max_reqs)``)."""
        index = to_index(req_index, "req_index")
        if not 0 <= index < self.max_reqs:
            raise SlotIndexError(f"req_index {index} outside [0, {self.max_reqs})")
        return 1 + index

    def is_track_slot(self, slot: int) -> bool:
        """Whether ``slot`` is a track slot (allocated or not)."""
        return self.first_track_slot <= to_index(slot, "slot") < self.num_slots

    def alloc_track_slot(self) -> int | None:
        """A free track slot (the highest first), or None when all are in use."""
        if not self._free_track:
            return None
        slot = self._free_track.pop()
        self._track_in_use[slot] = 1
        return slot

    def free_track_slot(self, slot: int | torch.Tensor) -> None:
        """Return a track slot from ``alloc_track_slot``; its state is left as it is.

        Raises:
            SlotIndexError: ``slot`` is not a track slot.
            DoubleFreeError: ``slot`` is not allocated.
        """
        index = self._track(slot)
        if not self._track_in_use[index]:
            raise DoubleFreeError(f"track slot {index} is not allocated")
        self._track_in_use[index] = 0
        self._free_track.append(index)

    def is_track_slot_allocated(self, slot: int | torch.Tensor) -> bool:
        """Whether ``slot`` is a track slot handed out and not yet freed."""
        index = to_index(slot, "slot")
        return self.first_track_slot <= index < self.num_slots and bool(self._track_in_use[index])

    def available_track_slots(self) -> int:
        return len(self._free_track)

    def num_allocated_track_slots(self) -> int:
        return self.max_track_slots - len(self._free_track)

    def copy_states(self, src: Any, dst: Any) -> None:
        """Copy the conv and temporal state of slot(s) ``src`` onto ``dst``, every layer.

        ``src`` and ``dst`` are a slot each or equally long sequences / 1-D tensors of
        slots; ``dst`` may not repeat a slot. Sources are read before any write, so the
        two may overlap (a permutation works).

        Raises:
            InvalidInputError: Lengths differ, ``dst`` repeats a slot, or a slot is not
                an integer.
            SlotIndexError: A slot lies outside ``[0, num_slots)``.
        """
        src_idx, dst_idx = self._slots(src, "src"), self._slots(dst, "dst")
        if src_idx.numel() != dst_idx.numel():
            raise InvalidInputError(
                f"copy_states of {src_idx.numel()} slots onto {dst_idx.numel()}"
            )
        if len(torch.unique(dst_idx)) != dst_idx.numel():
            raise InvalidInputError("copy_states: dst names a slot twice")
        for state in (self.conv_state, self.temporal_state):
            state.index_copy_(1, dst_idx, state.index_select(1, src_idx))

    def reset_states(self, slots: Any) -> None:
        """Zero the conv and temporal state of slot(s) ``slots`` in every layer.

        Raises:
            InvalidInputError: A slot is not an integer.
            SlotIndexError: A slot lies outside ``[0, num_slots)``.
        """
        idx = self._slots(slots, "slots")
        self.conv_state.index_fill_(1, idx, 0)
        self.temporal_state.index_fill_(1, idx, 0)

    def get_conv_state(self, layer_id: int) -> torch.Tensor:
        """Layer ``layer_id``'s conv state, ``[num_slots, *conv_state_shape]`` (a view)."""
        return self.conv_state[self._layer(layer_id)]

    def get_temporal_state(self, layer_id: int) -> torch.Tensor:
        """Layer ``layer_id``'s temporal state, ``[num_slots, *temporal_state_shape]``."""
        return self.temporal_state[self._layer(layer_id)]

    def nbytes(self) -> int:
        """Bytes held by both state tensors."""
        return sum(t.numel() * t.element_size() for t in (self.conv_state, self.temporal_state))

    def _track(self, slot: Any) -> int:
        index = to_index(slot, "slot")
        if not self.first_track_slot <= index < self.num_slots:
            raise SlotIndexError(
                f"slot {index} is not a track slot [{self.first_track_slot}, {self.num_slots})"
            )
        return index

    def _layer(self, layer_id: int) -> int:
        layer = to_index(layer_id, "layer_id")
        if not 0 <= layer < self.num_layers:
            raise InvalidInputError(f"layer_id {layer} outside [0, {self.num_layers})")
        return layer

    def _slots(self, slots: Any, name: str) -> torch.Tensor:
        """``slots`` as a flat int64 tensor on the pool's device, range-checked."""
        if isinstance(slots, torch.Tensor):
            if slots.dtype == torch.bool or slots.is_floating_point() or slots.is_complex():
                raise InvalidInputError(f"{name} must be integer slots, got {slots.dtype}")
            idx = slots.reshape(-1).to(device=self.device, dtype=torch.int64)
        else:
            items = [slots] if not isinstance(slots, Sequence) else list(slots)
            values = [to_index(s, name) for s in items]
            idx = torch.tensor(values, dtype=torch.int64, device=self.device)
        if idx.numel():
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= self.num_slots:
                bad = idx[(idx < 0) | (idx >= self.num_slots)][:8].tolist()
                raise SlotIndexError(f"{name} slots outside [0, {self.num_slots}): {bad}")
        return idx


def to_index(value: object, name: str) -> int:
    """``value`` as an int (an integer, or an integer tensor of one element)."""
    if isinstance(value, bool):
        raise InvalidInputError(f"{name} must be an int, got bool")
    if isinstance(value, torch.Tensor):
        if (
            value.numel() != 1
            or value.is_floating_point()
            or value.is_complex()
            or value.dtype == torch.bool
        ):
            raise InvalidInputError(
                f"{name} must be one integer slot, got a "
                f"{value.dtype} tensor of shape {tuple(value.shape)}"
            )
        return int(value.reshape(()).item())
    try:
        return operator.index(value)  # type: ignore[arg-type]  # it decides what is an int
    except TypeError as exc:
        raise InvalidInputError(f"{name} must be an int, got {type(value).__name__}") from exc


def _shape(shape: Sequence[int], name: str) -> tuple[int, ...]:
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence) or not shape:
        raise InvalidInputError(f"{name} must be a non-empty sequence of ints, got {shape!r}")
    return tuple(check_count(d, name, 1) for d in shape)
