"""A session that frees slots while one of its own workers is still copying into them
through the mapped pool (tensor-parallel rank 0 gives a failed save's slots back while
rank 1 copies) never lets that copy land in another session's KV (write_fence.py).

The worker is a real process: it takes its session's write fence, copies layer 0 of
two, and stops itself (SIGSTOP). Its session then frees those slots; another session
takes every free slot and writes its KV into them; the worker resumes and copies layer
1. The other session's rows must be intact, and the freed slots must stay out of the
free list until the worker is done. Without the fence on Free they went straight back
to the free list, the other session got them, and the worker overwrote its layer 1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import EVERY_KIND, ServerThread, running

from prefixcache.client import PrefixCacheClient
from prefixcache.server.config import ModelConfig, PoolConfig

MODELS = (
    ModelConfig(name="m", page_size=2, pool=PoolConfig(size=64, layers=2, k_heads=1, k_head_dim=4)),
)
FREED = 8

# The worker: copies 7s (k) and 9s (v) into the slots named by argv[4] through the
# mapped pool under the session's fence, stopping itself before layer 1.
WORKER = r"""
import json, os, signal, sys
import numpy as np
import torch
from prefixcache.client import PrefixCacheClient
from prefixcache.integrations.vllm.pool_access import MappedAccess

address, session_id, epoch = sys.argv[1], sys.argv[2], int(sys.argv[3])
slots = np.array(json.loads(sys.argv[4]), dtype=np.int64)

