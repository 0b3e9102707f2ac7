"""The clients' ``step``: one scheduling step in one call, typed per-item results,
fail-open for the whole batch, idempotent retries and sessions that outlive their
service-side session. Against a real server (conftest.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from harness import ServerThread

from prefixcache.client import (
    Admit,
    AllocReply,
    AsyncPrefixCacheClient,
    Finish,
    Free,
    FreeReply,
    InsertReply,
    InvalidArgument,
    MatchReply,
    NotFound,
    PrefixCacheClient,
    ResourceExhausted,
    SessionLost,
    StaleEpoch,
    StepReply,
    Unavailable,
    UnlockReply,
)

pytestmark = pytest.mark.usefixtures("quiet")


def test_a_scheduling_step_in_one_call(client: PrefixCacheClient) -> None:
    with client.session() as s:
        first = s.step("p", admits=[list(range(10)), Admit([50, 51], hint=4)], decodes=[1, 1])
        a, b = first.admits
        assert isinstance(a, MatchReply) and len(a.allocated) == 10 and first.stale_hints == 1
        assert [len(d.slots) for d in first.decodes] == [1, 1] and first.ok
        assert isinstance(first.decodes[0], AllocReply) and len(first.decoded_slots()) == 2
        assert first.counters == client.stats("p")["p"] == client.counters["p"]
        assert a.server_epoch == first.server_epoch == client.server_epoch

        done = s.step(
            "p",
            finishes=[Finish(list(range(10)), a.all_slots(), release_lock_id=a.lock_id)],
            unlocks=[b.lock_id],
            frees=[b.allocated, Free(first.decoded_slots())],
            admits=[list(range(12))],
        )
        (ins,), (hit,) = done.finishes, done.admits
        assert isinstance(ins, InsertReply) and ins.cached_len == 8
        assert done.unlocks == (UnlockReply(),) and done.frees == (FreeReply(), FreeReply())
        assert hit.prefix_len == 8 and hit.lock_id  # the finish ran first
        assert done.counters.session_slots == 4  # the hit's allocation; the tail is freed

        bad = s.step("m", unlocks=[10**12], decodes=[10**6], admits=[[5000], [1, 2]])
        assert not bad.ok
        kinds = [(name, i, type(err)) for name, i, err in bad.errors()]
        assert kinds == [
            ("unlocks", 0, NotFound),
            ("decodes", 0, ResourceExhausted),
            ("admits", 0, InvalidArgument),
        ]
        assert isinstance(bad.admits[1], MatchReply)
    with pytest.raises(InvalidArgument):  # malformed on this side: nothing is sent
        client.step("m", session=s, admits=[Admit([1], token_width=9)])


def test_a_retried_step_is_answered_again(client: PrefixCacheClient) -> None:
    with client.session() as s:
        first = client.step("m", session=s, admits=[[900, 901]], decodes=[2], request_id=42)
        again = client.step("m", session=s, admits=[[900, 901]], decodes=[2], request_id=42)
        assert again.replayed and not first.replayed
        assert (again.admits, again.decodes) == (first.admits, first.decodes)
        assert again.counters == first.counters


def _everything() -> dict:
    return {
        "finishes": [Finish([1, 2], [1, 2])],
        "unlocks": [3],
        "frees": [[4]],
        "decodes": [1],
        "admits": [[1, 2], Admit([3], allocate=False)],
    }


def _check_failed_open(reply: StepReply) -> None:
    assert reply.skipped and reply.counters is None
    assert reply.finishes == (InsertReply(skipped=True),)
    assert reply.unlocks == (UnlockReply(skipped=True),)
    assert reply.frees == (FreeReply(skipped=True),)
    assert isinstance(reply.decodes[0], Unavailable)  # slots cannot be made up
    assert isinstance(reply.admits[0], Unavailable) and reply.admits[1].skipped


def test_a_step_fails_open_as_a_whole(tmp_path: Path) -> None:
    dead = str(tmp_path / "nobody.sock")
    with PrefixCacheClient(dead, timeout=0.3, retries=0) as c:
        with pytest.raises(Unavailable):
            c.step("m", session="abc", **_everything())
        _check_failed_open(c.step("m", session="abc", fail_open=True, **_everything()))
        assert c.fail_open_count == 1

    async def run() -> None:
        async with AsyncPrefixCacheClient(dead, timeout=0.3, retries=0, fail_open=True) as c:
            _check_failed_open(await c.step("m", session="abc", **_everything()))

    asyncio.run(run())


def test_a_lost_session_sends_only_what_names_no_old_handle(client: PrefixCacheClient) -> None:
    s = client.session(ttl=0.3)
    m = s.step("m", admits=[[950, 951]]).admits[0]
    kept = s.step("m", finishes=[Finish([950, 951], m.all_slots(), lock=True)]).finishes[0]
    client.close_session(s.session_id)  # as if the lease had lapsed
    deadline = time.monotonic() + 30
    while s.lost is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert isinstance(s.lost, NotFound)
    reply = s.step(
        "m",
        unlocks=[kept.lock_id],
        frees=[[7]],
        finishes=[Finish([1], [7], keep_tail=True)],
        admits=[[950, 951, 952]],
        decodes=[1],
    )
    assert all(isinstance(r, SessionLost) for r in (*reply.unlocks, *reply.frees, *reply.finishes))
    assert reply.admits[0].prefix_len == 2 and len(reply.decodes[0].slots) == 1
    assert s.reopened == 1 and not s.lost
    with pytest.raises(StaleEpoch):
        s.step("m", decodes=[1], server_epoch=s.server_epoch + 1)
    again = s.step("m", unlocks=[kept.lock_id, reply.admits[0].lock_id])
    assert isinstance(again.unlocks[0], SessionLost) and again.unlocks[1] == UnlockReply()
    s.close()


def test_async_sessions_and_the_stream_step(server: ServerThread) -> None:
    async def run() -> None:
        async with AsyncPrefixCacheClient(server.address) as c:
            async with c.session() as s:
                r = await s.step("m", admits=[[960, 961]], decodes=1)
                m = r.admits[0]
                done = await s.step(
                    "m", finishes=[Finish([960, 961], m.all_slots())], frees=[r.decodes[0].slots]
                )
                assert done.ok and done.counters.session_slots == 0
            async with c.stream_session() as st:
                r = await st.step("m", admits=[[960, 961, 962]], decodes=[2, 10**6])
                assert r.admits[0].prefix_len == 2 and isinstance(r.decodes[1], ResourceExhausted)
                assert r.counters.session_slots == 3 and r.counters.locks == 1
            await asyncio.sleep(0.05)  # the stream's end released what it held
            assert (await c.stats("m"))["m"].locks == 0

    asyncio.run(run())
