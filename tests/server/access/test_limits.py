"""One test per per-request limit: the refusal, its status code and the setting it
names, a count in prefixcache_refusals_total{limit}, and nothing changed."""

from __future__ import annotations

import logging
import queue
from collections.abc import Iterator

import grpc
import pytest
from harness import SMALL_POOL, pack_slots, pb, running, serve_module, stub_for, stub_of, toks

from prefixcache.server.access.limits import LIMIT_NAMES, limits_of, request_tokens
from prefixcache.server.config import ConfigError, ModelConfig, PoolConfig, load_config

CODE = grpc.StatusCode
MODELS = (
    ModelConfig(name="m", page_size=1, pool=SMALL_POOL),
    ModelConfig(
        name="s", kind="slot", max_seq_len=40, pool=PoolConfig(size=4, k_heads=1, k_head_dim=2)
    ),
)
CAPS = {"max_extra_key_bytes": 16, "max_client_name_bytes": 24, "max_session_id_bytes": 40}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    yield from serve_module(tmp_path_factory, "limits", MODELS, **CAPS)


@pytest.fixture(scope="module")
def stub(server) -> Iterator:
    yield from stub_of(server)


def refusals(server, limit: str) -> float:
    value = server.server.metrics.registry.get_sample_value(
        "prefixcache_refusals_total", {"limit": limit}
    )
    return 0.0 if value is None else value


def refused(call, request, code: grpc.StatusCode, limit: str) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=10)
    assert err.value.code() == code, err.value.details()
    assert f"server.{limit}" in err.value.details()
    return err.value.details()


class Unchanged:
    """Asserts on exit that Stats (every counter, size and the session count) did not
    move, the caches are intact, and ``expected`` refusals were counted for ``limit``."""

    def __init__(self, server, stub, limit: str, expected: int) -> None:
        self.server, self.stub, self.limit, self.expected = server, stub, limit, expected

    def __enter__(self) -> Unchanged:
        self.before = self.stub.Stats(pb.StatsRequest())
        self.count = refusals(self.server, self.limit)
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            assert self.stub.Stats(pb.StatsRequest()) == self.before
            self.server.check_integrity()
            assert refusals(self.server, self.limit) == self.count + self.expected


def test_every_limit_is_exported_from_the_start(tmp_path) -> None:
    with running(tmp_path, MODELS) as srv:
        registry = srv.server.metrics.registry
        for limit in LIMIT_NAMES:
            assert registry.get_sample_value("prefixcache_refusals_total", {"limit": limit}) == 0.0


def test_an_extra_key_over_its_limit_is_invalid_argument(server, stub) -> None:
    sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
    with Unchanged(server, stub, "max_extra_key_bytes", 3):
        refused(
            stub.Match,
            pb.MatchRequest(model="m", token_ids=toks([1, 2]), extra_key="x" * 17),
            CODE.INVALID_ARGUMENT,
            "max_extra_key_bytes",
        )
        # 9 characters, 18 bytes: the limit is in UTF-8 bytes.
        refused(
            stub.Insert,
            pb.InsertRequest(
                model="m",
                token_ids=toks([1, 2]),
                extra_key="é" * 9,
                session_id=sid,
                slot_indices=pack_slots([1, 2]),
            ),
            CODE.INVALID_ARGUMENT,
            "max_extra_key_bytes",
        )
        refused(
            stub.Match,
            pb.MatchRequest(
                model="m",
                token_ids=toks([1]),
                session_id=sid,
                extra_key="y" * (1 << 20),
                allocate=True,
            ),
            CODE.INVALID_ARGUMENT,
            "max_extra_key_bytes",
        )
    stub.Match(pb.MatchRequest(model="m", token_ids=toks([1, 2]), extra_key="x" * 16))
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


def test_a_client_name_over_its_limit_is_refused_and_never_kept_or_logged(
    server, stub, caplog: pytest.LogCaptureFixture
) -> None:
    name = "worker-" + "z" * 100_000
    caplog.set_level(logging.DEBUG, logger="prefixcache")
    with Unchanged(server, stub, "max_client_name_bytes", 1):
        details = refused(
            stub.OpenSession,
            pb.OpenSessionRequest(client_name=name),
            CODE.INVALID_ARGUMENT,
            "max_client_name_bytes",
        )
    assert "zzzz" not in details
    assert not any("zzzz" in r.getMessage() or "zzzz" in str(vars(r)) for r in caplog.records)
    kept = stub.OpenSession(pb.OpenSessionRequest(client_name="n" * 24)).session_id
    assert [s.name for s in server.service.sessions if s.id == kept] == ["n" * 24]
    stub.CloseSession(pb.CloseSessionRequest(session_id=kept))


def test_a_session_id_over_its_limit_is_invalid_argument(server, stub) -> None:
    with Unchanged(server, stub, "max_session_id_bytes", 3):
        for call, request in (
            (stub.KeepAlive, pb.KeepAliveRequest(session_id="a" * 41)),
            (stub.CloseSession, pb.CloseSessionRequest(session_id="b" * (1 << 20))),
            (stub.Alloc, pb.AllocRequest(model="m", num_slots=1, session_id="c" * 41)),
        ):
            refused(call, request, CODE.INVALID_ARGUMENT, "max_session_id_bytes")
    # At the limit it is merely unknown.
    with pytest.raises(grpc.RpcError) as err:
        stub.KeepAlive(pb.KeepAliveRequest(session_id="a" * 40))
    assert err.value.code() == CODE.NOT_FOUND


