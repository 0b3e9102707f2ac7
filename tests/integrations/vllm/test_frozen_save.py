"""A vLLM engine frozen (SIGSTOP) past its session's lease in the middle of a save
through the mapped pool never writes another session's KV.

The engine is a real process: the scheduler and worker cores of the connector, against
the real server of this module, saving one request through the mapped pool. It stops
itself at a chosen point of the save: after the scheduler checked its session and
before the copy ("before"), or with the copy half done, one layer of two written
("during"). Its lease lapses while it is stopped; another session then takes every
free slot and writes its own KV into them; then the engine resumes. The other
session's rows must be intact, the engine's save must fail (nothing of it cached), and
no slot may leak. Without the write fence the engine wrote all its rows into the other
session's slots.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from harness import ServerThread
from integrations.vllm.vllm_support import DIM, HEADS, LAYERS, JsonLines

from prefixcache.client import PrefixCacheClient

pytestmark = pytest.mark.usefixtures("quiet")

TESTS = Path(__file__).resolve().parents[2]
PROMPT = list(range(700, 718))  # 18 tokens: 16 (4 blocks of 4) are saved
TTL = 1.0  # the engine's session lease, in seconds

# The engine: two requests saved through the mapped pool; in the second save it stops
# itself (SIGSTOP) at the point argv[2] names and says so on stdout, then finishes the
# step once resumed.
ENGINE = r"""
import json, os, signal, sys
from integrations.vllm.vllm_support import make_caches, make_scheduler, make_worker, settle
from prefixcache.integrations.vllm.keys import RequestInfo
from prefixcache.integrations.vllm.pool_access import MappedAccess

address, where, ttl = sys.argv[1], sys.argv[2], float(sys.argv[3])
prompt = list(range(700, 718))

def say(**fields):
    print(json.dumps(fields), flush=True)

def stop():
    say(stopping=True)
    os.kill(os.getpid(), signal.SIGSTOP)

write = MappedAccess.write
writes = []
def frozen_write(self, slots, source, heads, session_id, server_epoch, fill=None):
    writes.append(len(slots))
    if len(writes) == 1:  # the first request's save goes through
        return write(self, slots, source, heads, session_id, server_epoch, fill)
    if where == "before":
        stop()
        return write(self, slots, source, heads, session_id, server_epoch, fill)
    # Rows come from source (a gather) or go straight in through fill (one run of
    # slots): either way the engine stops before layer 1.
    def rows(layer):
        if layer == 1:  # layer 0 is in the pool already
            stop()
        return source(layer)
    def filled(layer, k, v):
        if layer == 1:
            stop()
        return fill(layer, k, v)
    return write(self, slots, rows, heads, session_id, server_epoch,
                 None if fill is None else filled)
MappedAccess.write = frozen_write

core = make_scheduler(address, session_ttl=ttl)
worker = make_worker(address)
worker.register(make_caches("kv_first"))

def save(req_id, tokens, blocks):
    # Request req_id finishes; its 16 tokens are saved. Stops in the second save.
    assert core.finished(RequestInfo(req_id, tokens, len(tokens)), blocks, 18)
    worker.start_step(core.build_meta())
    settle(core)
    meta = core.build_meta()
    assert len(meta.saves) == 1 and len(meta.saves[0].slots), meta
    if writes:
        say(session=meta.saves[0].session_id, slots=list(meta.saves[0].slots))
    worker.start_step(meta)
    sent = worker.finished_sends({req_id})
    core.saves_failed(worker.take_failed_saves())
    core.sends_done(sent)
    settle(core)

# A first save, so that the engine's fence is open long before (as in a running engine).
save("W", list(range(900, 918)), [1, 3, 4, 6, 8])
save("A", prompt, [2, 5, 7, 9, 11])
say(failed_saves=worker.failed_saves, saved_tokens=worker.saved_tokens,
    mapped=isinstance(worker._access, MappedAccess))
