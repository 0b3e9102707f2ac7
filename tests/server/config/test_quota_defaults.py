"""Quotas whose defaults bound a session: a per-session cap on Mamba state slots, a
default byte cap on Step, and an "auto" cap on locked tokens that keeps one session from
protecting the whole cache. Each refusal: RESOURCE_EXHAUSTED naming the setting, Stats (every model,
every session's holdings) unchanged, the cache's integrity, and one count in
prefixcache_refusals_total{limit}.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from harness import (
    SMALL_POOL,
    pb,
    running,
    serve_module,
    stub_for,
    stub_of,
    toks,
)

from prefixcache.server.access.limits import limits_of
from prefixcache.server.config import MambaConfig, ModelConfig, PoolConfig, ServerConfig
from prefixcache.server.rpc import request_caps

CODE = grpc.StatusCode
MAMBA = ModelConfig(
    name="h",
    kind="mamba",
    page_size=1,
    pool=SMALL_POOL,
    mamba=MambaConfig(
        state_slots=6,
        working_slots=1,
        layers=1,
        conv_state_shape=(3, 2),
        temporal_state_shape=(2, 2, 2),
    ),
)
MODELS = (
    ModelConfig(name="m", page_size=1, pool=SMALL_POOL),
    MAMBA,
    ModelConfig(
        name="s", kind="slot", max_seq_len=16, pool=PoolConfig(size=4, k_heads=1, k_head_dim=2)
    ),
)
STATES = 2  # max_session_state_slots


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    # Every other limit at its default; the locked-token cap is the derived one (auto).
    yield from serve_module(
        tmp_path_factory,
        "quota-defaults",
        MODELS,
        max_session_state_slots=STATES,
        max_session_locked_tokens=None,
    )


@pytest.fixture(scope="module")
def stub(server) -> Iterator:
    yield from stub_of(server)


@pytest.fixture
def sid(stub) -> Iterator[str]:
    session_id = stub.OpenSession(pb.OpenSessionRequest()).session_id
    yield session_id
    stub.CloseSession(pb.CloseSessionRequest(session_id=session_id))


def refusals(server, limit: str) -> float:
    return (
        server.server.metrics.registry.get_sample_value(
            "prefixcache_refusals_total", {"limit": limit}
        )
        or 0.0
    )


def snapshot(stub) -> pb.StatsResponse:
    reply = stub.Stats(pb.StatsRequest(top_sessions=100), timeout=10)
    for h in reply.top_sessions:
        h.ClearField("lease_left_seconds")  # the clock moves on
    return reply


def refused(server, stub, limit: str, call, request) -> str:
    """``call(request)`` is RESOURCE_EXHAUSTED naming ``limit`` and changes nothing."""
    before, count = snapshot(stub), refusals(server, limit)
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=30)
    assert err.value.code() == CODE.RESOURCE_EXHAUSTED, err.value.details()
    assert f"server.{limit}" in err.value.details()
    assert snapshot(stub) == before
    server.check_integrity()
    assert refusals(server, limit) == count + 1
    return err.value.details()


def mine(stub, sid: str) -> pb.SessionHoldings:
    reply = stub.Stats(pb.StatsRequest(top_sessions=1000), timeout=10)
    (found,) = [h for h in reply.top_sessions if sid.startswith(h.session)]
    return found


# ------------------------------------------------------------------ state slots


def test_state_slots_past_the_session_quota_are_refused(server, stub, sid) -> None:
    stub.Alloc(pb.AllocRequest(model="h", num_slots=1, num_state_slots=STATES, session_id=sid))
    assert "holds 2 state slots" in refused(
        server,
        stub,
        "max_session_state_slots",
        stub.Alloc,
        pb.AllocRequest(model="h", num_slots=3, num_state_slots=1, session_id=sid),
    )
    # A Match with allocate takes a state slot too: refused before it locks anything.
    refused(
        server,
        stub,
        "max_session_state_slots",
        stub.Match,
        pb.MatchRequest(
            model="h", token_ids=toks([1, 2, 3]), allocate=True, lock=True, session_id=sid
        ),
    )
    held = mine(stub, sid)
    assert (held.slots, held.state_slots, held.locks) == (1, STATES, 0)
    # A Step admission is refused as its Match would be, the item alone.
    before = refusals(server, "max_session_state_slots")
    reply = stub.Step(
        pb.StepRequest(
            model="h", session_id=sid, admits=[pb.StepAdmit(token_ids=toks([5, 6]), allocate=True)]
        )
    )
    assert reply.admits[0].error.code == CODE.RESOURCE_EXHAUSTED.value[0]
    assert "server.max_session_state_slots" in reply.admits[0].error.message
    assert refusals(server, "max_session_state_slots") == before + 1
    assert mine(stub, sid).state_slots == STATES
    server.check_integrity()


def test_freeing_state_slots_gives_the_quota_back(server, stub, sid) -> None:
    got = stub.Alloc(
        pb.AllocRequest(model="h", num_slots=1, num_state_slots=STATES, session_id=sid)
    )
    stub.Free(
        pb.FreeRequest(model="h", slot_indices=b"", state_slots=got.state_slots, session_id=sid)
    )
    stub.Alloc(pb.AllocRequest(model="h", num_slots=1, num_state_slots=STATES, session_id=sid))
    # Another session is not held to this one's count.
    other = stub.OpenSession(pb.OpenSessionRequest()).session_id
    try:
        stub.Alloc(
            pb.AllocRequest(model="h", num_slots=1, num_state_slots=STATES, session_id=other)
        )
    finally:
        stub.CloseSession(pb.CloseSessionRequest(session_id=other))
    server.check_integrity()


def test_the_state_slot_quota_defaults_to_the_state_pool(tmp_path) -> None:
    with running(tmp_path, (MAMBA,)) as srv:
        assert srv.service.engines["h"].quota.state_slots == 6
        channel, stub = stub_for(srv.address)
        with channel:
            sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
            stub.Alloc(pb.AllocRequest(model="h", num_slots=1, num_state_slots=6, session_id=sid))
            srv.check_integrity()


# ---------------------------------------------------------------- Step bytes


def test_a_step_has_a_byte_cap_by_default() -> None:
    caps = request_caps.derive(limits_of(ServerConfig(max_step_items=4)), MODELS)
    base = request_caps.BASE + 4096 + 128 + 256
    # The largest item is a finish of the largest pool's 256 tokens (ids and slots).
    assert caps["StepRequest"] == base + 4 * (request_caps.STEP_ITEM + 4096 + 256 * 40)


def test_an_oversized_step_is_refused_before_parsing_by_default(tmp_path) -> None:
    """No max_step_bytes: four admissions of 8192 token ids each (over the 256 one
    request may carry) are refused whole, unparsed, not item by item."""
    with running(tmp_path, MODELS[:1], max_step_items=4) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
            admit = pb.StepAdmit(token_ids=toks(np.zeros(8192)), allocate=True)
            step = pb.StepRequest(model="m", session_id=sid, admits=[admit] * 4)
            assert "before parsing" in refused(srv, stub, "max_request_bytes", stub.Step, step)


# ----------------------------------------------------------- locked tokens


def cache(stub, sid: str, tokens: list[int], model: str = "m") -> None:
    m = stub.Match(
        pb.MatchRequest(model=model, token_ids=toks(tokens), allocate=True, session_id=sid)
    )
    stub.Insert(
        pb.InsertRequest(
            model=model,
            token_ids=toks(tokens),
            session_id=sid,
            slot_indices=m.slot_indices + m.allocated_slots,
        )
    )


def test_with_auto_one_session_cannot_lock_the_whole_cache(server, stub, sid) -> None:
    """The issue's first attack: cache (nearly) the whole pool, then lock all of it."""
    assert server.service.engines["m"].quota.locked_tokens == 230  # 90% of 256
    prompt = list(range(1000, 1240))  # 240 tokens
    cache(stub, sid, prompt)
    details = refused(
        server,
        stub,
        "max_session_locked_tokens",
        stub.Match,
        pb.MatchRequest(model="m", token_ids=toks(prompt), lock=True, session_id=sid),
    )
    assert "protect 0 tokens and this lock 240 more" in details
    # A lock of most of it still fits, as a worker's requests need.
    stub.Match(pb.MatchRequest(model="m", token_ids=toks(prompt[:200]), lock=True, session_id=sid))
    assert mine(stub, sid).locked_tokens == 200
    # Slot models have no default cap (a sequence slot is one request's).
    assert server.service.engines["s"].quota.locked_tokens == 0


