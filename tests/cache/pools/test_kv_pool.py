"""Tests for KVPool: buffer shapes, paged bounds (bug P1), scatter/gather and validation."""

from __future__ import annotations

import pytest
import torch

from prefixcache.cache.errors import InvalidInputError, SlotIndexError
from prefixcache.cache.pools.allocator import TokenToKVPoolAllocator
from prefixcache.cache.pools.kv_pool import KVPool


def rows(n: int, heads: int, dim: int, start: float = 1.0) -> torch.Tensor:
    """Distinct, exactly representable fp16 values, one block per row."""
    return torch.arange(n * heads * dim, dtype=torch.float32).reshape(n, heads, dim) + start


def test_buffers_shapes_zeroed_and_typed() -> None:
    """Each layer has zeroed K and V buffers of [size + page_size, heads, dim]."""
    pool = KVPool(10, page_size=1, dtype=torch.float16, layer_num=3, k_head_num=2, k_head_dim=4)
    assert len(pool.k_buffer) == len(pool.v_buffer) == 3
    for layer in range(3):
        k, v = pool.get_kv_buffer(layer)
        assert k.shape == v.shape == (11, 2, 4)
        assert k.dtype == v.dtype == torch.float16
        assert k.device.type == "cpu"
        assert not k.any() and not v.any()
    assert (pool.v_head_num, pool.v_head_dim) == (2, 4)
    assert (pool.size, pool.page_size, pool.layer_num, pool.num_rows) == (10, 1, 3, 11)


def test_v_shape_may_differ_from_k() -> None:
    """V head count and dim may differ from K's (MLA-style)."""
    pool = KVPool(8, page_size=4, k_head_num=1, k_head_dim=96, v_head_num=3, v_head_dim=16)
    assert pool.get_key_buffer(0).shape == (12, 1, 96)
    assert pool.get_value_buffer(0).shape == (12, 3, 16)


def test_nbytes_counts_every_buffer() -> None:
    """nbytes() is the total size of all K and V buffers."""
    pool = KVPool(
        6,
        page_size=2,
        dtype=torch.bfloat16,
        layer_num=2,
        k_head_num=2,
        k_head_dim=8,
        v_head_num=1,
        v_head_dim=4,
    )
    assert pool.nbytes() == 2 * (8 * 2 * 8 + 8 * 1 * 4) * 2


@pytest.mark.parametrize(
    ("size", "page_size"), [(8, 1), (64, 16), (70, 16), (100, 4), (33, 8), (30, 3), (16, 16)]
)
def test_every_allocatable_slot_is_in_bounds(size: int, page_size: int) -> None:
    """Every slot a same-sized paged allocator hands out is a valid row (bug P1 fixed)."""
    alloc = TokenToKVPoolAllocator(size, page_size=page_size)
    pool = KVPool(size, page_size=page_size, k_head_num=1, k_head_dim=2)
    slots = alloc.alloc(alloc.available_size())
    assert slots is not None
    assert int(slots.max()) < pool.num_rows
    k = rows(slots.numel(), 1, 2)
    pool.set_kv_buffer(0, slots, k, -k)
    got_k, got_v = pool.read_kv(0, slots)
    assert torch.equal(got_k.float(), k) and torch.equal(got_v.float(), -k)


def test_set_then_read_roundtrip_and_layers_independent() -> None:
    """Rows written to one layer read back exactly; other layers and rows stay zero."""
    pool = KVPool(16, layer_num=2, k_head_num=2, k_head_dim=3, v_head_num=1, v_head_dim=5)
    idx = torch.tensor([5, 2, 9])
    k, v = rows(3, 2, 3), rows(3, 1, 5, start=100.0)
    pool.set_kv_buffer(1, idx, k, v)
    got_k, got_v = pool.read_kv(1, idx)
    assert got_k.dtype == torch.float16
    assert torch.equal(got_k.float(), k) and torch.equal(got_v.float(), v)
    assert torch.equal(pool.get_key_buffer(1)[2].float(), k[1])
    assert not pool.get_key_buffer(0).any() and not pool.get_value_buffer(0).any()
    untouched = [i for i in range(17) if i not in (2, 5, 9)]
    assert not pool.get_key_buffer(1)[untouched].any()


def test_overwrite_and_list_indices() -> None:
    """A later write to the same slot replaces the row; list indices work too."""
    pool = KVPool(4, k_head_num=1, k_head_dim=2)
    pool.set_kv_buffer(0, [1], torch.ones(1, 1, 2), torch.ones(1, 1, 2))
    pool.set_kv_buffer(0, [1], torch.full((1, 1, 2), 7.0), torch.full((1, 1, 2), 8.0))
    k, v = pool.read_kv(0, [1])
    assert k.flatten().tolist() == [7.0, 7.0] and v.flatten().tolist() == [8.0, 8.0]


def test_read_returns_copies_and_getters_live_buffers() -> None:
    """read_kv gathers copies; getters return the live buffers."""
    pool = KVPool(4, k_head_num=1, k_head_dim=2)
    k, _ = pool.read_kv(0, [2])
    k.fill_(5.0)
    assert not pool.get_key_buffer(0).any()
    pool.get_key_buffer(0)[3] = 1.0
    assert pool.read_kv(0, [3])[0].flatten().tolist() == [1.0, 1.0]


def test_padding_slot_zero_is_writable() -> None:
    """Slot 0 is a valid row: padded batch positions may write into it."""
    pool = KVPool(4, k_head_num=1, k_head_dim=2)
    pool.set_kv_buffer(0, [0], torch.ones(1, 1, 2), torch.ones(1, 1, 2))
    assert pool.read_kv(0, [0])[0].flatten().tolist() == [1.0, 1.0]


