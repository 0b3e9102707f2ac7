"""Write fences: no slot goes to another session while a worker may still be copying
into it through the mapped pool.

Why. A worker on the service's host writes its session's slots straight into the
mapped pool (pool attach), with no call per copy. A lease cannot make that safe: a
worker frozen (SIGSTOP, a debugger, a host swapping) after it checked its session and
before or during its copy resumes after the lease lapsed and the slots went to
somebody else, and overwrites that session's KV without anyone knowing. No deadline
helps either, since the freeze can last longer than any deadline. So the service must
know, at the moment it would free a session's slots, whether a copy into them may be
under way, and wait for it if so; and a worker must know, before it copies, whether
its session still holds its slots, in a way the service can see.

How. One file under ``shm_dir``, created through ``SharedPools`` on first use (so it
is swept and removed with the pool files), holds 8-byte records. ``WriteFence`` gives
a session a record holding its token (the session's tag: never reused in a start). For
each copy a worker (``prefixcache.client.write_fence``):

1. takes a shared OFD lock on the record (``fcntl`` ``F_OFD_SETLK``, ``F_RDLCK``);
2. reads the record: not its token means the session ended, so it copies nothing;
3. copies, then reads the record again: not the token means the session ended during
   the copy, and the save fails (the rows went into slots nobody else has: step 4);
4. unlocks.

When the session ends (closed or lapsed) the service writes 0 into its record, then
tries an exclusive lock on it without waiting. Taken: no worker is between steps 1 and
4, and any later one reads 0 in step 2; the session's slots are freed at once. Refused:
a worker is between 1 and 4, running or stopped for however long. The session's locks
are released, but its slots stay out of the free list (``waiting``), and every reaper
tick (``settle``) tries the lock again; the slots are freed once it is taken, when the
worker unlocked or died. The kernel drops an OFD lock when the last descriptor of its
open file is closed, however the process ends, so no pid is needed: the worker may be in
another PID namespace (a sidecar). A worker that stays stopped keeps its own session's
slots, and nothing else, out of use until it resumes or dies.

The records are written only while the service holds the exclusive lock, but for the 0
it writes before trying it: any worker that locks after the service unlocked reads what
it wrote. A record is reused for another session only once its lock could be taken
after the 0 was written, and with another token, so a worker of the old session never
reads its own token again.

A session that frees slots itself (Free, Step's frees, a failed save's give-back) while
one of its own workers still copies into them (one process gives slots back while
another of its workers is inside its copy) is fenced the same way. An engine's ``free``
asks ``holder``: for a session with a record, one non-blocking ``F_OFD_GETLK`` (none
for a session without). Unlocked: the slots are freed at once. Locked: they go to the
record's holder, a session of its own (tag ``-(record + 2)``, in no registry) that
holds them out of the free list; ``settle`` frees them once the record is unlocked,
and ``waiting`` counts them with the ended sessions' slots.

A Reset keeps the slots that wait for a worker (``waiting``) out of the allocator:
they are taken again after the clear, still owned by their ended session or holder,
and freed by ``settle`` as any others (a frozen writer that resumes after a Reset copies
into slots nobody else has; its save is lost anyway, as the session's tree is gone).

What it does not cover: a worker that starts its copy after the
Free was answered (its session still lives, so its record still reads its token: the
fence is per session, not per slot): a client frees slots only once none of its
workers will copy into them any more (the vLLM connector gives a failed save's slots
back only after every tensor-parallel rank reported its copy done: its scheduler.py,
"Failed saves"); slots an Insert gives back because the tree had their tokens
already; and Mamba state slots, which a Free returns at once.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import struct
import time

import torch

from prefixcache.v1 import prefix_cache_pb2 as pb

from ..errors import OverLimitError, PreconditionError
from ..sessions.session import Session
from .shared_pool import SharedPools

log = logging.getLogger("prefixcache.server")

RECORD = struct.Struct("<q")
FENCE_FILE = "write-fence"  # what the fence file is named after, as a model would be
_FREE = 0


def _flock(kind: int, start: int) -> bytes:
    """A ``struct flock`` for OFD locks (64-bit Linux): one record, ``l_pid`` 0."""
    return struct.pack("@hhqqi", kind, os.SEEK_SET, start, RECORD.size, 0) + bytes(4)


class WriteFences:
    """The records of one service's write fences (see the module docstring).

    Args:
        shared: Where the fence file is created (no directory: no fences).
        capacity: Records in the file; a claim beyond them is refused.
    """

    def __init__(self, shared: SharedPools, capacity: int) -> None:
        self._shared = shared
        self.capacity = max(int(capacity), 1)
        self._fd: int | None = None
        self._path = ""
        self._buffer: torch.Tensor | None = None
        self._next = 0  # records [_next, capacity) were never used
        self._free: list[int] = []
        self._of: dict[int, int] = {}  # live session tag -> its record
        self._waiting: dict[int, Session] = {}  # record -> ended session, writer inside
        # record -> the slots its session freed while a writer was inside (``holder``)
        self._holders: dict[int, Session] = {}

    # ------------------------------------------------------------------ claims

    def claim(self, session: Session) -> tuple[str, int, int]:
        """``session``'s record, taken on first use: ``(path, offset, token)``.

        Raises:
            PreconditionError: the service keeps no shared memory (``shm_dir`` "").
            OverLimitError: every record is taken.
        """
        if session.closed:
            raise PreconditionError("the session has ended")
        record = self._of.get(session.tag)
        if record is None:
            record = self._take(session.tag)
            self._of[session.tag] = record
        return self._path, record * RECORD.size, session.tag

    def _take(self, token: int) -> int:
        fd = self._open()
        for i, record in enumerate(self._free):
            # A worker of the record's last session may still sit between its lock and
            # its read (stopped): that record waits for a later claim.
            if self._set(fd, record, token):
                del self._free[i]
                return record
        if self._next < self.capacity:
            record, self._next = self._next, self._next + 1
            if self._set(fd, record, token):
                return record
            self._free.append(record)  # somebody locks records at random: try it later
        raise OverLimitError(
            f"all {self.capacity} write fences are taken (one per "
            "session that writes through the mapped pool, up to "
            "server.max_sessions); write through WriteKV",
            "max_sessions",
        )

    def _open(self) -> int:
        if self._fd is not None:
            return self._fd
        factory = self._shared.factory(FENCE_FILE, "cpu")
        if factory is None:
            raise PreconditionError(
                "this service keeps its pools in private memory "
                "(shm_dir is empty): there is no write fence; "
                "write through WriteKV"
            )
        self._buffer = factory((self.capacity,), torch.int64)
        handle = self._shared.handle(pb.BUFFER_ROLE_UNSPECIFIED, 0, self._buffer)
        if handle is None:  # cannot happen: the factory's buffers are its own files
            raise PreconditionError("the write fence file cannot be described")
        self._path = handle.shm_path
        self._fd = os.open(self._path, os.O_RDWR | os.O_CLOEXEC)
        return self._fd

    # ---------------------------------------------------------------- endings

    def end(self, session: Session) -> bool:
        """``session`` ended: True if its slots may be freed now; False if a worker
        holds its record (the slots wait: ``settle``)."""
        record = self._of.pop(session.tag, None)
        if record is None or self._fd is None:
            return True
        os.pwrite(self._fd, RECORD.pack(_FREE), record * RECORD.size)
        if self._set(self._fd, record, _FREE):
            self._free.append(record)
            return True
        self._waiting[record] = session
        log.warning(
            "a worker is copying into the slots of an ended session through "
            "the mapped pool: they are freed once it is done or gone",
            extra={"session": session.id[:8], "client": session.name},
        )
        return False

    def holder(self, session: Session) -> Session | None:
        """Who takes the slots ``session`` frees: None (the free list) unless a worker
        holds its record now; then the record's holder, until ``settle``."""
        record = self._of.get(session.tag)
        if record is None or self._fd is None or not self._locked(self._fd, record):
            return None
        held = self._holders.get(record)
        if held is None:
            held = self._holders[record] = Session(
                id=f"fenced-{session.id[:8]}",
                tag=-(record + 2),
                name=session.name,
                ttl=None,
                expires_at=float("inf"),
                client=session.client,
            )
            log.warning(
                "a session freed slots a worker may still be copying into "
                "through the mapped pool: they are freed once it is done or gone",
                extra={"session": session.id[:8], "client": session.name},
            )
        return held

    def settle(self) -> list[Session]:
        """The ended sessions and holders whose workers let go of their records since
        the last call: their slots may be freed now."""
        if (not self._waiting and not self._holders) or self._fd is None:
            return []
        out = []
        for record, session in list(self._waiting.items()):
            if self._set(self._fd, record, _FREE):
                del self._waiting[record]
                self._free.append(record)
                out.append(session)
        for record, held in list(self._holders.items()):
            if record not in self._waiting and not self._locked(self._fd, record):
                del self._holders[record]
                out.append(held)
        return out

    def waiting(self) -> list[Session]:
        """Ended sessions and holders whose slots wait for a worker."""
        return [*self._waiting.values(), *self._holders.values()]

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    # --------------------------------------------------------------- records

    @staticmethod
    def _locked(fd: int, record: int) -> bool:
        """Whether a worker holds ``record`` now: one ``F_OFD_GETLK``, never waiting."""
        got = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_WRLCK, record * RECORD.size))
        return struct.unpack_from("@h", got)[0] != fcntl.F_UNLCK

    @staticmethod
    def _set(fd: int, record: int, value: int) -> bool:
        """Write ``value`` into ``record`` under the exclusive lock, if it can be taken
        now (False: a worker holds the record)."""
        start = record * RECORD.size
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK, start))
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):  # a worker holds it
                return False
            raise
        try:
            os.pwrite(fd, RECORD.pack(value), start)
        finally:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK, start))
        return True


def reply(fences: WriteFences, session: Session, epoch: int) -> pb.WriteFenceResponse:
    """The ``WriteFence`` answer for ``session``."""
    path, offset, token = fences.claim(session)
    return pb.WriteFenceResponse(
        shm_path=path, offset_bytes=offset, token=token, server_epoch=epoch
    )


def quiesce(path: str, wait: float) -> bool:
    """End every fence of a dead service's fence file at ``path``: write 0 into each
    record, then wait up to ``wait`` seconds for an exclusive lock on the whole file.
    True once taken (no worker is inside a copy, and every later one reads 0 and
    copies nothing); False when a worker still holds its record (running, or stopped)."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        os.pwrite(fd, bytes(size - size % RECORD.size), 0)
        whole = struct.pack("@hhqqi", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0) + bytes(4)
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.fcntl(fd, fcntl.F_OFD_SETLK, whole)
                return True
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
    finally:
        os.close(fd)
