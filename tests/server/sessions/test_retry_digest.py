"""A request id reused for a different request is refused, not replayed.

The replay window used to key on (op, request id) alone: a Step retried with other
tokens was answered ``replayed``, the first answer's lock standing for tokens it never
covered. Each kept reply now carries its request's digest (replays.py).
"""

from __future__ import annotations

import queue
from collections.abc import Iterator

import grpc
import pytest
from harness import pb, serve_module, session_of, stub_of, toks

CODE = grpc.StatusCode


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    yield from serve_module(tmp_path_factory, "digest")


@pytest.fixture(scope="module")
def stub(server) -> Iterator:
    yield from stub_of(server)


@pytest.fixture
def session(server, stub) -> Iterator[str]:
    yield from session_of(stub)
    server.check_integrity()


def state(stub) -> tuple:
    m = stub.Stats(pb.StatsRequest(model="m")).models[0]
    return m.locks, m.session_slots, m.free_slots, m.evictable_tokens, m.protected_tokens


def refused(call, request) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call(request)
    assert err.value.code() == CODE.FAILED_PRECONDITION, err.value.details()
    return err.value.details()


def test_a_step_retried_with_other_tokens_is_refused(server, stub, session) -> None:
    first = pb.StepRequest(
        model="m",
        session_id=session,
        request_id=5,
        admits=[pb.StepAdmit(token_ids=toks([1, 2, 3]), lock=True, allocate=True)],
    )
    reply = stub.Step(first)
    before = state(stub)
    # The same shape (one admission), other tokens: refused, not answered `replayed`.
    other = pb.StepRequest(
        model="m",
        session_id=session,
        request_id=5,
        admits=[pb.StepAdmit(token_ids=toks([9, 9, 9, 9, 9]), lock=True, allocate=True)],
    )
    assert "request_id 5 was used by a different step" in refused(stub.Step, other)
    assert state(stub) == before
    again = stub.Step(first)  # the faithful retry is still answered from the window
    assert again.replayed and again.admits == reply.admits
    assert state(stub) == before
    # A retry may name another epoch-free field the same: server_epoch is left out.
    first.server_epoch = reply.server_epoch
    assert stub.Step(first).replayed


def test_match_lock_and_get_pages_retries_are_checked_too(server, stub, session) -> None:
    match = pb.MatchRequest(
        model="m",
        session_id=session,
        request_id=8,
        token_ids=toks([4, 5]),
        lock=True,
        allocate=True,
    )
    stub.Match(match)
    before = state(stub)
    other = pb.MatchRequest(
        model="m",
        session_id=session,
        request_id=8,
        token_ids=toks([4, 5, 6, 7]),
        lock=True,
        allocate=True,
    )
    assert "different match" in refused(stub.Match, other)
    assert state(stub) == before
    pages = pb.GetPagesRequest(model="m", session_id=session, request_id=10, page_hashes=b"\1" * 32)
    stub.GetPages(pages)
    pages.page_hashes = b"\2" * 32
    assert "different get_pages" in refused(stub.GetPages, pages)
    assert state(stub) == before


def test_the_stream_and_the_unary_call_share_a_retry(server, stub, session) -> None:
    """A retry over the Session stream of a call first made by the unary RPC: another
    session, so a new call; within one stream, session_id is not part of the digest."""
    requests: queue.Queue = queue.Queue()
    replies = stub.Session(iter(requests.get, None), timeout=30)
    step = pb.StepRequest(model="m", request_id=3, decodes=[2])
    requests.put(pb.SessionRequest(seq=1, step=step))
    first = next(replies).step
    step.session_id = "ignored-by-the-digest"
    requests.put(pb.SessionRequest(seq=2, step=step))
    assert next(replies).step.replayed
    step.decodes[0] = 3
    requests.put(pb.SessionRequest(seq=3, step=step))
    answer = next(replies)
    assert answer.error.code == CODE.FAILED_PRECONDITION.value[0]
    assert not first.replayed
    requests.put(None)
