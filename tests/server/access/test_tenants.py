"""Tenants: tokens bound to extra_key namespaces make ``extra_key`` an
isolation boundary. A real server with token auth; each refusal is checked for its
code, for changing nothing (Match reveals nothing, counts no lookup) and for its count
in ``prefixcache_refusals_total{limit="tenant_namespaces"}``."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from server.harness import SMALL_POOL, ServerThread, pb, running, stub_for, toks

from prefixcache.client import (
    FailedPrecondition,
    PermissionDenied,
    PrefixCacheClient,
    Unauthenticated,
)
from prefixcache.server.config import ConfigError, ModelConfig, TenantConfig, load_config

MODELS = (
    ModelConfig(name="m", page_size=1, pool=SMALL_POOL),
    ModelConfig(name="o", page_size=1, pool=SMALL_POOL, open_reads=True),
)
TENANTS = (
    TenantConfig("acme", "tok-acme", namespaces=("acme/",)),
    TenantConfig("beta", "tok-beta", namespaces=("beta/", "shared/")),
)


def _denied(srv: ServerThread) -> float:
    return (
        srv.server.metrics.registry.get_sample_value(
            "prefixcache_refusals_total", {"limit": "tenant_namespaces"}
        )
        or 0.0
    )


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    with running(
        tmp_path_factory.mktemp("tenants"), MODELS, token="t0k", admin_token="adm", tenants=TENANTS
    ) as thread:
        yield thread


def _client(srv: ServerThread, token: str | None) -> PrefixCacheClient:
    return PrefixCacheClient(srv.address, token=token, timeout=10)


@pytest.fixture(scope="module")
def acme(srv: ServerThread) -> Iterator[PrefixCacheClient]:
    with _client(srv, "tok-acme") as c:
        yield c


@pytest.fixture(scope="module")
def beta(srv: ServerThread) -> Iterator[PrefixCacheClient]:
    with _client(srv, "tok-beta") as c:
        yield c


@pytest.fixture(scope="module")
def operator(srv: ServerThread) -> Iterator[PrefixCacheClient]:
    with _client(srv, "t0k") as c:
        yield c


def _cache(client: PrefixCacheClient, tokens: list[int], key: str, model: str = "m") -> None:
    with client.session(10) as s:
        hit = s.match(model, tokens, extra_key=key, lock=True, allocate=True)
        k = torch.full((1, len(hit.allocated), 1, 4), 3.0).half()
        s.write_kv(model, hit.allocated, k, k)
        s.insert(model, tokens, hit.all_slots(), extra_key=key, release_lock_id=hit.lock_id)


def test_tokens(srv: ServerThread, acme: PrefixCacheClient) -> None:
    with _client(srv, None) as anyone, pytest.raises(Unauthenticated):
        anyone.stats()
    with _client(srv, "tok-nobody") as wrong, pytest.raises(Unauthenticated):
        wrong.stats()
    assert acme.stats().models  # a tenant's token is a token


def test_match_and_insert_outside_the_namespaces_are_denied_and_reveal_nothing(
    srv: ServerThread, acme: PrefixCacheClient, beta: PrefixCacheClient, operator: PrefixCacheClient
) -> None:
    _cache(beta, [1, 2, 3, 4], "beta/p")
    before, denied = operator.stats("m").models[0], _denied(srv)
    for key in ("beta/p", "shared/x", None, ""):
        with pytest.raises(PermissionDenied, match="tenant 'acme'"):
            acme.match("m", [1, 2, 3, 4], extra_key=key)
    with acme.session(10) as s:
        slots = s.alloc("m", 2).slots
        with pytest.raises(PermissionDenied):
            s.insert("m", [8, 9], slots, extra_key="beta/p")
        with pytest.raises(PermissionDenied):
            s.match("m", [1, 2, 3, 4], extra_key="beta/p", lock=True, allocate=True)
        s.free("m", slots)
    after = operator.stats("m").models[0]
    assert (after.match_tokens_total, after.evictable_tokens, after.locks) == (
        before.match_tokens_total,
        before.evictable_tokens,
        before.locks,
    )
    assert _denied(srv) == denied + 6
    # In its own namespaces a tenant works as usual; the server token sees every one.
    assert acme.match("m", [1, 2, 3, 4], extra_key="acme/p").prefix_len == 0
    assert beta.match("m", [1, 2, 3, 4], extra_key="beta/p").prefix_len == 4
    assert operator.match("m", [1, 2, 3, 4], extra_key="beta/p").prefix_len == 4


def test_lock_of_another_tenants_node_is_denied(
    acme: PrefixCacheClient, beta: PrefixCacheClient
) -> None:
    _cache(beta, [5, 6, 7], "beta/q")
    node = beta.match("m", [5, 6, 7], extra_key="beta/q").node_id
    with acme.session(10) as s, pytest.raises(PermissionDenied, match="node"):
        s.lock("m", node)
    assert acme.stats("m").models[0].locks == 0


def test_read_kv_of_another_tenants_slots_is_refused(
    acme: PrefixCacheClient, beta: PrefixCacheClient, operator: PrefixCacheClient
) -> None:
    _cache(beta, [11, 12, 13], "beta/r")
    _cache(acme, [11, 12, 13], "acme/r")
    with beta.session(10) as b, acme.session(10) as a:
        theirs = b.match("m", [11, 12, 13], extra_key="beta/r", lock=True)
        assert b.read_kv("m", theirs.slots).k[0].shape == (3, 1, 4)
        with pytest.raises(FailedPrecondition, match="not under a lock of this session"):
            a.read_kv("m", theirs.slots)
        # A tenant's own allocation may still hold an evicted entry's bytes: not readable.
        fresh = a.alloc("m", 2).slots
        with pytest.raises(FailedPrecondition, match="not under a lock"):
            a.read_kv("m", fresh)
        a.free("m", fresh)
        mine = a.match("m", [11, 12, 13], extra_key="acme/r", lock=True)
        assert torch.equal(a.read_kv("m", mine.slots).k[0], torch.full((3, 1, 4), 3.0).half())
        b.unlock(theirs.lock_id)
        a.unlock(mine.lock_id)
    # open_reads is for callers bound to no tenant.
    _cache(operator, [21, 22], "beta/o", model="o")
    hit = operator.match("o", [21, 22], extra_key="beta/o")
    assert operator.read_kv("o", hit.slots).k[0].shape == (2, 1, 4)
    with pytest.raises(FailedPrecondition, match="session"):
        acme.read_kv("o", hit.slots)


def test_session_stream_operations_are_checked(srv: ServerThread) -> None:
    channel, stub = stub_for(srv.address)
    with channel:
        requests = [
            pb.SessionRequest(
                seq=1, match=pb.MatchRequest(model="m", token_ids=toks([1, 2]), extra_key="beta/p")
            ),
            pb.SessionRequest(
                seq=2, match=pb.MatchRequest(model="m", token_ids=toks([1, 2]), extra_key="acme/p")
            ),
        ]
        denied, allowed = stub.Session(
            iter(requests), timeout=10, metadata=(("authorization", "Bearer tok-acme"),)
        )
        assert denied.error.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
        assert allowed.WhichOneof("result") == "match"


def test_subscribe_is_not_for_tenants(srv: ServerThread) -> None:
    channel, stub = stub_for(srv.address)
    with channel, pytest.raises(grpc.RpcError) as err:
        list(
            stub.Subscribe(
                pb.SubscribeRequest(model="m"),
                timeout=10,
                metadata=(("authorization", "Bearer tok-acme"),),
            )
        )
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_tenants_config(tmp_path: Path) -> None:
    (tmp_path / "acme").write_text("tok-acme\n")
    good = tmp_path / "good.yaml"
    good.write_text(
        "server:\n  tenants:\n    - name: acme\n      token_file: "
        f"{tmp_path / 'acme'}\n      namespaces: [acme/]\n"
    )
    (tenant,) = load_config(good, env={}).server.tenants
    assert (tenant.name, tenant.token, tenant.namespaces) == ("acme", "tok-acme", ("acme/",))
    env = {"PREFIXCACHE_TENANTS": '[{"name": "b", "token": "x", "namespaces": ["b/"]}]'}
    assert load_config(env=env).server.tenants[0].namespaces == ("b/",)
    for text, where in (
        ("- {name: a, token: x}", "tenants[0].namespaces"),
        ("- {name: a, namespaces: [a/]}", "tenants[0].token"),
        ("- {name: a, token: x, namespaces: [a/], colour: red}", "tenants[0].colour"),
        (
            "- {name: a, token: x, namespaces: [a/]}\n    - {name: a, token: y, namespaces: [b]}",
            "tenants[1].name",
        ),
        (
            "- {name: a, token: x, namespaces: [a/]}\n    - {name: b, token: x, namespaces: [b]}",
            "tenants[1].token",
        ),
        ("- {name: a, token: t0k, namespaces: [a/]}\n  token: t0k", "tenants[0].token"),
    ):
        path = tmp_path / "bad.yaml"
        path.write_text(f"server:\n  tenants:\n    {text}\n")
        with pytest.raises(ConfigError, match=re.escape(f"server.{where}")):
            load_config(path, env={})
