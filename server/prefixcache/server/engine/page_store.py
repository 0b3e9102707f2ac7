"""SetPages' store in slices, the loop free between them.

One SetPages may name a 1M-token prompt's pages. Stored in one go, a 200k-page chain
held the loop for 0.5 s of CPU (its lookups, its path's walk, the index entries and
page hashes of every page inserted), every other client waiting behind it. ``store``
is a generator that yields between slices of about ``SLICE`` pages' worth of work, and
the RPC lets other calls run at each yield (``page_rpcs.drive``).

What stays exact:

* Every check of the request runs before anything changes (the ones that read only the
  request in slices; whether the session holds every slot it sends, in the turn of the
  first change), so a refused request changes nothing.
* Each page is looked up, and stored or found held, in one turn with its slots'
  ownership checked again, so a page stored meanwhile by another call is answered
  HELD (its slots freed), never stored twice.
* A run of new pages is stored on the path of the hash page before it. The
  run goes into the tree one slice at a time, each slice a child of the one before:
  the path is carried from slice to slice and checked still cached whole (``peek``)
  before it is extended; where it was evicted meanwhile, the rest starts a path of its
  own, as it would had the call come a moment later.
* If the session ends or the model is Reset between two slices, the call stops there:
  what was stored stays the cache's (or went with the Reset), the session's other
  slots go with the session (or the Reset) as any held slot does, and the call is
  refused (NOT_FOUND or FAILED_PRECONDITION) naming how far it got. The cache is
  consistent after every slice (``check_integrity``).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from prefixcache.cache import InvalidInputError, RadixKey
from prefixcache.cache.index.page_index import (
    PageIndex,
    encode_hash_pages,
    hash_namespace,
    hash_page_width,
)
from prefixcache.cache.pools.allocator import host_indices

from ..errors import NotFoundError, PreconditionError
from ..sessions.session import Session
from .base import needs_session
from .slot_checks import check_distinct, check_range

if TYPE_CHECKING:
    from .hash_pages import HashPages, Namespace

# SetPages' answer per page (one byte each on the wire).
MISSING, STORED, HELD = 0, 1, 2
# Work per slice, in pages: each page looked up or stored costs one, and each run
# stored on a path a page per PATH_PAGES of that path (peeked, copied into its key):
# a few milliseconds between two loop turns.
SLICE = 2048
PATH_PAGES = 64


@dataclass(slots=True)
class Path:
    """A hash-namespace path from its root: its packed key, pages, and last page."""

    packed: bytearray
    depth: int
    last: str


def store(
    pages: HashPages,
    namespace: Namespace,
    prior: str | None,
    page_hashes: list[str],
    slots: np.ndarray,
    session: Session | None,
) -> Generator[None, None, bytes]:
    """Store the pages ``slots`` hold (``page_size`` a page; all zero: not sent) under
    their hashes, yielding between slices; returns one state byte per page (MISSING,
    STORED, HELD)."""
    owner = needs_session(session, "SetPages")
    per_page, sent = yield from _checked(pages, page_hashes, slots)
    _check_owned(pages, owner, per_page[sent].reshape(-1), 0)
    index, size = pages.index, pages.page_size
    hidden = (hash_namespace(*namespace), hash_page_width(size))
    states = bytearray(len(page_hashes))
    # The path a run of new pages goes on: a Path, the hash of a held page whose path
    # is still to be walked, or None (a path of its own).
    base: Path | str | None = prior if prior and index.find(hidden, prior) else None
    done = 0
    while done < len(page_hashes):
        walked = isinstance(base, str)
        if isinstance(base, str):
            base = yield from _walk(pages, hidden, base)
        if done or walked:
            _check_alive(pages, owner, per_page, sent, done)
        done, base = _slice(
            pages, namespace, hidden, page_hashes, per_page, sent, states, owner, done, base
        )
        if done < len(page_hashes):
            yield
    return bytes(states)


def store_now(
    pages: HashPages,
    namespace: Namespace,
    prior: str | None,
    page_hashes: list[str],
    slots: np.ndarray,
    session: Session | None,
) -> bytes:
    """``store`` in this loop turn, for a batch bounded by its caller (the tier's fetch,
    which must insert what it read before anything else runs)."""
    steps = store(pages, namespace, prior, page_hashes, slots, session)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def _slice(
    pages: HashPages,
    namespace: Namespace,
    hidden: Namespace,
    page_hashes: list[str],
    per_page: np.ndarray,
    sent: np.ndarray,
    states: bytearray,
    owner: Session,
    start: int,
    base: Path | None,
) -> tuple[int, Path | str | None]:
    """Look up and store pages from ``start`` until a slice's work is done; returns
    where it stopped and the path the next page's run goes on."""
    index, budget = pages.index, SLICE
    held: list[int] = []
    run: int | None = None  # where the run of new pages being gathered starts
    at = start
    out: Path | str | None = base
    while at < len(page_hashes) and budget > 0:
        page_hash = page_hashes[at]
        found = pages._locate(namespace, page_hash)
        if found is None and sent[at]:
            if isinstance(out, str):  # its path to walk first (the next slice)
                break
            run = at if run is None else run
            states[at] = STORED
            at += 1
            budget -= 1
            continue
        if run is not None:
            out = _insert(pages, hidden, page_hashes, per_page, run, at, out, owner)
            budget -= at - run + (out.depth if isinstance(out, Path) else 0) // PATH_PAGES
            run = None
        if found is None:
            states[at], out = MISSING, None
        else:
            states[at] = HELD
            if sent[at]:
                held.append(at)
            out = _after_held(index, hidden, out, page_hash)
        at += 1
        budget -= 1
    if run is not None:
        out = _insert(pages, hidden, page_hashes, per_page, run, at, out, owner)
    if held:
        pages.engine.free(owner, per_page[held].reshape(-1))
    return at, out


