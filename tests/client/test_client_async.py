"""AsyncPrefixCacheClient: every call, leased sessions, fail-open and the Session stream."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from harness import ServerThread, running

from prefixcache.client import (
    AsyncPrefixCacheClient,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)


def run(
    server: ServerThread, body: Callable[[AsyncPrefixCacheClient], Awaitable[Any]], **kwargs: Any
) -> Any:
    async def main() -> Any:
        async with AsyncPrefixCacheClient(server.address, **kwargs) as client:
            return await body(client)

    return asyncio.run(main())


@pytest.mark.usefixtures("quiet")
def test_every_call(server: ServerThread) -> None:
    async def body(c: AsyncPrefixCacheClient) -> None:
        models = await c.list_models()
        assert [m.name for m in models.models] == ["m", "p", "h", "s"]
        assert (await c.describe_pool("p")).page_size == 4
        assert (await c.stats()).server_epoch == models.server_epoch
        await c.evict("p", 10**6)
        async with c.session(ttl=10, name="async-worker") as s:
            assert s.ttl == pytest.approx(10)
            assert await s.keep_alive() == pytest.approx(10)
            tokens = list(range(300, 310))
            miss = await s.match("p", tokens, lock=True, allocate=True)
            assert (miss.prefix_len, len(miss.allocated)) == (0, 10)
            ins = await s.insert(
                "p", tokens, miss.all_slots(), lock=True, release_lock_id=miss.lock_id
            )
            assert (ins.prefix_len, ins.cached_len) == (0, 8) and ins.lock_id
            st = (await c.stats("p"))["p"]
            assert (st.protected_tokens, st.session_slots) == (8, 2)  # the tail stays ours
            await s.free("p", miss.allocated[8:])
            await s.unlock(ins.lock_id)
            again = await c.lock("p", ins.node_id, session=s)
            assert again.lock_id
            await c.unlock(again.lock_id, session=s)
            hit = await c.match("p", tokens)
            assert (hit.prefix_len, hit.node_id) == (8, ins.node_id)
            got = await s.alloc("p", 5)
            assert len(got.slots) == 5
            await c.free("p", got.slots, session=s)
            assert (await c.evict("p", 1)).evicted_tokens == 8
        assert s.closed
        info = await c.open_session(ttl=3)
        assert await c.keep_alive(info) == pytest.approx(3)
        await c.alloc("m", 2, session=info)
        closed = await c.close_session(info)
        assert closed.slots_freed == 2
        opened = await c.session(ttl=3)  # awaiting opens it without a block
        assert opened.session_id
        assert await opened.close() is not None

    run(server, body)


@pytest.mark.usefixtures("quiet")
def test_errors_reset_and_a_deadline(server: ServerThread) -> None:
    async def body(c: AsyncPrefixCacheClient) -> None:
        await c.evict("p", 10**6)
        async with c.session(ttl=10) as s:
            tokens = list(range(400, 408))
            m = await s.match("p", tokens, lock=True, allocate=True)
            await s.insert("p", tokens, m.all_slots(), release_lock_id=m.lock_id)
            with pytest.raises(InvalidArgument):
                await c.match("p", b"\x01\x02")
            with pytest.raises(NotFound):
                await c.describe_pool("zz")
            with pytest.raises(FailedPrecondition):
                await s.free("p", m.allocated)  # the tree owns them now
            with pytest.raises(ResourceExhausted):
                await s.alloc("p", 10**6)
        info = await c.open_session(ttl=3)
        closed = await c.close_session(info)
        assert (closed.locks_released, closed.slots_freed) == (0, 0)
        reset = await c.reset("p")
        assert reset.dropped_tokens == 8
        server.loop.call_soon_threadsafe(time.sleep, 0.3)
        with pytest.raises(DeadlineExceeded):
            await c.stats(timeout=0.05)
        await asyncio.sleep(0.3)

    run(server, body)


def test_renewal_task_keeps_the_lease(server: ServerThread) -> None:
    async def body(c: AsyncPrefixCacheClient) -> None:
        async with c.session(ttl=0.3) as kept:
            lapsing = await c.session(ttl=0.3, renew=False)
            for s, tokens in ((kept, [60, 61]), (lapsing, [70])):
                m = await s.match("m", tokens, allocate=True)
                ins = await s.insert("m", tokens, m.allocated, lock=True)
                assert ins.lock_id
            await asyncio.sleep(1.0)
            st = (await c.stats("m"))["m"]
            assert (st.locks, st.protected_tokens) == (1, 2)
            assert kept.renewals >= 2 and kept.lost is None
            await lapsing.close()
        assert (await c.stats("m"))["m"].locks == 0

    run(server, body)


def test_a_session_dropped_after_renewing_stops_its_task_and_lapses(server: ServerThread) -> None:
    """As the blocking session's thread: the renewal task holds its session only
    weakly, also between renewals, so dropping it ends the task and the lease."""

    async def body(c: AsyncPrefixCacheClient) -> None:
        s = await c.session(ttl=0.3)
        m = await s.match("m", [62, 63], allocate=True)
        assert (await s.insert("m", [62, 63], m.allocated, lock=True)).lock_id
        deadline = time.monotonic() + 30
        while s.renewals < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert s.renewals >= 2
        task = s._task
        del s
        gc.collect()
        assert task is not None
        await asyncio.wait_for(asyncio.shield(task), 30)
        deadline = time.monotonic() + 30
        while (await c.stats("m"))["m"].locks and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert (await c.stats("m"))["m"].locks == 0

    run(server, body)


def test_async_fail_open_with_the_server_stopped(tmp_path: Path) -> None:
    async def main() -> None:
        with running(tmp_path) as srv:
            c = AsyncPrefixCacheClient(srv.address, fail_open=True, retries=1, backoff=0.01)
            s = await c.session(ttl=5)
            m = await s.match("m", [1, 2], allocate=True)
            await s.insert("m", [1, 2], m.allocated)
            assert (await c.match("m", [1, 2])).prefix_len == 2
        miss = await s.match("m", [1, 2], lock=True)
        assert miss.skipped and miss.prefix_len == 0 and c.fail_open_count == 1
        assert (await s.insert("m", [1, 2], [1, 2])).skipped
        assert (await s.lock("m", 1)).skipped and (await s.unlock(1)).skipped
        assert c.fail_open_count == 4
        with pytest.raises(Unavailable):
            await s.alloc("m", 1)
        assert await s.close() is None
        await c.close()

    asyncio.run(main())


@pytest.mark.usefixtures("quiet")
def test_stream_session_carries_a_prefill_and_releases_on_close(server: ServerThread) -> None:
    async def body(c: AsyncPrefixCacheClient) -> None:
        tokens = list(range(500, 506))
        async with c.stream_session() as s:
            m = await s.match("m", tokens, lock=True, allocate=True)
            assert (m.prefix_len, len(m.allocated)) == (0, 6)
            ins = await s.insert("m", tokens, m.all_slots(), lock=True, release_lock_id=m.lock_id)
            assert ins.cached_len == 6 and ins.lock_id
            # Pipelined: several calls in flight at once, answered in order.
            replies = await asyncio.gather(*(s.match("m", tokens[:k]) for k in range(1, 6)))
            assert [r.prefix_len for r in replies] == [1, 2, 3, 4, 5]
            with pytest.raises(NotFound):  # an error comes back in-band; the stream goes on
                await s.lock("m", 987654321)
            extra = await s.alloc("m", 3)
            assert (await s.stats("m"))["m"].session_slots == 3
            await s.free("m", extra.slots[:1])
            assert (await s.lock("m", ins.node_id)).lock_id
            await s.unlock(ins.lock_id)
            assert (await s.evict("m", 0)).evicted_tokens == 0
            assert (await c.stats("m"))["m"].locks == 1
        # The stream ended: its lock and its two remaining slots are gone.
        for _ in range(100):
            st = (await c.stats("m"))["m"]
            if (st.locks, st.session_slots) == (0, 0):
                break
            await asyncio.sleep(0.01)
        assert (st.locks, st.session_slots) == (0, 0)
        with pytest.raises(Unavailable):
            await s.match("m", tokens)

    run(server, body)


def test_stream_session_deadline_and_fail_open(server: ServerThread) -> None:
    async def body(c: AsyncPrefixCacheClient) -> None:
        async with c.stream_session(fail_open=True) as s:
            assert (await s.match("m", [1])).prefix_len == 0
            server.loop.call_soon_threadsafe(time.sleep, 0.3)
            assert (await s.match("m", [1], timeout=0.05)).skipped
            with pytest.raises(DeadlineExceeded):
                await s.match("m", [1], timeout=0.05, fail_open=False)
            await asyncio.sleep(0.3)
            assert not (await s.match("m", [1])).skipped  # late answers were dropped
        assert c.fail_open_count == 1

    run(server, body)


def test_async_token_auth(tmp_path: Path) -> None:
    with running(tmp_path, token="t0k", admin_token="adm") as srv:

        async def body(c: AsyncPrefixCacheClient) -> None:
            assert (await c.list_models()).models
            with pytest.raises(PermissionDenied):
                await c.reset("m")
            async with c.stream_session() as s:
                assert (await s.match("m", [1])).prefix_len == 0

        run(srv, body, token="t0k")