def rows(layer):
    if layer == 1:
        print("stopping", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    full = torch.full((len(slots), 1, 4), 7.0, dtype=torch.float16)
    return full, full + 2

with PrefixCacheClient(address, timeout=10) as client:
    MappedAccess(client, "m").write(slots, rows, slice(None), session_id, epoch)
print("wrote", flush=True)
"""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    with running(tmp_path, MODELS) as srv:
        yield srv


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _wait(what, timeout: float, why: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting: {why}")
        time.sleep(0.05)


@contextmanager
def stopped_writer(
    server: ServerThread, client: PrefixCacheClient
) -> Iterator[tuple[Any, list[int], subprocess.Popen[bytes]]]:
    """A session holding ``FREED`` fresh slots and its worker (WORKER), stopped inside
    the session's fence after layer 0 of its copy into them: (session, slots, worker).
    The worker is killed on the way out if it is still there."""
    owner = client.open_session(60)
    slots = [int(s) for s in client.alloc("m", FREED, session=owner).slots]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [
            str(Path(__file__).parents[1]),  # tests/server
            env.get("PYTHONPATH", ""),
        ]
    )
    worker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            WORKER,
            server.address,
            owner.session_id,
            str(owner.server_epoch),
            str(slots),
        ],
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert worker.stdout is not None
        assert worker.stdout.readline().strip() == b"stopping"
        _wait(lambda: _stopped(worker.pid), 10, "the worker to stop")
        yield owner, slots, worker
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)


def _take_the_rest(
    client: PrefixCacheClient, count: int, fenced: list[int]
) -> tuple[Any, list[int], list[torch.Tensor], list[torch.Tensor]]:
    """Another session takes ``count`` slots (every free one), none of them ``fenced``,
    and writes its KV into them: (session, slots, k, v)."""
    victim = client.open_session(60)
    taken = [int(s) for s in client.alloc("m", count, session=victim).slots]
    assert not set(taken) & set(fenced)
    k = [torch.arange(len(taken) * 4, dtype=torch.float16).view(-1, 1, 4) + i for i in range(2)]
    v = [t + 100 for t in k]
    client.write_kv("m", taken, k, v, session=victim)
    return victim, taken, k, v


def _intact_then_returned(
    server: ServerThread,
    client: PrefixCacheClient,
    victim: Any,
    taken: list[int],
    k: list[torch.Tensor],
    v: list[torch.Tensor],
) -> None:
    """Once the writer is gone: ``victim``'s rows are as it wrote them, and the fenced
    slots are back (here, or on a reaper tick that settled them already), and only now;
    then ``victim`` ends."""
    got = client.read_kv("m", taken, session=victim)
    for layer in range(2):
        assert torch.equal(got.k[layer], k[layer])
        assert torch.equal(got.v[layer], v[layer])
    server.run(server.service.settle_fences)
    assert server.run(server.service.engines["m"].allocator.available_size) == FREED
    assert server.run(server.service.fences.waiting) == []
    server.check_integrity()
    client.close_session(victim)


def test_slots_freed_mid_copy_wait_for_the_writer(server: ServerThread) -> None:
    engine = server.service.engines["m"]
    free = lambda: server.run(engine.allocator.available_size)  # noqa: E731
    with (
        PrefixCacheClient(server.address, timeout=10) as client,
        stopped_writer(server, client) as (owner, slots, worker),
    ):
        # Rank 0's give-back, while the stopped worker still holds the fence.
        before = free()
        client.free("m", slots, session=owner)
        assert free() == before  # out of the free list, not back in it
        server.check_integrity()

        victim, taken, k, v = _take_the_rest(client, free(), slots)

        assert server.run(server.service.settle_fences) == 0  # still inside
        server.check_integrity()
        worker.send_signal(signal.SIGCONT)
        assert worker.stdout is not None
        assert worker.stdout.readline().strip() == b"wrote"
        assert worker.wait(30) == 0

        _intact_then_returned(server, client, victim, taken, k, v)
        client.close_session(owner)
        server.check_integrity()


@pytest.mark.parametrize("how", ["ended", "freed"])
def test_a_reset_keeps_fenced_slots_from_other_sessions(server: ServerThread, how: str) -> None:
    """The slots of a session that ended (or freed them) while its writer is stopped
    mid-copy survive an admin Reset out of the free list: a session that takes every
    free slot after the Reset and writes its KV keeps its rows when the writer resumes,
    and the slots come back only once the writer is gone. Before, Reset handed them to
    the allocator and the writer overwrote the other session's layer 1."""
    engine = server.service.engines["m"]
    free = lambda: server.run(engine.allocator.available_size)  # noqa: E731
    with (
        PrefixCacheClient(server.address, timeout=10) as client,
        stopped_writer(server, client) as (owner, slots, worker),
    ):
        if how == "ended":
            client.close_session(owner)
        else:
            client.free("m", slots, session=owner)
        server.check_integrity()
        client.reset("m")
        server.check_integrity()
        pool = engine.pool_size
        assert free() == pool - FREED  # the fenced slots stay out of the pool

        victim, taken, k, v = _take_the_rest(client, free(), slots)
        assert server.run(server.service.settle_fences) == 0  # still inside
        server.check_integrity()
        worker.send_signal(signal.SIGCONT)
        assert worker.stdout is not None
        worker.stdout.readline()  # "wrote", or nothing if the save was refused
        assert worker.wait(30) in (0, 1)

        _intact_then_returned(server, client, victim, taken, k, v)
        if how == "freed":
            client.close_session(owner)
        assert free() == pool
        server.check_integrity()


def test_a_free_without_a_writer_inside_frees_at_once(server: ServerThread) -> None:
    """A fenced session's Free with nobody copying returns the slots immediately."""
    engine = server.service.engines["m"]
    with PrefixCacheClient(server.address, timeout=10) as client:
        from prefixcache.client.write_fence import open_fence

        owner = client.open_session(60)
        fence = open_fence(client, owner.session_id)
        before = server.run(engine.allocator.available_size)
        slots = client.alloc("m", FREED, session=owner).slots
        with fence.held():
            pass
        client.free("m", slots, session=owner)
        assert server.run(engine.allocator.available_size) == before
        assert server.run(server.service.fences.waiting) == []
        server.check_integrity()
        fence.close()


@pytest.mark.parametrize("model", ["p", "s", "h"])
def test_partial_frees_under_a_held_fence_keep_the_accounting_sound(
    tmp_path: Path, model: str
) -> None:
    """Pages shared by a session and its fence holder (a Free of part of a page), a
    slot model, then the session's end while the holder waits: check_integrity holds
    throughout, and every slot comes back once the writer lets go."""
    from prefixcache.client.write_fence import open_fence

    with running(tmp_path, EVERY_KIND) as srv, PrefixCacheClient(srv.address, timeout=10) as client:
        engine = srv.service.engines[model]
        idle = srv.run(lambda: int(engine.session_slots))
        owner = client.open_session(60)
        slots = [int(s) for s in client.alloc(model, 3, session=owner).slots]
        fence = open_fence(client, owner.session_id)
        with fence.held():
            client.free(model, slots[:1], session=owner)  # part of a page
            srv.check_integrity()
            client.free(model, slots[1:2], session=owner)
            srv.check_integrity()
            assert srv.run(lambda: int(engine.session_slots)) == idle + 3
            client.close_session(owner)  # the rest waits with the ended session
            srv.check_integrity()
            assert srv.run(srv.service.settle_fences) == 0
        srv.run(srv.service.settle_fences)
        assert srv.run(lambda: int(engine.session_slots)) == idle
        assert srv.run(srv.service.fences.waiting) == []
        srv.check_integrity()
        fence.close()


@pytest.mark.parametrize("model", ["m", "p", "w", "c", "h", "s"])
def test_a_reset_under_a_held_fence_keeps_the_accounting_sound(tmp_path: Path, model: str) -> None:
    """Every model kind: slots freed and slots of the ended session, both waiting on a
    held fence, survive a Reset held (check_integrity holds), and come back once the
    writer lets go."""
    from prefixcache.client.write_fence import open_fence

    with running(tmp_path, EVERY_KIND) as srv, PrefixCacheClient(srv.address, timeout=10) as client:
        engine = srv.service.engines[model]
        owner = client.open_session(60)
        slots = [int(s) for s in client.alloc(model, 3, session=owner).slots]
        fence = open_fence(client, owner.session_id)
        with fence.held():
            client.free(model, slots[:1], session=owner)
            client.close_session(owner)
            client.reset(model)
            srv.check_integrity()
            assert srv.run(lambda: int(engine.session_slots)) == 3
            assert srv.run(srv.service.settle_fences) == 0
        srv.run(srv.service.settle_fences)
        assert srv.run(lambda: int(engine.session_slots)) == 0
        assert srv.run(srv.service.fences.waiting) == []
        srv.check_integrity()
        fence.close()
