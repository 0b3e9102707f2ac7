"""Seals on the tier's objects: written with every page, checked before a page is served.

A store object is a page's parts (its rows of every K and V buffer, layout.py) and then
its seal (memory/page_seal.py: a digest, or with ``tier.secret_file`` a MAC), 32 bytes
over the page's bytes and its identity (keys.py). The seal is one more part, read and
written zero-copy like the others, from a **seal slot**: registered memory of its own,
one slot per page on its way to or from the store (``SealSlots``), so the page's bytes
are never copied to seal them.

* **Put** (writer.py's thread, before the batch call): each page's seal is computed over
  its parts in place and written into its slot (``seal_pages``).
* **Fetch** (store_read.py's thread, right after ``get_into`` landed the pages in their
  pool slots and before any page enters a tree): each page's seal is checked
  (``checked_get``); the first page whose object is not a page and its seal, or whose
  seal does not check, ends the leading run there (a shorter hit, never a wrong one).
  Every refused object is removed from the store (force: a lookup's probe holds a
  read lease on it), and its code says why (``INTEGRITY_CODES``), for the loop to
  count.

XXH3 releases the GIL over large parts; AES-GMAC (``cryptography``) holds it for a
page's parts at a time, a few microseconds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from ..memory.page_seal import (
    BAD_SEAL,
    SEAL_BYTES,
    SEAL_MISMATCH,
    SIZE,
    WRONG_KIND,
    MemoryRegions,
    PageSeal,
)
from .backend import INVALID_PARAMS, TRANSFER_FAIL, Parts, TierBackend

log = logging.getLogger("prefixcache.server")

# A fetched page's code when it was refused (never a store code: those are above -1000),
# by why.
INTEGRITY_CODES = {-10001: SEAL_MISMATCH, -10002: BAD_SEAL, -10003: WRONG_KIND, -10004: SIZE}
_CODE_OF = {reason: code for code, reason in INTEGRITY_CODES.items()}


class SealSlots:
    """``count`` seal slots of one model, registered with the store; taken and given
    back on the loop (as arrays of slot numbers), written and read by the store threads
    that were given them. The free slots are a stack in an array: no Python object per
    slot."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._buf = np.zeros((count, SEAL_BYTES), dtype=np.uint8)
        self.base = int(self._buf.ctypes.data)
        self._free = np.arange(count - 1, -1, -1, dtype=np.int64)
        self._top = count  # slots free: _free[:_top]

    @property
    def available(self) -> int:
        return self._top

    def region(self) -> tuple[int, int]:
        """``(pointer, bytes)`` of the slots, to register with the store."""
        return self.base, int(self._buf.nbytes)

    def take(self, n: int) -> np.ndarray | None:
        """``n`` free slots, or None (none taken) when fewer are free."""
        if n > self._top:
            return None
        self._top -= n
        return self._free[self._top : self._top + n][::-1].copy()

    def release(self, taken: np.ndarray) -> None:
        n = len(taken)
        self._free[self._top : self._top + n] = taken
        self._top += n

    def ptrs(self, taken: np.ndarray) -> list[int]:
        return (self.base + taken * SEAL_BYTES).tolist()

    def write(self, slot: int, seal: bytes) -> None:
        self._buf[slot] = np.frombuffer(seal, dtype=np.uint8)

    def read(self, slot: int) -> bytes:
        return self._buf[slot].tobytes()


def seal_pages(
    seal: PageSeal,
    idents: Sequence[bytes],
    ptrs: Parts,
    sizes: Parts,
    regions: MemoryRegions,
    slots: SealSlots,
    taken: np.ndarray,
) -> None:
    """Seal each page ``i`` (its parts ``ptrs[i][:-1]``: the last is its seal slot) under
    ``idents[i]`` into seal slot ``taken[i]``. On a store thread."""
    for ident, p, z, slot in zip(idents, ptrs, sizes, taken, strict=True):
        slots.write(slot, seal.seal(ident, regions.views(p[:-1], z[:-1])))


def checked_get(
    backend: TierBackend,
    keys: list[str],
    ptrs: Parts,
    sizes: Parts,
    check: Callable[[int], str | None],
    object_bytes: int,
    deadline: float | None = None,
) -> list[int]:
    """``get_into``, then each page's seal checked (``check(i)``: None, or why page
    ``i`` is refused): the store's codes, each refused page's replaced by its
    ``INTEGRITY_CODES`` code. Every page read is checked, past a refused one too, so
    that each refused object is removed at once (the next writer of the page then
    replaces it) and counted. On a store thread.

    A read of an object whose size is not ``object_bytes`` fails in Mooncake (the
    buffers are larger: TRANSFER_FAIL; smaller: INVALID_PARAMS); the store is then asked
    the object's size, so that a wrong-sized object is told from a dead peer.
    ``deadline`` (monotonic seconds) is the store's to keep, if it can; a store that
    checks pages as they land (the disk tier) runs ``check`` itself, each page once."""
    verdicts: dict[int, str | None] = {}

    def early(i: int) -> None:
        verdicts[i] = check(i)

    codes = backend.get_into(keys, ptrs, sizes, deadline, early)
    refused: list[str] = []
    for i, code in enumerate(codes):
        reason: str | None = None
        if code == object_bytes:
            reason = verdicts[i] if i in verdicts else check(i)
        elif code >= 0 or code in (TRANSFER_FAIL, INVALID_PARAMS):
            size = backend.object_size(keys[i])
            if size >= 0 and size != object_bytes:
                reason = SIZE
        if reason is not None:
            codes[i] = _CODE_OF[reason]
            refused.append(keys[i])
        elif code != object_bytes:
            break  # a store error: the pages after it were not read
    if refused:
        try:
            backend.remove(refused)
        except Exception:  # the store is gone meanwhile: the objects go with it
            log.debug("tier could not remove refused objects", exc_info=True)
    return codes


def page_checker(
    seal: PageSeal,
    idents: Sequence[bytes],
    ptrs: Parts,
    sizes: Parts,
    regions: MemoryRegions,
    slots: SealSlots,
    taken: np.ndarray,
) -> Callable[[int], str | None]:
    """``check`` for ``checked_get``: page ``i``'s parts (the last its seal slot) against
    its identity."""

    def check(i: int) -> str | None:
        return seal.verdict(
            idents[i], regions.views(ptrs[i][:-1], sizes[i][:-1]), slots.read(taken[i])
        )

    return check


def sealed(ptrs: Parts, sizes: Parts, seal_ptrs: list[int]) -> tuple[Parts, Parts]:
    """Each page's parts with its seal slot appended (new lists; pages sharing one
    sizes list share the new one)."""
    shared: dict[int, list[int]] = {}
    out_sizes = []
    for z in sizes:
        with_seal = shared.get(id(z))
        if with_seal is None:
            with_seal = shared[id(z)] = [*z, SEAL_BYTES]
        out_sizes.append(with_seal)
    return [[*p, s] for p, s in zip(ptrs, seal_ptrs, strict=True)], out_sizes
