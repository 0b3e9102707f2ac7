"""Who is at the other end of the unix socket: the kernel's word, not the client's.

gRPC names a unix-socket caller ``unix:`` and nothing more (it reads no
``SO_PEERCRED``, and its local credentials check none), so every local worker would
look alike, and a client_name is whatever the client says. So the service accepts the
socket's connections itself, in a relay process of its own (``UnixPeerRelay``): it reads
each connection's peer credentials (``SO_PEERCRED``: the uid and pid the kernel
recorded at ``connect``), connects to gRPC's own socket (in a private 0700 directory)
from a socket bound to a name that carries them, and splices the two together
(``os.splice``, kernel to kernel: no byte passes through Python). gRPC reports that
bound name as the call's peer (``unix:<dir>/<uid>.<pid>.<n>``), and ``credentials``
reads uid and pid back from it, for this process's relays only: nobody else can bind a
name in their directories.

A process, not a thread: a thread would need the interpreter lock that the service's
event loop holds while it works, and every relayed message would wait for the loop's
turn to end. One selector moves every connection's bytes (non-blocking splices through
a pipe per direction), so a connection costs file descriptors, not threads; a side
that stops reading stops the relay reading the other side, so gRPC's flow control
holds. The relay ignores the signals that stop the service (the service drains
through it), ends when the service closes its lifeline pipe or dies, and is started
again if it dies first. A peer in another pid namespace (another container of the
pod) has pid 0: there only its uid tells it apart.

This module imports the standard library only: the relay process runs it as a script.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import select
import selectors
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time

log = logging.getLogger("prefixcache.server")

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_FLAGS = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
# Bytes a pipe holds between the two sides (F_SETPIPE_SZ; the kernel's default if refused).
_PIPE_BYTES = 1 << 20
_F_SETPIPE_SZ = 1031
# When accept runs out of file descriptors, the listener rests this long before trying
# again, instead of spinning on a socket that stays readable.
_REST = 0.1
# A relay that died is started again after this long (logged each time).
_RESTART_AFTER = 0.5
# How long a starting relay may take to say it accepts (an interpreter's start, on a
# loaded machine).
_READY_WITHIN = 30.0
_SUN_PATH = 107  # bytes of a unix socket path, less its terminating NUL
_LONGEST_NAME = "prefixcache-peers-xxxxxxxx/4294967295.4294967295.18446744073709551615"
# What stops the service does not stop the relay: the service drains through it.
_IGNORED = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)

# The relays' directories in this process: a peer named under one of them was bound by
# its relay (``credentials``).
_DIRECTORIES: set[str] = set()


def credentials(peer: str) -> tuple[int, int] | None:
    """The (uid, pid) of a gRPC peer that came through a relay of this process; None for
    any other peer."""
    if not peer.startswith("unix:"):
        return None
    folder, _, name = peer[5:].rpartition("/")
    if folder not in _DIRECTORIES:
        return None
    parts = name.split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


class UnixPeerRelay:
    """The service's side: the socket clients connect to, and the relay process.

    Args:
        path: The socket the clients connect to (bound here, with ``mode``).
        mode: Its file mode.

    Attributes:
        inner: Where gRPC must listen (in the private directory).
    """

    def __init__(self, path: str, mode: int) -> None:
        base = tempfile.gettempdir()
        if len(os.path.join(base, _LONGEST_NAME)) > _SUN_PATH:
            base = "/tmp"
        self.directory = tempfile.mkdtemp(prefix="prefixcache-peers-", dir=base)  # 0700
        self.inner = os.path.join(self.directory, "grpc.sock")
        self.path = path
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o777 & ~mode)  # no window with a looser mode
        try:
            self._listener.bind(path)
            os.chmod(path, mode)
        except OSError:
            self._listener.close()
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        finally:
            os.umask(old)
        _DIRECTORIES.add(self.directory)
        self._proc: subprocess.Popen[bytes] | None = None
        self._lifeline = -1  # the write end; the relay ends when it closes
        self._lock = threading.Lock()  # the watcher and close() both end lifelines
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None
        self.restarts = 0

    def start(self) -> None:
        """Accept connections (gRPC must listen on ``inner`` by now)."""
        self._listener.listen(socket.SOMAXCONN)
        self._spawn()
        self._watcher = threading.Thread(target=self._watch, name="unix-peer-relay", daemon=True)
        self._watcher.start()

    def _spawn(self) -> None:
        """Start the relay process; return once it accepts (so the first call after the
        service's start is not left waiting for an interpreter to start).

        Raises:
            OSError: it could not be started, or did not say it was ready in time.
        """
        read, self._lifeline = os.pipe2(os.O_CLOEXEC)
        ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
        listener = self._listener.fileno()
        try:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    "-S",
                    os.path.abspath(__file__),
                    str(listener),
                    str(read),
                    str(ready_w),
                    self.inner,
                    self.directory,
                ],
                pass_fds=(listener, read, ready_w),
                stdin=subprocess.DEVNULL,
                close_fds=True,
                start_new_session=True,
            )  # a terminal's ^C: the service's
        finally:
            os.close(read)
            os.close(ready_w)
        try:
            ready, _, _ = select.select([ready_r], [], [], _READY_WITHIN)
            if not ready or os.read(ready_r, 1) != b"r":
                raise OSError(
                    f"the unix socket's relay process did not start within {_READY_WITHIN:.0f} s"
                )
        finally:
            os.close(ready_r)

    def _watch(self) -> None:
        while True:
            proc = self._proc
            if proc is None:
                return
            code = proc.wait()
            if self._closing.is_set():
                return
            self._cut_lifeline()
            log.error(
                "the unix socket's relay process exited; starting it again",
                extra={"exit_code": code, "listen": self.path},
            )
            if self._closing.wait(_RESTART_AFTER):
                return
            with self._lock:
                if self._closing.is_set():
                    return
                self.restarts += 1
                try:
                    self._spawn()
                except OSError as exc:  # tried again after the pause
                    log.error(
                        "the unix socket's relay process could not be started",
                        extra={"error": str(exc), "listen": self.path},
                    )

    def _cut_lifeline(self) -> None:
        with self._lock:
            if self._lifeline >= 0:
                os.close(self._lifeline)
                self._lifeline = -1

    def close(self) -> None:
        """End the relay (cutting what it still relays), remove the socket and the
        private directory."""
        self._closing.set()
        self._cut_lifeline()
        proc = self._proc
        if proc is not None:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._watcher is not None:
            self._watcher.join(5)
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)
        _DIRECTORIES.discard(self.directory)
        shutil.rmtree(self.directory, ignore_errors=True)


# ------------------------------------------------------------------ the relay process


class _Direction:
    """Bytes from one side to the other, through a pipe."""

    __slots__ = ("dst", "eof", "held", "pipe_r", "pipe_w", "shut", "src")

    def __init__(self, src: socket.socket, dst: socket.socket) -> None:
        self.src, self.dst = src, dst
        self.pipe_r, self.pipe_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        with contextlib.suppress(OSError):  # above /proc/sys/fs/pipe-max-size: default
            fcntl.fcntl(self.pipe_w, _F_SETPIPE_SZ, _PIPE_BYTES)
        self.held = 0  # bytes in the pipe, not yet written to dst
        self.eof = False  # src has ended (dst's write side is shut once the pipe drains)
        self.shut = False

    def pump(self) -> None:
        """Move at most one pipe's worth now (a connection moving megabytes must not
        keep the others waiting: the selector comes back to it); OSError when a side is
        gone."""
        if not self.held and not self.eof:
            try:
                moved = os.splice(self.src.fileno(), self.pipe_w, _PIPE_BYTES, flags=_FLAGS)
            except BlockingIOError:
                moved = -1
            if moved == 0:
                self.eof = True
            elif moved > 0:
                self.held = moved
        while self.held:
            try:
                self.held -= os.splice(self.pipe_r, self.dst.fileno(), self.held, flags=_FLAGS)
            except BlockingIOError:
                return
        if self.eof and not self.shut:
            self.shut = True
            with contextlib.suppress(OSError):
                self.dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        os.close(self.pipe_r)
        os.close(self.pipe_w)


class _Connection:
    """A client's connection and the relay's connection to gRPC for it."""

    __slots__ = ("client", "down", "server", "up")

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client, self.server = client, server
        self.up = _Direction(client, server)
        try:
            self.down = _Direction(server, client)
        except OSError:
            self.up.close()
            raise

    def done(self) -> bool:
        return self.up.eof and self.down.eof and not self.up.held and not self.down.held

    def events(self, sock: socket.socket) -> int:
        """What to wait for on ``sock``: reading while the pipe it feeds is drained and
        open, writing while the pipe to it holds bytes."""
        out, into = (self.up, self.down) if sock is self.client else (self.down, self.up)
        mask = selectors.EVENT_READ if not out.eof and not out.held else 0
        return mask | (selectors.EVENT_WRITE if into.held else 0)

    def close(self) -> None:
        self.up.close()
        self.down.close()
        self.client.close()
        self.server.close()


class _Relay:
    """The relay process's loop: accept, connect to gRPC under the peer's name, splice."""

    def __init__(self, listener: socket.socket, lifeline: int, inner: str, directory: str) -> None:
        self.listener, self.lifeline = listener, lifeline
        self.inner, self.directory = inner, directory
        listener.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ)
        self.selector.register(lifeline, selectors.EVENT_READ)
        self.connections: dict[socket.socket, _Connection] = {}
        self.registered: dict[socket.socket, int] = {}
        self.serial = 0
        self.resting_until = 0.0

    def run(self) -> None:
        while True:
            timeout = None
            if self.resting_until:
                timeout = self.resting_until - time.monotonic()
                if timeout <= 0:
                    self.resting_until, timeout = 0.0, None
                    self.selector.register(self.listener, selectors.EVENT_READ)
            for key, _ in self.selector.select(timeout):
                sock = key.fileobj
                if sock is self.listener:
                    self.accept()
                elif sock == self.lifeline:  # the service closed it, or died
                    return
                else:
                    conn = self.connections.get(sock)  # type: ignore[call-overload]
                    if conn is not None:
                        self.serve(conn)

    def accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self.selector.unregister(self.listener)
                    self.resting_until = time.monotonic() + _REST
                    return
                continue  # the peer left before it was accepted
            try:
                server = self.connect(client)
            except OSError:
                client.close()
                continue
            try:
                conn = _Connection(client, server)
            except OSError:
                client.close()
                server.close()
                continue
            client.setblocking(False)
            server.setblocking(False)
            self.connections[client] = self.connections[server] = conn
            self.update(conn)

    def connect(self, client: socket.socket) -> socket.socket:
        pid, uid, _ = _UCRED.unpack(
            client.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        )
        self.serial += 1
        name = os.path.join(self.directory, f"{uid}.{pid}.{self.serial}")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            server.bind(name)
            try:
                server.settimeout(5.0)  # gRPC accepts at once; only a full backlog waits
                server.connect(self.inner)
            finally:
                os.unlink(name)  # the socket keeps its name; the file is not needed
        except OSError:
            server.close()
            raise
        return server

    def serve(self, conn: _Connection) -> None:
        try:
            conn.up.pump()
            conn.down.pump()
        except OSError:  # one side reset or went away: cut the other too
            self.drop(conn)
            return
        if conn.done():
            self.drop(conn)
        else:
            self.update(conn)

    def update(self, conn: _Connection) -> None:
        for sock in (conn.client, conn.server):
            mask, was = conn.events(sock), self.registered.get(sock, 0)
            if mask == was:
                continue
            if not was:
                self.selector.register(sock, mask)
            elif not mask:
                self.selector.unregister(sock)
            else:
                self.selector.modify(sock, mask)
            if mask:
                self.registered[sock] = mask
            else:
                del self.registered[sock]

    def drop(self, conn: _Connection) -> None:
        for sock in (conn.client, conn.server):
            if self.registered.pop(sock, 0):
                self.selector.unregister(sock)
            self.connections.pop(sock, None)
        conn.close()

    def close(self) -> None:
        for conn in set(self.connections.values()):
            self.drop(conn)
        self.selector.close()


def _main(argv: list[str]) -> int:
    for signum in _IGNORED:
        signal.signal(signum, signal.SIG_IGN)
    listener_fd, lifeline, ready = int(argv[0]), int(argv[1]), int(argv[2])
    relay = _Relay(socket.socket(fileno=listener_fd), lifeline, argv[3], argv[4])
    os.write(ready, b"r")
    os.close(ready)
    try:
        relay.run()
    finally:
        relay.close()
        # The service closed the lifeline, or died: a killed one leaves the directory.
        shutil.rmtree(argv[4], ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
