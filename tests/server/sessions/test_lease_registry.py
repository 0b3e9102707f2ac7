"""SessionRegistry's leases against a plain model: the lazy expiry heap, stall credits,
renewals and batches agree with "a lease lapses when its deadline is past"."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.server.errors import OverLimitError
from prefixcache.server.sessions.session import SessionRegistry


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# Durations are binary fractions, so that lease arithmetic is exact on both sides.
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("open"), st.sampled_from([0.5, 1.0, 3.0, None])),
        st.tuples(st.just("renew"), st.integers(0, 30)),
        st.tuples(st.just("close"), st.integers(0, 30)),
        st.tuples(st.just("advance"), st.sampled_from([0.25, 0.75, 1.0, 2.5])),
        st.tuples(st.just("stall"), st.sampled_from([0.5, 5.0])),
        st.tuples(st.just("expire"), st.sampled_from([None, 1, 3])),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_leases_lapse_exactly_when_their_deadline_passes(ops) -> None:
    clock = Clock()
    released = []
    registry = SessionRegistry(lambda s: (released.append(s.id), (0, 0))[1], clock)
    opened = []  # every session, in order
    deadline: dict[str, float] = {}  # model: open session -> lease-time deadline
    lease_now = clock.now  # model's lease time: the clock less the stalls
    for op, arg in ops:
        if op == "open":
            session = registry.open(arg)
            opened.append(session)
            deadline[session.id] = float("inf") if arg is None else lease_now + arg
        elif op == "renew" and arg < len(opened) and opened[arg].id in deadline:
            session = registry.get(opened[arg].id)
            if session.ttl is not None:
                deadline[session.id] = lease_now + session.ttl
        elif op == "close" and arg < len(opened):
            registry.close(opened[arg])
            deadline.pop(opened[arg].id, None)
        elif op == "advance":
            clock.now += arg
            lease_now += arg
        elif op == "stall":  # the loop could not run: time passes, lease time does not
            clock.now += arg
            registry.credit_stall(arg)
        elif op == "expire":
            lapsed = {sid for sid, d in deadline.items() if d <= lease_now}
            got = {s.id for s, _, _ in registry.expire(arg)}
            assert got <= lapsed
            assert len(got) == (len(lapsed) if arg is None else min(arg, len(lapsed)))
            for sid in got:
                del deadline[sid]
        assert registry.now() == pytest.approx(lease_now)
        assert {s.id for s in registry} == set(deadline)
        if deadline:
            soonest = min(deadline.values())
            # A lower bound: the reaper never sleeps past a lapse.
            assert registry.next_expiry() <= max(0.0, soonest - lease_now) + 1e-9
    assert len(registry._heap) <= 2 * len(deadline) + 65


def test_max_sessions_counts_open_sessions_of_both_kinds() -> None:
    registry = SessionRegistry(lambda s: (0, 0), Clock(), max_sessions=2)
    first = registry.open(1.0)
    registry.open(1.0, stream=True)
    with pytest.raises(OverLimitError) as err:
        registry.open(1.0)
    assert err.value.limit == "max_sessions"
    assert len(registry) == 2
    registry.close(first)
    registry.open(None)


def test_a_lapsed_session_is_told_after_it_is_closed() -> None:
    clock = Clock()
    registry = SessionRegistry(lambda s: (2, 3), clock)
    session = registry.open(1.0, stream=True)
    seen = []
    session.on_lapse = lambda: seen.append((session.closed, session.lapsed))
    clock.now += 1.0
    assert [(s.id, locks, slots) for s, locks, slots in registry.expire()] == [(session.id, 2, 3)]
    assert seen == [(True, True)]
