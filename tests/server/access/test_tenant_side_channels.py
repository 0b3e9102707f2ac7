"""Tenant side channels, two tenants through a real server:

* node handles and lock ids are unguessable, so probing the ids next to one's own
  finds nothing of another tenant's (47 Lock probes used to find 20 of 20 of its live
  nodes, told apart by PERMISSION_DENIED from NOT_FOUND);
* Stats shows a tenant only its own namespaces' lookups, and its own sessions;
* the Evict cap is a budget per client per interval, not per call (203 x Evict(64)
  used to flush another tenant's 12,928 tokens in 0.29 s).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import grpc
import pytest
from harness import SMALL_POOL, ServerThread, pb, running, stub_for, toks

from prefixcache.server.config import ModelConfig, TenantConfig

MODELS = (ModelConfig(name="m", page_size=1, pool=replace(SMALL_POOL, size=2048)),)
TENANTS = (
    TenantConfig("acme", "tok-acme", namespaces=("acme/",)),
    TenantConfig("beta", "tok-beta", namespaces=("beta/",)),
)
ACME, BETA, OPERATOR = (
    (("authorization", "Bearer tok-acme"),),
    (("authorization", "Bearer tok-beta"),),
    (("authorization", "Bearer t0k"),),
)
BUDGET, INTERVAL = 64, 60.0  # 64 tokens a minute: nothing refills during a test
CODE = grpc.StatusCode


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    with running(
        tmp_path_factory.mktemp("side"),
        MODELS,
        token="t0k",
        tenants=TENANTS,
        max_evict_tokens=BUDGET,
        evict_interval=INTERVAL,
    ) as thread:
        yield thread


@pytest.fixture(scope="module")
def stub(srv: ServerThread) -> Iterator:
    channel, stub = stub_for(srv.address)
    with channel:
        yield stub


def _session(stub, who) -> str:
    return stub.OpenSession(
        pb.OpenSessionRequest(ttl_seconds=60), metadata=who, timeout=10
    ).session_id


def _cache(stub, who, sid: str, key: str, tokens: list[int]) -> pb.InsertResponse:
    """Cache ``tokens`` under ``key`` and keep a lock on them."""
    m = stub.Match(
        pb.MatchRequest(
            model="m", token_ids=toks(tokens), extra_key=key, allocate=True, session_id=sid
        ),
        metadata=who,
        timeout=10,
    )
    return stub.Insert(
        pb.InsertRequest(
            model="m",
            token_ids=toks(tokens),
            extra_key=key,
            slot_indices=m.slot_indices + m.allocated_slots,
            lock=True,
            session_id=sid,
        ),
        metadata=who,
        timeout=10,
    )


def _code(call, request, who) -> grpc.StatusCode:
    try:
        call(request, metadata=who, timeout=10)
    except grpc.RpcError as err:
        return err.code()
    return CODE.OK


def test_probing_the_ids_next_to_ones_own_finds_nothing(srv: ServerThread, stub) -> None:
    acme = _session(stub, ACME)
    beta = _session(stub, BETA)
    theirs = [_cache(stub, ACME, acme, "acme/p", [7, i, i + 1, i + 2]) for i in range(20)]
    mine = _cache(stub, BETA, beta, "beta/p", [9, 9, 9])
    assert mine.node_id and mine.lock_id
    their_nodes = {r.node_id for r in theirs}
    their_locks = {r.lock_id for r in theirs}
    near = [d for d in range(-40, 41) if d]
    nodes = {
        d: _code(
            stub.Lock, pb.LockRequest(model="m", node_id=mine.node_id + d, session_id=beta), BETA
        )
        for d in near
    }
    locks = {
        d: _code(stub.Unlock, pb.UnlockRequest(lock_id=mine.lock_id + d, session_id=beta), BETA)
        for d in near
    }
    # Every probe names nothing: no node of acme's (PERMISSION_DENIED would say it is
    # there), no lock issued to anyone (FAILED_PRECONDITION: "not held by you").
    assert set(nodes.values()) == {CODE.NOT_FOUND}, nodes
    assert set(locks.values()) == {CODE.NOT_FOUND}, locks
    assert not their_nodes & {mine.node_id + d for d in near}
    assert not their_locks & {mine.lock_id + d for d in near}
    srv.check_integrity()
    for sid, who in ((acme, ACME), (beta, BETA)):
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid), metadata=who)


def test_stats_shows_a_tenant_only_its_own_namespaces(srv: ServerThread, stub) -> None:
    def stats(who) -> tuple[pb.ModelStats, int]:
        reply = stub.Stats(pb.StatsRequest(model="m"), metadata=who, timeout=10)
        return reply.models[0], reply.sessions

    acme = _session(stub, ACME)
    _cache(stub, ACME, acme, "acme/s", [5, 6, 7, 8])
    before_beta, _ = stats(BETA)
    before_all, _ = stats(OPERATOR)
    for _ in range(10):  # acme's hits: 10 x 4 tokens
        assert (
            stub.Match(
                pb.MatchRequest(model="m", token_ids=toks([5, 6, 7, 8]), extra_key="acme/s"),
                metadata=ACME,
            ).prefix_len
            == 4
        )
    after_beta, beta_sessions = stats(BETA)
    after_all, all_sessions = stats(OPERATOR)
    assert after_all.hit_tokens_total - before_all.hit_tokens_total == 40
    assert after_beta.hit_tokens_total == before_beta.hit_tokens_total  # sees none of it
    assert after_beta.match_tokens_total == before_beta.match_tokens_total
    acme_view, acme_sessions = stats(ACME)
    assert acme_view.hit_tokens_total >= 40
    # Sums over every tenant's sessions are not shown; the pool's room is.
    assert (after_beta.locks, after_beta.session_slots) == (0, 0) and after_all.locks >= 1
    assert after_beta.free_slots == after_all.free_slots
    assert (beta_sessions, acme_sessions) == (0, 1) and all_sessions >= 1
    # beta's own lookups do count for beta.
    stub.Match(
        pb.MatchRequest(model="m", token_ids=toks([1, 2]), extra_key="beta/x"), metadata=BETA
    )
    assert stats(BETA)[0].match_tokens_total == before_beta.match_tokens_total + 2
    # Step replies carry the same view.
    beta = _session(stub, BETA)
    step = stub.Step(pb.StepRequest(model="m", session_id=beta), metadata=BETA)
    assert step.counters.hit_tokens_total == before_beta.hit_tokens_total
    for sid, who in ((acme, ACME), (beta, BETA)):
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid), metadata=who)


def test_the_evict_budget_is_per_client_per_interval(srv: ServerThread, stub) -> None:
    acme = _session(stub, ACME)
    for i in range(40):  # 40 x 16 = 640 evictable tokens of acme's
        _cache(stub, ACME, acme, "acme/e", [3, i, *range(100, 114)])
    stub.CloseSession(pb.CloseSessionRequest(session_id=acme), metadata=ACME)  # unlocked
    evictable = stub.Stats(pb.StatsRequest(model="m"), metadata=OPERATOR).models[0].evictable_tokens
    codes = []
    beta_sessions = [_session(stub, BETA) for _ in range(4)]  # more sessions buy nothing
    for i in range(200):
        codes.append(
            _code(
                stub.Evict,
                pb.EvictRequest(model="m", num_tokens=BUDGET // 4, session_id=beta_sessions[i % 4]),
                BETA,
            )
        )
    codes.append(_code(stub.Evict, pb.EvictRequest(model="m", num_tokens=BUDGET // 4), BETA))
    left = stub.Stats(pb.StatsRequest(model="m"), metadata=OPERATOR).models[0].evictable_tokens
    # The budget (each call frees whole entries, 15 tokens here, and the bucket is
    # charged what it freed), then nothing until it refills: refused at once, not held
    # until it has refilled (then the call would be OK, or past its deadline).
    ok = codes.count(CODE.OK)
    assert 2 <= ok <= 4 and set(codes[ok:]) == {CODE.RESOURCE_EXHAUSTED}
    assert evictable - left <= BUDGET + 15  # what it may flush, not the cache
    # One call over the whole budget never fits: PERMISSION_DENIED.
    assert (
        _code(stub.Evict, pb.EvictRequest(model="m", num_tokens=BUDGET + 1), BETA)
        == CODE.PERMISSION_DENIED
    )
    # Another tenant has its own budget.
    assert _code(stub.Evict, pb.EvictRequest(model="m", num_tokens=BUDGET), ACME) == CODE.OK
    for sid in beta_sessions:
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid), metadata=BETA)
    srv.check_integrity()


def test_refusals_name_the_settings(srv: ServerThread, stub) -> None:
    stub.Evict(pb.EvictRequest(model="m", num_tokens=0), metadata=BETA)
    with pytest.raises(grpc.RpcError) as err:
        for _ in range(10):
            stub.Evict(pb.EvictRequest(model="m", num_tokens=BUDGET), metadata=BETA)
    assert "server.max_evict_tokens" in err.value.details()
    assert "server.evict_interval" in err.value.details()
