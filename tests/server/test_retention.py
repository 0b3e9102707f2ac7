"""Retention hints through a real server: Match, Insert, Step, OpenSession and Retain.

The server runs in invariant mode (every mutating call re-checks the caches, now with
their retentions). Eviction is driven by pool pressure from other prompts, the hints
come through the client library as a worker sends them, and the metrics are scraped
over HTTP.
"""

from __future__ import annotations

import math
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import grpc
import pytest
from harness import SMALL_POOL, pb, running, stub_for, toks

from prefixcache.client import Admit, Finish, InvalidArgument, PrefixCacheClient, Retention
from prefixcache.server.config import ModelConfig, RetentionConfig, TenantConfig

POOL = 256
MODELS = (
    ModelConfig(name="m", page_size=1, pool=replace(SMALL_POOL, size=POOL)),
    ModelConfig(name="lru", page_size=1, pool=replace(SMALL_POOL, size=POOL)),
    ModelConfig(name="p", page_size=4, pool=replace(SMALL_POOL, size=POOL)),
    ModelConfig(name="w", kind="swa", page_size=1, sliding_window_size=4, pool=SMALL_POOL),
)
TENANTS = (
    TenantConfig("acme", "tok-acme", namespaces=("acme/",)),
    TenantConfig("beta", "tok-beta", namespaces=("beta/",)),
)
SHARE = 0.25  # of the 256-token pools: 64 tokens a tenant


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with running(
        tmp_path_factory.mktemp("retention"),
        MODELS,
        metrics_host="127.0.0.1",
        metrics_port=0,
        retention=RetentionConfig(max_seconds=900.0, tenant_share=SHARE),
    ) as thread:
        yield thread


@pytest.fixture(scope="module")
def client(srv: Any) -> Iterator[PrefixCacheClient]:
    with PrefixCacheClient(srv.address, timeout=10) as c:
        yield c


@pytest.fixture()
def fresh(srv: Any, client: PrefixCacheClient) -> Iterator[None]:
    for model in ("m", "lru", "p", "w"):
        client.reset(model)
    yield
    srv.check_integrity()


def scrape(srv: Any, name: str, **labels: str) -> float:
    with urllib.request.urlopen(
        f"http://127.0.0.1:{srv.server.metrics_port}/metrics", timeout=10
    ) as reply:
        text = reply.read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{{want}}} not exported")


def prefill(
    client: PrefixCacheClient,
    session: Any,
    model: str,
    tokens: list[int],
    retain: Any = None,
    extra_key: str | None = None,
) -> Any:
    """A worker's prefill: a locking, allocating match, then an insert that releases it."""
    m = client.match(model, tokens, session=session, lock=True, allocate=True, extra_key=extra_key)
    return client.insert(
        model,
        tokens,
        m.all_slots(),
        session=session,
        release_lock_id=m.lock_id,
        retain=retain,
        extra_key=extra_key,
    )


def test_a_retained_prompt_outlives_newer_ones_under_pressure(
    srv: Any, client: Any, fresh: None
) -> None:
    """The same prompts into two models: with a hint on the oldest it survives the
    pressure and the next-oldest goes; without one (plain LRU) the oldest goes."""
    a, b, c, d = (list(range(k, k + 64)) for k in (0, 1000, 2000, 3000))
    with client.session() as s:
        for model, hint in (("m", Retention(600, "high")), ("lru", None)):
            ins = prefill(client, s, model, a, retain=hint)
            if hint is not None:
                assert ins.retained is not None
                assert (ins.retained.outcome, ins.retained.tokens) == ("accepted", 64)
                assert (ins.retained.seconds, ins.retained.priority) == (600.0, 75)
            else:
                assert ins.retained is None
            prefill(client, s, model, b)
            prefill(client, s, model, c)
            prefill(client, s, model, d + list(range(4000, 4064)))  # 128: evicts 64
    assert client.match("m", a).prefix_len == 64
    assert client.match("m", b).prefix_len == 0
    assert client.match("lru", a).prefix_len == 0
    assert client.match("lru", b).prefix_len == 64
    assert scrape(srv, "prefixcache_retained_tokens", model="m") == 64
    assert scrape(srv, "prefixcache_retained_tokens", model="lru") == 0
    assert scrape(srv, "prefixcache_retention_hints_total", model="m", outcome="accepted") >= 1


