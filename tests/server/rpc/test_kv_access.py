"""ReadKV and WriteKV on a shared service: who may read which slots, the
per-read byte cap, the chunk floor, row-by-row writes and the in-flight write budget.

Every limit: the refusal, its status code, nothing changed, and the refusal counted in
``prefixcache_refusals_total``. Real servers on unix sockets, real clients.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from server.harness import SMALL_POOL, ServerThread, pack_slots, pb, running, stub_for

from prefixcache.cache import RadixKey
from prefixcache.client import FailedPrecondition, PrefixCacheClient, ResourceExhausted
from prefixcache.server.config import MambaConfig, ModelConfig, PoolConfig
from prefixcache.server.errors import PreconditionError as FailedPreconditionError
from prefixcache.server.rpc import kv_access, kv_transfer

MODELS = (
    ModelConfig(name="m", page_size=1, pool=SMALL_POOL),  # rows of 8 bytes
    ModelConfig(name="o", page_size=1, pool=SMALL_POOL, open_reads=True),
    ModelConfig(
        name="h",
        kind="mamba",
        page_size=1,
        pool=SMALL_POOL,
        mamba=MambaConfig(
            state_slots=4,
            working_slots=2,
            layers=1,
            conv_state_shape=(3, 2),
            temporal_state_shape=(2, 2),
        ),
    ),
    ModelConfig(
        name="s", kind="slot", max_seq_len=4, pool=PoolConfig(size=4, k_heads=1, k_head_dim=2)
    ),
)
ROW = 8  # bytes of one K (or V) row of model "m": 1 head x 4 dims x float16


def _refusals(srv: ServerThread, limit: str) -> float:
    value = srv.server.metrics.registry.get_sample_value(
        "prefixcache_refusals_total", {"limit": limit}
    )
    return value or 0.0


def _rows(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((1, n, 1, 4), generator=gen).half()


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    with running(
        tmp_path_factory.mktemp("kv"),
        MODELS,
        min_chunk_bytes=1,
        max_request_tokens=4096,
        max_inflight_write_bytes=6,
        max_inflight_write_bytes_total=10,
    ) as thread:
        yield thread


@pytest.fixture(scope="module")
def client(srv: ServerThread) -> Iterator[PrefixCacheClient]:
    with PrefixCacheClient(srv.address, timeout=10) as c:
        yield c


# ------------------------------------------------------------------ who reads


def test_a_read_needs_the_session_that_holds_or_locked_the_slots(
    srv: ServerThread, client: PrefixCacheClient
) -> None:
    with client.session(10) as mine, client.session(10) as other:
        slots = list(mine.alloc("m", 3).slots)
        k = _rows(3, 1)
        mine.write_kv("m", slots, k, k + 1)
        assert torch.equal(mine.read_kv("m", slots, chunk_bytes=5).k[0], k[0])
        with pytest.raises(FailedPrecondition, match="neither held nor locked"):
            other.read_kv("m", slots)
        with pytest.raises(FailedPrecondition, match="needs a session_id"):
            client.read_kv("m", slots)
        # Cached and locked by the writer; another session reads once it locks them too.
        done = mine.insert("m", [7, 8, 9], slots, lock=True)
        assert torch.equal(mine.read_kv("m", slots).v[0], k[0] + 1)
        hit = other.match("m", [7, 8, 9], lock=True)
        assert list(hit.slots) == slots
        assert torch.equal(other.read_kv("m", slots[:2]).k[0], k[0][:2])
        other.unlock(hit.lock_id)
        with pytest.raises(FailedPrecondition, match="neither held nor locked"):
            other.read_kv("m", slots)
        mine.unlock(done.lock_id)


def test_state_slots_and_slot_models_follow_the_same_rule(client: PrefixCacheClient) -> None:
    with client.session(10) as mine, client.session(10) as other:
        got = mine.alloc("h", 1, num_state_slots=1)
        assert mine.read_kv("h", state_slots=got.state_slots).conv[0].shape == (1, 3, 2)
        with pytest.raises(FailedPrecondition, match="state slot"):
            other.read_kv("h", state_slots=got.state_slots)
        mine.free("h", got.slots, state_slots=got.state_slots)

        got = mine.alloc("s", 1)
        slot = list(got.slots)
        rows = torch.ones(1, 1, 4, 1, 2).half()
        mine.write_kv("s", slot, rows, rows)
        with pytest.raises(FailedPrecondition):
            other.read_kv("s", slot)
        mine.insert("s", [1, 2], slot, slot_version=got.slot_versions[0])
        hit = other.match("s", [1, 2], lock=True)  # pins (slot, version)
        assert torch.equal(other.read_kv("s", slot).k[0], rows[0])
        other.unlock(hit.lock_id)
        mine.free("s", slot)


def test_open_reads_lets_anyone_read(client: PrefixCacheClient) -> None:
    with client.session(10) as s:
        slots = list(s.alloc("o", 2).slots)
        k = _rows(2, 2)
        s.write_kv("o", slots, k, k)
        assert torch.equal(client.read_kv("o", slots).k[0], k[0])
        s.free("o", slots)


def test_a_grant_is_checked_again_before_each_chunk(srv: ServerThread) -> None:
    """A slot freed, or a lock released, while the stream waited to send: the next
    chunk's rows are refused, since they may hold somebody else's KV by then."""

    def message(call: Any) -> str:
        try:
            call()
        except FailedPreconditionError as exc:
            return str(exc)
        return "not refused"

    def scenario() -> list[str]:
        service = srv.service
        engine = service.engine("m")
        session = service.open_session(10, "reader")
        none = np.zeros(0, dtype=np.int64)
        try:
            held, _ = engine.alloc(session, 2)
            grant = kv_access.ReadGrant(engine, session, held, none, open_reads=False, bound=False)
            part = kv_transfer.plan(engine, held, [], none)[0]
            engine.free(session, held[1:])
            grant.check(part, 0, 1)  # the row still held reads on
            out = [message(lambda: grant.check(part, 1, 2))]
            engine.free(session, held[:1])

            cached, _ = engine.alloc(session, 2)
            done = engine.insert(RadixKey([9001, 9002]), cached, session, lock=True)
            again = engine.lock(session, done.node_id)  # a second lock on the same node
            elsewhere, _ = engine.alloc(session, 1)
            other = engine.insert(RadixKey([9003]), elsewhere, session, lock=True)
            grant = kv_access.ReadGrant(
                engine, session, cached, none, open_reads=False, bound=False
            )
            part = kv_transfer.plan(engine, cached, [], none)[0]
            engine.unlock(session, other.lock_id)  # a lock the read does not rely on
            grant.check(part, 0, 2)
            engine.unlock(session, done.lock_id)  # the other lock still covers the rows
            grant.check(part, 0, 2)
            engine.unlock(session, again)
            out.append(message(lambda: grant.check(part, 0, 2)))
            return out
        finally:
            service.close_session(session)

    freed, unlocked = srv.run(scenario)
    assert re.fullmatch(
        r"slot \d+ is neither held nor locked by this session \(only "
        r"those may be read\)",
        freed,
    ), freed
    assert re.fullmatch(
        r"lock \d+ was released \(or its slot handed on\) during the "
        r"read",
        unlocked,
    ), unlocked


def test_a_grant_costs_its_rows_not_the_pool(srv: ServerThread) -> None:
    """What a read under locks keeps is the locked rows (no per-call temporaries
    proportional to the pool), and it still tells locked rows from others."""

    def scenario() -> tuple[int, int, list[str]]:
        service = srv.service
        engine = service.engine("m")
        session = service.open_session(10, "reader")
        none = np.zeros(0, dtype=np.int64)
        try:
            cached, _ = engine.alloc(session, 3)
            engine.insert(RadixKey([9101, 9102, 9103]), cached, session, lock=True)
            grant = kv_access.ReadGrant(
                engine, session, cached, none, open_reads=False, bound=False
            )
            part = kv_transfer.plan(engine, cached, [], none)[0]
            grant.check(part, 0, 3)
            loose, _ = engine.alloc(session, 1)
            engine.free(session, loose)
            stray = kv_transfer.plan(engine, np.concatenate([cached, loose]), [], none)[0]
            try:
                grant.check(stray, 3, 4)
                refused = ["not refused"]
            except FailedPreconditionError as exc:
                refused = [str(exc)]
            return len(grant.kv_locked), len(engine._owner), refused
        finally:
            service.close_session(session)

    kept, pool_rows, refused = srv.run(scenario)
    assert kept == 3 < pool_rows
    assert "neither held nor locked" in refused[0], refused


# ------------------------------------------------------------------ read limits


def test_duplicates_count_against_the_read_byte_cap(
    srv: ServerThread, client: PrefixCacheClient
) -> None:
    with client.session(10) as s:
        slot = list(s.alloc("m", 1).slots)
        before = _refusals(srv, "max_read_bytes")
        # By default one read may answer the model's whole pool once (its rows x 16 bytes).
        rows = srv.run(lambda: kv_access.pool_bytes(srv.service.engine("m"))) // (2 * ROW)
        assert rows == 257  # 256 slots and the padding row
        assert len(s.read_kv("m", slot * rows).k[0]) == rows
        with pytest.raises(ResourceExhausted, match="max_read_bytes"):
            s.read_kv("m", slot * (rows + 1))
        assert _refusals(srv, "max_read_bytes") == before + 1
        s.free("m", slot)


def test_the_read_byte_cap_is_a_setting(tmp_path: Path) -> None:
    with (
        running(tmp_path, MODELS[:1], max_read_bytes=64) as srv,
        PrefixCacheClient(srv.address) as c,
        c.session(10) as s,
    ):
        slots = list(s.alloc("m", 5).slots)
        assert len(s.read_kv("m", slots[:4]).k[0]) == 4  # 4 x (8 + 8) bytes
        with pytest.raises(ResourceExhausted, match=r"server\.max_read_bytes"):
            s.read_kv("m", slots)
        with pytest.raises(ResourceExhausted):
            s.read_kv("m", [slots[0]] * 5)


def test_chunks_below_the_floor_are_raised_to_it(tmp_path: Path) -> None:
    with (
        running(tmp_path, MODELS[:1], min_chunk_bytes=24) as srv,
        PrefixCacheClient(srv.address) as c,
        c.session(10) as s,
    ):
        slots = list(s.alloc("m", 10).slots)
        k = _rows(10, 3)
        s.write_kv("m", slots, k, k)
        channel, stub = stub_for(srv.address)
        with channel:
            request = pb.ReadKVRequest(
                model="m",
                slot_indices=pack_slots(slots),
                session_id=s.session_id,
                max_chunk_bytes=1,
            )
            sizes = [len(x.data) for x in stub.ReadKV(request, timeout=10)]
        # 80 bytes per buffer, in 24-byte chunks (whole rows: 3 of 8 bytes), not 160 of 1.
        assert sizes == [24, 24, 24, 8] * 2
        assert torch.equal(s.read_kv("m", slots, chunk_bytes=1).k[0], k[0])


def test_reads_split_anywhere_when_the_floor_allows(client: PrefixCacheClient) -> None:
    with client.session(10) as s:
        slots = list(s.alloc("m", 7).slots)
        k, v = _rows(7, 4), _rows(7, 5)
        s.write_kv("m", slots, k, v, chunk_bytes=8)  # whole rows: this server's budget is 6
        for chunk in (1, 3, 13):
            back = s.read_kv("m", slots[::-1], chunk_bytes=chunk)
            assert torch.equal(back.k[0], k[0].flip(0)) and torch.equal(back.v[0], v[0].flip(0))
        s.free("m", slots)


# ------------------------------------------------------------------ writes


def _header(slots: list[int], session_id: str) -> pb.KVChunk:
    return pb.KVChunk(
        header=pb.WriteKVHeader(model="m", slot_indices=pack_slots(slots), session_id=session_id)
    )


def _budget(srv: ServerThread) -> int:
    return srv.run(lambda: srv.server.servicer.write_budget.total)


def _wait_for_budget(srv: ServerThread, want: int) -> None:
    deadline = time.monotonic() + 10
    while _budget(srv) != want:
        if time.monotonic() > deadline:
            raise AssertionError(f"write budget {_budget(srv)}, expected {want}")
        time.sleep(0.01)


def test_rows_are_written_as_their_bytes_arrive(
    srv: ServerThread, client: PrefixCacheClient
) -> None:
    with client.session(10) as s:
        slots = list(s.alloc("m", 3).slots)
        zero = torch.zeros(1, 3, 1, 4).half()
        s.write_kv("m", slots, zero, zero)
        data = _rows(3, 6)[0].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        channel, stub = stub_for(srv.address)
        with channel, pytest.raises(grpc.RpcError) as err:
            # Two and a half rows of K, then a chunk out of order: the stream fails.
            stub.WriteKV(
                iter(
                    [
                        _header(slots, s.session_id),
                        pb.KVChunk(role=pb.BUFFER_ROLE_K, data=data[:20]),
                        pb.KVChunk(role=pb.BUFFER_ROLE_K, offset_bytes=0, data=data[20:]),
                    ]
                ),
                timeout=10,
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        back = s.read_kv("m", slots).k[0].contiguous().view(torch.uint8).reshape(-1)
        assert back.numpy().tobytes() == data[:16] + bytes(8)  # whole rows only
        _wait_for_budget(srv, 0)  # the half row's bytes were handed back
        s.free("m", slots)


def test_a_half_sent_write_holds_a_partial_row_not_a_layer(
    srv: ServerThread, client: PrefixCacheClient
) -> None:
    with client.session(10) as s:
        slots = list(s.alloc("m", 100).slots)
        k = _rows(100, 7)
        data = k[0].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        go = threading.Event()

        def chunks() -> Iterator[pb.KVChunk]:
            yield _header(slots, s.session_id)
            yield pb.KVChunk(role=pb.BUFFER_ROLE_K, data=data[:403])  # 50 rows + 3 bytes
            go.wait(10)
            yield pb.KVChunk(role=pb.BUFFER_ROLE_K, offset_bytes=403, data=data[403:])
            yield pb.KVChunk(role=pb.BUFFER_ROLE_V, data=data)

        channel, stub = stub_for(srv.address)
        with channel:
            future = stub.WriteKV.future(chunks(), timeout=10)
            _wait_for_budget(srv, 3)  # 400 bytes already in the pool, 3 held
            assert torch.equal(s.read_kv("m", slots[:50]).k[0], k[0][:50])
            go.set()
            assert future.result().bytes_written == 2 * len(data)
        _wait_for_budget(srv, 0)
        assert torch.equal(s.read_kv("m", slots).v[0], k[0])
        s.free("m", slots)


def test_inflight_write_bytes_are_capped_per_session_and_in_total(
    srv: ServerThread, client: PrefixCacheClient
) -> None:
    with client.session(10) as one, client.session(10) as two:
        mine, theirs = list(one.alloc("m", 1).slots), list(two.alloc("m", 1).slots)
        zero = torch.zeros(1, 1, 1, 4).half()
        one.write_kv("m", mine, zero, zero)
        channel, stub = stub_for(srv.address)
        with channel:
            per_session = _refusals(srv, "max_inflight_write_bytes")
            with pytest.raises(grpc.RpcError) as err:  # 7 bytes of an 8-byte row > 6
                stub.WriteKV(
                    iter(
                        [
                            _header(mine, one.session_id),
                            pb.KVChunk(role=pb.BUFFER_ROLE_K, data=b"\1" * 7),
                        ]
                    ),
                    timeout=10,
                )
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "server.max_inflight_write_bytes " in (err.value.details() or "")
            assert _refusals(srv, "max_inflight_write_bytes") == per_session + 1
            assert not one.read_kv("m", mine).k[0].any()  # nothing written

            go = threading.Event()

            def held() -> Iterator[pb.KVChunk]:
                yield _header(mine, one.session_id)
                yield pb.KVChunk(role=pb.BUFFER_ROLE_K, data=b"\1" * 5)
                go.wait(10)

            future = stub.WriteKV.future(held(), timeout=10)
            _wait_for_budget(srv, 5)
            total = _refusals(srv, "max_inflight_write_bytes_total")
            with pytest.raises(grpc.RpcError) as err:  # 5 + 6 > 10 in all
                stub.WriteKV(
                    iter(
                        [
                            _header(theirs, two.session_id),
                            pb.KVChunk(role=pb.BUFFER_ROLE_K, data=b"\1" * 6),
                        ]
                    ),
                    timeout=10,
                )
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_inflight_write_bytes_total" in (err.value.details() or "")
            assert _refusals(srv, "max_inflight_write_bytes_total") == total + 1
            go.set()
            with pytest.raises(grpc.RpcError):  # it ends half-sent: INVALID_ARGUMENT
                future.result()
        _wait_for_budget(srv, 0)
        assert not one.read_kv("m", mine).k[0].any()
        one.free("m", mine)
        two.free("m", theirs)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 40), min_size=1, max_size=20),
    st.integers(1, 9),
    st.binary(min_size=8 * 9, max_size=8 * 9),
)
def test_any_chunking_writes_the_same_rows(cuts: list[int], n: int, data: bytes) -> None:
    """A write split anywhere, even inside rows, writes the same bytes, and never holds
    more than one row's bytes less one."""
    view = torch.zeros(12, 1, 4, dtype=torch.float16)
    rows = np.array([3, 0, 11, 5, 7, 1, 2, 9, 4][:n], dtype=np.int64)
    part = kv_transfer._part(pb.BUFFER_ROLE_K, 0, view, rows)
    budget = kv_access.WriteBudget(ROW - 1, ROW - 1)
    writer = kv_transfer.Writer([part], lambda *_: None, lambda d: budget.hold("s", d))
    data = data[: n * ROW]
    offset, i = 0, 0
    while offset < len(data):
        size = cuts[i % len(cuts)]
        writer.add(
            pb.KVChunk(
                role=pb.BUFFER_ROLE_K, offset_bytes=offset, data=data[offset : offset + size]
            )
        )
        offset = min(offset + size, len(data))
        i += 1
        assert budget.total == writer.held == offset % ROW
    assert writer.finish() == 1 and writer.bytes_written == len(data)
    writer.close()
    assert budget.total == 0
    got = view[torch.from_numpy(rows)].contiguous().view(torch.uint8).reshape(-1)
    assert got.numpy().tobytes() == data