def test_tokens_per_request_default_to_the_pool_size(server, stub) -> None:
    """Model m has 256 slots; model s has 4 slots of 40 positions: its cap is 40."""
    sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
    with Unchanged(server, stub, "max_request_tokens", 4):
        refused(
            stub.Match,
            pb.MatchRequest(model="m", token_ids=toks(range(257))),
            CODE.RESOURCE_EXHAUSTED,
            "max_request_tokens",
        )
        refused(
            stub.Insert,
            pb.InsertRequest(
                model="m",
                token_ids=toks(range(300)),
                session_id=sid,
                slot_indices=pack_slots(range(1, 301)),
            ),
            CODE.RESOURCE_EXHAUSTED,
            "max_request_tokens",
        )
        refused(
            stub.Free,
            pb.FreeRequest(model="m", session_id=sid, slot_indices=pack_slots([1] * 257)),
            CODE.RESOURCE_EXHAUSTED,
            "max_request_tokens",
        )
        refused(
            stub.Match,
            pb.MatchRequest(model="s", token_ids=toks(range(41)), session_id=sid, allocate=True),
            CODE.RESOURCE_EXHAUSTED,
            "max_request_tokens",
        )
    assert stub.Match(pb.MatchRequest(model="m", token_ids=toks(range(256)))).prefix_len == 0
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


def test_tokens_per_request_as_configured(tmp_path) -> None:
    with running(tmp_path, MODELS, max_request_tokens=8) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            with Unchanged(srv, stub, "max_request_tokens", 1):
                refused(
                    stub.Match,
                    pb.MatchRequest(model="m", token_ids=toks(range(9))),
                    CODE.RESOURCE_EXHAUSTED,
                    "max_request_tokens",
                )
            stub.Match(pb.MatchRequest(model="m", token_ids=toks(range(8))))


def test_a_stream_op_over_a_limit_gets_its_error_and_the_stream_goes_on(server, stub) -> None:
    requests: queue.Queue = queue.Queue()
    replies = stub.Session(iter(requests.get, None), timeout=10)
    with Unchanged(server, stub, "max_extra_key_bytes", 1):
        requests.put(
            pb.SessionRequest(
                seq=5, match=pb.MatchRequest(model="m", token_ids=toks([1]), extra_key="k" * 17)
            )
        )
        reply = next(replies)
        assert (reply.seq, reply.error.code) == (5, CODE.INVALID_ARGUMENT.value[0])
        assert "server.max_extra_key_bytes" in reply.error.message
    requests.put(pb.SessionRequest(seq=6, stats=pb.StatsRequest(model="m")))
    assert next(replies).seq == 6
    requests.put(None)
    list(replies)


def test_sessions_beyond_max_sessions_are_resource_exhausted(tmp_path) -> None:
    with running(tmp_path, MODELS, max_sessions=3) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            sids = [stub.OpenSession(pb.OpenSessionRequest()).session_id for _ in range(2)]
            requests: queue.Queue = queue.Queue()
            stream = stub.Session(iter(requests.get, None), timeout=10)  # the third
            requests.put(pb.SessionRequest(seq=1, stats=pb.StatsRequest(model="m")))
            assert next(stream).seq == 1
            with Unchanged(srv, stub, "max_sessions", 2):
                refused(
                    stub.OpenSession,
                    pb.OpenSessionRequest(),
                    CODE.RESOURCE_EXHAUSTED,
                    "max_sessions",
                )
                with pytest.raises(grpc.RpcError) as err:
                    list(stub.Session(iter([pb.SessionRequest(seq=1)]), timeout=10))
                assert err.value.code() == CODE.RESOURCE_EXHAUSTED
                assert "server.max_sessions" in err.value.details()
            stub.CloseSession(pb.CloseSessionRequest(session_id=sids[0]))
            stub.OpenSession(pb.OpenSessionRequest())
            requests.put(None)
            list(stream)


def test_limits_are_configurable_and_checked(tmp_path) -> None:
    env = {
        "PREFIXCACHE_MAX_SESSIONS": "7",
        "PREFIXCACHE_MAX_EXTRA_KEY_BYTES": "64",
        "PREFIXCACHE_STREAM_TTL": "2.5",
        "PREFIXCACHE_KEEPALIVE_TIME": "5",
    }
    limits = limits_of(load_config(env=env).server)
    assert (limits.max_sessions, limits.max_extra_key_bytes, limits.stream_ttl) == (7, 64, 2.5)
    defaults = limits_of()
    assert request_tokens(defaults, MODELS[0]) == 256 and request_tokens(defaults, MODELS[1]) == 40
    for name, bad in (
        ("MAX_SESSIONS", "0"),
        ("MAX_CLIENT_NAME_BYTES", "-1"),
        ("MAX_REQUEST_TOKENS", "-5"),
        ("STREAM_TTL", "nan"),
        ("KEEPALIVE_TIMEOUT", "0"),
        ("KEEPALIVE_TIME", "inf"),
    ):
        with pytest.raises(ConfigError, match=f"server.{name.lower()}"):
            load_config(env={f"PREFIXCACHE_{name}": bad})