def test_zero_turns_the_locked_token_cap_off(tmp_path) -> None:
    with running(tmp_path, MODELS[:1], max_session_locked_tokens=0) as srv:
        assert srv.service.engines["m"].quota.locked_tokens == 0
        channel, stub = stub_for(srv.address)
        with channel:
            sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
            prompt = list(range(1000, 1256))
            cache(stub, sid, prompt)
            stub.Match(
                pb.MatchRequest(model="m", token_ids=toks(prompt), lock=True, session_id=sid)
            )
            srv.check_integrity()


def test_the_locked_token_cap_is_off_by_default_and_auto_from_yaml_or_env(tmp_path) -> None:
    from prefixcache.server.config import load_config

    assert load_config(env={}).server.max_session_locked_tokens == 0
    (tmp_path / "c.yaml").write_text("server:\n  max_session_locked_tokens: auto\n")
    assert load_config(tmp_path / "c.yaml", env={}).server.max_session_locked_tokens is None
    env = {"PREFIXCACHE_MAX_SESSION_LOCKED_TOKENS": "auto"}
    assert load_config(env=env).server.max_session_locked_tokens is None
    env = {"PREFIXCACHE_MAX_SESSION_LOCKED_TOKENS": "5000"}
    assert load_config(env=env).server.max_session_locked_tokens == 5000