def _after_held(
    index: PageIndex, hidden: Namespace, base: Path | str | None, page_hash: str
) -> Path | str | None:
    """The path after a held page: it extends ``base`` where it is a hash page that
    chains on it; else its own, to walk (or none, where it is no hash page)."""
    entry = index.find(hidden, page_hash)
    if entry is None:
        return None
    if isinstance(base, Path) and entry.parent == base.last:
        base.packed += entry.page
        base.depth += 1
        base.last = page_hash
        return base
    return page_hash


def _insert(
    pages: HashPages,
    hidden: Namespace,
    page_hashes: list[str],
    per_page: np.ndarray,
    start: int,
    end: int,
    base: Path | str | None,
    owner: Session,
) -> Path:
    """Store pages ``start:end`` on ``base`` (where it is still cached whole; on a path
    of their own where not); returns the path through their last page."""
    engine, size = pages.engine, pages.page_size
    path = base if isinstance(base, Path) else Path(bytearray(), 0, "")
    base_slots = np.zeros(0, dtype=np.int64)
    if path.depth:
        base_slots = host_indices(
            engine.cache.peek_prefix(RadixKey.from_bytes(path.packed, hidden[1], hidden[0]))
        )
        if len(base_slots) != path.depth * size:  # evicted since: a path of their own
            path, base_slots = Path(bytearray(), 0, ""), np.zeros(0, dtype=np.int64)
    path.packed += encode_hash_pages(page_hashes[start:end], size)
    path.depth += end - start
    path.last = page_hashes[end - 1]
    value = np.concatenate([base_slots, per_page[start:end].reshape(-1)])
    engine.insert(RadixKey.from_bytes(path.packed, hidden[1], hidden[0]), value, owner)
    return path


def _walk(
    pages: HashPages, hidden: Namespace, page_hash: str
) -> Generator[None, None, Path | None]:
    """The path to held hash page ``page_hash``, walked ``SLICE`` pages a turn (None:
    evicted meanwhile)."""
    index, parts = pages.index, []
    current: str | None = page_hash
    while current is not None:
        if index.find(hidden, current) is None:
            return None
        part, current = index.path_part(hidden, current, SLICE, len(parts))
        parts += part
        if current is not None:
            yield
    parts.reverse()
    return Path(bytearray(b"".join(parts)), len(parts), page_hash)


def _checked(
    pages: HashPages, page_hashes: list[str], slots: np.ndarray
) -> Generator[None, None, tuple[np.ndarray, np.ndarray]]:
    """Each page's slots (a row each) and which pages were sent (not all zeros), every
    rule that reads only the request checked (its distinct hashes in slices)."""
    size, engine, count = pages.page_size, pages.engine, len(page_hashes)
    seen: set[str] = set()
    for start in range(0, count, SLICE):
        if start:
            yield
        seen.update(page_hashes[start : start + SLICE])
        if len(seen) != start + len(page_hashes[start : start + SLICE]):
            raise InvalidInputError(
                "page_hashes names a page twice (a chain of page hashes never repeats one)"
            )
    if len(slots) != count * size:
        raise InvalidInputError(f"slot_indices has {len(slots)} slots for {count} pages of {size}")
    per_page = slots.reshape(count, size)
    zero = (per_page == 0).all(axis=1)
    mixed = ~zero & (per_page == 0).any(axis=1)
    if mixed.any():
        raise InvalidInputError(
            f"page {int(np.argmax(mixed))} names slot 0 among its "
            "slots: name all of a page's slots, or none (page_size zeros)"
        )
    rows = per_page[~zero].reshape(-1)
    check_range(rows, 1, engine.num_rows, engine.name)
    check_distinct(rows)
    return per_page, ~zero


def _check_owned(pages: HashPages, owner: Session, rows: np.ndarray, done: int) -> None:
    held = pages.engine._owner[rows] == owner.tag
    if not held.all():
        bad = int(rows[np.argmin(held)])
        if not done:
            raise PreconditionError(
                f"slot {bad} is not held by this session (Alloc it, "
                "and write the page's KV into it, first)"
            )
        raise PreconditionError(
            f"slot {bad} is no longer held by this session (freed, "
            "or the model reset, while SetPages stored its pages): "
            f"the call stopped after its first {done} pages"
        )


def _check_alive(
    pages: HashPages, owner: Session, per_page: np.ndarray, sent: np.ndarray, done: int
) -> None:
    """Between slices: the session still open, and still holding the slots of the
    pages the next slice may reach (at most ``SLICE``: each costs a page of work)."""
    if owner.closed:
        raise NotFoundError(
            "SetPages: the session ended while its pages were stored: "
            f"the call stopped after its first {done} pages"
        )
    end = done + SLICE
    _check_owned(pages, owner, per_page[done:end][sent[done:end]].reshape(-1), done)
