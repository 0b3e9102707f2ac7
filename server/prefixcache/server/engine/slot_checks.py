"""Checks on the slot indices a client names, shared by the engines."""

from __future__ import annotations

from itertools import pairwise

import numpy as np

from prefixcache.cache import InvalidInputError

from ..errors import PreconditionError


def check_distinct(slots: np.ndarray, page_size: int = 1) -> None:
    """Refuse a slot named twice (it would enter the tree, or be freed, twice)."""
    if len(slots) < 2:
        return
    steps = slots[1:] - slots[:-1]
    if (steps > 0).all():  # the allocator hands out ascending runs: the common case
        return
    if page_size > 1 and page_blocks(slots, page_size) is not None:
        return  # whole pages in any order (a fragmented pool's allocation): per page
    ordered = np.sort(slots)
    dup = ordered[1:][ordered[1:] == ordered[:-1]]
    if len(dup):
        raise InvalidInputError(f"slot {int(dup[0])} is named twice")


def check_range(slots: np.ndarray, low: int, high: int, model: str) -> None:
    """Refuse a slot outside ``[low, high)``."""
    if len(slots) and (int(slots.min()) < low or int(slots.max()) >= high):
        bad = slots[(slots < low) | (slots >= high)][0]
        raise InvalidInputError(
            f"slot {int(bad)} is outside model {model!r}'s pool [{low}, {high})"
        )


def check_tree_prefix(head: np.ndarray, tree: np.ndarray, first_held: int) -> None:
    """Slots before the session's first one must be the tree's slots, token by token."""
    if first_held > len(tree):
        raise PreconditionError(
            f"slot_indices[{len(tree)}] = {int(head[len(tree)])} is not held by this "
            f"session, and the cache holds only the first {len(tree)} tokens (allocate "
            "slots for the rest)"
        )
    same = head[:first_held] == tree[:first_held]
    if not same.all():
        bad = int(np.argmin(same))
        raise PreconditionError(
            f"slot_indices[{bad}] = {int(head[bad])}, but the cache holds that token in "
            f"slot {int(tree[bad])} and the session does not hold slot {int(head[bad])}"
        )


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


def page_blocks(slots: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The pages ``slots`` lie on and how many of them each holds, where that shows the
    slots distinct: each page's slots are one block of consecutive ascending slots and
    no page has two blocks (whole pages in any order, as a fragmented pool hands them
    out). None otherwise (not a refusal: the caller sorts the slots instead).

    The pages are distinct, in the slots' order; the counts are exactly those of
    ``np.unique(slots // page_size, return_counts=True)``. Vector passes over the
    slots, then a sort of the pages only where they are not ascending.
    """
    n = len(slots)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    shift = page_size.bit_length() - 1
    # A right shift is floor division by a power of two, a third of its cost.
    pages = slots >> shift if page_size == 1 << shift else slots // page_size
    new = pages[1:] != pages[:-1]
    # Within a page the next slot is the one after: no repeat, no gap, no step back.
    # (Slots on one page lie under page_size apart: their difference cannot wrap.)
    if not (new | (slots[1:] - slots[:-1] == 1)).all():
        return None
    heads = np.flatnonzero(new)
    heads += 1
    firsts = np.empty(len(heads) + 1, np.int64)
    firsts[0] = 0
    firsts[1:] = heads
    held = np.diff(firsts, append=n)
    on = pages[firsts]
    if len(on) > 1 and not bool((on[1:] > on[:-1]).all()):
        ordered = np.sort(on)
        if bool((ordered[1:] == ordered[:-1]).any()):
            return None  # a page in two blocks: its slots may repeat
    return on, held
