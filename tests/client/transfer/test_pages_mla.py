"""Alloc / Match in pages (``as_pages``), and MLA and fp8 pools over attach and
ReadKV / WriteKV, against a real server."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import torch
from harness import ServerThread, client_of, pack_slots, pb, serve_module, stub_for

from prefixcache.cache.pages import to_slots
from prefixcache.client import InvalidArgument, PrefixCacheClient
from prefixcache.server.config import ConfigError, ModelConfig, PoolConfig, load_config

PS = 4
MODELS = (
    ModelConfig(name="p", page_size=PS, pool=PoolConfig(size=64, k_heads=1, k_head_dim=4)),
    ModelConfig(name="one", page_size=1, pool=PoolConfig(size=32, k_heads=1, k_head_dim=4)),
    ModelConfig(
        name="s", kind="slot", max_seq_len=8, pool=PoolConfig(size=4, k_heads=1, k_head_dim=2)
    ),
    ModelConfig(
        name="mla",
        page_size=PS,
        pool=PoolConfig(size=32, layers=2, k_heads=1, k_head_dim=12, mla=True),
    ),
    ModelConfig(
        name="f8",
        page_size=PS,
        pool=PoolConfig(size=32, layers=2, k_heads=2, k_head_dim=4, dtype="float8_e4m3fn"),
    ),
    ModelConfig(
        name="f8mla",
        page_size=PS,
        pool=PoolConfig(size=32, k_heads=1, k_head_dim=8, dtype="float8_e5m2", mla=True),
    ),
)

pytestmark = pytest.mark.usefixtures("quiet")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    yield from serve_module(tmp_path_factory, "pages", MODELS)


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[PrefixCacheClient]:
    yield from client_of(server)


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bytes as ``dtype`` (NaN payloads included: copies must be bytewise)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(
        0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), dtype=torch.uint8, generator=gen
    ).view(dtype)


# ------------------------------------------------------------------ as_pages


def test_alloc_in_pages_is_whole_aligned_pages(client: PrefixCacheClient) -> None:
    with client.session(5.0) as s:
        reply = s.alloc("p", 10, as_pages=True)
        assert len(reply.slots) == 0 and len(reply.page_ids) == 3
        pages = list(reply.page_ids)
        assert len(set(pages)) == 3 and min(pages) >= 1
        assert client.stats("p").models[0].session_slots == 10
        held = to_slots(pages, PS, 10).tolist()
        # Exactly these slots are held: freeing them frees everything.
        s.free("p", held)
        assert client.stats("p").models[0].session_slots == 0


def test_match_in_pages_equals_the_slot_form(client: PrefixCacheClient) -> None:
    tokens = list(range(100, 112))
    with client.session(5.0) as s:
        pages = list(s.alloc("p", 12, as_pages=True).page_ids)
        s.insert("p", tokens, to_slots(pages, PS).tolist())
        paged = s.match("p", [*tokens, 1, 2, 3, 4, 5], as_pages=True, lock=True, allocate=True)
        plain = client.match("p", tokens)
        assert paged.prefix_len == plain.prefix_len == 12
        assert list(paged.page_ids) == pages and len(paged.slots) == 0
        assert to_slots(paged.page_ids, PS).tolist() == list(plain.slots)
        # 5 allocated slots: 2 pages, the session holds the first 5 slots of them.
        assert len(paged.allocated) == 0 and len(paged.allocated_page_ids) == 2
        assert client.stats("p").models[0].session_slots == 5
        s.free("p", to_slots(paged.allocated_page_ids, PS, 5).tolist())
        s.unlock(paged.lock_id)
    client.reset("p")


def test_match_in_pages_stops_before_a_scattered_page(client: PrefixCacheClient) -> None:
    """Slots an insert was given need not be whole pages; the page form's hit then
    ends before the first that is not, and still locks what it answers."""
    tokens = list(range(200, 212))
    with client.session(5.0) as s:
        a, b, c = to_slots(list(s.alloc("p", 12, as_pages=True).page_ids), PS).reshape(3, PS)
        slots = [*a.tolist(), *b[::-1].tolist(), *c.tolist()]  # page 2 scattered
        s.insert("p", tokens, slots)
        assert client.match("p", tokens).prefix_len == 12
        paged = s.match("p", tokens, as_pages=True, lock=True)
        assert paged.prefix_len == PS and list(paged.page_ids) == [a[0] // PS]
        assert paged.lock_id
        s.unlock(paged.lock_id)
    client.reset("p")


def test_page_size_one_pages_are_slots(client: PrefixCacheClient) -> None:
    with client.session(5.0) as s:
        reply = s.alloc("one", 5, as_pages=True)
        assert len(reply.page_ids) == 5
        s.insert("one", [1, 2, 3, 4, 5], list(reply.page_ids))
        paged = client.match("one", [1, 2, 3, 4, 5, 6], as_pages=True)
        assert (
            list(paged.page_ids)
            == list(reply.page_ids)
            == list(client.match("one", [1, 2, 3, 4, 5]).slots)
        )
    client.reset("one")


def test_as_pages_on_a_slot_model_is_refused_unchanged(client: PrefixCacheClient) -> None:
    with client.session(5.0) as s:
        with pytest.raises(InvalidArgument, match="as_pages"):
            s.alloc("s", 1, as_pages=True)
        with pytest.raises(InvalidArgument, match="as_pages"):
            s.match("s", [1, 2], as_pages=True, allocate=True)
        assert client.stats("s").models[0].session_slots == 0


# ------------------------------------------------------------------ MLA, fp8


def test_mla_pool_is_described_without_v(client: PrefixCacheClient) -> None:
    info = client.describe_pool("mla")
    assert info.mla and (info.v_head_num, info.v_head_dim) == (0, 0)
    assert [(b.role, b.layer) for b in info.buffers] == [("k", 0), ("k", 1)]
    assert not client.describe_pool("p").mla


@pytest.mark.parametrize("model, dtype", [("mla", torch.float16), ("f8mla", torch.float8_e5m2)])
def test_mla_round_trip_through_attach_and_transfer(
    client: PrefixCacheClient, model: str, dtype: torch.dtype
) -> None:
    info = client.describe_pool(model)
    pool = client.attach_pool(model)
    assert pool.v_buffer == [] and len(pool.k_buffer) == info.layer_num
    row = (info.k_head_num, info.k_head_dim)
    with client.session(5.0) as s:
        pages = list(s.alloc(model, 2 * PS, as_pages=True).page_ids)
        slots = to_slots(pages, PS).tolist()
        k = [_random((len(slots), *row), dtype, layer) for layer in range(info.layer_num)]
        # written over the wire, seen in the mapped pool, each page one run of rows
        reply = s.write_kv(model, slots, k)
        assert reply.buffers_written == info.layer_num
        for layer in range(info.layer_num):
            for i, page in enumerate(pages):
                run = pool.k_buffer[layer][page * PS : (page + 1) * PS]
                assert _bytes_equal(run, k[layer][i * PS : (i + 1) * PS])
        # written in the mapped pool, read over the wire
        new = _random((len(slots), *row), dtype, 99)
        pool.k_buffer[0][torch.tensor(slots)] = new
        back = s.read_kv(model, slots)
        assert back.v == [] and _bytes_equal(back.k[0], new)
        with pytest.raises(InvalidArgument, match="no V"):
            s.write_kv(model, slots, k, k)
        s.free(model, slots)
    pool.close()


def test_mla_write_with_a_v_chunk_is_refused(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    channel, stub = stub_for(server.address)
    with channel, client.session(5.0) as s:
        slots = list(s.alloc("mla", 1).slots)
        before = client.read_kv("mla", slots, session=s).k[0].clone()
        header = pb.WriteKVHeader(
            model="mla", slot_indices=pack_slots(slots), layers=[0], session_id=s.session_id
        )
        chunks = [
            pb.KVChunk(header=header),
            pb.KVChunk(role=pb.BUFFER_ROLE_V, layer=0, data=b"\x01" * 24),
        ]
        with pytest.raises(grpc.RpcError) as err:
            stub.WriteKV(iter(chunks))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert _bytes_equal(client.read_kv("mla", slots, session=s).k[0], before)
        s.free("mla", slots)


def test_fp8_round_trip_is_bytewise(client: PrefixCacheClient) -> None:
    dtype = torch.float8_e4m3fn
    with client.session(5.0) as s:
        slots = list(s.alloc("f8", 6).slots)
        k = [_random((6, 2, 4), dtype, 10 + layer) for layer in range(2)]
        v = [_random((6, 2, 4), dtype, 20 + layer) for layer in range(2)]
        s.write_kv("f8", slots, k, v, chunk_bytes=5)
        back = s.read_kv("f8", slots[::-1], chunk_bytes=7)
        for layer in range(2):
            assert back.k[layer].dtype == dtype
            assert _bytes_equal(back.k[layer], k[layer].flip(0))
            assert _bytes_equal(back.v[layer], v[layer].flip(0))
        pool = client.attach_pool("f8")
        assert _bytes_equal(pool.v_buffer[1][torch.tensor(slots)], v[1])
        pool.close()
        s.free("f8", slots)


@pytest.mark.parametrize(
    "pool, message",
    [
        ("{mla: true, v_head_dim: 8}", "no V"),
        ("{mla: true, v_heads: 1}", "no V"),
    ],
)
def test_mla_config_refuses_v(tmp_path: object, pool: str, message: str) -> None:
    path = tmp_path / "pc.yaml"  # type: ignore[operator]
    path.write_text(f"models:\n  - name: x\n    pool: {pool}\n")
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_mla_config_refuses_slot_kind(tmp_path: object) -> None:
    path = tmp_path / "pc.yaml"  # type: ignore[operator]
    path.write_text(
        "models:\n  - name: x\n    kind: slot\n    max_seq_len: 4\n    pool: {size: 2, mla: true}\n"
    )
    with pytest.raises(ConfigError, match="mla"):
        load_config(path)
