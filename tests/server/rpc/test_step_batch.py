"""Step as a batch, against a real server: per-item errors, whole-step refusals, limits,
idempotent retries, leases, and the Session stream.

(``test_step.py`` checks that each item behaves exactly like its unary call.)
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from harness import EVERY_KIND, pack_slots, pb, serve_module, session_of, slots, stub_of, toks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.server.rpc.status import EPOCH_TRAILER
from prefixcache.server.rpc.step import _shares_a_slot

CODE = grpc.StatusCode
MAX_ITEMS, MAX_BYTES = 40, 8192


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    yield from serve_module(
        tmp_path_factory,
        "batch",
        EVERY_KIND,
        session_ttl_min=0.2,
        max_step_items=MAX_ITEMS,
        max_step_bytes=MAX_BYTES,
    )


@pytest.fixture(scope="module")
def stub(server) -> Iterator:
    yield from stub_of(server)


@pytest.fixture
def session(server, stub) -> Iterator[str]:
    yield from session_of(stub)
    server.check_integrity()
    for model in stub.Stats(pb.StatsRequest()).models:
        assert (model.locks, model.session_slots, model.session_state_slots) == (0, 0, 0)


def stats(stub: Any, model: str = "m") -> pb.ModelStats:
    """A model's Stats, less what only Stats carries (lookup outcomes and the ceiling),
    so that it compares with a Step reply's counters."""
    out = stub.Stats(pb.StatsRequest(model=model)).models[0]
    for name in (
        "lookup_tokens_total",
        "pages_requested_total",
        "distinct_pages",
        "hit_ratio_ceiling",
    ):
        out.ClearField(name)
    return out


def code_of(result: pb.StepResult) -> CODE:
    assert result.HasField("error"), result
    return next(c for c in CODE if c.value[0] == result.error.code)


def admit(tokens: list[int], **kw: Any) -> pb.StepAdmit:
    return pb.StepAdmit(token_ids=toks(tokens), **{"lock": True, "allocate": True, **kw})


def finish(tokens: list[int], m: pb.MatchResponse, **kw: Any) -> pb.StepFinish:
    return pb.StepFinish(
        token_ids=toks(tokens),
        slot_indices=m.slot_indices + m.allocated_slots,
        release_lock_id=m.lock_id,
        **kw,
    )


def refused(call: Any, request: Any, code: CODE) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(request)
    assert err.value.code() == code, err.value.details()
    return err.value


def test_items_fail_alone_and_run_in_order(server, stub, session) -> None:
    """Each item gets its own result; a failed one changes nothing; finishes run before
    admissions, so an admission hits what a finish of the same step cached."""
    cached = list(range(90, 94))
    pre = stub.Step(pb.StepRequest(model="p", session_id=session, admits=[admit(cached)]))
    stub.Step(
        pb.StepRequest(
            model="p", session_id=session, finishes=[finish(cached, pre.admits[0].admit)]
        )
    )
    longer = list(range(90, 100))
    first = stub.Step(
        pb.StepRequest(
            model="p", session_id=session, admits=[admit(list(range(10))), admit(longer)]
        )
    )
    a, b = (r.admit for r in first.admits)
    before = stats(stub, "p")
    bad_tail = finish(longer, b)  # the tail's last slot is not the session's:
    bad_tail.slot_indices = bad_tail.slot_indices[:-8] + pack_slots([3])
    reply = stub.Step(
        pb.StepRequest(
            model="p",
            session_id=session,
            finishes=[finish(list(range(10)), a), bad_tail],  # a's 10 tokens: 8 cached
            unlocks=[10**12, b.lock_id],
            frees=[pb.StepFree(slot_indices=b"\x01")],
            decodes=[1, 10**6, 1],
            admits=[
                admit(list(range(12)), expected_prefix_len=8),
                admit([1], token_width=9),
                admit([5], extra_key="k" * 5000),
                admit([5, 6, 7, 8], expected_prefix_len=4),
            ],
        )
    )
    ok, failed = reply.finishes
    assert ok.finish.cached_len == 8 and code_of(failed) == CODE.FAILED_PRECONDITION
    assert "unaligned tail" in failed.error.message
    assert [r.WhichOneof("result") for r in reply.unlocks] == ["error", "unlock"]
    assert code_of(reply.unlocks[0]) == CODE.NOT_FOUND
    assert code_of(reply.frees[0]) == CODE.INVALID_ARGUMENT
    assert [r.WhichOneof("result") for r in reply.decodes] == ["decode", "error", "decode"]
    assert code_of(reply.decodes[1]) == CODE.RESOURCE_EXHAUSTED
    hit, wide, long_key, miss = reply.admits
    assert hit.admit.prefix_len == 8 and hit.admit.lock_id  # the finish came first
    assert code_of(wide) == code_of(long_key) == CODE.INVALID_ARGUMENT
    assert miss.admit.prefix_len == 0 and reply.stale_hints == 1
    assert reply.counters == stats(stub, "p") and reply.server_epoch == server.service.epoch
    # The refused finish inserted nothing, and its lock was released by the unlock only.
    assert stub.Match(pb.MatchRequest(model="p", token_ids=toks(longer))).prefix_len == 4
    assert before.locks == 1 and reply.counters.locks == 1  # b's released, the hit's taken
    server.check_integrity()


