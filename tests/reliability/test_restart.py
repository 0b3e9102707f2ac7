"""Server restart: `prefixcache serve` is killed with SIGKILL and started again on the same
socket. Clients see the new epoch, drop the handles they hold from before instead of
using them, and a fail-open worker keeps running throughout. The servers run in
invariant mode, so a stale handle that got through and broke the cache would answer
INTERNAL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from harness import SOURCE_PATH, pb, stub_for, wait_serving

from prefixcache.client import (
    PrefixCacheClient,
    RemoteRadixCache,
    SessionLost,
    StaleEpoch,
    Unavailable,
)

CONFIG = """\
models:
  - name: m
    page_size: 1
    pool: {size: 512, layers: 1, k_heads: 1, k_head_dim: 4}
"""


class Server:
    """One start of `prefixcache serve --check-integrity` on ``tmp``'s socket."""

    def __init__(self, tmp: Path) -> None:
        (tmp / "pc.yaml").write_text(CONFIG)
        self.address = f"unix:{tmp / 'pc.sock'}"
        env = {**os.environ, "PYTHONPATH": SOURCE_PATH, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "prefixcache.server.cli",
                "serve",
                "--config",
                str(tmp / "pc.yaml"),
                "--listen",
                self.address,
                "--metrics-port",
                "-1",
                "--check-integrity",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        wait_serving(self.proc, self.address)

    def crash(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(30) in (0, -signal.SIGKILL)


@contextmanager
def restarts(tmp: Path) -> Iterator[list[Server]]:
    """Yields the list of starts; ``restart(starts, tmp)`` kills the last and adds one."""
    starts = [Server(tmp)]
    try:
        yield starts
    finally:
        for server in starts:
            server.stop()


def restart(starts: list[Server], tmp: Path) -> Server:
    starts[-1].crash()
    starts.append(Server(tmp))
    return starts[-1]


def epoch_of(address: str) -> int:
    # Waits for the channel: another channel of this process may have left the shared
    # subchannel in reconnect backoff while the service was down.
    channel, stub = stub_for(address)
    with channel:
        return stub.ListModels(pb.ListModelsRequest(), timeout=10, wait_for_ready=True).server_epoch


@pytest.mark.slow
def test_stale_handles_are_dropped_not_used(tmp_path: Path) -> None:
    with restarts(tmp_path) as starts:
        client = PrefixCacheClient(starts[0].address, fail_open=True, retries=0)
        strict = PrefixCacheClient(starts[0].address, retries=0)
        s, t = client.session(ttl=30), strict.session(ttl=30)
        old = s.match("m", [1, 2, 3, 4], lock=True, allocate=True)
        ins = s.insert("m", [1, 2, 3, 4], old.all_slots(), lock=True, release_lock_id=old.lock_id)
        held = s.alloc("m", 3).slots
        t_hit = t.match("m", [1, 2, 3, 4], lock=True)
        cache = RemoteRadixCache(client, "m", session=s)
        hit = cache.match_prefix([1, 2, 3])
        cache.inc_lock_ref(hit.last_node)
        first = hit.last_node.server_epoch
        assert first == ins.server_epoch == client.server_epoch

        new = restart(starts, tmp_path)
        second = epoch_of(new.address)
        assert second != first
        # The first call after the restart is fenced with the old epoch: refused by the
        # service, it fails open, and the client learns the new epoch.
        assert s.unlock(ins.lock_id).skipped
        assert (client.server_epoch, client.restarts) == (second, 1)
        assert isinstance(s.lost, StaleEpoch)
        # Until a new session opens, handle-naming calls are dropped without a call.
        assert s.free("m", held) is None
        assert s.lock("m", ins.node_id).skipped
        assert s.dropped == 2
        # The next match opens a new session and answers from the new service.
        fresh = s.match("m", [1, 2, 3, 4], lock=True, allocate=True)
        assert (fresh.server_epoch, fresh.prefix_len, s.reopened, s.lost) == (second, 0, 1, None)
        # Lock ids of the old session, and handles of the old epoch, stay dropped.
        assert s.unlock(ins.lock_id).skipped
        assert s.insert("m", [1, 2, 3], held, server_epoch=first).skipped
        assert s.free("m", held, server_epoch=first) is None
        assert s.dropped == 5
        cache.dec_lock_ref(hit.last_node)  # a node from before: dropped, no error
        cache.inc_lock_ref(hit.last_node)
        assert cache.stale_dropped == 2
        # The new session works as usual.
        done = s.insert("m", [1, 2, 3, 4], fresh.all_slots(), release_lock_id=fresh.lock_id)
        assert done.server_epoch == second and not done.skipped
        assert cache.match_prefix([1, 2, 3, 4, 5]).prefix_len == 4

        # Without fail-open the same stale calls raise, and still change nothing.
        with pytest.raises(StaleEpoch):
            t.unlock(t_hit.lock_id)
        assert strict.server_epoch == second
        with pytest.raises(SessionLost):
            t.unlock(t_hit.lock_id)
        with pytest.raises(SessionLost):  # not reopened yet: every handle is stale
            t.insert("m", [9], [1], server_epoch=first)
        assert t.match("m", [1, 2, 3, 4]).prefix_len == 4  # reopened
        assert t.reopened == 1
        with pytest.raises(StaleEpoch):  # handles named as from the old epoch
            t.insert("m", [9], [1], server_epoch=first)

        s.close()
        t.close()
        stats = client.stats("m")
        assert (stats.sessions, stats["m"].locks, stats["m"].session_slots) == (0, 0, 0)
        assert stats["m"].free_slots + stats["m"].cached_tokens == stats["m"].pool_size
        client.close()
        strict.close()


@pytest.mark.slow
def test_a_fail_open_worker_keeps_running_through_a_crash(tmp_path: Path) -> None:
    """A worker thread serves requests (match+lock+allocate, insert with the lock handed
    over, unlock) while the service is killed and started again. It never stops: calls
    made while the service is down fail open or raise Unavailable (slots cannot be made
    up), which it treats as "serve without the cache"; nothing else may be raised."""
    with restarts(tmp_path) as starts:
        client = PrefixCacheClient(starts[0].address, fail_open=True, retries=0, timeout=2.0)
        session = client.session(ttl=2)
        counts: Counter[str] = Counter()
        served_in: Counter[int] = Counter()
        errors: list[BaseException] = []
        stop = threading.Event()

        def worker() -> None:
            i = 0
            while not stop.is_set():
                i += 1
                tokens = [i % 7, 1 + i % 5, 2, 3, i % 11 + 20]
                try:
                    hit = session.match("m", tokens, lock=True, allocate=True)
                except Unavailable:
                    counts["uncached"] += 1  # the service is down: compute without it
                    time.sleep(0.01)
                    continue
                except BaseException as err:  # anything else is a failure
                    errors.append(err)
                    return
                try:
                    time.sleep(0.002)  # "compute", so a crash can land mid-request
                    ins = session.insert(
                        "m",
                        tokens,
                        hit.all_slots(),
                        lock=True,
                        release_lock_id=hit.lock_id,
                        server_epoch=hit.server_epoch,
                    )
                    unlock = session.unlock(ins.lock_id, server_epoch=hit.server_epoch)
                    counts["skipped"] += ins.skipped or unlock.skipped
                    served_in[hit.server_epoch] += 1
                except BaseException as err:
                    errors.append(err)
                    return

        thread = threading.Thread(target=worker, daemon=True)
        thread.start()
        try:
            for _ in range(2):
                deadline = time.monotonic() + 60
                epoch = epoch_of(starts[-1].address)
                while served_in[epoch] < 30 and not errors:
                    assert time.monotonic() < deadline, "the worker made no progress"
                    time.sleep(0.01)
                if len(starts) == 1:
                    restart(starts, tmp_path)
        finally:
            stop.set()
            thread.join(30)
        assert not errors, errors
        assert not thread.is_alive()
        epochs = [epoch_of(starts[0].address)]  # the socket now answers for the last
        assert client.restarts == 1 and client.server_epoch == epochs[0]
        assert session.reopened >= 1 and len(served_in) == 2
        session.close()
        stats = client.stats("m")
        assert (stats.sessions, stats["m"].locks, stats["m"].session_slots) == (0, 0, 0)
        client.close()
