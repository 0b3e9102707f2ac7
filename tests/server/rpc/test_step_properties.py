"""Random scheduling steps: a Step answers exactly what its items as unary calls, one by
one in the step's order, answer, and leaves the same cache (property test, real server).

A simulated worker admits prompts that share prefixes, finishes some of the admitted
(keeping the tail or a lock now and then), decodes, frees and unlocks, with a few bad
items mixed in. The same abstract steps drive two twin models, one through Step and
one through the unary calls; every item's answer and the counters after every step
must agree. The server runs in invariant mode.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from harness import SMALL_POOL, pb, running, stub_for, toks
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from step_runners import LISTS, Stepped, Unary, stepped_step, unary_step

from prefixcache.server.config import ModelConfig, PoolConfig

BASE = (
    ModelConfig(name="m", page_size=1, vocab_size=1000, pool=SMALL_POOL),
    ModelConfig(name="p", page_size=4, pool=PoolConfig(size=128, k_heads=1, k_head_dim=4)),
)
MODELS = (*BASE, *(replace(m, name=m.name + "2") for m in BASE))
PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [20, 21, 22])


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    with running(tmp_path_factory.mktemp("steprop"), MODELS) as srv:
        channel, stub = stub_for(srv.address)
        yield srv, stub
        channel.close()


_finish = st.tuples(st.integers(0, 7), st.booleans(), st.booleans())  # which, keep_tail, lock
_admit = st.tuples(
    st.sampled_from(range(len(PREFIXES))), st.integers(0, 40), st.integers(0, 3)
)  # prefix, tail length, hint
_step = st.fixed_dictionaries(
    {
        "finishes": st.lists(_finish, max_size=3),
        "unlocks": st.lists(st.integers(0, 7), max_size=2),
        "frees": st.lists(st.integers(0, 7), max_size=2),
        "decodes": st.lists(st.one_of(st.integers(0, 4), st.just(10**6)), max_size=6),
        "admits": st.lists(_admit, max_size=3),
    }
)


class Worker:
    """What one runner's worker holds: admitted requests, kept locks, decode slots."""

    def __init__(self) -> None:
        self.admitted: list[tuple[bytes, Any]] = []
        self.locks: list[int] = []
        self.decoded: list[bytes] = []
        self.tokens = 0

    def request(self, step: dict[str, Any]) -> pb.StepRequest:
        """The concrete step for the abstract one, from what this worker holds."""
        req = pb.StepRequest()
        for which, keep_tail, lock in step["finishes"]:
            if not self.admitted:
                continue
            tokens, m = self.admitted.pop(which % len(self.admitted))
            req.finishes.add(
                token_ids=tokens,
                slot_indices=m.slot_indices + m.allocated_slots,
                release_lock_id=m.lock_id,
                keep_tail=keep_tail,
                lock=lock,
            )
        for which in step["unlocks"]:
            req.unlocks.append(
                self.locks.pop(which % len(self.locks)) if self.locks else 10**12 + which
            )  # bogus: NOT_FOUND
        for which in step["frees"]:
            slots = (
                self.decoded.pop(which % len(self.decoded))
                if self.decoded
                else (10_000 + which).to_bytes(8, "little")
            )  # bogus: INVALID_ARGUMENT
            req.frees.add(slot_indices=slots)
        req.decodes.extend(step["decodes"])
        for prefix, extra, hint in step["admits"]:
            self.tokens += 1
            tail = [100 + (self.tokens * 7 + i) % 800 for i in range(extra)]
            req.admits.add(
                token_ids=toks(PREFIXES[prefix] + tail),
                lock=True,
                allocate=True,
                expected_prefix_len=hint * 4,
            )
        return req

    def absorb(self, req: pb.StepRequest, results: dict[str, list[Any]]) -> None:
        for f, r in zip(req.finishes, results["finishes"], strict=True):
            if f.lock and getattr(r, "lock_id", 0):
                self.locks.append(r.lock_id)
        for n, r in zip(req.decodes, results["decodes"], strict=True):
            if n and hasattr(r, "slot_indices"):
                self.decoded.append(r.slot_indices)
        for a, r in zip(req.admits, results["admits"], strict=True):
            if hasattr(r, "prefix_len"):
                self.admitted.append((a.token_ids, r))


def _s(frees=(), decodes=(), admits=()) -> dict[str, Any]:
    return {
        "finishes": [],
        "unlocks": [],
        "frees": list(frees),
        "decodes": list(decodes),
        "admits": list(admits),
    }


# Found by CI: the step's decodes handed out other slots than the unary Allocs.
_CI_EXAMPLE = [
    _s(),
    _s(),
    _s(admits=[(0, 0, 0), (0, 3, 0), (0, 40, 0)]),
    _s(admits=[(0, 0, 0), (0, 21, 0)]),
    _s(frees=[0], decodes=[1], admits=[(0, 0, 0), (0, 1, 0), (0, 40, 0)]),
    _s(frees=[0, 0], decodes=[0], admits=[(0, 0, 0), (0, 11, 0), (0, 40, 0)]),
    _s(decodes=[4, 4, 4]),
]


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(model=st.sampled_from(["m", "p"]), steps=st.lists(_step, min_size=1, max_size=8))
@example(model="m", steps=_CI_EXAMPLE)
def test_a_step_is_its_items_one_by_one(
    world: tuple[Any, Any], model: str, steps: list[dict[str, Any]]
) -> None:
    srv, stub = world
    traces = []
    for runner, run in (
        (Unary(stub, model), unary_step),
        (Stepped(stub, model + "2"), stepped_step),
    ):
        worker, trace = Worker(), []
        for step in steps:
            req = worker.request(step)
            results = run(runner, req)
            worker.absorb(req, results)
            trace.append(
                ({name: [runner.norm(r) for r in results[name]] for name in LISTS}, runner.stats())
            )
        runner.close()
        trace.append(runner.stats())
        traces.append(trace)
    assert traces[1] == traces[0]
    srv.check_integrity()