def test_a_tail_repeating_an_aligned_slot_refuses_the_finish_whole(server, stub, session) -> None:
    """The insert does not check the tail against the aligned part; the finish must, or
    the repeated slot goes to the tree and the tail's free then fails, half done."""
    tokens = list(range(800, 806))  # page 4: 4 aligned tokens, a tail of 2
    m = (
        stub.Step(pb.StepRequest(model="p", session_id=session, admits=[admit(tokens, lock=False)]))
        .admits[0]
        .admit
    )
    own = slots(m.allocated_slots)
    before = stats(stub, "p")
    repeat = pb.StepFinish(token_ids=toks(tokens), slot_indices=pack_slots(own[:5] + own[1:2]))
    reply = stub.Step(pb.StepRequest(model="p", session_id=session, finishes=[repeat]))
    assert code_of(reply.finishes[0]) == CODE.INVALID_ARGUMENT
    assert "aligned part too" in reply.finishes[0].error.message
    assert stats(stub, "p") == before  # nothing inserted, nothing freed
    assert stub.Match(pb.MatchRequest(model="p", token_ids=toks(tokens))).prefix_len == 0
    # A tail whose span holds aligned slots, none of them its own, is fine.
    ordered = sorted(own)
    spread = [*ordered[1:5], ordered[0], ordered[5]]
    done = stub.Step(
        pb.StepRequest(
            model="p",
            session_id=session,
            finishes=[pb.StepFinish(token_ids=toks(tokens), slot_indices=pack_slots(spread))],
        )
    )
    assert done.finishes[0].finish.cached_len == 4 and done.counters.session_slots == 0


@settings(max_examples=200, deadline=None)
@given(
    tail=st.lists(st.integers(1, 64), min_size=1, max_size=6, unique=True),
    head=st.lists(st.integers(1, 64), max_size=40),
)
def test_shares_a_slot_is_isin(tail: list[int], head: list[int]) -> None:
    t, h = np.array(tail, dtype=np.int64), np.array(head, dtype=np.int64)
    assert _shares_a_slot(t, h) == bool(np.isin(t, h).any())


