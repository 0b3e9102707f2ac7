"""Unit tests of SlotAllocator (per-sequence slots with versions) and the slot KV helpers."""

from __future__ import annotations

import pytest
import torch

from prefixcache.cache.errors import (
    DoubleFreeError,
    IntegrityError,
    InvalidInputError,
    SlotIndexError,
)
from prefixcache.cache.pools.slot_allocator import SlotAllocator, copy_slot_kv, kv_layout


def state(alloc: SlotAllocator) -> tuple[list[int], list[int]]:
    """Free queue order and every version: all an allocator's observable state."""
    return list(alloc._free), [alloc.version(s) for s in range(alloc.max_slots)]


def test_alloc_hands_out_every_slot_once_then_none() -> None:
    """Slots come out in order, each at version 1; a full pool answers None."""
    alloc = SlotAllocator(3)
    assert [alloc.alloc() for _ in range(3)] == [0, 1, 2]
    assert [alloc.version(s) for s in range(3)] == [1, 1, 1]
    assert alloc.alloc() is None
    assert alloc.free_count() == 0 and alloc.num_allocated() == 3
    alloc.check_integrity()


def test_freed_slots_are_reused_least_recently_freed_first() -> None:
    """Never-used slots go first, then freed ones in the order they were freed."""
    alloc = SlotAllocator(4)
    a, b = alloc.alloc(), alloc.alloc()
    alloc.free(b)
    alloc.free(a)
    assert [alloc.alloc() for _ in range(4)] == [2, 3, b, a]
    assert alloc.version(b) == alloc.version(a) == 2
    assert alloc.version(2) == 1


def test_free_keeps_the_version_so_kv_stays_current() -> None:
    """A freed slot's KV stays usable until the slot is allocated again."""
    alloc = SlotAllocator(1)
    slot = alloc.alloc()
    alloc.free(slot)
    assert alloc.is_free(slot) and alloc.is_current(slot, 1)
    assert alloc.alloc() == slot
    assert not alloc.is_current(slot, 1) and alloc.is_current(slot, 2)


def test_double_free_raises_and_changes_nothing() -> None:
    """Freeing a free slot is DoubleFreeError; the queue and versions are untouched."""
    alloc = SlotAllocator(3)
    slot = alloc.alloc()
    alloc.free(slot)
    before = state(alloc)
    with pytest.raises(DoubleFreeError):
        alloc.free(slot)
    with pytest.raises(DoubleFreeError):
        alloc.free(2)  # never allocated
    assert state(alloc) == before


@pytest.mark.parametrize("slot", [-1, 3, 10**20])
def test_slots_outside_the_pool_are_refused(slot: int) -> None:
    """Out-of-range slots raise SlotIndexError from every method that takes one."""
    alloc = SlotAllocator(3)
    before = state(alloc)
    for call in (alloc.free, alloc.is_free, alloc.version, lambda s: alloc.occupy(s, 1)):
        with pytest.raises(SlotIndexError):
            call(slot)
    assert not alloc.is_current(slot, 1)
    assert state(alloc) == before


@pytest.mark.parametrize("slot", [True, 1.0, "1", None])
def test_non_integer_slots_are_invalid_input(slot: object) -> None:
    """A bool, float, str or None is not a slot."""
    alloc = SlotAllocator(3)
    with pytest.raises(InvalidInputError):
        alloc.free(slot)  # type: ignore[arg-type]


@pytest.mark.parametrize("max_slots", [0, -1, 2.5, True])
def test_max_slots_must_be_a_positive_int(max_slots: object) -> None:
    with pytest.raises(InvalidInputError):
        SlotAllocator(max_slots)  # type: ignore[arg-type]


