"""Per-session quotas: slots held, tokens locked and KV streams in flight.

Against a real server in invariant mode (every mutating call runs the integrity check,
which audits each session's locked-token count against its locks). Each refusal: its
status code, the setting it names, a count in prefixcache_refusals_total{limit}, and
nothing changed (Stats of every model, the caller's holdings, the cache's integrity).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import grpc
import pytest
from harness import (
    SMALL_POOL,
    pack_slots,
    pb,
    running,
    serve_module,
    slots,
    stub_for,
    stub_of,
    toks,
)

from prefixcache.cache import hash_token_ids
from prefixcache.server.config import (
    ConfigError,
    ModelConfig,
    PoolConfig,
    TenantConfig,
    load_config,
)

CODE = grpc.StatusCode
SLOTS, LOCKED = 16, 20
QUOTAS = {"max_session_slots": SLOTS, "max_session_locked_tokens": LOCKED, "max_session_streams": 1}
MODELS = (
    ModelConfig(name="m", page_size=1, pool=SMALL_POOL),
    ModelConfig(
        name="s", kind="slot", max_seq_len=16, pool=PoolConfig(size=4, k_heads=1, k_head_dim=2)
    ),
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    yield from serve_module(tmp_path_factory, "quotas", MODELS, **QUOTAS)


@pytest.fixture(scope="module")
def stub(server) -> Iterator:
    yield from stub_of(server)


@pytest.fixture
def sid(stub) -> Iterator[str]:
    """A fresh session, closed after the test (so holdings do not carry over)."""
    session_id = stub.OpenSession(pb.OpenSessionRequest(client_name="quota-test")).session_id
    yield session_id
    stub.CloseSession(pb.CloseSessionRequest(session_id=session_id))


def refusals(server, limit: str) -> float:
    return (
        server.server.metrics.registry.get_sample_value(
            "prefixcache_refusals_total", {"limit": limit}
        )
        or 0.0
    )


class Refused:
    """Runs ``call(request)`` expecting RESOURCE_EXHAUSTED naming ``limit``, and checks
    that Stats (every model, every session's holdings) did not move and one refusal was
    counted."""

    def __init__(self, server, stub, limit: str) -> None:
        self.server, self.stub, self.limit = server, stub, limit

    def snapshot(self) -> pb.StatsResponse:
        reply = self.stub.Stats(pb.StatsRequest(top_sessions=100), timeout=10)
        for h in reply.top_sessions:
            h.ClearField("lease_left_seconds")  # the clock moves on
        return reply

    def __call__(self, call, request) -> str:
        before, count = self.snapshot(), refusals(self.server, self.limit)
        with pytest.raises(grpc.RpcError) as err:
            call(request, timeout=10)
        assert err.value.code() == CODE.RESOURCE_EXHAUSTED, err.value.details()
        assert f"server.{self.limit}" in err.value.details()
        assert self.snapshot() == before
        self.server.check_integrity()
        assert refusals(self.server, self.limit) == count + 1
        return err.value.details()


def held(stub, sid: str) -> pb.SessionHoldings:
    reply = stub.Stats(pb.StatsRequest(top_sessions=1000), timeout=10)
    (mine,) = [h for h in reply.top_sessions if sid.startswith(h.session)]
    return mine


def cache(stub, sid: str, tokens: list[int], model: str = "m") -> None:
    """Cache ``tokens`` (allocate, insert) as ``sid``, leaving it holding nothing."""
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


# ------------------------------------------------------------------------ slots


def test_alloc_past_the_slot_quota_is_refused(server, stub, sid) -> None:
    stub.Alloc(pb.AllocRequest(model="m", num_slots=10, session_id=sid))
    refused = Refused(server, stub, "max_session_slots")
    assert "holds 10 slots" in refused(
        stub.Alloc, pb.AllocRequest(model="m", num_slots=7, session_id=sid)
    )
    stub.Alloc(pb.AllocRequest(model="m", num_slots=6, session_id=sid))  # exactly the cap
    assert held(stub, sid).slots == SLOTS


def test_a_match_that_would_allocate_past_it_takes_no_lock(server, stub, sid) -> None:
    cache(stub, sid, [1, 2, 3, 4])
    stub.Alloc(pb.AllocRequest(model="m", num_slots=12, session_id=sid))
    # 4 cached tokens to lock, 5 to allocate: 12 + 5 > 16, so neither happens.
    Refused(server, stub, "max_session_slots")(
        stub.Match,
        pb.MatchRequest(
            model="m",
            token_ids=toks([1, 2, 3, 4, 5, 6, 7, 8, 9]),
            lock=True,
            allocate=True,
            session_id=sid,
        ),
    )
    mine = held(stub, sid)
    assert (mine.slots, mine.locks, mine.locked_tokens) == (12, 0, 0)


def test_other_sessions_are_not_held_to_one_sessions_quota(server, stub, sid) -> None:
    stub.Alloc(pb.AllocRequest(model="m", num_slots=SLOTS, session_id=sid))
    other = stub.OpenSession(pb.OpenSessionRequest()).session_id
    try:
        stub.Alloc(pb.AllocRequest(model="m", num_slots=SLOTS, session_id=other))
    finally:
        stub.CloseSession(pb.CloseSessionRequest(session_id=other))


def test_the_slot_quota_counts_sequence_slots_of_a_slot_model(tmp_path) -> None:
    with running(tmp_path, MODELS, max_session_slots=2, max_session_locked_tokens=6) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
            got = stub.Alloc(pb.AllocRequest(model="s", num_slots=2, session_id=sid))
            refused = Refused(srv, stub, "max_session_slots")
            refused(stub.Alloc, pb.AllocRequest(model="s", num_slots=1, session_id=sid))
            refused(
                stub.Match,
                pb.MatchRequest(model="s", token_ids=toks([1, 2]), allocate=True, session_id=sid),
            )
            # Locks on a slot model count the pinned prefix's depth.
            slot = slots(got.slot_indices)[0]
            ins = stub.Insert(
                pb.InsertRequest(
                    model="s",
                    token_ids=toks([1, 2, 3, 4, 5]),
                    slot_indices=pack_slots([slot]),
                    slot_version=got.slot_versions and slots(got.slot_versions)[0],
                    session_id=sid,
                    lock=True,
                )
            )
            assert ins.lock_id
            locked = Refused(srv, stub, "max_session_locked_tokens")
            locked(stub.Lock, pb.LockRequest(model="s", node_id=ins.node_id, session_id=sid))
            locked(
                stub.Match,
                pb.MatchRequest(
                    model="s", token_ids=toks([1, 2, 3, 4, 5]), lock=True, session_id=sid
                ),
            )
            stub.Unlock(pb.UnlockRequest(lock_id=ins.lock_id, session_id=sid))
            stub.Lock(pb.LockRequest(model="s", node_id=ins.node_id, session_id=sid))
            srv.check_integrity()


# ----------------------------------------------------------------- locked tokens


def test_locks_past_the_token_quota_are_refused(server, stub, sid) -> None:
    prompt = list(range(100, 112))  # 12 tokens: one lock fits (20), two do not
    cache(stub, sid, prompt)
    first = stub.Match(
        pb.MatchRequest(model="m", token_ids=toks(prompt), lock=True, session_id=sid)
    )
    assert (held(stub, sid).locked_tokens, first.prefix_len) == (12, 12)
    refused = Refused(server, stub, "max_session_locked_tokens")
    assert "protect 12 tokens" in refused(
        stub.Match, pb.MatchRequest(model="m", token_ids=toks(prompt), lock=True, session_id=sid)
    )
    refused(stub.Lock, pb.LockRequest(model="m", node_id=first.node_id, session_id=sid))
    # An insert with lock is refused before it inserts anything.
    extra = stub.Alloc(pb.AllocRequest(model="m", num_slots=3, session_id=sid))
    refused(
        stub.Insert,
        pb.InsertRequest(
            model="m",
            token_ids=toks([*prompt, 7, 8, 9]),
            lock=True,
            session_id=sid,
            slot_indices=first.slot_indices + extra.slot_indices,
        ),
    )
    # Handing the held lock over in the same insert fits: 12 - 12 + 15 <= 20.
    out = stub.Insert(
        pb.InsertRequest(
            model="m",
            token_ids=toks([*prompt, 7, 8, 9]),
            lock=True,
            session_id=sid,
            release_lock_id=first.lock_id,
            slot_indices=first.slot_indices + extra.slot_indices,
        )
    )
    mine = held(stub, sid)
    assert (mine.locks, mine.locked_tokens, mine.slots) == (1, 15, 0)
    stub.Unlock(pb.UnlockRequest(lock_id=out.lock_id, session_id=sid))
    assert held(stub, sid).locked_tokens == 0


def test_step_items_are_held_to_the_quotas_one_by_one(server, stub, sid) -> None:
    stub.Alloc(pb.AllocRequest(model="m", num_slots=12, session_id=sid))
    before = refusals(server, "max_session_slots")
    reply = stub.Step(
        pb.StepRequest(
            model="m",
            session_id=sid,
            decodes=[2, 2, 1],
            admits=[pb.StepAdmit(token_ids=toks([40, 41, 42]), allocate=True)],
        )
    )
    codes = [r.error.code if r.HasField("error") else 0 for r in reply.decodes]
    # 12 + 2 + 2 = 16: the third decode and the admission are over the quota.
    assert codes == [0, 0, CODE.RESOURCE_EXHAUSTED.value[0]]
    assert reply.admits[0].error.code == CODE.RESOURCE_EXHAUSTED.value[0]
    assert "server.max_session_slots" in reply.admits[0].error.message
    assert held(stub, sid).slots == SLOTS
    assert refusals(server, "max_session_slots") >= before + 2
    server.check_integrity()


def test_closing_a_session_gives_its_quota_back(server, stub) -> None:
    sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
    prompt = list(range(200, 210))
    cache(stub, sid, prompt)
    stub.Match(pb.MatchRequest(model="m", token_ids=toks(prompt), lock=True, session_id=sid))
    stub.Alloc(pb.AllocRequest(model="m", num_slots=SLOTS, session_id=sid))
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    stats = stub.Stats(pb.StatsRequest(model="m", top_sessions=10))
    assert (stats.models[0].locks, stats.models[0].session_slots) == (0, 0)
    assert not [h for h in stats.top_sessions if sid.startswith(h.session)]


# ----------------------------------------------------------------------- streams


def test_a_second_kv_stream_of_a_session_is_refused(server, stub, sid) -> None:
    got = stub.Alloc(pb.AllocRequest(model="m", num_slots=2, session_id=sid))
    header = pb.KVChunk(
        header=pb.WriteKVHeader(model="m", slot_indices=got.slot_indices, session_id=sid)
    )
    chunks: queue.Queue = queue.Queue()
    chunks.put(header)
    result: list = []

    def write() -> None:
        try:
            result.append(stub.WriteKV(iter(chunks.get, None), timeout=30))
        except grpc.RpcError as exc:
            result.append(exc.code())

    writer = threading.Thread(target=write)
    writer.start()
    try:
        # The first stream holds the session's one stream once its header is read.
        for _ in range(200):
            if held(stub, sid).streams == 1:
                break
            threading.Event().wait(0.01)
        assert held(stub, sid).streams == 1
        refused = Refused(server, stub, "max_session_streams")
        refused(stub.WriteKV, iter([header]))
        refused(
            lambda req, timeout: list(stub.ReadKV(req, timeout=timeout)),
            pb.ReadKVRequest(model="m", slot_indices=got.slot_indices, session_id=sid),
        )
    finally:
        chunks.put(None)  # the first stream ends (incomplete: INVALID_ARGUMENT)
        writer.join(30)
    assert result == [CODE.INVALID_ARGUMENT]
    assert held(stub, sid).streams == 0
    list(
        stub.ReadKV(
            pb.ReadKVRequest(model="m", slot_indices=got.slot_indices, session_id=sid), timeout=10
        )
    )


# ------------------------------------------------------------------------- Stats


def test_stats_lists_the_top_holders_most_first(server, stub) -> None:
    ids = [
        stub.OpenSession(pb.OpenSessionRequest(client_name=f"w{i}")).session_id for i in range(3)
    ]
    try:
        for i, session_id in enumerate(ids):
            stub.Alloc(pb.AllocRequest(model="m", num_slots=2 + 3 * i, session_id=session_id))
        prompt = list(range(300, 308))
        cache(stub, ids[0], prompt)
        stub.Match(pb.MatchRequest(model="m", token_ids=toks(prompt), lock=True, session_id=ids[0]))
        top = stub.Stats(pb.StatsRequest(model="m", top_sessions=2)).top_sessions
        assert [h.client_name for h in top] == ["w0", "w2"]  # 2 + 8 locked, then 8 slots
        assert (top[0].slots, top[0].locks, top[0].locked_tokens) == (2, 1, 8)
        assert top[0].session == ids[0][:8] and not top[0].stream
        assert 0 < top[0].lease_left_seconds <= 30
        assert stub.Stats(pb.StatsRequest()).top_sessions == []  # only when asked
        everyone = stub.Stats(pb.StatsRequest(top_sessions=2**32 - 1)).top_sessions
        assert len(everyone) == stub.Stats(pb.StatsRequest()).sessions
    finally:
        for session_id in ids:
            stub.CloseSession(pb.CloseSessionRequest(session_id=session_id))


def test_a_long_client_name_is_cut_in_the_list(server, stub) -> None:
    sid = stub.OpenSession(pb.OpenSessionRequest(client_name="é" * 100)).session_id
    try:
        (mine,) = [
            h
            for h in stub.Stats(pb.StatsRequest(top_sessions=1000)).top_sessions
            if sid.startswith(h.session)
        ]
        assert mine.client_name == "é" * 32  # 64 UTF-8 bytes
    finally:
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


def test_config_refuses_a_negative_quota(tmp_path) -> None:
    for name in QUOTAS:
        path = tmp_path / f"{name}.yaml"
        path.write_text(f"server:\n  {name}: -1\n")
        with pytest.raises(ConfigError, match=name):
            load_config(path)
    path = tmp_path / "streams.yaml"
    path.write_text("server:\n  max_session_streams: 0\n")
    with pytest.raises(ConfigError, match="max_session_streams"):
        load_config(path)


def test_a_tenant_may_not_list_the_sessions(tmp_path) -> None:
    """The list names every tenant's clients: a tenant's token is refused it."""
    tenants = (TenantConfig("acme", "tok-acme", namespaces=("acme/",)),)
    with running(tmp_path, MODELS, token="t0k", tenants=tenants) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            acme = [("authorization", "Bearer tok-acme")]
            assert stub.Stats(pb.StatsRequest(), metadata=acme).sessions == 0
            with pytest.raises(grpc.RpcError) as err:
                stub.Stats(pb.StatsRequest(top_sessions=5), metadata=acme)
            assert err.value.code() == CODE.PERMISSION_DENIED
            operator = [("authorization", "Bearer t0k")]
            assert stub.Stats(pb.StatsRequest(top_sessions=5), metadata=operator)


def test_get_pages_past_the_token_quota_locks_nothing(tmp_path) -> None:
    """GetPages locks the pages it answers: held to the quota like any lock."""
    pages = (
        ModelConfig(name="p2", page_size=2, pool=PoolConfig(size=16, k_heads=1, k_head_dim=4)),
    )
    with running(tmp_path, pages, max_session_locked_tokens=6) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
            got = stub.Alloc(pb.AllocRequest(model="p2", num_slots=4, session_id=sid))
            stub.Insert(
                pb.InsertRequest(
                    model="p2",
                    token_ids=toks([1, 2, 3, 4]),
                    slot_indices=got.slot_indices,
                    session_id=sid,
                )
            )
            h12 = hash_token_ids([1, 2], None)
            h34 = hash_token_ids([3, 4], h12)
            request = pb.GetPagesRequest(
                model="p2", session_id=sid, page_hashes=bytes.fromhex(h12 + h34)
            )
            first = stub.GetPages(request)  # 4 tokens locked
            assert len(first.lock_ids) == 1
            Refused(srv, stub, "max_session_locked_tokens")(stub.GetPages, request)
            assert held(stub, sid).locked_tokens == 4
