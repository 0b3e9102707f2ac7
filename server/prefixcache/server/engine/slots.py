"""Slot ownership of a ModelEngine: which session holds which pool row.

One int64 array over the pool rows (slot -> session tag, 0 = not held by any
session), so checking thousands of slots is a vector compare. A slot is held by at
most one of: the allocator's free list, a session, the tree, the quarantine (slots a
store transfer may still write: see ``quarantine``). These helpers check an
insert's slots against it, allocate (evicting for room) and mark or clear owners;
``ModelEngine`` (engine/model_engine.py) drives them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from prefixcache.cache import InvalidInputError, TokenToKVPoolAllocator
from prefixcache.cache.distinct import count_distinct, distinct, distinct_counts
from prefixcache.cache.pools.allocator import host_indices

from ..errors import PoolExhaustedError, PreconditionError
from ..sessions.session import Session
from .slot_checks import (
    check_distinct,
    check_range,
    check_tree_prefix,
    page_blocks,
    runs_fit,
    slot_runs,
)
from .state_slots import StateSlots

# Runs of one session's allocations followed for its close (beyond: a pool scan).
MAX_TRACKED_RUNS = 256
# Up to this many runs, page counts change one slice per run; more: one vector pass.
_SLICED_RUNS = 8


class SlotOwnership:
    """Mixin of ``ModelEngine``: the slot -> session array and the checks over it."""

    # Set by ModelEngine (and EngineBase) before any of these run.
    name: str
    kind: str
    page_size: int
    pool_size: int
    num_rows: int
    allocator: Any
    cache: Any
    states: StateSlots | None
    session_slots: int
    ops: dict[str, int]
    evicted_tokens: dict[str, int]
    _owner: np.ndarray
    _alloc_runs: dict[int, list[Any] | None]
    # Per page: how many of its slots a session holds. An allocation takes whole pages
    # (the unused tail of its last page stays reserved until the page comes back), and
    # a page comes back only once none of its slots is held, so a session's charge under
    # max_session_slots is the pages it holds slots on, whole (see quotas.py). Pages
    # are never shared between sessions: each was free when one session took it.
    _page_held: np.ndarray

    def _checked_head(
        self, slots: np.ndarray, head: np.ndarray, tree: np.ndarray, tag: int
    ) -> tuple[int, list[tuple[int, int]]] | None:
        """``(first_held, runs of head[first_held:])`` if ``slots`` pass every insert
        check, else None (not a refusal: the slots may be too scattered to check here).

        The tree's part of ``head`` ends at its first slot that differs from the tree's:
        a session's slot is never the tree's, so where the insert is valid that is
        exactly the first slot the session holds. The rest is checked run by run.
        """
        common = min(len(tree), len(head))
        first = common
        if common:
            same = head[:common] == tree[:common]
            if not same.all():
                first = int(np.argmin(same))
        runs = slot_runs(head[first:])
        tail = slots[len(head) :]
        if (
            runs is None
            or not runs_fit(runs, 1, self.num_rows)
            or (len(tail) and (int(tail.min()) < 1 or int(tail.max()) >= self.num_rows))
        ):
            return None
        owner = self._owner
        if not all((owner[lo:end] == tag).all() for lo, end in runs):
            return None
        return first, runs

    def _check_head(self, head: np.ndarray, tree: np.ndarray, tag: int) -> int:
        """The insert's slot checks one by one, raising on the first that fails; returns
        where the session's slots start."""
        held = self._owner[head] == tag
        first_held = int(np.argmax(held)) if held.any() else len(head)
        check_tree_prefix(head, tree, first_held)
        if not held[first_held:].all():
            bad = first_held + int(np.argmin(held[first_held:]))
            raise PreconditionError(
                f"slot_indices[{bad}] = {int(head[bad])} is not held by "
                "this session (allocate it, or pass the matched slot)"
            )
        check_distinct(head[first_held:], self.page_size)
        return first_held

    def _set_owner(self, slots: np.ndarray, runs: list[tuple[int, int]] | None, tag: int) -> None:
        """Mark ``slots`` (whose runs are ``runs``, or None: not known) as ``tag``'s."""
        if runs is None:
            self._owner[slots] = tag
        else:
            for lo, end in runs:
                self._owner[lo:end] = tag

    def _held_slots(self, session: Session) -> int:
        """Slots ``session`` takes from this model's pool: the whole pages it holds."""
        if self.page_size == 1:
            return session.slots.get(self.name, 0)
        return session.pages.get(self.name, 0) * self.page_size

    def _check_slot_quota(self, session: Session, n: int) -> None:
        """Refuse ``n`` more slots past ``max_session_slots``, counting the whole pages
        an allocation of ``n`` takes and the whole pages the session holds."""
        ps = self.page_size
        self.quota.check_slots(session, -(-n // ps) * ps, self._held_slots(session))

    def _count_pages(
        self,
        session: Session | None,
        slots: np.ndarray,
        sign: int,
        runs: list[tuple[int, int]] | None = None,
    ) -> None:
        """``session`` now holds (``sign`` 1) or no longer holds (-1) ``slots``, whose
        runs of consecutive slots are ``runs`` (None: not known): update the pages it
        holds slots on."""
        ps = self.page_size
        if ps == 1 or session is None or not len(slots):
            return  # with one-slot pages, pages are slots (session.slots)
        if runs is not None and len(runs) <= _SLICED_RUNS:
            change = self._count_runs(runs, sign)
        else:
            blocks = page_blocks(slots, ps)
            if blocks is None:  # repeats or split pages: the sort sums them
                blocks = distinct_counts(slots // ps)
            pages, counts = blocks
            before = self._page_held[pages]
            after = before + sign * counts.astype(self._page_held.dtype)
            self._page_held[pages] = after
            change = int(np.count_nonzero(after)) - int(np.count_nonzero(before))
        left = session.pages.get(self.name, 0) + change
        if left:
            session.pages[self.name] = left
        else:
            session.pages.pop(self.name, None)

    def _count_runs(self, runs: list[tuple[int, int]], sign: int) -> int:
        """Add ``sign`` per slot of ``runs`` to the page counts, one slice of pages per
        run (no index vector); returns the change in pages with a held slot. Runs may
        share a page: each run's change is counted after the ones before it, so the
        changes add up to the whole one."""
        ps, held, change = self.page_size, self._page_held, 0
        for lo, end in runs:
            if end <= lo:
                continue
            first, last = lo // ps, (end - 1) // ps
            pages = held[first : last + 1]
            before = int(np.count_nonzero(pages))
            pages += sign * ps  # whole pages, then the two ends' missing slots
            pages[0] -= sign * (lo - first * ps)
            pages[-1] -= sign * ((last + 1) * ps - end)
            change += int(np.count_nonzero(pages)) - before
        return change

    def page_problems(self, sessions: list[Session]) -> list[str]:
        """Where the per-page counts disagree with the slot owners (the integrity check)."""
        if self.page_size == 1:
            return []
        rows = np.flatnonzero(self._owner)
        counts = np.bincount(rows // self.page_size, minlength=len(self._page_held))
        problems = []
        if not np.array_equal(counts, self._page_held):
            problems.append(
                f"{int(np.count_nonzero(counts != self._page_held))} pages count "
                "held slots the owner array disagrees with"
            )
        # Distinct (tag, page) pairs, then pages per tag: one pass, whatever the sessions.
        pairs = distinct(self._owner[rows] * len(self._page_held) + rows // self.page_size)
        tags, held = distinct_counts(pairs // len(self._page_held))
        by_tag = dict(zip(tags.tolist(), held.tolist(), strict=True))
        for session in sessions:
            pages = by_tag.get(session.tag, 0)
            if pages != session.pages.get(self.name, 0):
                problems.append(
                    f"session {session.id[:8]} holds slots on {pages} pages, "
                    f"counts {session.pages.get(self.name, 0)}"
                )
        return problems

    def _check_room(self, n: int) -> None:
        """Refuse ``n`` slots the pool cannot supply even after evicting (not SWA)."""
        want = -(-n // self.page_size) * self.page_size
        if (
            self.kind != "swa"
            and want - self.allocator.available_size() > self.cache.evictable_size()
        ):
            raise self._exhausted(n)

    def _allocate(self, n: int, session: Session) -> np.ndarray:
        if n < 0:
            raise InvalidInputError(f"cannot allocate {n} slots")
        want = -(-n // self.page_size) * self.page_size  # whole pages come off the pool
        if self.kind == "swa":
            full_short = want - self.allocator.full_available_size()
            swa_short = want - self.allocator.swa_available_size()
            if (
                full_short > self.cache.evictable_size()
                or swa_short > self.cache.swa_evictable_size()
            ):
                raise self._exhausted(n)
            if full_short > 0 or swa_short > 0:
                result = self.cache.evict(max(full_short, 0), max(swa_short, 0))
                self.evicted_tokens["pressure"] += result.full_evicted
        else:
            short = want - self.allocator.available_size()
            if short > self.cache.evictable_size():
                raise self._exhausted(n)
            if short > 0:
                self.evicted_tokens["pressure"] += self.cache.evict(short).full_evicted
        if isinstance(self.allocator, TokenToKVPoolAllocator):
            got = self.allocator.alloc_host(n)
            if got is None:
                raise self._exhausted(n)
            out, runs = got
        else:
            slots = self.allocator.alloc(n)
            if slots is None:
                raise self._exhausted(n)
            out, runs = host_indices(slots), None
        self._set_owner(out, runs, session.tag)
        self._count_pages(session, out, 1, runs)
        self._track(session.tag, n, runs)
        session.slots[self.name] = session.slots.get(self.name, 0) + n
        self.session_slots += n
        self.ops["alloc"] += 1
        return out

    def _states(self) -> StateSlots:
        if self.states is None:
            raise PreconditionError(f"model {self.name!r} has no Mamba state pool")
        return self.states

    def _exhausted(self, n: int) -> PoolExhaustedError:
        return PoolExhaustedError(
            f"model {self.name!r} cannot supply {n} slots: {self.allocator.available_size()} "
            f"free and {self.cache.evictable_size()} evictable of {self.pool_size}",
            self.name,
            "larger_than_pool" if n > self.pool_size else "pool_exhausted",
        )

    def _disown(self, session: Session | None, n: int) -> None:
        if session is None or not n:
            return
        left = session.slots.get(self.name, 0) - n
        if left:
            session.slots[self.name] = left
        else:
            session.slots.pop(self.name, None)
            self._alloc_runs.pop(session.tag, None)
        self.session_slots -= n

    def _track(self, tag: int, n: int, runs: list[tuple[int, int]] | None) -> None:
        """Remember where ``tag`` was given ``n`` slots (``runs``; None: scattered), so
        closing its session looks there instead of at every row of the pool."""
        tracked = self._alloc_runs.get(tag, [0, []])
        if tracked is None:
            return
        tracked[0] += n
        if (
            runs is None
            or len(tracked[1]) + len(runs) > MAX_TRACKED_RUNS
            or tracked[0] > max(self.num_rows // 8, MAX_TRACKED_RUNS)
        ):
            self._alloc_runs[tag] = None  # too many to follow: closing scans the pool
            return
        tracked[1].extend(runs)
        self._alloc_runs[tag] = tracked

    def _rows_of(self, session: Session) -> np.ndarray:
        """The rows ``session`` holds, ascending: from its allocations' runs when they
        were followed and account for every slot it holds, else from the whole pool."""
        tracked = self._alloc_runs.pop(session.tag, None)
        if tracked is not None:
            owner, tag = self._owner, session.tag
            parts = [np.flatnonzero(owner[lo:end] == tag) + lo for lo, end in tracked[1]]
            # A slot given twice (freed and given again) is in two runs: unique.
            mine = distinct(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
            if len(mine) == session.slots.get(self.name, 0):
                return mine
        return np.flatnonzero(self._owner == session.tag)

    def _check_range(self, slots: np.ndarray) -> None:
        check_range(slots, 1, self.num_rows, self.name)

    # ------------------------------------------------------------ quarantine

    # Slots a writer the server cannot stop may still fill (a store transfer past its
    # deadline: Mooncake calls cannot be cancelled). Allocated, held by no session, in
    # no tree; no free, session close or Reset hands them out (``reset_keeping``) until
    # ``unquarantine``. ``_quarantined`` marks them per row; ``quarantined`` counts them.
    _quarantined: np.ndarray
    quarantined: int

    def quarantine(self, session: Session, slots: np.ndarray) -> None:
        """Move ``slots`` (held by ``session``) into the quarantine.

        Raises:
            PreconditionError: a slot is not held by ``session``.
        """
        self._check_range(slots)
        if not (self._owner[slots] == session.tag).all():
            raise PreconditionError("only a session's own slots can be quarantined")
        check_distinct(slots, self.page_size)
        self._owner[slots] = 0
        self._count_pages(session, slots, -1)
        self._disown(session, len(slots))
        self._quarantined[slots] = True
        self.quarantined += len(slots)

    def unquarantine(self, slots: np.ndarray, session: Session | None = None) -> None:
        """Take ``slots`` out of the quarantine once their writer is done: back to
        ``session``'s (as if it allocated them), or freed with no session.

        Raises:
            PreconditionError: a slot is not quarantined.
        """
        self._check_range(slots)
        if not self._quarantined[slots].all():
            raise PreconditionError("a slot is not quarantined")
        check_distinct(slots, self.page_size)
        if session is None:
            self.allocator.free(slots)
        else:
            self._set_owner(slots, None, session.tag)
            self._count_pages(session, slots, 1)
            self._track(session.tag, len(slots), slot_runs(slots))
            session.slots[self.name] = session.slots.get(self.name, 0) + len(slots)
            self.session_slots += len(slots)
        self._quarantined[slots] = False
        self.quarantined -= len(slots)

    def keep_quarantine(self) -> None:
        """After a Reset cleared the allocator: the quarantined slots are taken again
        (their writer may still be filling them), every other slot stays free."""
        kept = np.flatnonzero(self._quarantined)
        if not kept.size:
            return
        # The pool was just cleared: take every page, give back all but the kept slots.
        got = self.allocator.alloc_host(self.allocator.available_size())
        if got is None:  # cannot be: everything is free after a clear
            raise PreconditionError("the pool is not empty after a reset")
        self.allocator.free(np.setdiff1d(got[0], kept, assume_unique=True))

    def held_window(self, held: list[tuple[Session, np.ndarray]]) -> np.ndarray | None:
        if isinstance(self.allocator, TokenToKVPoolAllocator) or not held:
            return None
        rows = np.concatenate([r for _, r in held])
        return host_indices(self.allocator.translate_loc_from_full_to_swa(rows))

    def _retake(self, rows: np.ndarray, window: np.ndarray | None) -> None:
        """Take ``rows`` (and, on an SWA model, the ``window`` slots they mapped to)
        out of a just-cleared pool (``keep_held``): every page is taken, and all but
        them given back."""
        alloc = self.allocator
        if isinstance(alloc, TokenToKVPoolAllocator):
            # The quarantine was taken again already (``keep_quarantine``): a page may
            # hold slots of both, so both are taken again together, in one pass.
            kept = np.flatnonzero(self._quarantined)
            if kept.size:
                alloc.free(kept)
            _take_only(alloc, np.union1d(rows, kept))
            return
        _take_only(alloc.full_attn_allocator, rows)
        mapped = window is not None and window != 0
        if window is not None and mapped.any():
            _take_only(alloc.swa_attn_allocator, window[mapped])
            alloc._full_to_swa[rows[mapped]] = window[mapped]

    def _own(self, session: Session, rows: np.ndarray) -> None:
        self._set_owner(rows, None, session.tag)
        self._count_pages(session, rows, 1)
        if self.page_size > 1:  # a page may hold slots of two of them (a holder's)
            pages = count_distinct(rows // self.page_size)
            session.pages[self.name] = pages
        self._track(session.tag, len(rows), None)
        session.slots[self.name] = session.slots.get(self.name, 0) + len(rows)
        self.session_slots += len(rows)

    def quarantine_problems(self) -> list[str]:
        """What the integrity check finds wrong with the quarantine."""
        kept = np.flatnonzero(self._quarantined)
        problems = []
        if kept.size != self.quarantined:
            problems.append(f"{kept.size} slots quarantined, {self.quarantined} counted")
        if kept.size and self._owner[kept].any():
            problems.append("a quarantined slot is held by a session")
        if kept.size and not bool(self.allocator.is_allocated(kept).all()):
            problems.append("a quarantined slot is free in the allocator")
        return problems


def _take_only(alloc: TokenToKVPoolAllocator, rows: np.ndarray) -> None:
    """Take exactly ``rows`` out of ``alloc``, whose every page is free (a Reset): take
    every page, give back all but ``rows``."""
    got = alloc.alloc_host(alloc.available_size())
    if got is None or not np.isin(rows, got[0]).all():
        raise PreconditionError("held slots cannot be taken again after a reset")
    alloc.free(np.setdiff1d(got[0], rows))
