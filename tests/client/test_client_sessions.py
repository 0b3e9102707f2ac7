"""Sessions the client manages (context manager, lease renewal) and fail-open mode."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from pathlib import Path

import pytest
from harness import ServerThread, running

from prefixcache.client import (
    AsyncPrefixCacheClient,
    ClientSession,
    DeadlineExceeded,
    NotFound,
    PrefixCacheClient,
    Unavailable,
)
from prefixcache.client.results import CloseReply


def prefill(s: ClientSession, model: str, tokens: list[int], *, keep_lock: bool = False) -> int:
    m = s.match(model, tokens, lock=True, allocate=True)
    return s.insert(model, tokens, m.all_slots(), lock=keep_lock, release_lock_id=m.lock_id).lock_id


def test_leaving_the_block_releases_locks_and_slots(client: PrefixCacheClient) -> None:
    with client.session() as s:
        assert prefill(s, "m", [1, 2, 3], keep_lock=True)
        s.alloc("m", 4)
        st = client.stats("m")["m"]
        assert (st.locks, st.session_slots, st.protected_tokens) == (1, 4, 3)
    assert s.closed and s.close() is None  # closing twice is a no-op
    st = client.stats("m")["m"]
    assert (st.locks, st.session_slots, st.protected_tokens) == (0, 0, 0)
    with pytest.raises(NotFound):
        client.keep_alive(s)


def test_an_error_leaving_the_block_is_not_hidden(client: PrefixCacheClient) -> None:
    with pytest.raises(KeyError), client.session() as s:
        prefill(s, "m", [4, 5], keep_lock=True)
        client.close_session(s)  # closing again on the way out finds nothing
        raise KeyError("the worker's own error")
    assert client.stats("m")["m"].locks == 0


def test_renewal_keeps_locks_past_the_lease(client: PrefixCacheClient) -> None:
    """Lease 0.5 s, 2 s of idleness: the renewed session keeps its lock, the other
    one (not renewed) has lapsed and lost its lock."""
    kept = client.session(ttl=0.5)
    lapsing = client.session(ttl=0.5, renew=False)
    assert kept.ttl == pytest.approx(0.5)
    prefill(kept, "m", [10, 11, 12], keep_lock=True)
    prefill(lapsing, "m", [20, 21], keep_lock=True)
    assert client.stats("m")["m"].locks == 2
    time.sleep(2.0)
    st = client.stats("m")["m"]
    assert (st.locks, st.protected_tokens) == (1, 3)
    assert kept.renewals >= 3 and kept.lost is None
    assert lapsing.close() is not None  # the service no longer knows it: empty reply
    kept.close()
    assert client.stats("m")["m"].locks == 0


def test_a_session_dropped_without_close_stops_renewing_and_lapses(
    client: PrefixCacheClient,
) -> None:
    s = client.session(ttl=0.3)
    prefill(s, "m", [30, 31], keep_lock=True)
    thread = s._thread
    del s
    _renewal_ends_and_lease_lapses(client, thread)


def test_a_session_dropped_after_renewing_stops_renewing_and_lapses(
    client: PrefixCacheClient,
) -> None:
    """The renewal thread holds its session only weakly, also between renewals: once
    it has renewed, dropping the session still ends the thread and the lease."""
    s = client.session(ttl=0.3)
    prefill(s, "m", [32, 33], keep_lock=True)
    deadline = time.monotonic() + 30
    while s.renewals < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert s.renewals >= 2
    thread = s._thread
    del s
    _renewal_ends_and_lease_lapses(client, thread)


def _renewal_ends_and_lease_lapses(
    client: PrefixCacheClient, thread: threading.Thread | None
) -> None:
    """After the test dropped its only reference to a session renewed by ``thread``."""
    gc.collect()
    assert thread is not None
    thread.join(30)
    assert not thread.is_alive()
    deadline = time.monotonic() + 30
    while client.stats("m")["m"].locks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.stats("m")["m"].locks == 0


def test_a_session_the_service_forgot_is_reported_lost(client: PrefixCacheClient) -> None:
    s = client.session(ttl=0.3)
    client.close_session(s.session_id)  # as if the lease had lapsed or the server restarted
    deadline = time.monotonic() + 30
    while s.lost is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert isinstance(s.lost, NotFound)
    assert s.close() is not None


def test_fail_open_when_the_server_stops_mid_run(tmp_path: Path) -> None:
    with running(tmp_path, session_ttl_min=0.2) as srv:
        client = PrefixCacheClient(srv.address, fail_open=True, retries=1, backoff=0.01)
        s = client.session(ttl=5)
        prefill(s, "m", [1, 2, 3])
        node = client.match("m", [1, 2, 3]).node_id
        assert client.match("m", [1, 2, 3, 4]).prefix_len == 3
        assert client.fail_open_count == 0
    # The server is gone.
    miss = s.match("m", [1, 2, 3, 4], lock=True)
    assert (miss.skipped, miss.prefix_len, len(miss.slots), miss.lock_id) == (True, 0, 0, 0)
    assert client.fail_open_count == 1
    assert client.match("m", [1, 2, 3]).skipped
    assert s.insert("m", [1, 2, 3], [1, 2, 3]).skipped
    assert s.lock("m", node).skipped
    assert s.unlock(5).skipped
    assert client.fail_open_count == 5
    with pytest.raises(Unavailable):  # slots cannot be made up
        s.alloc("m", 1)
    with pytest.raises(Unavailable):
        s.match("m", [1, 2, 3], allocate=True)
    with pytest.raises(Unavailable):  # nor can reads other than match
        client.stats()
    assert client.fail_open_count == 5
    assert s.close() is None  # fails open too: the dead server released everything
    client.close()


def test_fail_open_covers_opening_the_session(tmp_path: Path) -> None:
    """A worker that starts before its sidecar gets a session that is not open yet:
    its calls are misses, and its first match once the sidecar is up opens it."""
    address = f"unix:{tmp_path / 'pc.sock'}"
    client = PrefixCacheClient(address, fail_open=True, timeout=0.2, retries=0)
    s = client.session(ttl=5)
    assert (s.session_id, s.lost is not None, s.reopened) == ("", True, 0)
    assert client.fail_open_count == 1
    assert s.match("m", [1, 2, 3], lock=True).skipped
    assert s.insert("m", [1, 2, 3], [1, 2, 3]).skipped  # names no slot it holds
    assert client.fail_open_count == 3  # each miss it made up is counted
    with pytest.raises(Unavailable):  # slots cannot be made up
        s.alloc("m", 1)
    with running(tmp_path, session_ttl_min=0.2) as srv:
        deadline = time.monotonic() + 10  # the channel reconnects with a backoff
        while s.match("m", [1, 2, 3]).skipped and time.monotonic() < deadline:
            time.sleep(0.05)
        prefill(s, "m", [1, 2, 3])
        assert s.session_id and s.lost is None and s.reopened == 0
        assert s.match("m", [1, 2, 3, 4]).prefix_len == 3
        assert s.close() == CloseReply(locks_released=0, slots_freed=0)
        srv.check_integrity()
    strict = PrefixCacheClient(address, timeout=0.2, retries=0)
    with pytest.raises(Unavailable):  # not failing open: the error itself
        strict.session()
    strict.close()
    client.close()


async def _open_async_before_the_sidecar(tmp_path: Path) -> None:
    address = f"unix:{tmp_path / 'pc.sock'}"
    client = AsyncPrefixCacheClient(address, fail_open=True, timeout=0.2, retries=0)
    async with client.session(ttl=5) as s:
        assert (s.session_id, client.fail_open_count) == ("", 1)
        assert (await s.match("m", [7, 8])).skipped
        assert client.fail_open_count == 2  # the miss it made up is counted
        with running(tmp_path, session_ttl_min=0.2) as srv:
            deadline = time.monotonic() + 10  # the channel reconnects with a backoff
            while (await s.match("m", [7, 8])).skipped and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            m = await s.match("m", [7, 8], lock=True, allocate=True)
            assert not m.skipped and s.session_id and s.reopened == 0
            await s.insert("m", [7, 8], m.all_slots(), release_lock_id=m.lock_id)
            assert (await s.match("m", [7, 8, 9])).prefix_len == 2
            await s.close()
            srv.check_integrity()
    strict = AsyncPrefixCacheClient(address, timeout=0.2, retries=0)
    with pytest.raises(Unavailable):
        await strict.session().open()
    await strict.close()
    await client.close()


def test_fail_open_covers_opening_an_async_session(tmp_path: Path) -> None:
    asyncio.run(_open_async_before_the_sidecar(tmp_path))


def test_fail_open_on_a_slow_or_draining_server(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    open_client = PrefixCacheClient(server.address, fail_open=True, timeout=0.1, retries=0)
    release = threading.Event()  # the server's loop stuck until the test lets it go
    server.loop.call_soon_threadsafe(release.wait, 30)
    try:
        # Skipped by the client's own deadline while the loop is still stuck.
        assert open_client.match("m", [1, 2]).skipped
    finally:
        release.set()
    server.run(setattr, server.service, "draining", True)
    try:
        assert open_client.match("m", [1, 2]).skipped
        with pytest.raises(Unavailable):
            client.match("m", [1, 2], timeout=0.5)  # fail_open is off for this client
        assert client.match("m", [1, 2], fail_open=True).skipped  # per call
    finally:
        server.run(setattr, server.service, "draining", False)
    assert open_client.fail_open_count == 2 and client.fail_open_count == 1
    assert not open_client.match("m", [1, 2]).skipped
    open_client.close()


def test_fail_open_per_session(server: ServerThread, client: PrefixCacheClient) -> None:
    with client.session(fail_open=True) as s:
        server.loop.call_soon_threadsafe(time.sleep, 0.3)
        assert s.match("m", [3, 4], timeout=0.05).skipped
        with pytest.raises(DeadlineExceeded):
            client.match("m", [3, 4], session=s, timeout=0.05)
        time.sleep(0.3)


_WORKER = """
import sys
from prefixcache.client import PrefixCacheClient
client = PrefixCacheClient(sys.argv[1])
s = client.session(ttl=0.5)  # renewed by a thread for as long as the process lives
for i in range(120):  # 120 locks and 120 allocated-but-not-inserted slots
    tokens = [500 + i]
    m = s.match("m", tokens, lock=True, allocate=True)
    s.insert("m", tokens, m.all_slots(), lock=True, release_lock_id=m.lock_id)
    s.alloc("m", 1)
print("ready", flush=True)
sys.stdin.read()  # hold everything until killed
"""


def test_a_killed_worker_s_locks_and_slots_are_released_after_its_lease(
    server: ServerThread, client: PrefixCacheClient, tmp_path: Path
) -> None:
    import os
    import signal
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1")
    worker = subprocess.Popen(
        [sys.executable, "-c", _WORKER, server.address],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout is not None and worker.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # past two leases: only renewal keeps the worker's claims alive
        st = client.stats("m")["m"]
        assert (st.locks, st.session_slots) == (120, 120)
        worker.send_signal(signal.SIGKILL)
        worker.wait(10)
        # Released once its 0.5 s lease lapses unrenewed (a polling deadline, generous).
        deadline = time.monotonic() + 30
        while True:
            st = client.stats("m")["m"]
            if (st.locks, st.session_slots) == (0, 0):
                break
            assert time.monotonic() < deadline, f"never released: {st.locks} locks"
            time.sleep(0.05)
        server.check_integrity()
    finally:
        worker.kill()
        worker.wait(10)
    client.evict("m", 10**6)
