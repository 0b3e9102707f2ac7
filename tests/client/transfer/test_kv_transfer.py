"""ReadKV / WriteKV: byte-exact round trips in chunks of any size, refusals, the
message limit."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch
from harness import ServerThread, pack_slots, pb, running, stub_for

from prefixcache.client import (
    AsyncPrefixCacheClient,
    FailedPrecondition,
    InvalidArgument,
    PrefixCacheClient,
    ResourceExhausted,
)
from prefixcache.server.config import ModelConfig, PoolConfig

pytestmark = pytest.mark.usefixtures("quiet")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (random floats may hold NaN payloads)."""
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(
        0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), dtype=torch.uint8, generator=gen
    ).view(dtype)


@pytest.mark.parametrize("chunk", [None, 3, 8, 13, 64])
def test_round_trip_in_chunks(client: PrefixCacheClient, chunk: int | None) -> None:
    with client.session(5.0) as s:
        slots = list(s.alloc("m", 7).slots)
        k = _random((1, 7, 1, 4), torch.float16, 1)
        v = _random((1, 7, 1, 4), torch.float16, 2)
        reply = s.write_kv("m", slots, k, v, chunk_bytes=chunk)
        assert (reply.bytes_written, reply.buffers_written) == (2 * 7 * 8, 2)
        back = s.read_kv("m", slots[::-1], chunk_bytes=chunk)
        assert back.layers == (0,)
        assert _same(back.k[0], k[0].flip(0)) and _same(back.v[0], v[0].flip(0))
        # In order: one run of slots is sliced from the pool, not gathered.
        ahead = s.read_kv("m", sorted(slots), chunk_bytes=chunk)
        order = sorted(range(7), key=slots.__getitem__)
        assert _same(ahead.k[0], k[0][order]) and _same(ahead.v[0], v[0][order])
        s.free("m", slots)


def test_read_into_staging_buffers(client: PrefixCacheClient) -> None:
    """read_kv(out=...) fills an earlier result in place (a worker's staging buffers)."""
    with client.session(5.0) as s:
        slots = list(s.alloc("m", 5).slots)
        first = [_random((5, 1, 4), torch.float16, 8)], [_random((5, 1, 4), torch.float16, 9)]
        s.write_kv("m", slots, *first)
        staging = s.read_kv("m", slots, chunk_bytes=6)
        pointers = [t.data_ptr() for t in staging.k + staging.v]
        second = [_random((5, 1, 4), torch.float16, 10)], [_random((5, 1, 4), torch.float16, 11)]
        s.write_kv("m", slots, *second)
        back = s.read_kv("m", slots, chunk_bytes=6, out=staging)
        assert [t.data_ptr() for t in back.k + back.v] == pointers
        assert _same(back.k[0], second[0][0]) and _same(back.v[0], second[1][0])
        with pytest.raises(InvalidArgument, match="needs a contiguous CPU"):
            s.read_kv("m", slots[:4], out=staging)
        s.free("m", slots)


def test_mamba_state_and_slot_model(client: PrefixCacheClient) -> None:
    with client.session(5.0) as s:
        got = s.alloc("h", 2, num_state_slots=2)
        conv = _random((2, 2, 3, 2), torch.float16, 3)
        temporal = _random((2, 2, 2, 2, 2), torch.float32, 4)
        k = [_random((2, 1, 4), torch.float16, 5)]
        v = [_random((2, 1, 4), torch.float16, 6)]
        s.write_kv(
            "h",
            got.slots,
            k,
            v,
            state_slots=got.state_slots,
            conv=conv,
            temporal=temporal,
            chunk_bytes=5,
        )
        back = s.read_kv("h", got.slots, state_slots=got.state_slots, chunk_bytes=7)
        assert _same(back.k[0], k[0]) and _same(back.v[0], v[0])
        assert all(_same(back.conv[i], conv[i]) for i in range(2))
        assert all(_same(back.temporal[i], temporal[i]) for i in range(2))
        state_only = s.read_kv("h", state_slots=got.state_slots[:1])
        assert state_only.k[0].shape == (0, 1, 4) and _same(state_only.conv[1], conv[1][:1])
        s.free("h", got.slots, state_slots=got.state_slots)

        slot = s.alloc("s", 1).slots
        rows = _random((1, 1, 16, 1, 2), torch.float16, 7)
        s.write_kv("s", slot, rows, rows + 1, chunk_bytes=10)
        back = s.read_kv("s", slot)
        assert _same(back.k[0], rows[0]) and _same(back.v[0], rows[0] + 1)
        s.free("s", slot)


