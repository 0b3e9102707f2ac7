"""Evict on a shared service: a cap beyond which only the admin token may
evict, and every eviction attributed to its caller, in metrics by kind (session,
anonymous, admin) and in the log by client name. The budget refills almost at once
here (``evict_interval``), so each call meets the cap alone; the budget over time is
tests/server/access/test_tenant_side_channels.py's."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import grpc
import pytest
from server.harness import SMALL_POOL, ServerThread, pb, running, stub_for, toks

from prefixcache.client import PermissionDenied, PrefixCacheClient
from prefixcache.server.config import ModelConfig

MODELS = (ModelConfig(name="m", page_size=1, pool=SMALL_POOL),)


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _sample(srv: ServerThread, name: str, **labels: str) -> float:
    return srv.server.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    with running(
        tmp_path_factory.mktemp("evict"),
        MODELS,
        token="t0k",
        admin_token="adm",
        max_evict_tokens=4,
        evict_interval=1e-6,
    ) as thread:
        yield thread


@pytest.fixture(scope="module")
def worker(srv: ServerThread) -> Iterator[PrefixCacheClient]:
    with PrefixCacheClient(srv.address, token="t0k", timeout=10) as c:
        yield c


@pytest.fixture(scope="module")
def admin(srv: ServerThread) -> Iterator[PrefixCacheClient]:
    with PrefixCacheClient(srv.address, token="adm", timeout=10) as c:
        yield c


def _cache(client: PrefixCacheClient, first: int, n: int) -> None:
    """Cache ``n`` tokens (evictable: no lock kept)."""
    with client.session(10) as s:
        tokens = list(range(first, first + n))
        hit = s.match("m", tokens, lock=True, allocate=True)
        s.insert("m", tokens, hit.all_slots(), release_lock_id=hit.lock_id)


def test_an_eviction_over_the_cap_needs_the_admin_token(
    srv: ServerThread, worker: PrefixCacheClient, admin: PrefixCacheClient
) -> None:
    _cache(worker, 1000, 20)
    before = worker.stats("m").models[0].evictable_tokens
    refused = _sample(srv, "prefixcache_refusals_total", limit="max_evict_tokens")
    with pytest.raises(PermissionDenied, match=r"server\.max_evict_tokens"):
        worker.evict("m", 5)
    with pytest.raises(PermissionDenied):
        worker.evict("m", 0, swa_num_tokens=2**64 - 1)
    assert worker.stats("m").models[0].evictable_tokens == before  # nothing evicted
    assert _sample(srv, "prefixcache_refusals_total", limit="max_evict_tokens") == refused + 2
    assert worker.evict("m", 4).evicted_tokens >= 4  # within the cap: anyone
    left = worker.stats("m").models[0].evictable_tokens
    assert admin.evict("m", 2**64 - 1).evicted_tokens == left  # the admin: any amount
    assert admin.stats("m").models[0].evictable_tokens == 0


def test_the_session_stream_is_held_to_the_cap(srv: ServerThread) -> None:
    _, stub = stub_for(srv.address)
    requests = [
        pb.SessionRequest(seq=1, evict=pb.EvictRequest(model="m", num_tokens=5)),
        pb.SessionRequest(seq=2, evict=pb.EvictRequest(model="m", num_tokens=4)),
    ]
    denied, allowed = stub.Session(iter(requests), timeout=10, metadata=_bearer("t0k"))
    assert denied.error.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
    assert allowed.WhichOneof("result") == "evict"
    ok = list(stub.Session(iter(requests[:1]), timeout=10, metadata=_bearer("adm")))
    assert ok[0].WhichOneof("result") == "evict"


def test_evictions_are_counted_by_kind_of_caller_and_logged_by_client(
    srv: ServerThread,
    worker: PrefixCacheClient,
    admin: PrefixCacheClient,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def calls(kind: str) -> float:
        return _sample(srv, "prefixcache_evict_calls_total", model="m", caller=kind)

    counts = {kind: calls(kind) for kind in ("session", "anonymous", "admin")}
    freed = _sample(srv, "prefixcache_evict_call_tokens_total", model="m", caller="session")
    _cache(worker, 2000, 10)
    logger = logging.getLogger("prefixcache")
    logger.addHandler(caplog.handler)  # the service's logger may not propagate to root
    try:
        with (
            caplog.at_level(logging.DEBUG, logger="prefixcache"),
            worker.session(10, name="worker-7") as s,
        ):
            evicted = s.evict("m", 3).evicted_tokens
            worker.evict("m", 1)
            worker.evict("m", 1, session="no-such-session")  # gone: anonymous, not refused
            admin.evict("m", 100)  # a flush: logged at INFO
    finally:
        logger.removeHandler(caplog.handler)
    assert calls("session") == counts["session"] + 1
    assert calls("anonymous") == counts["anonymous"] + 2
    assert calls("admin") == counts["admin"] + 1
    assert (
        _sample(srv, "prefixcache_evict_call_tokens_total", model="m", caller="session")
        == freed + evicted
    )
    records = list({id(r): r for r in caplog.records if r.getMessage() == "evict"}.values())
    mine = [r for r in records if getattr(r, "client", None) == "worker-7"]
    assert len(mine) == 1 and mine[0].levelno == logging.DEBUG and mine[0].caller == "session"
    flush = [r for r in records if r.caller == "admin"]
    assert len(flush) == 1 and flush[0].levelno == logging.INFO and flush[0].asked == 100


def test_no_cap_by_default(tmp_path: pytest.TempPathFactory) -> None:
    with running(tmp_path, MODELS) as srv, PrefixCacheClient(srv.address) as c:
        _cache(c, 1, 8)
        assert c.evict("m", 2**64 - 1).evicted_tokens == 8
        channel, stub = stub_for(srv.address)
        with channel:
            stub.Evict(pb.EvictRequest(model="m", num_tokens=1), timeout=10)
            assert (
                stub.Match(pb.MatchRequest(model="m", token_ids=toks([1])), timeout=10).prefix_len
                == 0
            )
