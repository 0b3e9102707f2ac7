"""The service's half of the integrity check: what sessions hold against what the models
count.

Each engine checks its cache and pools (``check_integrity``), and the cache checks that
``lock_ref == own_lock_ref + sum(children's lock_ref)`` on every node. Neither knows the
sessions, so neither sees a lock that one side lost and the other kept: a lock that
left its session but stayed in the tree (its tokens protected until a Reset), or a
counter that went below the locks held. This module compares them, per model:

* ``engine.num_locks`` is the number of ``HeldLock``s of all sessions on the model;
* every tree node's ``own_lock_ref`` (the locks taken on the node itself, which the
  lock walks up to the root as ``lock_ref``) is the number of session locks on it, and
  every session lock is on a node that is still in the tree;
* SWA models: every node's ``swa_lock_ref`` is the number of session locks whose
  window covers it (the walk ``dec_lock_ref`` will make: up the path to the lock's
  boundary node, skipping tombstones);
* ``engine.session_slots`` is the sum of the sessions' slot counts on the model;
* models with pages of several slots: the pages each session holds slots on (what its
  slot quota counts) and the per-page counts agree with the slot owners.

Mamba state locks need nothing more: the cache checks ``mamba_lock_ref ==
own_lock_ref`` on every node with state. A check runs only between calls, when no
call holds a transient lock of its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from prefixcache.cache import IntegrityError

from .session import HeldLock, Session


def audit(engines: dict[str, Any], sessions: Iterable[Session]) -> None:
    """Compare every model's lock and slot counts with what ``sessions`` hold.

    Raises:
        IntegrityError: naming every disagreement found.
    """
    sessions = list(sessions)
    problems: list[str] = []
    by_engine: dict[int, list[HeldLock]] = {id(e): [] for e in engines.values()}
    for session in sessions:
        for lock_id, held in session.locks.items():
            mine = by_engine.get(id(held.engine))
            if mine is None or engines.get(held.engine.name) is not held.engine:
                problems.append(f"session {session.id[:8]}: lock {lock_id} is on no hosted model")
            else:
                mine.append(held)
    for engine in engines.values():
        problems += [
            f"model {engine.name!r}: {p}"
            for p in _engine_problems(engine, by_engine[id(engine)], sessions)
        ]
    if problems:
        raise IntegrityError("; ".join(problems[:20]))


def _engine_problems(engine: Any, held: list[HeldLock], sessions: list[Session]) -> list[str]:
    problems = []
    if engine.num_locks != len(held):
        problems.append(f"num_locks is {engine.num_locks}, sessions hold {len(held)} locks")
    slots = sum(s.slots.get(engine.name, 0) for s in sessions)
    if engine.session_slots != slots:
        problems.append(f"session_slots is {engine.session_slots}, sessions count {slots}")
    page_problems = getattr(engine, "page_problems", None)
    if page_problems is not None:
        problems += page_problems(sessions)
    root = getattr(engine.cache, "root_node", None)
    if root is None:  # a chunk cache: nothing can be locked
        if held:
            problems.append(f"{len(held)} session locks on a cache without a tree")
        return problems
    own = Counter(h.node for h in held)
    swa = _swa_expected(held, problems) if engine.kind == "swa" else None
    stack = [root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if not node.key_len:
            continue
        want = own.pop(node, 0)
        if node.own_lock_ref != want:
            problems.append(
                f"node {node.id}: own lock count {node.own_lock_ref}, sessions "
                f"hold {want} locks on it"
            )
        if swa is not None and node.swa_lock_ref != swa.get(node, 0):
            problems.append(
                f"node {node.id}: swa_lock_ref {node.swa_lock_ref}, sessions' "
                f"windows cover it {swa.get(node, 0)} times"
            )
    if own:
        problems.append(f"{sum(own.values())} session locks on nodes no longer in the tree")
    return problems


def _swa_expected(held: list[HeldLock], problems: list[str]) -> Counter[Any]:
    """How many session locks' SWA windows cover each node (as dec_lock_ref walks)."""
    covered: Counter[Any] = Counter()
    for lock in held:
        node = lock.node
        while node is not None and node.key_len:
            if not node.swa_tombstone:
                covered[node] += 1
            if lock.boundary is not None and node.swa_boundary_id == lock.boundary:
                break
            node = node.parent
        else:
            if lock.boundary is not None:
                problems.append(
                    f"a lock's SWA boundary {lock.boundary} is not on the path "
                    f"of node {lock.node.id}"
                )
    return covered
