"""Slots as page ids: page ``p`` is the slots ``[p * page_size, (p + 1) * page_size)``.

A paged ``TokenToKVPoolAllocator`` hands out whole aligned pages, so what it allocates
always has a page form; slots a caller chose itself (an insert of other slots) may not.
One page of one layer is then one contiguous run of rows in every K/V buffer, which is
what lets an engine block or page be copied as a single run.
"""

from __future__ import annotations

import numpy as np

from .errors import InvalidInputError, check_count


def whole_pages(slots: np.ndarray, page_size: int) -> int:
    """How many leading pages' worth of ``slots`` are whole aligned pages, in order.

    Slots ``[i * page_size, (i + 1) * page_size)`` of ``slots`` count as page ``i``
    when they are exactly one page's slots in ascending order. A last, short group
    counts when it is the start of a page.
    """
    ps = check_count(page_size, "page_size", 1)
    slots = np.asarray(slots, dtype=np.int64).reshape(-1)
    full = slots.size // ps
    rows = slots[: full * ps].reshape(full, ps)
    first = rows[:, 0]
    ok = (first % ps == 0) & (rows == first[:, None] + np.arange(ps)).all(axis=1)
    if not ok.all():
        return int(np.argmin(ok))
    tail = slots[full * ps :]
    if tail.size and not (tail[0] % ps == 0 and (tail == tail[0] + np.arange(tail.size)).all()):
        return full
    return full + (1 if tail.size else 0)


def to_page_ids(slots: np.ndarray, page_size: int) -> np.ndarray:
    """The page ids of ``slots``, which must be whole aligned pages in order (a last
    short group the start of a page).

    Raises:
        InvalidInputError: some page of ``slots`` is not whole or not aligned.
    """
    slots = np.asarray(slots, dtype=np.int64).reshape(-1)
    num = -(-slots.size // page_size)
    good = whole_pages(slots, page_size)
    if good != num:
        bad = slots[good * page_size : (good + 1) * page_size][:8].tolist()
        raise InvalidInputError(
            f"slots of page {good} are not one whole page of {page_size}: {bad}"
        )
    return slots[::page_size] // page_size


def to_slots(page_ids: np.ndarray, page_size: int, num_slots: int | None = None) -> np.ndarray:
    """The slots of ``page_ids`` in order, the first ``num_slots`` of them (all if None)."""
    ids = np.asarray(page_ids, dtype=np.int64).reshape(-1)
    slots = (ids[:, None] * page_size + np.arange(page_size, dtype=np.int64)).reshape(-1)
    return slots if num_slots is None else slots[:num_slots]
