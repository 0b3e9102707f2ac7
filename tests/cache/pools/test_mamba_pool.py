"""MambaPool: slot layout, track-slot allocation with checked frees, state copies."""

from __future__ import annotations

import pytest
import torch

from prefixcache.cache import DoubleFreeError, InvalidInputError, SlotIndexError
from prefixcache.cache.pools.mamba_pool import MambaPool


def small_pool(**kwargs: object) -> MambaPool:
    args: dict[str, object] = dict(
        max_reqs=2,
        max_track_slots=3,
        num_layers=2,
        conv_state_shape=(6, 3),
        temporal_state_shape=(2, 4, 5),
    )
    args.update(kwargs)
    return MambaPool(**args)  # type: ignore[arg-type]


def test_shapes_dtypes_and_slot_layout() -> None:
    """Slot 0 pads, then one working slot per request, then the track slots."""
    pool = small_pool(dtype=torch.bfloat16)
    assert pool.num_slots == 6 and pool.first_track_slot == 3
    assert pool.conv_state.shape == (2, 6, 6, 3) and pool.conv_state.dtype == torch.bfloat16
    assert pool.temporal_state.shape == (2, 6, 2, 4, 5)
    assert pool.temporal_state.dtype == torch.float32  # accumulates: float32 by default
    assert pool.get_conv_state(1).shape == (6, 6, 3)
    assert pool.get_temporal_state(0).data_ptr() == pool.temporal_state.data_ptr()
    assert [pool.working_slot(r) for r in range(2)] == [1, 2]
    assert [pool.is_track_slot(s) for s in range(6)] == [False] * 3 + [True] * 3
    assert pool.nbytes() == 2 * 6 * 18 * 2 + 2 * 6 * 40 * 4
    assert not pool.conv_state.any() and not pool.temporal_state.any()


def test_track_slots_come_highest_first_and_return_lifo() -> None:
    """Track slots 5, 4, 3, then None (two requests, three track slots); a freed slot
    is the next one handed out."""
    pool = small_pool()
    assert [pool.alloc_track_slot() for _ in range(4)] == [5, 4, 3, None]
    assert pool.num_allocated_track_slots() == 3 and pool.available_track_slots() == 0
    pool.free_track_slot(4)
    pool.free_track_slot(torch.tensor([3]))
    assert not pool.is_track_slot_allocated(4) and pool.is_track_slot_allocated(5)
    assert [pool.alloc_track_slot(), pool.alloc_track_slot()] == [3, 4]
    pool.clear()
    assert pool.available_track_slots() == 3 and not pool.is_track_slot_allocated(5)


def test_bad_frees_raise() -> None:
    """Departure 14: double frees and frees of non-track slots raise, changing nothing."""
    pool = small_pool()
    slot = pool.alloc_track_slot()
    assert slot is not None
    pool.free_track_slot(slot)
    with pytest.raises(DoubleFreeError):
        pool.free_track_slot(slot)
    for bad in (0, 1, 2, 6, -1):
        with pytest.raises(SlotIndexError):
            pool.free_track_slot(bad)
    for bad in (1.0, True, torch.tensor([3, 4]), "3"):
        with pytest.raises(InvalidInputError):
            pool.free_track_slot(bad)  # type: ignore[arg-type]
    assert pool.available_track_slots() == 3


def test_copy_and_reset_states() -> None:
    """copy_states copies both states in every layer; sources are read before writes."""
    pool = small_pool()
    pool.conv_state.copy_(torch.randn(pool.conv_state.shape))
    pool.temporal_state.copy_(torch.randn(pool.temporal_state.shape))
    conv, temporal = pool.conv_state.clone(), pool.temporal_state.clone()
    pool.copy_states(1, 4)
    assert torch.equal(pool.conv_state[:, 4], conv[:, 1])
    assert torch.equal(pool.temporal_state[:, 4], temporal[:, 1])
    pool.copy_states([1, 2], torch.tensor([2, 1]))  # a swap
    assert torch.equal(pool.conv_state[:, 1], conv[:, 2])
    assert torch.equal(pool.temporal_state[:, 2], temporal[:, 1])
    pool.reset_states([4, 5])
    assert not pool.conv_state[:, 4:].any() and not pool.temporal_state[:, 4:].any()
    assert torch.equal(pool.temporal_state[:, 3], temporal[:, 3])
    pool.copy_states([], [])


@pytest.mark.parametrize(
    ("src", "dst", "error"),
    [
        ([1, 2], [3], InvalidInputError),
        ([1, 2], [3, 3], InvalidInputError),
        (6, 3, SlotIndexError),
        (1, -1, SlotIndexError),
        (torch.tensor([1.0]), 3, InvalidInputError),
    ],
)
def test_bad_copies_raise(src: object, dst: object, error: type[Exception]) -> None:
    pool = small_pool()
    pool.temporal_state.fill_(1)
    with pytest.raises(error):
        pool.copy_states(src, dst)
    assert pool.temporal_state.all()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_reqs=-1),
        dict(num_layers=0),
        dict(conv_state_shape=()),
        dict(temporal_state_shape=(4, 0)),
        dict(dtype="float16"),
        dict(temporal_dtype=None),
    ],
)
def test_bad_construction_raises(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidInputError):
        small_pool(**kwargs)


def test_bad_layer_and_request_raise() -> None:
    pool = small_pool()
    with pytest.raises(InvalidInputError):
        pool.get_conv_state(2)
    with pytest.raises(SlotIndexError):
        pool.working_slot(2)


@pytest.mark.gpu
def test_states_live_on_a_cuda_device() -> None:
    """The pool works on any torch device; copies stay on it."""
    pool = small_pool(device="cuda", dtype=torch.bfloat16)
    assert pool.conv_state.device.type == "cuda"
    pool.conv_state[:, 1] = 1
    pool.copy_states(1, pool.alloc_track_slot())
    assert bool(pool.conv_state[:, 5].eq(1).all())
    pool.reset_states(torch.tensor([5], device="cuda"))
    assert not pool.conv_state[:, 5].any()