def test_empty_write_and_read() -> None:
    """Writing or reading no rows is a no-op returning empty tensors."""
    pool = KVPool(4, k_head_num=2, k_head_dim=3)
    pool.set_kv_buffer(0, torch.tensor([], dtype=torch.int64), rows(0, 2, 3), rows(0, 2, 3))
    k, v = pool.read_kv(0, [])
    assert k.shape == (0, 2, 3) and v.shape == (0, 2, 3)
    assert not pool.get_key_buffer(0).any()


@pytest.mark.parametrize("bad", [-1, 9, 100])
def test_out_of_range_index_raises_and_writes_nothing(bad: int) -> None:
    """Indices outside [0, size + page_size) raise SlotIndexError; no row is written."""
    pool = KVPool(8, k_head_num=1, k_head_dim=2)
    with pytest.raises(SlotIndexError, match="outside"):
        pool.set_kv_buffer(0, [1, bad], torch.ones(2, 1, 2), torch.ones(2, 1, 2))
    with pytest.raises(SlotIndexError):
        pool.read_kv(0, [bad])
    assert not pool.get_key_buffer(0).any() and not pool.get_value_buffer(0).any()


@pytest.mark.parametrize("layer", [-1, 2, 1.0, True, "0"])
def test_bad_layer_raises(layer: object) -> None:
    """A layer id outside [0, layer_num) or not an int raises InvalidInputError."""
    pool = KVPool(4, layer_num=2, k_head_num=1, k_head_dim=2)
    with pytest.raises(InvalidInputError):
        pool.set_kv_buffer(layer, [1], torch.ones(1, 1, 2), torch.ones(1, 1, 2))  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        pool.get_key_buffer(layer)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        pool.read_kv(layer, [1])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("k_shape", "v_shape"),
    [((2, 1, 2), (1, 1, 2)), ((1, 2, 2), (1, 1, 2)), ((1, 1, 3), (1, 1, 2)), ((1, 2), (1, 1, 2))],
)
def test_shape_mismatch_raises_and_writes_nothing(
    k_shape: tuple[int, ...], v_shape: tuple[int, ...]
) -> None:
    """K/V rows must be [len(indices), heads, dim]; anything else is InvalidInputError."""
    pool = KVPool(4, k_head_num=1, k_head_dim=2)
    with pytest.raises(InvalidInputError, match="shape"):
        pool.set_kv_buffer(0, [1], torch.ones(k_shape), torch.ones(v_shape))
    assert not pool.get_key_buffer(0).any()


@pytest.mark.parametrize("bad", [torch.tensor([1.0]), torch.tensor([True]), [0.5]])
def test_non_integer_indices_raise(bad: object) -> None:
    """Float or bool indices raise InvalidInputError instead of masking or truncating."""
    pool = KVPool(4, k_head_num=1, k_head_dim=2)
    with pytest.raises(InvalidInputError):
        pool.read_kv(0, bad)  # type: ignore[arg-type]


def test_non_tensor_rows_raise() -> None:
    """K and V must be tensors."""
    pool = KVPool(4, k_head_num=1, k_head_dim=2)
    with pytest.raises(InvalidInputError):
        pool.set_kv_buffer(0, [1], [[[1.0, 2.0]]], torch.ones(1, 1, 2))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"size": 0},
        {"size": 4, "page_size": 0},
        {"size": 4, "layer_num": 0},
        {"size": 4, "k_head_dim": -1},
        {"size": 4, "v_head_num": 0},
        {"size": 4, "dtype": "float16"},
        {"size": 4.0},
    ],
)
def test_constructor_rejects_bad_arguments(kwargs: dict[str, object]) -> None:
    """Sizes, counts and dims must be positive ints and dtype a torch.dtype."""
    with pytest.raises(InvalidInputError):
        KVPool(**kwargs)  # type: ignore[arg-type]


def test_writes_cast_to_pool_dtype() -> None:
    """float32 rows written into a bfloat16 pool are stored as bfloat16."""
    pool = KVPool(4, dtype=torch.bfloat16, k_head_num=1, k_head_dim=2)
    pool.set_kv_buffer(0, [2], torch.full((1, 1, 2), 1.5), torch.full((1, 1, 2), -2.0))
    k, v = pool.read_kv(0, [2])
    assert k.dtype == torch.bfloat16
    assert k.flatten().tolist() == [1.5, 1.5] and v.flatten().tolist() == [-2.0, -2.0]


@pytest.mark.gpu
def test_cuda_pool_with_paged_allocator() -> None:
    """On CUDA, buffers live on the GPU and every paged slot round-trips (CPU rows in)."""
    alloc = TokenToKVPoolAllocator(70, device="cuda", page_size=16)
    pool = KVPool(70, page_size=16, layer_num=2, k_head_num=2, k_head_dim=8, device="cuda")
    assert pool.get_key_buffer(1).device.type == "cuda"
    slots = alloc.alloc(alloc.available_size())
    assert slots is not None and slots.device.type == "cuda"
    k = rows(slots.numel(), 2, 8)
    pool.set_kv_buffer(1, slots.cpu(), k, k * 2)
    got_k, got_v = pool.read_kv(1, slots)
    assert got_k.device.type == "cuda"
    assert torch.equal(got_k.float().cpu(), k) and torch.equal(got_v.float().cpu(), k * 2)
    with pytest.raises(SlotIndexError):
        pool.read_kv(0, torch.tensor([86], device="cuda"))
    alloc.free(slots)
    assert alloc.available_size() == 64 and alloc.num_allocated() == 0
