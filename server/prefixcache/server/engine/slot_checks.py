"""Checks on the slot indices a client names, shared by the engines."""

from __future__ import annotations

from itertools import pairwise

import numpy as np

from prefixcache.cache import InvalidInputError

from ..errors import PreconditionError


def check_distinct(slots: np.ndarray) -> None:
    """Refuse a slot named twice (it would enter the tree, or be freed, twice)."""
    if len(slots) < 2:
        return
    steps = slots[1:] - slots[:-1]
    if (steps > 0).all():  # the allocator hands out ascending runs: the common case
        return
    ordered = np.sort(slots)
    dup = ordered[1:][ordered[1:] == ordered[:-1]]
    if len(dup):
        raise InvalidInputError(f"slot {int(dup[0])} is named twice")


def check_range(slots: np.ndarray, low: int, high: int, model: str) -> None:
    """Refuse a slot outside ``[low, high)``."""
    if len(slots) and (int(slots.min()) < low or int(slots.max()) >= high):
        bad = slots[(slots < low) | (slots >= high)][0]
        raise InvalidInputError(f"slot {int(bad)} is outside model {model!r}'s pool "
                                f"[{low}, {high})")


def check_tree_prefix(head: np.ndarray, tree: np.ndarray, first_held: int) -> None:
    """Slots before the session's first one must be the tree's slots, token by token."""
    if first_held > len(tree):
        raise PreconditionError(
            f"slot_indices[{len(tree)}] = {int(head[len(tree)])} is not held by this "
            f"session, and the cache holds only the first {len(tree)} tokens (allocate "
            "slots for the rest)")
    same = head[:first_held] == tree[:first_held]
    if not same.all():
        bad = int(np.argmin(same))
        raise PreconditionError(
            f"slot_indices[{bad}] = {int(head[bad])}, but the cache holds that token in "
            f"slot {int(tree[bad])} and the session does not hold slot {int(head[bad])}")


# Slots come as a few ascending runs (the allocator hands out runs of pages): with fewer
# runs than this, checks and ownership changes work on slices, one run at a time.
MAX_RUNS = 32


def slot_runs(slots: np.ndarray) -> list[tuple[int, int]] | None:
    """The ``[first, end)`` bounds of ``slots``' runs of consecutive ascending values, in
    order; None when there are more than ``MAX_RUNS`` (then work on the whole vector)."""
    n = len(slots)
    if n == 0:
        return []
    first, last = int(slots[0]), int(slots[-1])
    # Strictly ascending with last - first == n - 1 leaves every step exactly 1: one run,
    # proven by one compare pass (the usual insert: the slots of one allocation).
    if last - first == n - 1 and (n == 1 or bool((slots[1:] > slots[:-1]).all())):
        return [(first, last + 1)]
    breaks = np.flatnonzero(slots[1:] - slots[:-1] != 1)
    if len(breaks) >= MAX_RUNS:
        return None
    cuts = (breaks + 1).tolist()
    firsts, lasts = [0, *cuts], [*cuts, len(slots)]
    return [(int(slots[a]), int(slots[b - 1]) + 1) for a, b in zip(firsts, lasts, strict=True)]


def runs_fit(runs: list[tuple[int, int]], low: int, high: int) -> bool:
    """Whether the runs lie in ``[low, high)`` and no slot is in two of them."""
    if not runs:
        return True
    ordered = sorted(runs)
    if ordered[0][0] < low or max(end for _, end in ordered) > high:
        return False
    return all(prev_end <= first for (_, prev_end), (first, _) in pairwise(ordered))