def test_not_a_pin_retained_tokens_go_when_nothing_else_is_left(
    srv: Any, client: Any, fresh: None
) -> None:
    before = scrape(srv, "prefixcache_retained_evicted_tokens_total", model="m")
    with client.session() as s:
        prefill(client, s, "m", list(range(64)), retain=Retention(600))
        prefill(client, s, "m", list(range(5000, 5250)))  # 250: 58 more than are free
    assert client.match("m", list(range(64))).prefix_len == 0
    assert scrape(srv, "prefixcache_retained_evicted_tokens_total", model="m") > before


def test_a_session_default_retains_every_call_that_names_none(
    srv: Any, client: Any, fresh: None
) -> None:
    info = client.open_session(60, retain={"retain_seconds": 5000, "priority": "high"})
    try:
        assert info.retained is not None  # clipped to max_seconds
        assert (info.retained.outcome, info.retained.seconds, info.retained.priority) == (
            "clipped",
            900.0,
            75,
        )
        ins = prefill(client, info.session_id, "m", [7] * 8 + [1, 2])
        assert ins.retained is not None and ins.retained.outcome == "clipped"
        assert ins.retained.tokens == 10
        own = client.match("m", [7] * 8, session=info.session_id, retain=Retention(30, 5))
        assert own.retained is not None
        assert (own.retained.outcome, own.retained.seconds, own.retained.priority) == (
            "accepted",
            30.0,
            5,
        )
        # A call without a session has no default: no retention, no result.
        assert client.match("m", [7] * 8).retained is None
    finally:
        client.close_session(info.session_id)


def test_retain_sets_and_ends_a_retention_without_a_lookup(
    srv: Any, client: Any, fresh: None
) -> None:
    tokens = list(range(300, 340))
    with client.session() as s:
        prefill(client, s, "m", tokens)
    queried = scrape(srv, "prefixcache_query_tokens_total", model="m")
    got = client.retain("m", [*tokens, 9999], Retention(120))
    assert got.prefix_len == 40 and got.retained is not None
    assert (got.retained.outcome, got.retained.tokens) == ("accepted", 40)
    assert scrape(srv, "prefixcache_retained_tokens", model="m") == 40
    ended = client.retain("m", tokens, 0)
    assert ended.retained is not None and ended.retained.tokens == 0
    assert scrape(srv, "prefixcache_retained_tokens", model="m") == 0
    assert scrape(srv, "prefixcache_query_tokens_total", model="m") == queried
    missing = client.retain("m", [12345, 12346], Retention(120))
    assert missing.prefix_len == 0 and missing.retained is not None
    assert (missing.retained.outcome, missing.retained.tokens) == ("accepted", 0)


def test_a_retention_lapses_without_a_hit(srv: Any, client: Any, fresh: None) -> None:
    tokens = list(range(600, 632))
    with client.session() as s:
        prefill(client, s, "m", tokens, retain=Retention(0.3))
    assert scrape(srv, "prefixcache_retained_tokens", model="m") == 32
    deadline = time.monotonic() + 20  # the lease reaper's tick finds the lapse
    while scrape(srv, "prefixcache_retained_tokens", model="m") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert scrape(srv, "prefixcache_retained_tokens", model="m") == 0
    with client.session() as s:  # now the oldest and unretained: the first to go
        prefill(client, s, "m", list(range(700, 940)))  # 16 more than are free
    assert client.match("m", tokens).prefix_len == 0


def test_step_items_carry_their_retention(srv: Any, client: Any, fresh: None) -> None:
    tokens = list(range(800, 812))
    with client.session() as s:
        admitted = client.step("p", session=s, admits=[Admit(tokens, retain=60)]).admits[0]
        assert admitted.retained is not None and admitted.retained.tokens == 0  # a miss
        done = client.step(
            "p",
            session=s,
            finishes=[
                Finish(
                    tokens,
                    admitted.all_slots(),
                    release_lock_id=admitted.lock_id,
                    retain=Retention(60, "low"),
                )
            ],
        ).finishes[0]
        assert done.retained is not None
        assert (done.retained.outcome, done.retained.tokens, done.retained.priority) == (
            "accepted",
            12,
            25,
        )
        again = client.step(
            "p", session=s, admits=[Admit([*tokens, 1], lock=False, allocate=False, retain=60)]
        ).admits[0]
        assert again.retained is not None and again.retained.tokens == 12