def test_occupy_takes_a_free_slot_whose_kv_is_intact() -> None:
    """occupy returns the new version and removes the slot from the free queue."""
    alloc = SlotAllocator(3)
    slot = alloc.alloc()
    alloc.free(slot)
    assert alloc.occupy(slot, 1) == 2
    assert not alloc.is_free(slot) and alloc.version(slot) == 2
    assert [alloc.alloc(), alloc.alloc(), alloc.alloc()] == [1, 2, None]
    alloc.check_integrity()


def test_occupy_refuses_slots_in_use_stale_or_never_written() -> None:
    """None (and no change) for a slot in use, a version that moved on, or version 0."""
    alloc = SlotAllocator(2)
    slot = alloc.alloc()
    before = state(alloc)
    assert alloc.occupy(slot, 1) is None  # in use
    assert alloc.occupy(1, 0) is None  # never allocated: its KV is garbage
    alloc.free(slot)
    assert alloc.occupy(slot, 0) is None
    assert alloc.occupy(slot, 7) is None
    alloc.free(alloc.alloc())  # slot 1 once
    alloc.free(alloc.alloc())  # slot 0 again: version 2
    assert alloc.occupy(slot, 1) is None
    assert before[1][slot] == 1
    with pytest.raises(InvalidInputError):
        alloc.occupy(slot, -1)


def test_clear_takes_every_slot_back_and_keeps_versions() -> None:
    alloc = SlotAllocator(3)
    for _ in range(3):
        alloc.alloc()
    alloc.free(1)
    alloc.clear()
    assert alloc.free_count() == 3
    assert [alloc.version(s) for s in range(3)] == [1, 1, 1]
    assert [alloc.alloc() for _ in range(3)] == [1, 0, 2]
    alloc.check_integrity()


def test_check_integrity_spots_a_corrupt_queue() -> None:
    alloc = SlotAllocator(2)
    alloc._free[5] = None
    with pytest.raises(IntegrityError):
        alloc.check_integrity()


def test_kv_layout_accepts_a_tensor_or_a_pair() -> None:
    """One tensor, or K and V with different trailing dims but the same leading three."""
    single = torch.zeros(4, 8, 3, 2, 5)
    tensors, layers = kv_layout(single, 4)
    assert tensors == [single] and layers == 3
    k, v = torch.zeros(4, 8, 3, 2, 5), torch.zeros(4, 8, 3, 1, 7)
    tensors, layers = kv_layout((k, v), 4, 2)
    assert tensors[0] is k and tensors[1] is v and layers == 2


@pytest.mark.parametrize(
    ("kv", "n_layers"),
    [
        (torch.zeros(3, 8, 2), None),  # fewer slots than the pool
        (torch.zeros(4, 8), None),  # no layer dim
        ((torch.zeros(4, 8, 2), torch.zeros(4, 9, 2)), None),  # K and V disagree
        ((), None),
        ([torch.zeros(4, 8, 2), "v"], None),
        ("kv", None),
        (torch.zeros(4, 8, 2), 3),  # more layers than the tensor has
        (torch.zeros(4, 8, 2), -1),
    ],
)
def test_kv_layout_refuses_bad_layouts(kv: object, n_layers: int | None) -> None:
    with pytest.raises(InvalidInputError):
        kv_layout(kv, 4, n_layers)


def test_copy_slot_kv_copies_only_the_prefix_and_layers_asked() -> None:
    """Positions [0, length) of the first n_layers layers; nothing else moves."""
    k = torch.arange(3 * 4 * 2, dtype=torch.float32).reshape(3, 4, 2, 1)
    v = -k.clone()
    before_k, before_v = k.clone(), v.clone()
    copy_slot_kv([k, v], source=0, target=2, length=3, n_layers=1)
    assert torch.equal(k[2, :3, 0], before_k[0, :3, 0])
    assert torch.equal(v[2, :3, 0], before_v[0, :3, 0])
    untouched = torch.ones_like(k, dtype=torch.bool)
    untouched[2, :3, 0] = False
    assert torch.equal(k[untouched], before_k[untouched])
    assert torch.equal(v[untouched], before_v[untouched])
