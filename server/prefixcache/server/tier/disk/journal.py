"""The disk tier's index on disk: a checked index file, and a journal of what changed
since it was written; a start reads both (never a page) to know every slot's page.

* ``index``: a header (the store's identity, the key seed, the sequence number it
  covers, a checksum of itself and of the body) and one entry per held page (its slot,
  key, seal, last use, hits, write sequence number and retention: priority, seconds,
  expiry and owner). Written whole, to a temporary
  file that is synced and then renamed over the old one: it is either the old index or
  the new one, never half of either.
* ``journal``: a header, then blocks appended as pages are written (and slots freed
  before they are written over): a block header (a magic number, its record count, an
  XXH3 checksum of its records) and its records (the operation, slot, sequence number,
  time, key, seal and the retention the page came with). A block is appended by one
  ``write``; one that a crash cut short, or any byte of which changed, fails its
  checksum, and it and everything after it are dropped (the journal is cut back to the
  last whole block).

A record names a page only once the page's bytes are written (the write returned), so
a page whose write failed is in no record, and after a crash the journal holds at most
pages that are whole on disk or, if the machine itself went down before its caches
reached the disk, pages whose bytes fail their seal when read (counted, a miss). The
journal is not synced per block: a killed process loses nothing the kernel took.

When the journal outgrows its bound, and at a clean stop, the index is written anew
from memory and the journal cut back to its header (``compact``); so a retention's
renewals by hits since (never journaled) last across a clean stop, and after a crash
a page has the retention it was written with. Records at or below
the index's sequence number are skipped, so a crash between the two loses nothing.

The **identity** names what the slots hold: the format, the model's fingerprint, the
page and slot sizes and the key scheme (digest or keyed, and which key). Files of
another identity are not read: the store starts empty and says why.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from prefixcache.cache.distinct import distinct_first

from ..backend import PageRetention
from .slot_index import KEY_BYTES, SEAL_BYTES, SlotIndex, owner_id

log = logging.getLogger("prefixcache.server")

# 2: entries and records carry a retention.
VERSION = 2
INDEX_MAGIC = b"PCDISKIX"
JOURNAL_MAGIC = b"PCDISKJR"
BLOCK_MAGIC = 0x4B4C4250  # "PBLK"
# magic, version, identity, seed, seq, count, slots, body checksum; then its checksum.
_INDEX_HEAD = struct.Struct("<8sI16s16sQQQQ")
_JOURNAL_HEAD = struct.Struct("<8sI16s16s")
_CHECK = struct.Struct("<Q")
_BLOCK = struct.Struct("<IIQ")  # magic, records, checksum of the records
ENTRY = np.dtype(
    [
        ("slot", "<u4"),
        ("priority", "<i2"),
        ("pad", "V2"),
        ("hits", "<i8"),
        ("id", "<i8"),
        ("time", "<f8"),
        ("key", f"V{KEY_BYTES}"),
        ("seal", f"V{SEAL_BYTES}"),
        ("seconds", "<f8"),
        ("until", "<f8"),
        ("owner", "<i8"),
    ]
)
RECORD = np.dtype(
    [
        ("op", "u1"),
        ("pad", "V1"),
        ("priority", "<i2"),
        ("slot", "<u4"),
        ("seq", "<i8"),
        ("time", "<f8"),
        ("key", f"V{KEY_BYTES}"),
        ("seal", f"V{SEAL_BYTES}"),
        ("seconds", "<f8"),
        ("until", "<f8"),
        ("owner", "<i8"),
    ]
)
# The fields of a page's retention, in entries and records alike.
RETENTION = ("priority", "seconds", "until", "owner")
ADD, FREE = 1, 2
INDEX_HEAD_BYTES = _INDEX_HEAD.size + _CHECK.size
JOURNAL_HEAD_BYTES = _JOURNAL_HEAD.size + _CHECK.size


def metadata_bytes(slots: int) -> int:
    """Bytes the index and journal of ``slots`` slots take at most: the index twice (a
    new one is written beside the old) and the journal at its bound, one record per
    slot in blocks of one record at worst."""
    return (
        2 * (INDEX_HEAD_BYTES + slots * ENTRY.itemsize)
        + JOURNAL_HEAD_BYTES
        + journal_bound(slots)
        + _BLOCK.size
        + RECORD.itemsize
    )


def journal_bound(slots: int) -> int:
    """Journal bytes past which the index is written anew."""
    return max(slots, 1024) * (RECORD.itemsize + _BLOCK.size)


@dataclass(slots=True)
class Loaded:
    """What a start found: the seed of its keys, and why it started empty (or None)."""

    seed: bytes
    empty_because: str | None = None
    pages: int = 0
    torn: bool = False


class IndexFiles:
    """The ``index`` and ``journal`` files in ``folder`` of a store with ``identity``."""

    def __init__(self, folder: Path, identity: bytes) -> None:
        self.folder = folder
        self.identity = identity
        self.index_path = folder / "index"
        self.journal_path = folder / "journal"
        self.seed = b""
        self.covered = 0  # the sequence number the index file covers
        self._journal: int | None = None  # its fd
        self.journal_bytes = 0
        self.full = False  # the last append failed: the file system is full

    # ------------------------------------------------------------------ start

    def load(self, index: SlotIndex) -> Loaded:
        """Fill ``index`` from the files (made anew where missing or not ours)."""
        head = self._read_index()
        why: str | None = None
        entries = None
        if isinstance(head, str):
            why, self.seed, self.covered = head, b"", 0
        else:
            self.seed, self.covered, entries = head
        records, good, journal_seed, journal_why = self._read_journal()
        if journal_why is not None:
            records = None
            why = why or journal_why
        elif not self.seed:
            self.seed = journal_seed
        elif journal_seed != self.seed:
            records, why = None, "the journal is of another index"
        if not self.seed:
            self.seed = os.urandom(16)
        loaded = Loaded(self.seed, why)
        used = np.zeros(index.slots, dtype=bool)
        fields = {
            name: np.zeros(index.slots, dtype=ENTRY[name])
            for name in ("hits", "id", "time", "key", "seal", *RETENTION)
        }
        if entries is not None:
            inside = entries[entries["slot"] < index.slots]
            slots = inside["slot"].astype(np.int64)
            used[slots] = True
            for name, arr in fields.items():
                arr[slots] = inside[name]
        if records is not None:
            loaded.torn = good < self.journal_size()
            self._apply(records[records["seq"] > self.covered], index.slots, used, fields)
        slots = np.flatnonzero(used)
        # A key in two slots (written twice before a crash): the later write wins.
        order = slots[np.argsort(fields["id"][slots], kind="stable")]
        where = dict(zip(fields["key"][order].tolist(), order.tolist(), strict=True))
        keep = np.fromiter(where.values(), dtype=np.int64, count=len(where))
        keep.sort()
        index.load(
            keep,
            np.frombuffer(fields["key"][keep].tobytes(), dtype=np.uint8).reshape(-1, KEY_BYTES),
            np.frombuffer(fields["seal"][keep].tobytes(), dtype=np.uint8).reshape(-1, SEAL_BYTES),
            fields["time"][keep],
            fields["hits"][keep],
            fields["id"][keep],
            where,
            tuple(fields[name][keep] for name in RETENTION),  # type: ignore[arg-type]
        )
        index.seq = max(
            index.seq,
            self.covered,
            int(records["seq"].max()) if records is not None and len(records) else 0,
        )
        loaded.pages = len(keep)
        self._open_journal(good if records is not None else None)
        return loaded

    def _read_index(self) -> tuple[bytes, int, np.ndarray] | str:
        """The index file's seed, sequence number and entries, or why not."""
        try:
            data = self.index_path.read_bytes()
        except FileNotFoundError:
            return "no index file"
        if len(data) < INDEX_HEAD_BYTES:
            return "the index file is cut short"
        raw = data[: _INDEX_HEAD.size]
        (check,) = _CHECK.unpack_from(data, _INDEX_HEAD.size)
        if xxhash.xxh3_64_intdigest(raw) != check:
            return "the index file's header does not check"
        magic, version, identity, seed, seq, count, _slots, body_check = _INDEX_HEAD.unpack(raw)
        if magic != INDEX_MAGIC or version != VERSION:
            return "the index file is not one of this version"
        if identity != self.identity:
            return "the index file is of another model, page size or key"
        body = memoryview(data)[INDEX_HEAD_BYTES:]
        if len(body) != count * ENTRY.itemsize or xxhash.xxh3_64_intdigest(body) != body_check:
            return "the index file's entries do not check"
        return seed, seq, np.frombuffer(body, dtype=ENTRY).copy()

    def _read_journal(self) -> tuple[np.ndarray | None, int, bytes, str | None]:
        """The journal's whole blocks' records, the bytes they end at, its seed, and why
        it is not read (or None)."""
        try:
            data = self.journal_path.read_bytes()
        except FileNotFoundError:
            return np.zeros(0, dtype=RECORD), 0, b"", None
        if len(data) < JOURNAL_HEAD_BYTES:
            return None, 0, b"", "the journal is cut short"
        raw = data[: _JOURNAL_HEAD.size]
        (check,) = _CHECK.unpack_from(data, _JOURNAL_HEAD.size)
        if xxhash.xxh3_64_intdigest(raw) != check:
            return None, 0, b"", "the journal's header does not check"
        magic, version, identity, seed = _JOURNAL_HEAD.unpack(raw)
        if magic != JOURNAL_MAGIC or version != VERSION or identity != self.identity:
            return None, 0, b"", "the journal is of another model, page size or key"
        at, blocks = JOURNAL_HEAD_BYTES, []
        view = memoryview(data)
        while at + _BLOCK.size <= len(data):
            magic_n, count, check = _BLOCK.unpack_from(data, at)
            end = at + _BLOCK.size + count * RECORD.itemsize
            if magic_n != BLOCK_MAGIC or not count or end > len(data):
                break
            body = view[at + _BLOCK.size : end]
            if xxhash.xxh3_64_intdigest(body, seed=count) != check:
                break
            blocks.append(np.frombuffer(body, dtype=RECORD))
            at = end
        records = np.concatenate(blocks) if blocks else np.zeros(0, dtype=RECORD)
        return records, at, seed, None

    @staticmethod
    def _apply(
        records: np.ndarray, slots: int, used: np.ndarray, fields: dict[str, np.ndarray]
    ) -> None:
        """Each slot's last record, over what the index file had."""
        records = records[records["slot"] < slots]
        if not len(records):
            return
        slot_of = records["slot"].astype(np.int64)
        _, first_from_end = distinct_first(slot_of[::-1])
        last = records[len(records) - 1 - first_from_end]
        adds = last[last["op"] == ADD]
        frees = last[last["op"] != ADD]
        used[frees["slot"].astype(np.int64)] = False
        at = adds["slot"].astype(np.int64)
        used[at] = True
        fields["hits"][at] = 0
        fields["id"][at] = adds["seq"]
        fields["time"][at] = adds["time"]
        fields["key"][at] = adds["key"]
        fields["seal"][at] = adds["seal"]
        for name in RETENTION:
            fields[name][at] = adds[name]

    def journal_size(self) -> int:
        try:
            return self.journal_path.stat().st_size
        except FileNotFoundError:
            return 0

    def _open_journal(self, good: int | None) -> None:
        """Open the journal for appends, cut back to ``good`` bytes (None: made anew)."""
        fd = os.open(self.journal_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if good is None or good < JOURNAL_HEAD_BYTES:
                os.ftruncate(fd, 0)
                head = _JOURNAL_HEAD.pack(JOURNAL_MAGIC, VERSION, self.identity, self.seed)
                _write_all(fd, head + _CHECK.pack(xxhash.xxh3_64_intdigest(head)), 0)
                good = JOURNAL_HEAD_BYTES
            elif good < os.fstat(fd).st_size:
                os.ftruncate(fd, good)
        except BaseException:
            os.close(fd)
            raise
        self._journal = fd
        self.journal_bytes = good

    # ---------------------------------------------------------------- appends

    def append(self, records: np.ndarray) -> None:
        """Append one block of ``records`` (RECORD); on failure the journal is cut back
        to where it was and the OSError raised."""
        if self._journal is None or not len(records):
            return
        body = records.tobytes()
        block = (
            _BLOCK.pack(
                BLOCK_MAGIC, len(records), xxhash.xxh3_64_intdigest(body, seed=len(records))
            )
            + body
        )
        at = self.journal_bytes
        try:
            _write_all(self._journal, block, at)
        except OSError:
            self.full = True
            try:
                os.ftruncate(self._journal, at)  # no torn block before the next one
            except OSError:
                log.exception("disk tier: the journal could not be cut back")
            raise
        self.full = False
        self.journal_bytes = at + len(block)

    def compact(self, index: SlotIndex) -> None:
        """Write the index anew from ``index``, then cut the journal back to its header.
        Raises OSError (the old files stay as they were). The caller holds off appends
        meanwhile (they would be cut)."""
        if self._journal is None:
            return
        (slots, keys, seals, last_access, hits, ids, *retention, stale) = index.entries()
        seq = index.seq
        body = np.zeros(len(slots), dtype=ENTRY)
        body["slot"] = slots
        for name, values in zip(RETENTION, retention, strict=True):
            body[name] = values
        body["hits"] = hits
        body["id"] = ids
        body["time"] = last_access
        body["key"] = np.ascontiguousarray(keys).view(f"V{KEY_BYTES}").reshape(-1)
        body["seal"] = np.ascontiguousarray(seals).view(f"V{SEAL_BYTES}").reshape(-1)
        data = body.tobytes()
        head = _INDEX_HEAD.pack(
            INDEX_MAGIC,
            VERSION,
            self.identity,
            self.seed,
            seq,
            len(body),
            index.slots,
            xxhash.xxh3_64_intdigest(data),
        )
        tmp = self.index_path.with_name("index.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _write_all(fd, head + _CHECK.pack(xxhash.xxh3_64_intdigest(head)), 0)
            _write_all(fd, data, INDEX_HEAD_BYTES)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(tmp, self.index_path)
        _sync_dir(self.folder)
        self.covered = seq
        os.ftruncate(self._journal, JOURNAL_HEAD_BYTES)
        self.journal_bytes = JOURNAL_HEAD_BYTES
        index.settled(stale)

    def reset(self) -> None:
        """Start both files anew, empty (their old selves were removed or cut)."""
        self.close()
        self.index_path.unlink(missing_ok=True)
        self.covered = 0
        self._open_journal(None)

    def close(self) -> None:
        if self._journal is not None:
            os.close(self._journal)
            self._journal = None


def records(
    op: int,
    slots: np.ndarray,
    seqs: list[int],
    now: float,
    keys: list[bytes] | None = None,
    seals: np.ndarray | None = None,
    retain: Sequence[PageRetention | None] | None = None,
) -> np.ndarray:
    """Journal records of ``op`` for ``slots`` (with their pages' keys, seals and
    retentions)."""
    out = np.zeros(len(slots), dtype=RECORD)
    out["op"] = op
    out["slot"] = slots
    out["seq"] = seqs
    out["time"] = now
    if keys is not None:
        out["key"] = np.frombuffer(b"".join(keys), dtype=f"V{KEY_BYTES}")
    if seals is not None:
        out["seal"] = np.ascontiguousarray(seals).view(f"V{SEAL_BYTES}").reshape(-1)
    for row, r in enumerate(retain or ()):
        if r is not None:
            out["priority"][row] = r.priority
            out["seconds"][row] = r.seconds
            out["until"][row] = r.until
            out["owner"][row] = owner_id(r.owner)
    return out


def _write_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _sync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