def test_refusals(client: PrefixCacheClient, server: ServerThread) -> None:
    k = torch.zeros(1, 2, 1, 4, dtype=torch.float16)
    with client.session(5.0) as s, client.session(5.0) as other:
        mine = list(s.alloc("m", 2).slots)
        theirs = list(other.alloc("m", 2).slots)
        with pytest.raises(FailedPrecondition, match="not held"):
            s.write_kv("m", theirs, k, k)
        with pytest.raises(FailedPrecondition, match="session"):
            client.write_kv("m", mine, k, k, session="")
        with pytest.raises(InvalidArgument, match="outside"):
            s.write_kv("m", [0, 1 << 20], k, k)
        with pytest.raises(InvalidArgument, match="outside"):
            s.read_kv("m", [1 << 20])
        with pytest.raises(InvalidArgument, match="layer"):
            s.read_kv("m", mine, layers=[3])
        with pytest.raises(InvalidArgument, match="shape"):
            s.write_kv("m", mine, k[:, :1], k[:, :1])
        with pytest.raises(InvalidArgument, match="twice"):
            s.write_kv("m", [mine[0], mine[0]], k, k)
        with pytest.raises(FailedPrecondition, match="Mamba"):
            s.read_kv("m", mine, state_slots=[1])
        # Wrong byte counts on the raw wire: too many, too few, out of order.
        channel, stub = stub_for(server.address)
        head = pb.KVChunk(
            header=pb.WriteKVHeader(
                model="m", slot_indices=pack_slots(mine), session_id=s.session_id
            )
        )
        k_role = pb.BUFFER_ROLE_K
        for bad, message in (
            ([pb.KVChunk(role=k_role, data=bytes(17))], "more than"),
            ([pb.KVChunk(role=k_role, data=bytes(16))], "V\\[0\\]: 0 of 16"),
            ([pb.KVChunk(role=k_role, offset_bytes=4, data=bytes(4))], "offset"),
            ([pb.KVChunk(role=pb.BUFFER_ROLE_CONV, data=bytes(4))], "does not cover"),
            ([], "K\\[0\\]: 0 of 16"),
        ):
            with pytest.raises(grpc.RpcError) as err:
                stub.WriteKV(iter([head, *bad]), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() and __import__("re").search(message, err.value.details())
        channel.close()
        # Slots freed while nothing was written are refused at the header.
        s.free("m", mine)
        with pytest.raises(FailedPrecondition):
            s.write_kv("m", mine, k, k)
        other.free("m", theirs)


def test_message_limit(tmp_path: Path) -> None:
    model = ModelConfig(name="big", pool=PoolConfig(size=64, k_heads=4, k_head_dim=128))
    with running(tmp_path, [model], max_message_bytes=4096) as srv:
        with PrefixCacheClient(srv.address, max_message_bytes=4096) as c, c.session(5) as s:
            slots = list(s.alloc("big", 9).slots)
            k = _random((1, 9, 4, 128), torch.float16, 8)
            s.write_kv("big", slots, k, k + 1, chunk_bytes=1 << 20)  # clamped to the limit
            assert _same(s.read_kv("big", slots, chunk_bytes=1 << 20).k[0], k[0])
            channel, stub = stub_for(srv.address)
            chunks = list(
                stub.ReadKV(
                    pb.ReadKVRequest(
                        model="big", slot_indices=pack_slots(slots), session_id=s.session_id
                    ),
                    timeout=5,
                )
            )
            # 9 rows of 1 KiB per buffer, at most 3 KiB (4096 less room for the rest) a chunk
            assert max(x.ByteSize() for x in chunks) <= 4096 and len(chunks) == 2 * 3
            channel.close()
        with PrefixCacheClient(srv.address) as c, c.session(5) as s:
            slots = list(s.alloc("big", 9).slots)
            with pytest.raises(ResourceExhausted):
                s.write_kv("big", slots, k, k, chunk_bytes=8192)


def test_async_round_trip(server: ServerThread) -> None:
    async def main() -> None:
        async with AsyncPrefixCacheClient(server.address, timeout=5) as c, c.session(5.0) as s:
            slots = list((await s.alloc("p", 5)).slots)
            k = _random((1, 5, 1, 4), torch.float16, 9)
            await s.write_kv("p", slots, k, k, chunk_bytes=6)
            back = await s.read_kv("p", slots, chunk_bytes=11)
            assert _same(back.k[0], k[0]) and _same(back.v[0], k[0])
            with pytest.raises(FailedPrecondition):
                await c.write_kv("p", [slots[0] + 40], k[:, :1], k[:, :1], session=s)
            pool = await c.attach_pool("p")
            assert _same(pool.k_buffer[0][slots], k[0])
            await s.free("p", slots)

    asyncio.run(main())


@pytest.mark.parametrize(
    ("role", "layer", "offset", "data"),
    [
        (pb.BUFFER_ROLE_K, 0, 0, b"abc"),
        (pb.BUFFER_ROLE_V, 31, 2**40 + 5, bytes(range(256)) * 3),
        (pb.BUFFER_ROLE_CONV, 5, 0, b""),
        (pb.BUFFER_ROLE_TEMPORAL, 0, 7, b"\x00"),
    ],
)
def test_chunks_by_hand_are_protobufs(role: int, layer: int, offset: int, data: bytes) -> None:
    """The hand-serialized chunks (the server's ReadKV replies, the client's WriteKV data)
    are byte for byte protobuf's, and the client's parser reads protobuf's (data as a
    view) as protobuf does."""
    from prefixcache.client.transfer.kv import encode_chunk as client_encode
    from prefixcache.client.transfer.kv import parse_chunk
    from prefixcache.server.rpc.kv_wire import encode_chunk

    wire = pb.KVChunk(role=role, layer=layer, offset_bytes=offset, data=data).SerializeToString()
    assert encode_chunk(role, layer, offset, memoryview(data)) == wire
    assert client_encode(role, layer, offset, memoryview(data)) == wire  # WriteKV's
    got = parse_chunk(wire)
    assert (got.role, got.layer, got.offset_bytes, bytes(got.data)) == (role, layer, offset, data)


def test_malformed_chunks_are_refused() -> None:
    from prefixcache.client.transfer.kv import parse_chunk

    wire = pb.KVChunk(role=1, layer=2, offset_bytes=3, data=b"x" * 50).SerializeToString()
    for bad in (wire[:-1], wire[:5], b"\x80", b"\x07"):
        with pytest.raises(InvalidArgument, match="malformed ReadKV chunk"):
            parse_chunk(bad)
    # A field the parser does not know (a header) is skipped, as protobuf skips it.
    header = pb.KVChunk(header=pb.WriteKVHeader(model="m")).SerializeToString()
    assert bytes(parse_chunk(header + wire).data) == b"x" * 50


def test_write_chunks_parsed_by_hand_on_the_server() -> None:
    """WriteKV's data chunks are read by hand (data a view of the message) as protobuf
    reads them; a header, an unknown field or malformed bytes go to protobuf instead."""
    from prefixcache.server.rpc.kv_wire import parse_data_chunk

    for chunk in (
        pb.KVChunk(role=2, layer=7, offset_bytes=2**33, data=b"y" * 300),
        pb.KVChunk(role=1),
        pb.KVChunk(),
    ):
        got = parse_data_chunk(chunk.SerializeToString())
        assert got is not None and not got.HasField("header")
        assert (got.role, got.layer, got.offset_bytes, bytes(got.data)) == (
            chunk.role,
            chunk.layer,
            chunk.offset_bytes,
            chunk.data,
        )
    header = pb.KVChunk(header=pb.WriteKVHeader(model="m")).SerializeToString()
    data = pb.KVChunk(role=1, data=b"abc").SerializeToString()
    for other in (
        header,
        header + data,
        data[:-1],
        b"\x80",
        data + b"\x30\x01",
        pb.KVChunk(role=-1).SerializeToString(),
    ):
        assert parse_data_chunk(other) is None
