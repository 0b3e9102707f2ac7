"""A save that fails on one tensor-parallel rank never lets another rank's later copy
land in another session's KV (the tensor-parallel window).

Two ranks save one request through the mapped pool. Rank 0 (this process) fails its
copy. Rank 1 is a real process, stopped (SIGSTOP) before its copy starts: as in vLLM,
the step's output, and so the request's end, reaches the scheduler side only once
every rank has reported. Meanwhile another session takes every free slot and writes
its KV into them; then rank 1 resumes and copies. The other session's rows must be
intact, nothing of the failed save may be cached, and no slot may leak. The same
holds when the engine gives up on the stopped rank and its session ends first.

Before, rank 0 gave the slots back itself as soon as its copy failed (so that the
Insert would be refused): the other session got them, and rank 1, whose session still
lived, took its fence and wrote its rows over the other session's.
"""

from __future__ import annotations

import base64
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from harness import ServerThread
from integrations.vllm.vllm_support import (
    DIM,
    HEADS,
    LAYERS,
    JsonLines,
    make_caches,
    make_scheduler,
    make_worker,
    settle,
)

from prefixcache.client import PrefixCacheClient
from prefixcache.integrations.vllm.keys import RequestInfo
from prefixcache.integrations.vllm.meta import StepMeta

pytestmark = pytest.mark.usefixtures("quiet")

TESTS = Path(__file__).resolve().parents[2]
PROMPT = list(range(800, 818))  # 18 tokens: 16 (4 blocks of 4) are saved
BLOCKS = [2, 5, 7, 9, 11]

# Rank 1 of two: reads one step a line (base64 pickle of (meta, finished, stop)); with
# stop, says so and stops itself (SIGSTOP) before its copies; answers with what vLLM's
# model runner would hand back for the step.
RANK = r"""
import base64, json, os, pickle, signal, sys
from integrations.vllm.vllm_support import make_caches, make_worker

worker = make_worker(sys.argv[1], tp_rank=1, tp_size=2)
worker.register(make_caches("kv_first", heads=1))
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    meta, finished, stop = pickle.loads(base64.b64decode(line))
    if stop:
        print(json.dumps({"stopping": True}), flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    worker.start_step(meta)
    print(json.dumps({"copied": True}), flush=True)
    print(json.dumps({"sent": sorted(worker.finished_sends(set(finished))),
                      "failed_saves": sorted(worker.take_failed_saves()),
                      "failed_loads": sorted(worker.take_failed_loads()),
                      "saved_tokens": worker.saved_tokens}), flush=True)
worker.close()
"""


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


class Rank:
    """Rank 1's process."""

    def __init__(self, address: str) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(TESTS), str(TESTS / "server"), env.get("PYTHONPATH", "")]
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", RANK, address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self._lines = JsonLines(self.proc, "rank 1")
        assert self.read() == {"ready": True}

    def send(self, meta: StepMeta, finished: set[str], stop: bool = False) -> None:
        assert self.proc.stdin is not None
        line = base64.b64encode(pickle.dumps((meta, finished, stop))) + b"\n"
        self.proc.stdin.write(line)
        self.proc.stdin.flush()

    def read(self, timeout: float = 60.0) -> dict:
        return self._lines.read(timeout)

    def stop_before_copy(self, meta: StepMeta, finished: set[str]) -> None:
        self.send(meta, finished, stop=True)
        assert self.read() == {"stopping": True}
        deadline = time.monotonic() + 10
        while not _stopped(self.proc.pid):
            if time.monotonic() > deadline:
                raise AssertionError("rank 1 did not stop")
            time.sleep(0.02)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def rank1(server: ServerThread) -> Iterator[Rank]:
    rank = Rank(server.address)
    try:
        yield rank
    finally:
        rank.close()


