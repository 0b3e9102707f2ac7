"""A session's write fence, held around each copy into its slots through the mapped
pool, so that the service never hands those slots to somebody else mid-copy.

A copy through the mapped pool needs no call, so nothing on the service's side knows
it is under way; a worker frozen (SIGSTOP, a debugger) past its session's lease would
resume and overwrite slots given to another session since. ``WriteFence`` (the
service's ``write_fence.py`` has the whole protocol) gives the session an 8-byte record
in a shared-memory file, holding a token while the session lives. ``WriteFence.held``
takes a shared OFD lock on the record, checks the token, and yields; the caller
copies, then calls ``check`` (the token again: the session may have ended meanwhile);
leaving the block unlocks. While the lock is held the service frees none of the
session's slots, however long the holder is stopped; if the holder dies, the kernel
drops the lock.

Linux only (``F_OFD_SETLK``), like the mapped pool itself.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefixcache.v1 import prefix_cache_pb2 as pb

from ._requests import Op
from .errors import FailedPrecondition, SessionLost

if TYPE_CHECKING:
    from .sync import PrefixCacheClient

_RECORD = struct.Struct("<q")
# How long to wait for the service's exclusive lock on a record: it holds it only
# within one short call of its own (claiming or ending a record).
LOCK_WAIT = 2.0


@dataclass(frozen=True, slots=True)
class WriteFenceInfo:
    """Where a session's fence is (see ``WriteFenceResponse``)."""

    shm_path: str
    offset_bytes: int
    token: int
    server_epoch: int = 0

    @classmethod
    def from_pb(cls, m: pb.WriteFenceResponse) -> WriteFenceInfo:
        return cls(m.shm_path, m.offset_bytes, m.token, m.server_epoch)


def _flock(kind: int, start: int) -> bytes:
    """A ``struct flock`` for OFD locks (64-bit Linux): one record, ``l_pid`` 0."""
    return struct.pack("@hhqqi", kind, os.SEEK_SET, start, _RECORD.size, 0) + bytes(4)


class WriteFence:
    """One session's fence, opened in this process.

    Raises:
        FailedPrecondition: the fence file cannot be opened from here.
    """

    def __init__(self, info: WriteFenceInfo) -> None:
        self.info = info
        self._fd = -1
        try:
            self._fd = os.open(info.shm_path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise FailedPrecondition(
                f"cannot open the write fence {info.shm_path}: {exc.strerror}"
            ) from exc

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        with suppress(OSError):
            self.close()

    @contextmanager
    def held(self) -> Iterator[WriteFence]:
        """Hold the fence: the session's slots stay its own until the block ends.

        Raises:
            SessionLost: the session has ended; nothing may be written.
            FailedPrecondition: the record stayed locked by the service.
        """
        start = self.info.offset_bytes
        self._lock(fcntl.F_RDLCK, start)
        try:
            self.check()
            yield self
        finally:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK, start))

    def check(self) -> None:
        """Refuse unless the session still lives (call it while ``held``, after the
        copy too: a session that ended during the copy has written nothing it owns).

        Raises:
            SessionLost: the session has ended.
        """
        raw = os.pread(self._fd, _RECORD.size, self.info.offset_bytes)
        if len(raw) != _RECORD.size or _RECORD.unpack(raw)[0] != self.info.token:
            raise SessionLost(
                "the session has ended (its write fence was withdrawn): "
                "its slots are not its own to write any more"
            )

    def _lock(self, kind: int, start: int) -> None:
        deadline = time.monotonic() + LOCK_WAIT
        while True:
            try:
                fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _flock(kind, start))
                return
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise FailedPrecondition(f"cannot lock the write fence: {exc}") from exc
            if time.monotonic() > deadline:
                raise FailedPrecondition("the write fence stayed locked by the service")
            time.sleep(0.001)


def open_fence(
    client: PrefixCacheClient,
    session_id: str,
    server_epoch: int = 0,
    *,
    timeout: float | None = None,
) -> WriteFence:
    """``session_id``'s fence (``WriteFence``, idempotent), opened here.

    Raises:
        FailedPrecondition: the service has no shared memory, or the fence file cannot
            be opened from here (write through WriteKV).
        ResourceExhausted: every fence record of the service is taken.
        NotFound: the session has ended.
    """
    request = pb.WriteFenceRequest(session_id=session_id, server_epoch=server_epoch)
    info = client._run(Op("WriteFence", request, WriteFenceInfo.from_pb, True), timeout)
    return WriteFence(info)


__all__ = ["WriteFence", "WriteFenceInfo", "open_fence"]
