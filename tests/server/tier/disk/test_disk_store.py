"""DiskStore on a real file system: pages written from staging read back byte for
byte into pool rows, with their seals; the index survives a close and a crash (from the
journal alone) without a page read; a torn or changed journal or index is never
trusted; a failed write is never visible; eviction follows the model's policy and
never takes a slot being read; files removed or cut under the store are misses."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from disk_harness import StoreRig, fill, pages, seal_of

from prefixcache.server.tier.backend import (
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    PAST_DEADLINE,
)
from prefixcache.server.tier.disk.journal import JOURNAL_HEAD_BYTES


def _keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}/{i}" for i in range(n)]


def test_pages_come_back_byte_for_byte_with_their_seals(tmp_path: Path) -> None:
    rig = StoreRig(tmp_path / "s")
    rig.fill(pages(1, 4), seed=1)
    want = rig.page_bytes_of(pages(1, 4))
    keys = _keys("a", 4)
    assert rig.put(keys, pages(1, 4)) == [0, 0, 0, 0]
    assert rig.store.exists([*keys, "b/0"]) == [1, 1, 1, 1, 0]
    assert rig.store.exists(["b/0", *keys]) == [0] * 5  # a leading run only
    codes, got, seals = rig.get(keys, pages(20, 4))
    assert codes == [rig.store.object_bytes] * 4
    assert got == want
    assert seals == [seal_of(k) for k in keys]
    assert rig.put(keys[:1], pages(1, 1)) == [OBJECT_ALREADY_EXISTS]
    assert rig.store.pages_held == 4


def test_a_read_stops_at_the_first_page_missing(tmp_path: Path) -> None:
    rig = StoreRig(tmp_path / "s")
    rig.fill(pages(1, 2), seed=2)
    rig.put(["a/0", "a/1"], pages(1, 2))
    codes, _got, _ = rig.get(["a/0", "x", "a/1"], pages(30, 3))
    assert codes[0] == rig.store.object_bytes
    assert codes[1:] == [OBJECT_NOT_FOUND] * 2


def test_a_restart_reads_the_index_not_the_pages(tmp_path: Path) -> None:
    rig = StoreRig(tmp_path / "s")
    rig.fill(pages(1, 6), seed=3)
    want = rig.page_bytes_of(pages(1, 6))
    rig.put(_keys("a", 3), pages(1, 3))
    rig.put(_keys("b", 3), pages(4, 3))
    slot = rig.store.index.slot_of(rig.store.digest("b/2"))
    rig.store.close()  # a clean close: the index file, an empty journal
    assert (tmp_path / "s" / "journal").stat().st_size == JOURNAL_HEAD_BYTES
    with open(tmp_path / "s" / "pages", "r+b") as f:  # b/2 changed while stopped
        f.seek(slot * rig.slot_bytes)
        f.write(b"\xff" * 8)
    rig.store = rig.open()
    # The start read no page: b/2 is held (the tier's seal check refuses it on read).
    assert rig.store.pages_held == 6
    codes, got, seals = rig.get(_keys("a", 3) + _keys("b", 3), pages(40, 6))
    assert codes == [rig.store.object_bytes] * 6 and got[:5] == want[:5]
    assert got[5] != want[5] and got[5][:8] == b"\xff" * 8
    assert seals == [seal_of(k) for k in _keys("a", 3) + _keys("b", 3)]


def test_a_crash_keeps_what_the_journal_took(tmp_path: Path) -> None:
    rig = StoreRig(tmp_path / "s")
    rig.fill(pages(1, 4), seed=4)
    want = rig.page_bytes_of(pages(1, 4))
    rig.put(_keys("a", 2), pages(1, 2))
    rig.reopen()  # the index file has a/0 and a/1
    rig.put(_keys("b", 2), pages(3, 2))  # the journal only
    crashed = rig.store  # never closed, as after SIGKILL: no index written
    rig.store = rig.open()
    assert rig.store.pages_held == 4
    codes, got, _ = rig.get(_keys("a", 2) + _keys("b", 2), pages(40, 4))
    assert codes == [rig.store.object_bytes] * 4 and got == want
    crashed.file.close(1.0)


def test_a_torn_journal_block_and_all_after_it_are_dropped(tmp_path: Path) -> None:
    rig = StoreRig(tmp_path / "s")
    rig.fill(pages(1, 3), seed=5)
    for i in range(3):  # three blocks, one page each
        rig.put([f"a/{i}"], pages(1 + i, 1))
    journal = tmp_path / "s" / "journal"
    size = journal.stat().st_size
    block = (size - JOURNAL_HEAD_BYTES) // 3
    os.truncate(journal, size - block // 2)  # the last block cut in half
    rig.store = rig.open()
    assert rig.store.exists(["a/0", "a/1", "a/2"]) == [1, 1, 0]
    assert journal.stat().st_size == size - block  # cut back to the last whole block
    # A changed byte in the middle block: it and the ones after are not trusted.
    data = bytearray(journal.read_bytes())
    data[JOURNAL_HEAD_BYTES + block + 20] ^= 0xFF
    journal.write_bytes(bytes(data))
    rig.store = rig.open()
    assert rig.store.exists(["a/0", "a/1"]) == [1, 0]


def test_a_changed_index_file_is_not_read(tmp_path: Path) -> None:
    rig = StoreRig(tmp_path / "s")
    rig.fill(pages(1, 2), seed=6)
    rig.put(_keys("a", 2), pages(1, 2))
    rig.store.close()
    index = tmp_path / "s" / "index"
    data = bytearray(index.read_bytes())
    data[-5] ^= 0x01  # an entry's byte
    index.write_bytes(bytes(data))
    rig.store = rig.open()
    assert rig.store.pages_held == 0
    rig.put(_keys("c", 1), pages(1, 1))
    assert rig.store.exists(["c/0"]) == [1]


def test_another_identity_starts_empty(tmp_path: Path) -> None:
    rig = StoreRig(tmp_path / "s")
    rig.fill(pages(1, 1), seed=7)
    rig.put(["a/0"], pages(1, 1))
    rig.store.close()
    rig.identity = b"another-model!!!"
    rig.store = rig.open()
    assert rig.store.exists(["a/0"]) == [0]


def test_eviction_follows_the_model_policy(tmp_path: Path) -> None:
    rig = StoreRig(tmp_path / "s", slots=4, policy="lru")
    rig.fill(pages(1, 8), seed=8)
    rig.put(_keys("a", 4), pages(1, 4))
    time.sleep(0.01)
    rig.get(["a/2"], pages(40, 1))  # a/2 used last
    rig.put(["b/0"], pages(5, 1))  # full: the least recently used goes
    held = {k: rig.store.exists([k])[0] for k in [*_keys("a", 4), "b/0"]}
    assert held["b/0"] == 1 and held["a/2"] == 1
    assert sum(held.values()) == 4 and rig.store.evicted == 1


def test_fifo_evicts_the_oldest_write(tmp_path: Path) -> None:
    rig = StoreRig(tmp_path / "s", slots=4, policy="fifo")
    rig.fill(pages(1, 8), seed=9)
    for i in range(4):
        rig.put([f"a/{i}"], pages(1 + i, 1))
    rig.get(["a/0"], pages(40, 1))  # use changes nothing for fifo
    rig.put(["b/0"], pages(5, 1))
    assert rig.store.exists(["a/0"]) == [0]
    assert rig.store.exists(["a/1"]) == [1]


def test_a_slot_being_read_is_never_evicted(tmp_path: Path) -> None:
    rig = StoreRig(tmp_path / "s", slots=2)
    rig.fill(pages(1, 4), seed=10)
    rig.put(_keys("a", 2), pages(1, 2))
    digests = [rig.store.digest(k) for k in _keys("a", 2)]
    pinned, _ = rig.store.index.pin(digests)  # a read in flight on both
    assert rig.put(["b/0"], pages(3, 1)) == [-200]  # no slot to be had
    rig.store.index.unpin(pinned, 0, time.time())
    assert rig.put(["b/0"], pages(3, 1)) == [0]


def test_a_read_past_its_deadline_reads_nothing_more(tmp_path: Path) -> None:
    rig = StoreRig(tmp_path / "s")
    rig.fill(pages(1, 2), seed=11)
    rig.put(_keys("a", 2), pages(1, 2))
    codes, _, _ = rig.get(_keys("a", 2), pages(40, 2), deadline=time.monotonic() - 1)
    assert codes == [PAST_DEADLINE] * 2


def test_a_removed_pages_file_makes_misses_and_new_files(tmp_path: Path) -> None:
    rig = StoreRig(tmp_path / "s")
    rig.fill(pages(1, 2), seed=12)
    rig.put(_keys("a", 2), pages(1, 2))
    (tmp_path / "s" / "pages").unlink()
    codes, _, _ = rig.get(_keys("a", 2), pages(40, 2))
    assert codes == [OBJECT_NOT_FOUND] * 2
    assert rig.store.pages_held == 0
    assert (tmp_path / "s" / "pages").stat().st_size == rig.slots * rig.slot_bytes
    assert rig.put(["b/0"], pages(1, 1)) == [0]
    rig.reopen()
    assert rig.store.exists(["a/0", "b/0"]) == [0, 0] and rig.store.exists(["b/0"]) == [1]


def test_a_cut_pages_file_reads_short_and_is_grown_back(tmp_path: Path) -> None:
    rig = StoreRig(tmp_path / "s", slots=8)
    rig.fill(pages(1, 8), seed=13)
    rig.put(_keys("a", 8), pages(1, 8))
    os.truncate(tmp_path / "s" / "pages", 2 * rig.slot_bytes)
    store = rig.store
    codes, _, _ = rig.get(_keys("a", 8), pages(40, 8))
    # The store saw the cut first: the pages past it are gone, the file whole again.
    assert codes[:2] == [store.object_bytes] * 2
    assert codes[2] == OBJECT_NOT_FOUND
    assert store.pages_held == 2
    assert (tmp_path / "s" / "pages").stat().st_size == rig.slots * rig.slot_bytes


def test_a_write_the_file_system_refuses_is_never_visible(tmp_path: Path) -> None:
    from disk_harness import small_filesystem

    with small_filesystem(tmp_path, 1 << 20) as fs:
        if fs is None:
            pytest.skip("needs root to mount a small tmpfs")
        rig = StoreRig(fs / "s", slots=16)
        rig.fill(pages(1, 16), seed=14)
        assert rig.put(_keys("a", 2), pages(1, 2)) == [0, 0]
        # Fill what is left, so the journal's next block cannot be written.
        fill(fs / "filler")
        # The journal's last page of the file system has room for a few blocks more.
        for i in range(400):
            codes = rig.put([f"b/{i}"], pages(3 + i % 8, 1))
            if codes != [0]:
                break
        assert codes == [-2002]  # DISK_FULL
        assert rig.store.exists([f"b/{i}"]) == [0] and rig.store.full
        assert rig.put(["c/0"], pages(5, 1)) == [-2002]  # paused
        assert rig.store.exists(["c/0"]) == [0]
        (fs / "filler").unlink()
        rig.store._full_until = 0.0  # the pause over
        assert rig.put([f"b/{i}"], pages(3 + i % 8, 1)) == [0]
        want = rig.page_bytes_of(pages(3 + i % 8, 1))
        codes, got, _ = rig.get([f"b/{i}"], pages(40, 1))
        assert got == want
        rig.store = rig.reopen()
        assert rig.store.exists([f"b/{i}"]) == [1]
        rig.store.close()
