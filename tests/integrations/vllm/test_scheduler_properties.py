"""Random sequences of vLLM's scheduler-side calls (probes, allocations, preemptions,
aborts, finishes with saves, saves the workers fail, idle time past the lease) against
a real server: answers are stable within an attempt and never overreach, no copy
touches the null block, and once every request has finished the connector holds no
lock and no slot, and the cache is sound. With ``during_run_saves`` (a sliding-window
engine) the steps carry the running requests' progress, their tables losing their
first blocks to the null block as they go."""

from __future__ import annotations

import pytest
from harness import ServerThread
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from integrations.vllm.vllm_support import BLOCK, Clock, make_scheduler, settle

from prefixcache.client import PrefixCacheClient
from prefixcache.integrations.vllm.keys import RequestInfo, lookup_len
from prefixcache.integrations.vllm.meta import NULL_BLOCK, touches_null
from prefixcache.integrations.vllm.scheduler import SchedulerCore

PREFIXES = [
    list(range(900, 920)),
    list(range(900, 908)) + list(range(40, 52)),
    list(range(300, 311)),
]
pytestmark = pytest.mark.usefixtures("quiet")

ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(["probe", "alloc", "preempt", "finish", "step", "idle"]),
        st.integers(0, 3),
        st.integers(0, 2),
        st.integers(0, 2),
    ),
    min_size=1,
    max_size=30,
)


TABLE = list(range(1, 9))  # a request's blocks (block 0 is vLLM's null block)


def engine_step(
    core: SchedulerCore,
    preempted: set[str] = frozenset(),  # type: ignore[assignment]
    progress: dict[str, tuple[int, list[int]]] | None = None,
) -> None:
    """A step: its metadata reaches the workers, which report its saves done, a save
    of every other one failed (its slots are given back, not inserted)."""
    meta = core.build_meta(preempted, progress)
    for op in meta.saves:
        assert not touches_null(op.block_ids, op.start, op.start + len(op.slots), BLOCK)
    for op in meta.loads:
        assert op.fail or not touches_null(op.block_ids, op.start, op.end, BLOCK)
    settle(core)
    core.saves_failed(s.ref for s in meta.saves if s.ref % 2)
    core.saves_copied(s.report for s in meta.saves if s.during_run)
    core.sends_done(s.req_id for s in meta.saves if not s.during_run)
    settle(core)


def with_nulls(n: int) -> list[int]:
    """A table whose first ``n`` blocks vLLM freed (a sliding window moved on)."""
    return [NULL_BLOCK] * n + TABLE[n:]


@pytest.mark.parametrize(
    ("during_run", "save"),
    [(False, "all"), (False, "prompt"), (True, "all")],
    ids=["at-finish", "prompt-while-running", "sliding-window"],
)
@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(actions=ACTIONS)
def test_random_call_sequences_leave_nothing_behind(
    server: ServerThread,
    client: PrefixCacheClient,
    during_run: bool,
    save: str,
    actions: list[tuple[str, int, int, int]],
) -> None:
    client.reset("v")
    clock = Clock()
    core = make_scheduler(
        server.address, clock=clock, lease_ttl=5.0, save=save, during_run_saves=during_run
    )
    attempts = [0] * 4
    answers: dict[tuple[int, int], int] = {}
    finished: set[int] = set()
    running: dict[str, tuple[int, list[int]]] = {}
    try:
        for action, r, which, local_blocks in actions:
            if r in finished:
                continue
            tokens = PREFIXES[r % len(PREFIXES)] if which == 0 else PREFIXES[which]
            info = RequestInfo(f"r{r}", tokens, len(tokens), attempt=attempts[r])
            local = local_blocks * BLOCK
            if action == "probe":
                got, load_async = core.probe(info, local)
                assert load_async is False
                if got is None:  # a new lookup: its answer may differ from an old one
                    answers.pop((r, attempts[r]), None)
                else:
                    assert 0 <= got <= max(lookup_len(len(tokens), BLOCK) - local, 0)
                    if got and (r, attempts[r]) in answers:
                        assert local + got == answers[(r, attempts[r])]
                    if got:
                        answers[(r, attempts[r])] = local + got
            elif action == "alloc":
                hit = answers.get((r, attempts[r]), 0)
                core.allocated(f"r{r}", with_nulls(which), max(hit - local, 0))
                answers.pop((r, attempts[r]), None)
                running[f"r{r}"] = (min(len(tokens), local + BLOCK), with_nulls(which))
            elif action == "preempt":
                running.pop(f"r{r}", None)
                engine_step(core, {f"r{r}"})
                attempts[r] += 1
            elif action == "finish":
                running.pop(f"r{r}", None)
                core.finished(info, with_nulls(local_blocks), len(tokens) - 1)
                finished.add(r)
            elif action == "step":
                engine_step(core, progress=running)
                # The next chunk computed, and the window moved on by ``which`` blocks.
                for req, (done, table) in list(running.items()):
                    freed = table.count(NULL_BLOCK) + which
                    running[req] = (done + BLOCK * local_blocks, with_nulls(freed))
            else:
                clock.now += 6.0  # every unclaimed reservation lapses
        for r in range(4):
            if r not in finished:
                core.finished(RequestInfo(f"r{r}", [], 0), [], 0)
        for _ in range(4):  # saves: allocated, sent to the workers, done, inserted
            engine_step(core)
        assert not core.has_pending_saves() and core.reservations() == {}
        stats = client.stats("v")["v"]
        assert (stats.locks, stats.session_slots) == (0, 0)
        server.check_integrity()
    finally:
        core.close()