def test_whole_step_refusals_change_nothing(server, stub, session) -> None:
    before = stub.Stats(pb.StatsRequest())
    item = admit([1, 2, 3])
    too_many = pb.StepRequest(
        model="m",
        session_id=session,
        admits=[item] * (MAX_ITEMS // 2),
        decodes=[1] * (MAX_ITEMS // 2 + 1),
    )
    assert "max_step_items" in refused(stub.Step, too_many, CODE.RESOURCE_EXHAUSTED).details()
    too_big = pb.StepRequest(
        model="m", session_id=session, admits=[admit(list(range(100)))] * 21
    )  # 8400 bytes
    assert "max_step_bytes" in refused(stub.Step, too_big, CODE.RESOURCE_EXHAUSTED).details()
    epoch = server.service.epoch
    for request, code in (
        (pb.StepRequest(model="m", admits=[item]), CODE.FAILED_PRECONDITION),
        (pb.StepRequest(model="m", session_id="f" * 32, admits=[item]), CODE.NOT_FOUND),
        (pb.StepRequest(model="zz", session_id=session, admits=[item]), CODE.NOT_FOUND),
        (pb.StepRequest(model="m", session_id="x" * 200, admits=[item]), CODE.INVALID_ARGUMENT),
    ):
        refused(stub.Step, request, code)
    stale = refused(
        stub.Step,
        pb.StepRequest(model="m", session_id=session, admits=[item], server_epoch=epoch + 1),
        CODE.FAILED_PRECONDITION,
    )
    assert (EPOCH_TRAILER, str(epoch)) in tuple(stale.trailing_metadata())
    server.run(setattr, server.service, "draining", True)
    try:
        refused(
            stub.Step,
            pb.StepRequest(model="m", session_id=session, admits=[item]),
            CODE.UNAVAILABLE,
        )
    finally:
        server.run(setattr, server.service, "draining", False)
    stats_now = stub.Stats(pb.StatsRequest())
    assert stats_now.models == before.models


def test_malformed_bytes_are_invalid_argument(server) -> None:
    channel = grpc.insecure_channel(server.address)
    with channel:
        call = channel.unary_unary("/prefixcache.v1.PrefixCache/Step")
        with pytest.raises(grpc.RpcError) as err:
            call(b"\xff\xff\xff")
        assert err.value.code() == CODE.INVALID_ARGUMENT


def test_a_retried_step_is_answered_again_and_kept_compactly(server, stub, session) -> None:
    """A retry with the same request id gets the first answer, changes nothing, and the
    replay window does not keep a locked admission's prefix slots (the tree has them)."""
    warm = stub.Step(
        pb.StepRequest(model="m", session_id=session, admits=[admit(list(range(100, 140)))])
    )
    m = warm.admits[0].admit
    stub.Step(
        pb.StepRequest(model="m", session_id=session, finishes=[finish(list(range(100, 140)), m)])
    )
    request = pb.StepRequest(
        model="m",
        session_id=session,
        request_id=77,
        admits=[admit(list(range(100, 150))), admit([7], lock=False)],
        decodes=[2, 10**6],
        unlocks=[10**12],
    )
    first = stub.Step(request)
    after_first = stats(stub)
    again = stub.Step(request)
    assert again.replayed and not first.replayed
    assert stats(stub) == after_first  # nothing done twice
    for name in ("finishes", "unlocks", "frees", "decodes", "admits"):
        assert getattr(again, name) == getattr(first, name), name
    assert len(slots(again.admits[0].admit.slot_indices)) == 40  # read back from the tree
    kept = server.run(lambda: server.service.session(session).replay("step", 77)).reply
    assert kept.admits[0].admit.slot_indices == b"" and not kept.HasField("counters")
    assert kept.admits[1].admit.allocated_slots == first.admits[1].admit.allocated_slots
    other = pb.StepRequest(model="m", session_id=session, request_id=77, decodes=[1])
    assert "different step" in refused(stub.Step, other, CODE.FAILED_PRECONDITION).details()
    # Once the admission's lock is gone, its answer cannot be replayed: the item says so.
    stub.Unlock(pb.UnlockRequest(lock_id=first.admits[0].admit.lock_id, session_id=session))
    late = stub.Step(request)
    assert code_of(late.admits[0]) == CODE.FAILED_PRECONDITION
    assert late.decodes == first.decodes and stats(stub).locks == 0


def test_a_lapsed_lease_hands_back_what_steps_took(server, stub) -> None:
    sid = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=0.5)).session_id
    base = stats(stub)
    m = (
        stub.Step(pb.StepRequest(model="m", session_id=sid, admits=[admit([500, 501, 502, 503])]))
        .admits[0]
        .admit
    )
    stub.Step(pb.StepRequest(model="m", session_id=sid, finishes=[finish([500, 501, 502, 503], m)]))
    for _ in range(4):  # 0.8 s in all: each step renews the lease
        stub.Step(
            pb.StepRequest(
                model="m", session_id=sid, decodes=[1], admits=[admit([500, 501, 502, 503, 504])]
            )
        )
        time.sleep(0.2)
    held = stats(stub)
    assert (held.locks, held.session_slots) == (4, 4 + 4)
    ins = stub.Step(
        pb.StepRequest(
            model="m",
            session_id=sid,
            admits=[admit([500])],
            finishes=[
                pb.StepFinish(
                    token_ids=toks([600, 601]), slot_indices=pack_slots([1, 2]), keep_tail=True
                )
            ],
        )
    )
    assert code_of(ins.finishes[0]) == CODE.FAILED_PRECONDITION  # not its slots
    deadline = time.monotonic() + 5
    while stats(stub).session_slots and time.monotonic() < deadline:
        time.sleep(0.05)
    gone = stats(stub)
    assert (gone.locks, gone.session_slots, gone.protected_tokens) == (0, 0, 0)
    assert gone.free_slots + gone.evictable_tokens == base.free_slots + base.evictable_tokens
    refused(stub.Step, pb.StepRequest(model="m", session_id=sid, decodes=[1]), CODE.NOT_FOUND)
    server.check_integrity()


