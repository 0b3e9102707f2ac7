"""DiskStore: one model's disk tier, a store (tier/backend.py's interface) over a slot
file (slot_file.py), its index in memory (slot_index.py) and on disk (journal.py).

An object is a page and its seal, as in the Mooncake store: ``get_into`` reads the
page's bytes from its slot straight into the pool's rows (the parts it is given) and
copies the seal the index keeps into the seal part; ``put_from`` writes the page's
parts (staging pages) into a free slot and keeps the seal (the last part). The tier's
code seals pages before they are put and checks every page read against its identity
(tier/seals.py) before it enters a tree, so a page whose bytes changed on disk is
refused there, counted and removed (``prefixcache_integrity_failures_total
{source="disk"}``).

Keys: the tier's object keys (keys.py), each kept as a keyed BLAKE2b-128 digest under a
random seed of the store's (a client who makes its prompts' keys collide cannot know
the digests).

A page is visible (``exists``, ``get_into``) only once its bytes are written and its
record is in the journal: a write that failed, whole or in part, or whose record could
not be appended, leaves its slot free and the page unknown. The file system being full
(``ENOSPC``, a quota, a file size limit) pauses writes for ``FULL_PAUSE`` seconds (each
refused as ``DISK_FULL``); reads go on.

Files removed or cut under a running store: every read and write first checks that
the slot file at its path is still the one it opened and long enough (a ``stat``, about
2 us). A removed file's pages are forgotten, and the files made anew; a cut one's pages
past the cut are forgotten and the file grown back. A read of a slot the file no longer
reaches comes back short, and its page is refused for its size.

Thread-safe: the write thread (``put_from``), the lookups' read threads (``get_into``,
``remove``, ``object_size``) and the event loop (``exists``, ``holds``) share it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import mmap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ...memory.page_seal import SEAL_BYTES, MemoryRegions
from ..backend import (
    DISK_FULL,
    IO_ERROR,
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    PAST_DEADLINE,
    PageRetention,
    Parts,
)
from .journal import ADD, FREE, IndexFiles, journal_bound, metadata_bytes, records
from .slot_file import FULL_ERRNOS, Done, Run, SlotFile
from .slot_index import SlotIndex

log = logging.getLogger("prefixcache.server")

# Seconds writes stay paused after the file system said it is full.
FULL_PAUSE = 5.0
# Seconds a closing store waits for its reads and writes in flight.
CLOSE_SECONDS = 2.0
# The error codes a write answers when no slot could be had (every one pinned).
NO_SLOT = -200
PAGES_FILE = "pages"


def slots_for(nbytes: int, slot_bytes: int) -> int:
    """Slots a store of ``nbytes`` in all (slots, index and journal) holds."""
    low, high = 0, nbytes // slot_bytes  # the most that fit: a binary search
    while low < high:
        mid = (low + high + 1) // 2
        if mid * slot_bytes + metadata_bytes(mid) <= nbytes:
            low = mid
        else:
            high = mid - 1
    return low


def stored_bytes(folder: Path) -> int:
    """Bytes the files in ``folder`` take on disk now (what a start may reuse)."""
    total = 0
    for entry in folder.iterdir() if folder.is_dir() else ():
        if entry.is_file():
            total += entry.stat().st_blocks * 512
    return total


class DiskStore:
    """One model's disk tier in ``folder`` (a directory of its own).

    Args:
        folder: Where its files are (made if missing).
        page_bytes: A page's bytes (PageLayout.page_bytes).
        slots: Page slots (``slots_for``).
        slot_bytes: A slot's bytes: the page's, rounded up to ``align``.
        align: The file system's direct-I/O block (slot_file.probe_direct), 0: none.
        identity: What its slots hold (journal.py): files of another are not read.
        policy: The model's eviction policy (prefixcache.cache.eviction).
        name: The model's name, for logs.
        retain_limit: Slots one owner (tenant) may retain (slot_index.py; None: any).

    Raises:
        OSError: the files cannot be made or preallocated.
    """

    def __init__(
        self,
        folder: Path,
        page_bytes: int,
        slots: int,
        slot_bytes: int,
        align: int,
        identity: bytes,
        policy: Any,
        name: str = "",
        retain_limit: int | None = None,
    ) -> None:
        folder.mkdir(exist_ok=True)
        self.folder = folder
        self.name = name
        self.page_bytes = page_bytes
        self.object_bytes = page_bytes + SEAL_BYTES
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.align = align
        self.index = SlotIndex(slots, policy, retain_limit)
        self.files = IndexFiles(folder, identity)
        pages_path = folder / PAGES_FILE
        had = pages_path.stat().st_size if pages_path.exists() else -1
        start = time.monotonic()
        loaded = self.files.load(self.index)
        if had < 0 and loaded.pages:  # the index names pages of a file now gone
            self.index.clear()
            self.files.reset()
            loaded.empty_because, loaded.pages = "its pages file is gone", 0
        elif 0 <= had < slots * slot_bytes:
            self.index.drop_from(had // slot_bytes)
        self.file = SlotFile(pages_path, slots, slot_bytes, align)
        self.seed = loaded.seed
        self.evicted_at_start = self.index.evicted
        self.journal_lock = threading.Lock()
        self._lock = threading.Lock()  # the slot file in use, and its repair
        self._epoch = 0  # bumped when the files are made anew
        self._full_until = 0.0
        self._regions: list[tuple[int, int]] = []
        self._memory: MemoryRegions | None = None
        pad = max(slot_bytes - page_bytes, 0)
        self._pad_map = mmap.mmap(-1, max(pad, 1))
        self._pad = memoryview(self._pad_map)[:pad]
        self._pad_address = _address_of(self._pad_map)
        self.closed = False
        log.info(
            "disk tier store opened",
            extra={
                "model": name,
                "path": str(folder),
                "slots": slots,
                "slot_bytes": slot_bytes,
                "direct_io": bool(align),
                "pages": loaded.pages,
                "torn_journal": loaded.torn,
                "started_empty": loaded.empty_because or "",
                "seconds": round(time.monotonic() - start, 3),
            },
        )

    # ----------------------------------------------------------- properties

    @property
    def pages_held(self) -> int:
        return self.index.held

    @property
    def evicted(self) -> int:
        return self.index.evicted

    @property
    def full(self) -> bool:
        """Writes are paused: the file system was full a moment ago."""
        return time.monotonic() < self._full_until

    def digest(self, key: str) -> bytes:
        return hashlib.blake2b(key.encode(), digest_size=16, key=self.seed).digest()

    def register(self, ptr: int, size: int) -> None:
        """Memory pages are read into and written from (the pool, staging, seals)."""
        self._regions.append((ptr, size))
        self._memory = None

    def _views(self, ptrs: list[int], sizes: list[int]) -> list[memoryview]:
        if self._memory is None:
            self._memory = MemoryRegions(self._regions, writable=True)
        return self._memory.views(ptrs, sizes)

    # ------------------------------------------------------------- lookups

    def exists(self, keys: list[str]) -> list[int]:
        """1 for each key of the leading run held, then 0 (the first missing ends it:
        lookups use a leading run only)."""
        found = 0
        for key in keys:
            if self.index.slot_of(self.digest(key)) < 0:
                break
            found += 1
        return [1] * found + [0] * (len(keys) - found)

    def holds(self, keys: list[str], retain: PageRetention | None = None) -> list[bool]:
        """Whether each key is held (each held one is used now, and takes ``retain``)."""
        return self.index.holds([self.digest(k) for k in keys], time.time(), retain)

    def retentions(self, keys: list[str]) -> list[tuple[int, float, int] | None]:
        """Each key's retention in force now: (priority, seconds, owner id) or None."""
        return self.index.retentions([self.digest(k) for k in keys], time.time())

    def object_size(self, key: str) -> int:
        """The object's bytes as the file holds them now (a page cut short by the end
        of a cut file is shorter), or OBJECT_NOT_FOUND."""
        slot = self.index.slot_of(self.digest(key))
        if slot < 0:
            return OBJECT_NOT_FOUND
        here = min(max(self.file.length() - slot * self.slot_bytes, 0), self.page_bytes)
        return here + SEAL_BYTES

    def get_into(
        self,
        keys: list[str],
        ptrs: Parts,
        sizes: Parts,
        deadline: float | None = None,
        check: Callable[[int], None] | None = None,
    ) -> list[int]:
        """Read the leading run of ``keys`` held into their parts (the last part of each
        its seal): ``object_bytes`` per page read whole; then the code of the first page
        that was not (short, PAST_DEADLINE, IO_ERROR, OBJECT_NOT_FOUND) and of those
        after it. ``check(i)`` runs for each page read whole as its request lands, on
        the I/O thread that read it (seal checks overlap the other reads)."""
        codes = [OBJECT_NOT_FOUND] * len(keys)
        self._repair()
        slots, seals = self.index.pin([self.digest(k) for k in keys])
        read = 0
        try:
            if not slots:
                return codes
            file = self.file
            runs: list[Run] = []
            page_of = {slot: i for i, slot in enumerate(slots)}

            def landed(first: int, nbytes: int) -> None:
                if check is not None:
                    for slot in range(first, first + nbytes // self.slot_bytes):
                        check(page_of[slot])

            for i, slot in enumerate(slots):
                views = self._views(ptrs[i][:-1], sizes[i][:-1])
                addresses = list(ptrs[i][:-1])
                if len(self._pad):
                    views.append(self._pad)
                    addresses.append(self._pad_address)
                if not runs or slot != runs[-1].first + len(runs[-1].pages):
                    runs.append(Run(slot))
                runs[-1].add_page(views, addresses)
                ctypes.memmove(ptrs[i][-1], seals[i].ctypes.data, SEAL_BYTES)
            done = file.read(runs, deadline, landed)
            at = 0
            for run, got in zip(runs, done, strict=True):
                for j in range(len(run.pages)):
                    left = got.nbytes - j * self.slot_bytes
                    if left >= self.slot_bytes:
                        codes[at] = self.object_bytes
                    elif got.stop == "short":
                        codes[at] = min(max(left, 0), self.page_bytes)
                    elif got.stop == "skipped":
                        codes[at] = PAST_DEADLINE
                    else:
                        codes[at] = IO_ERROR
                    at += 1
            while read < len(slots) and codes[read] == self.object_bytes:
                read += 1
            if read < len(slots) and codes[read] == IO_ERROR:
                log.warning(
                    "disk tier read failed",
                    extra={
                        "model": self.name,
                        "errno": next((g.errno for g in done if g.stop == "error"), 0),
                    },
                )
            return codes
        finally:
            self.index.unpin(slots, read, time.time())

    def remove(self, keys: list[str]) -> list[int]:
        """Forget pages (those refused for their seal, those a Reset made stale)."""
        with self.journal_lock:
            gone = self.index.drop([self.digest(k) for k in keys])
            if gone:
                slots = np.asarray(gone, dtype=np.int64)
                try:
                    self.files.append(
                        records(FREE, slots, self.index.next_ids(len(gone)), time.time())
                    )
                    self.index.settled(slots)
                except OSError:  # stale: freed in the journal before they are reused
                    log.debug("disk tier: could not journal removed pages", exc_info=True)
        return [0] * len(keys)

    # ------------------------------------------------------------- writes

    def put_from(
        self,
        keys: list[str],
        ptrs: Parts,
        sizes: Parts,
        retain: list[PageRetention | None] | None = None,
    ) -> list[int]:
        """Write each page not held yet (its parts, then its seal) into a free slot,
        with its retention in ``retain``: 0, OBJECT_ALREADY_EXISTS (held: it counts as
        used now, and takes the retention), or DISK_FULL, IO_ERROR, NO_SLOT for a page
        not written."""
        n = len(keys)
        if self.full or self.closed:
            return [DISK_FULL] * n
        self._repair()
        epoch = self._epoch
        digests = [self.digest(k) for k in keys]
        now = time.time()
        if retain is None:
            held = self.index.holds(digests, now)
        else:
            held = [self.index.holds([d], now, r)[0] for d, r in zip(digests, retain, strict=True)]
        codes = [OBJECT_ALREADY_EXISTS if h else 0 for h in held]
        seen: set[bytes] = set()
        new = []
        for i, d in enumerate(digests):
            if codes[i] == 0 and d not in seen:
                seen.add(d)
                new.append(i)
            elif codes[i] == 0:
                codes[i] = OBJECT_ALREADY_EXISTS  # the same page twice in one batch
        if not new:
            return codes
        slots, stale = self.index.reserve(len(new))
        for i in new[len(slots) :]:
            codes[i] = NO_SLOT
        new = new[: len(slots)]
        if not new:
            return codes
        ok = self._journal_frees(stale)
        if ok is not None:
            self.index.release(slots)
            for i in new:
                codes[i] = ok
            return codes
        # Pages in slot order, so that a run of slots is one request.
        pairs = sorted(zip(slots.tolist(), new, strict=True))
        runs: list[Run] = []
        for slot, i in pairs:
            views, addresses = self._sources(ptrs[i][:-1], sizes[i][:-1])
            if not runs or slot != runs[-1].first + len(runs[-1].pages):
                runs.append(Run(slot))
            runs[-1].add_page(views, addresses)
        try:
            done = self.file.write(runs)
        except Exception:  # a bug must not end the write thread, nor show a page
            log.exception("disk tier write failed")
            done = [Done(stop="error") for _ in runs]
        written: list[tuple[int, int]] = []
        failed: list[int] = []
        at = 0
        for run, got in zip(runs, done, strict=True):
            whole = got.nbytes // self.slot_bytes
            for j in range(len(run.pages)):
                slot, i = pairs[at]
                if j < whole:
                    written.append((slot, i))
                else:
                    failed.append(slot)
                    codes[i] = self._failed(got.errno)
                at += 1
        if failed:
            self.index.release(failed)
        if written:
            self._commit(written, digests, ptrs, codes, epoch, retain)
        self._maybe_compact()
        return codes

    def _sources(self, ptrs: list[int], sizes: list[int]) -> tuple[list[memoryview], list[int]]:
        """A page's parts as buffers of a slot's bytes: one buffer when the parts are
        one run of memory (a staging page) and its slot's padding lies in the same
        region, else the parts and the store's padding."""
        if all(ptrs[j] + sizes[j] == ptrs[j + 1] for j in range(len(ptrs) - 1)):
            try:
                return self._views([ptrs[0]], [self.slot_bytes]), [ptrs[0]]
            except ValueError:
                pass
        views = self._views(ptrs, sizes)
        addresses = list(ptrs)
        if len(self._pad):
            views.append(self._pad)
            addresses.append(self._pad_address)
        return views, addresses

    def _journal_frees(self, stale: np.ndarray) -> int | None:
        """Journal that ``stale`` slots are free before they are written over: None, or
        the code of every page of the batch when that failed."""
        if not len(stale):
            return None
        with self.journal_lock:
            try:
                self.files.append(
                    records(FREE, stale, self.index.next_ids(len(stale)), time.time())
                )
            except OSError as exc:
                return self._failed(exc.errno or 0)
        self.index.settled(stale)
        return None

    def _commit(
        self,
        written: list[tuple[int, int]],
        digests: list[bytes],
        ptrs: Parts,
        codes: list[int],
        epoch: int,
        retain: list[PageRetention | None] | None = None,
    ) -> None:
        slots = np.asarray([s for s, _ in written], dtype=np.int64)
        keys = [digests[i] for _, i in written]
        kept = [retain[i] for _, i in written] if retain is not None else None
        seals = np.empty((len(written), SEAL_BYTES), dtype=np.uint8)
        for row, (_, i) in enumerate(written):
            ctypes.memmove(seals[row].ctypes.data, ptrs[i][-1], SEAL_BYTES)
        now = time.time()
        ids = self.index.next_ids(len(written))
        with self.journal_lock:
            if epoch != self._epoch:  # the files were made anew meanwhile
                error: int | None = IO_ERROR
            else:
                try:
                    self.files.append(records(ADD, slots, ids, now, keys, seals, kept))
                    error = None
                except OSError as exc:
                    error = self._failed(exc.errno or 0)
            if error is not None:
                self.index.release(slots)
                for _, i in written:
                    codes[i] = error
                return
            self.index.commit(slots, keys, seals, now, ids, kept)

    def _failed(self, err: int) -> int:
        """The code of a write that failed with ``err``; a full file system pauses
        writes."""
        if err in FULL_ERRNOS:
            if not self.full:
                log.warning(
                    "disk tier: the file system is full, writes pause",
                    extra={
                        "model": self.name,
                        "path": str(self.folder),
                        "pause_seconds": FULL_PAUSE,
                    },
                )
            self._full_until = time.monotonic() + FULL_PAUSE
            return DISK_FULL
        return IO_ERROR

    def _maybe_compact(self) -> None:
        if self.files.journal_bytes < journal_bound(self.slots):
            return
        with self.journal_lock:
            try:
                self.files.compact(self.index)
            except OSError as exc:
                self._failed(exc.errno or 0)
                log.warning(
                    "disk tier: the index could not be written (the journal stays)",
                    extra={"model": self.name, "errno": exc.errno},
                )

    # ----------------------------------------------------- files under us

    def _repair(self) -> None:
        """Forget what a removed or cut slot file took with it, and make it whole."""
        state = self.file.state()
        if state is None:
            return
        with self._lock:
            state = self.file.state()
            if state == "removed":
                lost = self.index.held
                with self.journal_lock:
                    self._epoch += 1
                    self.index.clear()
                    old = self.file
                    try:
                        self.folder.mkdir(exist_ok=True)
                        self.files.reset()
                        self.file = SlotFile(
                            self.folder / PAGES_FILE, self.slots, self.slot_bytes, self.align
                        )
                    except OSError as exc:
                        self._failed(exc.errno or 0)
                        log.warning(
                            "disk tier: its files were removed and cannot be made anew",
                            extra={"model": self.name, "errno": exc.errno},
                        )
                        return
                threading.Thread(target=old.close, args=(CLOSE_SECONDS,), daemon=True).start()
                log.warning(
                    "disk tier: its pages file was removed; its pages are gone, "
                    "the files are made anew",
                    extra={"model": self.name, "pages": lost},
                )
            elif state == "truncated":
                length = self.file.length()
                lost = self.index.drop_from(length // self.slot_bytes)
                try:
                    self.file.reserve()
                except OSError as exc:
                    self._failed(exc.errno or 0)
                log.warning(
                    "disk tier: its pages file was cut short; the pages past the cut are gone",
                    extra={"model": self.name, "pages": lost, "bytes": length},
                )

    # ----------------------------------------------------------- lifetime

    def close(self) -> None:
        """Write the index (the next start reads it instead of the journal) and close."""
        if self.closed:
            return
        self.closed = True
        with self.journal_lock:
            try:
                if self.file.state() is None:
                    self.files.compact(self.index)
            except OSError as exc:
                log.warning(
                    "disk tier: the index could not be written at stop (the journal stays)",
                    extra={"model": self.name, "errno": exc.errno},
                )
            self.files.close()
        self.file.close(CLOSE_SECONDS)


def _address_of(buf: mmap.mmap) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)
