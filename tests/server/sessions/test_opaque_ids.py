"""Opaque ids: node handles and lock ids are a keyed permutation of
their counters, so they are unique, reveal nothing of their neighbours, and can still
be told "issued" or not."""

from __future__ import annotations

import itertools

from prefixcache.server.sessions.opaque_ids import DOMAIN, OpaqueIds
from prefixcache.server.sessions.session import SessionRegistry


def test_ids_are_unique_nonzero_and_fit_int64() -> None:
    ids = OpaqueIds()
    locks = [ids.lock(i) for i in range(1, 20001)]
    nodes = [ids.node(i) for i in range(1, 20001)]
    for made in (locks, nodes):
        assert len(set(made)) == len(made)
        assert all(0 < x < 1 << 63 for x in made)
    # Not a counter: consecutive counters land far apart, in no order.
    steps = [b - a for a, b in itertools.pairwise(locks)]
    assert sum(s > 0 for s in steps) not in (0, len(steps))
    assert min(abs(s) for s in steps) > 1000


def test_the_inverse_tells_issued_ids_from_guesses() -> None:
    ids = OpaqueIds()
    assert all(ids.lock_counter(ids.lock(i)) == i for i in range(1, 5000))
    assert ids.lock_counter(0) == -1 and ids.lock_counter(DOMAIN + 1) == -1
    registry = SessionRegistry(lambda s: (0, 0), ids=ids)
    issued = [registry.next_lock_id() for _ in range(100)]
    assert all(registry.issued(i) for i in issued)
    guesses = {x + d for x in issued for d in (-2, -1, 1, 2)} - set(issued)
    assert not any(registry.issued(g) for g in guesses)


def test_a_new_key_names_other_ids() -> None:
    """A restart draws a new key: its ids share nothing with the last start's."""
    first, second = OpaqueIds(), OpaqueIds()
    assert not {first.lock(i) for i in range(1, 1000)} & {second.lock(i) for i in range(1, 1000)}
    assert OpaqueIds(b"k" * 32).node(7) == OpaqueIds(b"k" * 32).node(7)