def test_the_session_stream_carries_steps_and_releases_them(server, stub, session) -> None:
    m = (
        stub.Step(pb.StepRequest(model="m", session_id=session, admits=[admit([700, 701])]))
        .admits[0]
        .admit
    )
    stub.Step(pb.StepRequest(model="m", session_id=session, finishes=[finish([700, 701], m)]))
    requests: queue.Queue = queue.Queue()
    replies = stub.Session(iter(requests.get, None))
    requests.put(
        pb.SessionRequest(
            seq=1,
            step=pb.StepRequest(
                model="m",
                session_id="ignored",
                decodes=[3],
                admits=[admit([700, 701, 702]), admit([1], token_width=9)],
            ),
        )
    )
    first = next(replies)
    assert first.seq == 1 and first.WhichOneof("result") == "step"
    assert len(slots(first.step.decodes[0].decode.slot_indices)) == 3
    assert code_of(first.step.admits[1]) == CODE.INVALID_ARGUMENT
    requests.put(pb.SessionRequest(seq=2, step=pb.StepRequest(model="m", decodes=[1] * 50)))
    over = next(replies)
    assert over.error.code == CODE.RESOURCE_EXHAUSTED.value[0]
    assert first.step.admits[0].admit.prefix_len == 2
    assert (stats(stub).session_slots, stats(stub).locks) == (4, 1)
    requests.put(None)  # the stream ends: everything the steps took comes back
    assert list(replies) == []
    deadline = time.monotonic() + 5
    while stats(stub).session_slots and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (stats(stub).session_slots, stats(stub).locks) == (0, 0)
    server.check_integrity()


_garbage = st.one_of(
    st.binary(max_size=24),
    st.lists(st.integers(-5, 300), max_size=6).map(lambda ids: pack_slots(ids)),
)
_tokens = st.one_of(st.binary(max_size=24), st.lists(st.integers(0, 1200), max_size=8).map(toks))
_items = st.fixed_dictionaries(
    {
        "finishes": st.lists(
            st.builds(
                pb.StepFinish,
                token_ids=_tokens,
                slot_indices=_garbage,
                token_width=st.integers(0, 10),
                release_lock_id=st.integers(0, 2**64 - 1),
                lock=st.booleans(),
                keep_tail=st.booleans(),
                slot_version=st.integers(0, 2**64 - 1),
            ),
            max_size=3,
        ),
        "unlocks": st.lists(st.integers(0, 2**64 - 1), max_size=3),
        "frees": st.lists(
            st.builds(pb.StepFree, slot_indices=_garbage, state_slots=_garbage), max_size=3
        ),
        "decodes": st.lists(st.integers(0, 2**64 - 1), max_size=4),
        "admits": st.lists(
            st.builds(
                pb.StepAdmit,
                token_ids=_tokens,
                token_width=st.integers(0, 10),
                lock=st.booleans(),
                allocate=st.booleans(),
                expected_prefix_len=st.integers(0, 2**32 - 1),
            ),
            max_size=3,
        ),
    }
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(model=st.sampled_from([m.name for m in EVERY_KIND]), items=_items)
def test_adversarial_items_get_documented_codes(
    server, stub, model: str, items: dict[str, Any]
) -> None:
    """Garbage items never answer INTERNAL, whole or per item, and leave a sound cache."""
    sid = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=60)).session_id
    try:
        request = pb.StepRequest(model=model, session_id=sid, **items)
        try:
            reply = stub.Step(request)
        except grpc.RpcError as err:
            assert err.code() in ALLOWED, err.details()
            return
        for name in ("finishes", "unlocks", "frees", "decodes", "admits"):
            for result in getattr(reply, name):
                if result.HasField("error"):
                    assert code_of(result) in ALLOWED, result.error.message
    finally:
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        server.check_integrity()


ALLOWED = {CODE.INVALID_ARGUMENT, CODE.NOT_FOUND, CODE.FAILED_PRECONDITION, CODE.RESOURCE_EXHAUSTED}


def test_the_step_limits_are_settings(tmp_path) -> None:
    from prefixcache.server.config import ConfigError, load_config

    (tmp_path / "c.yaml").write_text(
        "models:\n  - name: m\n    pool: {size: 64, layers: 1, k_heads: 1, k_head_dim: 4}\n"
    )
    env = {"PREFIXCACHE_MAX_STEP_ITEMS": "7", "PREFIXCACHE_MAX_STEP_BYTES": "100"}
    server = load_config(tmp_path / "c.yaml", env=env).server
    assert (server.max_step_items, server.max_step_bytes) == (7, 100)
    with pytest.raises(ConfigError, match="max_step_items"):
        load_config(tmp_path / "c.yaml", env={"PREFIXCACHE_MAX_STEP_ITEMS": "0"})
