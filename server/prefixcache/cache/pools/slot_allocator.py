"""SlotAllocator: whole per-sequence KV slots, with a version per slot to spot stale reuse."""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import DoubleFreeError, IntegrityError, InvalidInputError, SlotIndexError, check_count

KVCacheLike = torch.Tensor | Sequence[torch.Tensor]


class StaleSlotError(InvalidInputError):
    """A ``(slot, version)`` pair names KV that has been handed to a newer owner since."""


class SlotAllocator:
    """Hands out KV slots of a ``k_cache[slot, position, layer, ...]`` layout, one per sequence.

    Every slot ``0 .. max_slots - 1`` is usable (a slot is a whole row, not a token, so
    there is no padding slot). Each slot has a version that starts at 0 and moves on
    every time the slot gets a new owner (``alloc`` or ``occupy``), so a cache entry
    ``(slot, version)`` is usable exactly while ``version(slot) == version``: the owner
    of one version only appends positions, a new owner may overwrite any of them.

    Free slots wait in a FIFO queue and are handed out least recently freed first, so a
    freed slot's KV, still indexed by a prefix cache, survives as long as the pool
    allows: slots never used come first, then the ones whose KV is oldest. ``occupy``
    takes a specific free slot back while its KV is still intact, which is how a new
    request reuses a cached prefix without copying. Alloc, free and occupy are O(1).

    Args:
        max_slots: number of slots (rows of the KV tensors).
    """

    __slots__ = ("_free", "_versions", "max_slots")

    def __init__(self, max_slots: int) -> None:
        self.max_slots = check_count(max_slots, "max_slots", minimum=1)
        self._versions = [0] * self.max_slots
        # An OrderedDict is a linked list with O(1) removal from anywhere (for occupy),
        # and popitem(last=False) stays O(1) where a plain dict's first-key scan does not.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.max_slots))

    def alloc(self) -> int | None:
        """A free slot under a new version, or None when every slot is in use."""
        if not self._free:
            return None
        slot, _ = self._free.popitem(last=False)
        self._versions[slot] += 1
        return slot

    def free(self, slot: int) -> None:
        """Give ``slot`` back. Its KV stays valid (same version) until it is reallocated.

        Raises:
            SlotIndexError: ``slot`` is outside the pool.
            DoubleFreeError: ``slot`` is already free. Nothing changes.
        """
        slot = self.checked_slot(slot)
        if slot in self._free:
            raise DoubleFreeError(f"slot {slot} is already free")
        self._free[slot] = None

    def occupy(self, slot: int, version: int) -> int | None:
        """Take free ``slot`` back for a new owner if it still holds ``version``'s KV.

        Returns the slot's new version (the owner inserts under it), or None when the
        slot is in use or was reallocated since ``version`` (its KV is gone). The version
        moves on even here: the new owner overwrites the positions after the prefix it
        reuses, so deeper entries made under the old version must stop being usable.

        Raises:
            SlotIndexError: ``slot`` is outside the pool.
        """
        slot = self.checked_slot(slot)
        version = check_count(version, "version")
        if slot not in self._free or version == 0 or self._versions[slot] != version:
            return None
        del self._free[slot]
        self._versions[slot] += 1
        return self._versions[slot]

    def is_free(self, slot: int) -> bool:
        return self.checked_slot(slot) in self._free

    def version(self, slot: int) -> int:
        """The slot's current version: 0 until it is first allocated."""
        return self._versions[self.checked_slot(slot)]

    def is_current(self, slot: int, version: int) -> bool:
        """True while the KV written under ``(slot, version)`` is intact (False off the pool)."""
        return 0 <= slot < self.max_slots and version != 0 and self._versions[slot] == version

    def free_count(self) -> int:
        return len(self._free)

    def num_allocated(self) -> int:
        return self.max_slots - len(self._free)

    def clear(self) -> None:
        """Take every allocated slot back (admin reset); versions and KV stay as they are."""
        for slot in range(self.max_slots):
            if slot not in self._free:
                self._free[slot] = None

    def checked_slot(self, slot: object) -> int:
        """``slot`` as an int in ``[0, max_slots)``; SlotIndexError or InvalidInputError."""
        if isinstance(slot, bool) or not hasattr(slot, "__index__"):
            raise InvalidInputError(f"slot must be an int, got {type(slot).__name__}")
        number = operator.index(slot)
        if not 0 <= number < self.max_slots:
            raise SlotIndexError(f"slot {number} is outside [0, {self.max_slots})")
        return number

    def check_integrity(self) -> None:
        """Every free-queue entry is a real slot, listed once; versions never went back."""
        problems = []
        if any(not 0 <= s < self.max_slots for s in self._free):
            problems.append("the free queue holds a slot outside the pool")
        if len(self._free) > self.max_slots:
            problems.append("the free queue is longer than the pool")
        if any(v < 0 for v in self._versions) or len(self._versions) != self.max_slots:
            problems.append("a slot version is negative or missing")
        if any(self._versions[s] == 0 for s in range(self.max_slots) if s not in self._free):
            problems.append("an allocated slot still has version 0")
        if problems:
            raise IntegrityError("; ".join(problems))

    def __repr__(self) -> str:
        return f"SlotAllocator(max_slots={self.max_slots}, free={len(self._free)})"


def kv_layout(
    kv_cache: Any, num_slots: int, n_layers: int | None = None
) -> tuple[list[torch.Tensor], int]:
    """Check a slot-major KV layout and return its tensors and the layers to copy.

    ``kv_cache`` is one tensor ``[num_slots, max_seq_len, n_layers, ...]`` or a sequence
    of them (a ``(k_cache, v_cache)`` pair) sharing those three leading dims, with at
    least ``num_slots`` slots. ``n_layers`` None means all of them.

    Raises:
        InvalidInputError: anything else.
    """
    tensors = (
        [kv_cache]
        if isinstance(kv_cache, torch.Tensor)
        else list(kv_cache)
        if isinstance(kv_cache, (list, tuple))
        else []
    )
    if not tensors or not all(isinstance(t, torch.Tensor) and t.dim() >= 3 for t in tensors):
        raise InvalidInputError(
            "kv_cache must be a tensor [slots, positions, layers, ...] "
            "or a (k_cache, v_cache) pair of them"
        )
    lead = tensors[0].shape[:3]
    if any(t.shape[:3] != lead for t in tensors) or lead[0] < num_slots:
        raise InvalidInputError(
            f"kv_cache tensors must share [slots, positions, layers] and "
            f"have at least {num_slots} slots, got "
            f"{[tuple(t.shape) for t in tensors]}"
        )
    layers = lead[2] if n_layers is None else check_count(n_layers, "n_layers")
    if layers > lead[2]:
        raise InvalidInputError(f"n_layers {layers} > the {lead[2]} layers of kv_cache")
    return tensors, layers


def copy_slot_kv(
    tensors: list[torch.Tensor], source: int, target: int, length: int, n_layers: int
) -> None:
    """Copy positions ``[0, length)`` of the first ``n_layers`` layers from slot ``source``
    to slot ``target`` in every tensor (checked by ``kv_layout``), on their device."""
    with torch.no_grad():
        for t in tensors:
            t[target, :length, :n_layers] = t[source, :length, :n_layers]