def _pattern(n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(5)

    def one() -> torch.Tensor:
        raw = torch.randint(0, 256, (n, HEADS, DIM * 2), dtype=torch.uint8, generator=g)
        return raw.view(torch.float16)

    return [one() for _ in range(LAYERS)], [one() for _ in range(LAYERS)]


def _intact(
    client: PrefixCacheClient,
    session: object,
    slots: object,
    k: list[torch.Tensor],
    v: list[torch.Tensor],
) -> bool:
    """Whether ``slots`` still hold the K and V ``session`` wrote (bytes)."""
    got = client.read_kv("v", slots, session=session)
    return all(
        torch.equal(got.k[i].view(torch.uint8), k[i].view(torch.uint8))
        and torch.equal(got.v[i].view(torch.uint8), v[i].view(torch.uint8))
        for i in range(LAYERS)
    )


def _model(client: PrefixCacheClient):  # type: ignore[no-untyped-def]
    return next(m for m in client.stats("v").models)


@pytest.mark.parametrize("engine", ["waits", "stops"])
def test_a_rank_that_copies_after_another_ranks_failure_never_writes_another_session(
    server: ServerThread, client: PrefixCacheClient, rank1: Rank, engine: str
) -> None:
    """``waits``: the engine waits for rank 1 (vLLM's step). ``stops``: the engine
    gives up on it meanwhile (vLLM's execute-model timeout) and its scheduler side
    closes the session; rank 1, resumed, must write nothing."""
    core = make_scheduler(server.address)
    # Rank 0 fails its save: a rank of two cannot write whole rows through WriteKV.
    rank0 = make_worker(server.address, tp_rank=0, tp_size=2, transfer="remote")
    victim = None
    try:
        rank0.register(make_caches("kv_first", heads=1))
        assert core.finished(RequestInfo("A", PROMPT, len(PROMPT)), BLOCKS, 18)
        meta = core.build_meta()  # the save's slots are allocated
        settle(core)
        meta = core.build_meta()
        (save,) = meta.saves
        assert len(save.slots) == 16

        # The step: rank 1 is stopped before its copy; rank 0 copies and fails.
        rank1.stop_before_copy(meta, {"A"})
        rank0.start_step(meta)
        assert rank0.failed_saves == 1
        sent0 = rank0.finished_sends({"A"})
        settle(core)
        # vLLM waits for every rank's output of the step: nothing reaches the
        # scheduler side while rank 1 is stopped.
        if engine == "stops":
            core.close()  # the save is lost; the session's end frees its slots

        # Another session takes every free slot and writes its KV into them.
        victim = client.open_session(60)
        taken = client.alloc("v", _model(client).free_slots, session=victim).slots
        k, v = _pattern(len(taken))
        client.write_kv("v", taken, k, v, session=victim)

        rank1.proc.send_signal(signal.SIGCONT)  # rank 1 starts its copy
        assert rank1.read() == {"copied": True}
        assert _intact(client, victim, taken, k, v), "rank 1 overwrote another session's KV"
        report = rank1.read()
        assert report["sent"] == ["A"]
        if engine == "stops":
            assert set(save.slots) <= set(taken)  # the slots did go to the victim
            assert report["failed_saves"] == [save.ref]  # its session had ended
            assert report["saved_tokens"] == 0
            assert core.stats.saves_lost == 1
            return
        assert not set(save.slots) & set(taken)  # the save's slots were never free
        assert report["failed_saves"] == []
        assert report["saved_tokens"] == 16  # it wrote the save's own slots

        # What vLLM's aggregator hands over once every rank reported: the failure,
        # then the request done. The slots go back; nothing is cached.
        core.saves_failed(rank0.take_failed_saves() | set(report["failed_saves"]))
        core.sends_done(sent0 & set(report["sent"]))
        settle(core)
        assert core.stats.saves == 0 and core.stats.saves_failed == 1
        assert client.match("v", PROMPT[:16]).prefix_len == 0
        assert _model(client).session_slots == len(taken)  # the victim's only
        assert _intact(client, victim, taken, k, v)
    finally:
        if victim is not None:
            client.close_session(victim)
        core.close()
        rank0.close()
