"""The per-session replay window: bounded in replies and in bytes, cleared by Reset."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from harness import EVERY_KIND, pb, running, stub_for, toks

from prefixcache.server.sessions.session import REPLAY_BYTES, REPLAY_WINDOW, Session


def _session() -> Session:
    return Session(id="s", tag=1, name="", ttl=None, expires_at=0.0)


def _reply(n_bytes: int) -> pb.MatchResponse:
    return pb.MatchResponse(slot_indices=b"\0" * n_bytes)


def test_the_window_keeps_the_newest_replies_within_count_and_bytes() -> None:
    s = _session()
    for rid in range(1, REPLAY_WINDOW + 5):
        s.remember("match", rid, _reply(10))
    assert len(s.replies) == REPLAY_WINDOW
    assert s.replay("match", 1) is None and s.replay("match", REPLAY_WINDOW + 4) is not None
    big = REPLAY_BYTES // 4
    for rid in range(100, 110):  # ten replies of a quarter of the budget each
        s.remember("match", rid, _reply(big))
    assert s.replay_bytes <= REPLAY_BYTES
    assert s.replay_bytes == sum(size for _, size in s.replies.values())
    assert s.replay("match", 109) is not None and s.replay("match", 100) is None


def test_a_reply_larger_than_the_budget_is_still_kept_alone() -> None:
    s = _session()
    s.remember("match", 1, _reply(10))
    s.remember("match", 2, _reply(REPLAY_BYTES * 2))
    assert list(s.replies) == [("match", 2)]
    assert s.replay("match", 2) is not None
    s.remember("match", 3, _reply(10))
    assert list(s.replies) == [("match", 3)]
    assert s.replay_bytes == _reply(10).ByteSize()


@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    with running(tmp_path_factory.mktemp("replay"), EVERY_KIND) as server:
        channel, stub = stub_for(server.address)
        yield stub
        channel.close()


def test_reset_forgets_replies_so_a_retry_takes_a_new_lock(stub) -> None:
    sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
    ins = pb.InsertRequest(model="m", token_ids=toks([5, 6, 7]), session_id=sid)
    alloc = stub.Alloc(pb.AllocRequest(model="m", num_slots=3, session_id=sid))
    ins.slot_indices = alloc.slot_indices
    stub.Insert(ins)
    m = pb.MatchRequest(
        model="m", token_ids=toks([5, 6, 7]), session_id=sid, lock=True, request_id=41
    )
    before = stub.Match(m)
    assert before.lock_id and stub.Match(m).lock_id == before.lock_id
    stub.Reset(pb.ResetRequest(model="m"))
    after = stub.Match(m)  # the kept reply named a lock the reset dropped
    assert after.lock_id != before.lock_id and after.prefix_len == 0
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
