"""Random sequences of vLLM's scheduler-side calls (probes, allocations, preemptions,
aborts, finishes with saves, saves the workers fail, idle time past the lease) against
a real server: answers are stable within an attempt and never overreach, and once
every request has finished the connector holds no lock and no slot, and the cache is
sound."""

from __future__ import annotations

import pytest
from harness import ServerThread
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from integrations.vllm.vllm_support import BLOCK, Clock, make_scheduler, settle

from prefixcache.client import PrefixCacheClient
from prefixcache.integrations.vllm.keys import RequestInfo, lookup_len
from prefixcache.integrations.vllm.scheduler import SchedulerCore

PREFIXES = [list(range(900, 920)), list(range(900, 908)) + list(range(40, 52)),
            list(range(300, 311))]
pytestmark = pytest.mark.usefixtures("quiet")

ACTIONS = st.lists(st.tuples(st.sampled_from(["probe", "alloc", "preempt", "finish",
                                              "step", "idle"]),
                             st.integers(0, 3), st.integers(0, 2), st.integers(0, 2)),
                   min_size=1, max_size=30)


def engine_step(core: SchedulerCore, preempted: set[str] = frozenset()  # type: ignore[assignment]
                ) -> None:
    """A step: its metadata reaches the workers, which report its saves done, a save
    of every other one failed (its slots are given back, not inserted)."""
    meta = core.build_meta(preempted)
    settle(core)
    core.saves_failed(s.ref for s in meta.saves if s.ref % 2)
    core.sends_done(s.req_id for s in meta.saves)
    settle(core)


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=ACTIONS)
def test_random_call_sequences_leave_nothing_behind(server: ServerThread,
                                                    client: PrefixCacheClient,
                                                    actions: list[tuple[str, int, int, int]]
                                                    ) -> None:
    client.reset("v")
    clock = Clock()
    core = make_scheduler(server.address, clock=clock, lease_ttl=5.0, save="all")
    attempts = [0] * 4
    answers: dict[tuple[int, int], int] = {}
    finished: set[int] = set()
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
                core.allocated(f"r{r}", list(range(8)), max(hit - local, 0))
                answers.pop((r, attempts[r]), None)
            elif action == "preempt":
                engine_step(core, {f"r{r}"})
                attempts[r] += 1
            elif action == "finish":
                core.finished(info, list(range(8)), len(tokens) - 1)
                finished.add(r)
            elif action == "step":
                engine_step(core)
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