def test_kinds_without_retention_reject_the_hint_and_answer_the_call(
    srv: Any, client: Any, fresh: None
) -> None:
    with client.session() as s:
        ins = prefill(client, s, "w", [1, 2, 3, 4, 5, 6], retain=Retention(60))
    assert ins.cached_len == 6
    assert ins.retained is not None and ins.retained.outcome == "rejected"
    assert client.match("w", [1, 2, 3, 4, 5, 6]).prefix_len == 6


def test_malformed_hints_are_refused_and_change_nothing(srv: Any, client: Any, fresh: None) -> None:
    channel, stub = stub_for(srv.address)
    with channel:
        sid = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=60)).session_id
        before = stub.Stats(pb.StatsRequest(model="m"))
        for seconds in (-1.0, math.inf, math.nan):
            with pytest.raises(grpc.RpcError) as err:
                stub.Match(
                    pb.MatchRequest(
                        model="m",
                        token_ids=toks([1, 2, 3]),
                        session_id=sid,
                        allocate=True,
                        retention=pb.Retention(seconds=seconds),
                    )
                )
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.RpcError) as err:
                stub.OpenSession(pb.OpenSessionRequest(retention=pb.Retention(seconds=seconds)))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert stub.Stats(pb.StatsRequest(model="m")) == before
        # Past the bounds is no mistake: lowered to them, and said so.
        opened = stub.OpenSession(
            pb.OpenSessionRequest(retention=pb.Retention(seconds=10, priority=200))
        )
        assert (opened.retention.outcome, opened.retention.priority) == (
            pb.RETENTION_OUTCOME_CLIPPED,
            99,
        )
    with pytest.raises(InvalidArgument):
        client.match("m", [1], retain=Retention(10, 200))
    with pytest.raises(InvalidArgument):
        client.match("m", [1], retain={"retain_seconds": 10, "priority": "urgent"})
    with pytest.raises(InvalidArgument):
        client.match("m", [1], retain={"retain": 10})


def test_each_tenant_retains_within_its_share(tmp_path: Any) -> None:
    """Tenants' quotas: over its share a hint is clipped to it (the node split where the
    room ends), then rejected; another tenant has a share of its own."""
    with running(
        tmp_path,
        MODELS[:1],
        token="t0k",
        tenants=TENANTS,
        retention=RetentionConfig(tenant_share=SHARE),
    ) as srv:
        limit = int(SHARE * POOL)
        with (
            PrefixCacheClient(srv.address, token="tok-acme", timeout=10) as acme,
            PrefixCacheClient(srv.address, token="tok-beta", timeout=10) as beta,
        ):
            with acme.session() as s:
                got = prefill(acme, s, "m", list(range(100)), Retention(600), "acme/a")
                assert (got.retained.outcome, got.retained.tokens) == ("clipped", limit)
                again = prefill(acme, s, "m", list(range(9, 30)), Retention(600), "acme/b")
                assert (again.retained.outcome, again.retained.tokens) == ("rejected", 0)
            with beta.session() as s:
                own = prefill(beta, s, "m", list(range(50)), Retention(600), "beta/a")
                assert (own.retained.outcome, own.retained.tokens) == ("accepted", 50)
            # Ending acme's retention gives its share back.
            assert acme.retain("m", list(range(100)), 0, extra_key="acme/a").retained.tokens == 0
            with acme.session() as s:
                back = prefill(acme, s, "m", list(range(9, 30)), Retention(600), "acme/b")
                assert (back.retained.outcome, back.retained.tokens) == ("accepted", 21)
        srv.check_integrity()


def test_retention_off_rejects_every_hint(tmp_path: Any) -> None:
    with (
        running(tmp_path, MODELS[:1], retention=RetentionConfig(enabled=False)) as srv,
        PrefixCacheClient(srv.address, timeout=10) as client,
        client.session() as s,
    ):
        ins = prefill(client, s, "m", [1, 2, 3], retain=Retention(60))
        assert ins.cached_len == 3
        assert ins.retained is not None and ins.retained.outcome == "rejected"
        assert client.retain("m", [1, 2, 3], Retention(60)).retained.outcome == "rejected"