worker.close()
core.close()
"""


def _wait(what: Callable[[], bool], timeout: float, why: str) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting: {why}")
        time.sleep(0.05)


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


class Engine:
    """The engine process, stopped inside its save once constructed."""

    def __init__(self, server: ServerThread, where: str) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(TESTS), str(TESTS / "server"), env.get("PYTHONPATH", "")]
        )
        self.server = server
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ENGINE, server.address, where, str(TTL)],
            stdout=subprocess.PIPE,
            env=env,
        )
        self._lines = JsonLines(self.proc, "the engine")
        save = self._read()
        self.session, self.slots = save["session"], save["slots"]
        assert self._read() == {"stopping": True}
        _wait(lambda: _stopped(self.proc.pid), 10, "the engine to stop")

    def _read(self, timeout: float = 60.0) -> dict:
        return self._lines.read(timeout)

    def lapse(self) -> None:
        """Wait, stopped, until the service has ended the engine's session."""
        sessions = self.server.service.sessions
        _wait(
            lambda: self.server.run(sessions.find, self.session) is None,
            10 * TTL + 5,
            "the frozen engine's lease to lapse",
        )

    def resume(self) -> dict:
        """SIGCONT; the engine's report once it finished the step."""
        self.proc.send_signal(signal.SIGCONT)
        report = self._read()
        assert self.proc.wait(30) == 0
        return report

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def engine(server: ServerThread) -> Iterator[Callable[[str], Engine]]:
    made: list[Engine] = []

    def start(where: str) -> Engine:
        made.append(Engine(server, where))
        return made[-1]

    yield start
    for e in made:
        e.kill()


def _pattern(n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(21)

    def one() -> torch.Tensor:
        raw = torch.randint(0, 256, (n, HEADS, DIM * 2), dtype=torch.uint8, generator=g)
        return raw.view(torch.float16)

    return [one() for _ in range(LAYERS)], [one() for _ in range(LAYERS)]


def _held(client: PrefixCacheClient) -> int:
    return next(m.session_slots for m in client.stats("v").models)


@pytest.mark.parametrize("where", ["before", "during"])
def test_a_frozen_engine_never_writes_another_sessions_slots(
    server: ServerThread, client: PrefixCacheClient, engine: Callable[[str], Engine], where: str
) -> None:
    frozen = engine(where)
    frozen.lapse()
    # Another session takes every free slot and writes its own KV into them.
    victim = client.open_session(60)
    try:
        _victim(client, frozen, victim, where)
    finally:
        client.close_session(victim)
    # The slots the engine held are back in the pool once it let go of them.
    _wait(lambda: _held(client) == 0, 5, "the frozen engine's slots to be freed")


def _victim(client: PrefixCacheClient, frozen: Engine, victim: object, where: str) -> None:
    """``victim`` takes every free slot and writes its KV; the engine resumes; the
    victim's rows are intact and the engine's save failed."""
    free = next(m.free_slots for m in client.stats("v").models)
    taken = client.alloc("v", free, session=victim).slots
    if where == "during":
        # The engine is inside its copy: its slots must not be anybody else's yet.
        assert not set(frozen.slots) & set(taken)
        assert _held(client) == free + len(frozen.slots)
    k, v = _pattern(len(taken))
    client.write_kv("v", taken, k, v, session=victim)

    report = frozen.resume()

    got = client.read_kv("v", taken, session=victim)
    for layer in range(LAYERS):
        assert torch.equal(got.k[layer].view(torch.uint8), k[layer].view(torch.uint8)), layer
        assert torch.equal(got.v[layer].view(torch.uint8), v[layer].view(torch.uint8)), layer
    # The save failed cleanly: reported failed, and nothing of it cached.
    assert report == {"failed_saves": 1, "saved_tokens": 16, "mapped": True}
    assert client.match("v", PROMPT[:16]).prefix_len == 0


def test_a_frozen_engine_that_dies_gives_its_slots_back(
    server: ServerThread, client: PrefixCacheClient, engine: Callable[[str], Engine]
) -> None:
    frozen = engine("during")
    frozen.lapse()
    time.sleep(0.5)  # a few reaper ticks: the slots stay out while the engine lives
    assert _held(client) == len(frozen.slots)
    frozen.kill()  # SIGKILL, still stopped: the kernel drops its fence lock
    _wait(lambda: _held(client) == 0, 5, "a dead engine's slots to be freed")
    server.check_integrity()
