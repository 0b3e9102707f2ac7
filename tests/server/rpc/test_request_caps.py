"""Requests over their byte cap are refused before they are parsed (request_caps.py), and
ReadKV is sized before any plan is built: the refusal, its status code and
setting, nothing changed, and the refusal counted in prefixcache_refusals_total.

That a request was not parsed shows in bytes that would not parse: past the cap they
are RESOURCE_EXHAUSTED (or the oversized string's INVALID_ARGUMENT), never "malformed".
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from harness import (
    SMALL_POOL,
    pack_slots,
    pb,
    running,
    serve_module,
    stub_for,
    stub_of,
    toks,
)

from prefixcache.server.access.limits import limits_of
from prefixcache.server.config import (
    ConfigError,
    MambaConfig,
    ModelConfig,
    PoolConfig,
    ServerConfig,
    build_server_config,
)
from prefixcache.server.rpc import kv_access, kv_transfer, request_caps

CODE = grpc.StatusCode
TOKENS = 4096  # max_request_tokens
MODELS = (ModelConfig(name="m", page_size=1, pool=SMALL_POOL),)
LIMITS = limits_of(ServerConfig(max_request_tokens=TOKENS, max_step_bytes=1 << 16))
CAPS = request_caps.derive(LIMITS, MODELS)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    yield from serve_module(
        tmp_path_factory, "caps", MODELS, max_request_tokens=TOKENS, max_step_bytes=1 << 16
    )


@pytest.fixture(scope="module")
def stub(server) -> Iterator:
    yield from stub_of(server)


def refusals(server, limit: str) -> float:
    value = server.server.metrics.registry.get_sample_value(
        "prefixcache_refusals_total", {"limit": limit}
    )
    return 0.0 if value is None else value


def raw_call(server, method: str, data: bytes) -> grpc.RpcError:
    """Send ``data`` as the request bytes of unary ``method``; the error it gets."""
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(
            f"/prefixcache.v1.PrefixCache/{method}",
            request_serializer=None,
            response_deserializer=None,
        )
        with pytest.raises(grpc.RpcError) as err:
            call(data, timeout=10)
    return err.value


def unchanged(server, stub, limit: str, expected: int, body) -> None:
    """``body()`` leaves Stats and the caches as they were, with ``expected`` refusals of
    ``limit`` counted."""
    before, count = stub.Stats(pb.StatsRequest()), refusals(server, limit)
    body()
    assert stub.Stats(pb.StatsRequest()) == before
    server.check_integrity()
    assert refusals(server, limit) == count + expected


def test_caps_follow_the_limits() -> None:
    base = request_caps.BASE + 4096 + 128 + 256  # the string limits' defaults
    assert CAPS["KeepAliveRequest"] == CAPS["LockRequest"] == base
    assert CAPS["MatchRequest"] == base + TOKENS * 4 * 8
    assert CAPS["InsertRequest"] == base + TOKENS * (4 * 8 + 8)
    assert CAPS["ReadKVRequest"] == base + 2 * TOKENS * 8
    assert CAPS["StepRequest"] == base + (1 << 16) + 8192 * (request_caps.STEP_ITEM + 4096)
    assert CAPS["SessionRequest"] == max(CAPS["StepRequest"], CAPS["InsertRequest"]) + 32
    assert "KVChunk" not in CAPS  # WriteKV's data chunks: max_message_bytes only
    # Without max_step_bytes a Step is capped by its items x the largest item (a
    # finish at the pool's 256 tokens); the setting replaces every cap.
    default = request_caps.derive(limits_of(), MODELS)
    assert default["StepRequest"] == base + 8192 * (
        request_caps.STEP_ITEM + 4096 + 256 * (4 * 8 + 8)
    )
    fixed = request_caps.derive(limits_of(ServerConfig(max_request_bytes=5000)), MODELS)
    assert set(fixed.values()) == {5000}


def test_bytes_over_the_cap_are_refused_unparsed(server, stub) -> None:
    match = pb.MatchRequest(model="m", token_ids=toks(range(8))).SerializeToString()
    # A length-delimited field 15 claiming more bytes than follow: does not parse.
    broken = match + b"\x7a\xff\xff\x03" + b"\0" * CAPS["MatchRequest"]
    err = raw_call(server, "Match", match + b"\x7a\xff\xff\x03")
    assert err.code() == CODE.INVALID_ARGUMENT and "malformed" in err.details()

    def body() -> None:
        err = raw_call(server, "Match", broken)
        assert err.code() == CODE.RESOURCE_EXHAUSTED, err.details()
        assert "server.max_request_bytes" in err.details()
        assert "before parsing" in err.details()

    unchanged(server, stub, "max_request_bytes", 1, body)


def test_token_ids_past_the_cap_are_resource_exhausted(server, stub) -> None:
    too_many = CAPS["MatchRequest"] // 4 + 64  # at width 1
    request = pb.MatchRequest(
        model="m", token_ids=toks(np.zeros(too_many)), lock=True, allocate=True
    )

    def body() -> None:
        with pytest.raises(grpc.RpcError) as err:
            stub.Match(request, timeout=10)
        assert err.value.code() == CODE.RESOURCE_EXHAUSTED
        assert "server.max_request_bytes" in err.value.details()

    unchanged(server, stub, "max_request_bytes", 1, body)


def test_an_oversized_string_is_its_own_refusal_without_parsing(server, stub) -> None:
    # 256 KiB of extra_key that is not UTF-8: parsing would call it malformed.
    request = pb.MatchRequest(model="m", token_ids=toks([1])).SerializeToString()
    data = request + b"\x12\x80\x80\x10" + b"\xff" * (1 << 18)
    assert len(data) > CAPS["MatchRequest"]

    def body() -> None:
        err = raw_call(server, "Match", data)
        assert err.code() == CODE.INVALID_ARGUMENT, err.details()
        assert "extra_key" in err.details()
        assert "server.max_extra_key_bytes" in err.details()

    unchanged(server, stub, "max_extra_key_bytes", 1, body)


def test_control_messages_have_a_small_cap(server, stub) -> None:
    sid = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=60)).session_id
    # Unknown fields parse (and would be dropped): only the cap refuses them.
    keep = pb.KeepAliveRequest(session_id=sid).SerializeToString()
    padded = keep + b"\x7a\x80\x80\x08" + b"\0" * (1 << 17)
    assert len(padded) > CAPS["KeepAliveRequest"]

    def body() -> None:
        for method in ("KeepAlive", "CloseSession"):
            err = raw_call(server, method, padded)
            assert err.code() == CODE.RESOURCE_EXHAUSTED, err.details()
            assert "server.max_request_bytes" in err.details()

    unchanged(server, stub, "max_request_bytes", 2, body)
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


def test_a_step_over_its_cap_is_refused(server, stub) -> None:
    sid = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=60)).session_id
    admit = pb.StepAdmit(token_ids=toks(np.zeros(TOKENS)), extra_key="k" * 4096)
    step = pb.StepRequest(model="m", session_id=sid, admits=[admit] * 2048)
    assert step.ByteSize() > CAPS["StepRequest"]

    def body() -> None:
        with pytest.raises(grpc.RpcError) as err:
            stub.Step(step, timeout=30)
        assert err.value.code() == CODE.RESOURCE_EXHAUSTED
        assert "server.max_request_bytes" in err.value.details()

    unchanged(server, stub, "max_request_bytes", 1, body)
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


def test_a_session_stream_message_over_its_cap_is_an_error_reply(server, stub) -> None:
    too_many = CAPS["MatchRequest"] // 4 + 64  # at width 1
    requests = [
        pb.SessionRequest(
            seq=7,
            match=pb.MatchRequest(model="m", token_ids=toks(np.zeros(too_many)), allocate=True),
        ),
        pb.SessionRequest(seq=8, keep_alive=pb.KeepAliveRequest()),
    ]

    def body() -> None:
        replies = list(stub.Session(iter(requests), timeout=30))
        assert [r.seq for r in replies] == [7, 8]  # the refusal still pairs with its seq
        assert replies[0].error.code == CODE.RESOURCE_EXHAUSTED.value[0]
        assert "server.max_request_bytes" in replies[0].error.message
        assert replies[1].WhichOneof("result") == "keep_alive"  # the stream goes on

    unchanged(server, stub, "max_request_bytes", 1, body)


def test_the_cap_is_a_setting(tmp_path) -> None:
    with pytest.raises(ConfigError, match="max_request_bytes"):
        build_server_config({"max_request_bytes": -1})
    assert build_server_config({"max_request_bytes": 4096}).max_request_bytes == 4096
    with running(tmp_path, MODELS, max_request_bytes=4096) as srv:
        channel, stub = stub_for(srv.address)
        stub.Match(pb.MatchRequest(model="m", token_ids=toks(range(200))), timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            stub.Match(pb.MatchRequest(model="m", token_ids=toks(range(1100))), timeout=10)
        assert err.value.code() == CODE.RESOURCE_EXHAUSTED
        assert refusals(srv, "max_request_bytes") == 1
        channel.close()


# ------------------------------------------------------- ReadKV, sized first


def test_a_read_is_sized_before_any_slot_is_looked_at(server, stub) -> None:
    """One slot named past max_read_bytes' worth is refused from the counts alone: an
    out-of-range slot among them would otherwise be the refusal (INVALID_ARGUMENT)."""
    sid = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=60)).session_id
    slot = stub.Alloc(pb.AllocRequest(model="m", num_slots=1, session_id=sid)).slot_indices
    rows = kv_transfer.transfer_bytes(server.service.engine("m"), 1, [], 0)
    pool = server.run(kv_access.pool_bytes, server.service.engine("m"))
    count = pool // rows + 1
    request = pb.ReadKVRequest(
        model="m", session_id=sid, slot_indices=slot * (count - 1) + pack_slots([10**9])
    )

    def body() -> None:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.ReadKV(request, timeout=10))
        assert err.value.code() == CODE.RESOURCE_EXHAUSTED
        assert "server.max_read_bytes" in err.value.details()

    unchanged(server, stub, "max_read_bytes", 1, body)
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


@pytest.mark.parametrize(
    "model",
    [
        ModelConfig(
            name="r",
            page_size=1,
            pool=PoolConfig(size=16, layers=3, k_heads=1, k_head_dim=4, v_head_dim=2),
        ),
        ModelConfig(
            name="h",
            kind="mamba",
            page_size=1,
            pool=PoolConfig(size=256, layers=2, k_heads=1, k_head_dim=4),
            mamba=MambaConfig(
                state_slots=4,
                working_slots=2,
                layers=2,
                conv_state_shape=(3, 2),
                temporal_state_shape=(2, 2),
            ),
        ),
        ModelConfig(
            name="s",
            kind="slot",
            max_seq_len=4,
            pool=PoolConfig(size=4, layers=2, k_heads=1, k_head_dim=2),
        ),
    ],
    ids=lambda m: m.kind,
)
def test_transfer_bytes_is_the_plans_size_and_the_plan_shares_its_index(tmp_path, model) -> None:
    with running(tmp_path, (model,)) as srv:
        engine = srv.service.engine(model.name)
        low = 0 if model.kind == "slot" else 1
        slots = np.array([low, low + 1, low, low + 2], dtype=np.int64)
        states = (
            np.array([0, 1, 1], dtype=np.int64)
            if model.kind == "mamba"
            else np.zeros(0, dtype=np.int64)
        )
        for layers in ([], [1], [1, 0]):
            parts = srv.run(kv_transfer.plan, engine, slots, layers, states)
            assert srv.run(
                kv_transfer.transfer_bytes, engine, len(slots), layers, len(states)
            ) == sum(p.nbytes for p in parts)
            # One index per row vector, whatever the number of buffers.
            assert len({id(p.index) for p in parts}) == 1 + (len(states) > 0)
