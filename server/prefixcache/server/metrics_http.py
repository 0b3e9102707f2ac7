"""The /metrics HTTP endpoint: one thread, a bounded number of connections, a token.

prometheus_client's own server starts a thread per connection and keeps it while the
connection is open: 1000 idle connections made 1010 threads, and the endpoint bound
0.0.0.0 by default with no way to ask for a token. This one runs an asyncio loop on a
single thread of its own (never the service's loop: a scrape must not take turns from
the RPCs), so an idle connection costs a socket and a coroutine, and:

* at most ``max_connections`` are open at once; one more closes the connection that has
  waited longest for a request, or, when every one is busy answering, is closed itself;
* a connection that sends no complete request within ``idle_timeout`` is closed, so
  neither a slow sender nor an idle keep-alive holds its place;
* with a ``token``, a scrape needs ``Authorization: Bearer <token>`` (401 otherwise).

The exposition itself is prometheus_client's (text, or OpenMetrics when asked for).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import threading
import time
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

log = logging.getLogger("prefixcache.server")

MAX_CONNECTIONS = 64
IDLE_TIMEOUT = 10.0  # seconds to send a whole request, first or next on a connection
MAX_HEAD_BYTES = 8192  # request line and headers


class MetricsHttpServer:
    """Serves ``registry`` at ``/metrics`` (and ``/``) on ``host:port`` once started."""

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str,
        port: int,
        token: str | None = None,
        max_connections: int = MAX_CONNECTIONS,
        idle_timeout: float = IDLE_TIMEOUT,
    ) -> None:
        self.registry = registry
        self.host = host
        self.port = port
        self.token = token.encode() if token else None
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        # Open connections: writer -> monotonic time it began waiting for a request, or
        # None while one is being answered.
        self._conns: dict[asyncio.StreamWriter, float | None] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None

    def start(self) -> int:
        """Bind (an OSError when the address is taken or not ours) and serve on a
        thread of its own; returns the bound port."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.create_server((self.host, self.port), family=family, backlog=128)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        # The loop is made and run on the thread: start() is called from the service's
        # own running loop, where another loop cannot be run, not even to set up.
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(self._handle, sock=sock, limit=MAX_HEAD_BYTES)
                )
            except BaseException as exc:  # handed to start()
                failed.append(exc)
                sock.close()
                return
            finally:
                ready.set()
            loop.run_forever()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="prefixcache-metrics", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            self._thread.join()
            self._loop = self._thread = None
            loop.close()
            raise failed[0]
        return self.port

    def close(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self._loop = self._thread = None

        async def shut() -> None:
            if self._server is not None:
                self._server.close()
            for writer in list(self._conns):
                writer.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            loop.stop()

        loop.call_soon_threadsafe(lambda: loop.create_task(shut()))
        thread.join(10)
        if not thread.is_alive():
            loop.close()

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    def _admit(self, writer: asyncio.StreamWriter) -> bool:
        if len(self._conns) < self.max_connections:
            return True
        waiting = [(since, w) for w, since in self._conns.items() if since is not None]
        if not waiting:
            return False  # every connection is being answered: this one waits its turn
        _, oldest = min(waiting, key=lambda item: item[0])
        self._conns.pop(oldest, None)
        oldest.close()
        return True

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._admit(writer):
            writer.close()
            return
        self._conns[writer] = time.monotonic()
        try:
            while writer in self._conns:
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.idle_timeout)
                except (
                    TimeoutError,
                    asyncio.IncompleteReadError,
                    asyncio.LimitOverrunError,
                    ConnectionError,
                ):
                    return
                self._conns[writer] = None
                # A client that does not read its reply holds its place no longer.
                try:
                    keep = await asyncio.wait_for(self._answer(head, writer), self.idle_timeout)
                except TimeoutError:
                    return
                if not keep or writer not in self._conns:
                    return
                self._conns[writer] = time.monotonic()
        except ConnectionError:
            return
        finally:
            self._conns.pop(writer, None)
            writer.close()

    async def _answer(self, head: bytes, writer: asyncio.StreamWriter) -> bool:
        """Write the reply to one request; whether the connection may stay open."""
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            await self._send(writer, 400, b"bad request\n", "text/plain", False)
            return False
        method, target, version = parts
        connection = headers.get("connection", "").lower()
        keep = connection != "close" if version == "HTTP/1.1" else connection == "keep-alive"
        if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
            await self._send(writer, 400, b"no request body expected\n", "text/plain", False)
            return False
        if method not in ("GET", "HEAD"):
            await self._send(
                writer, 405, b"GET or HEAD\n", "text/plain", keep, extra="Allow: GET, HEAD\r\n"
            )
            return keep
        if self.token is not None and not self._authorized(headers.get("authorization")):
            await self._send(
                writer,
                401,
                b"bearer token required\n",
                "text/plain",
                keep,
                extra='WWW-Authenticate: Bearer realm="prefixcache"\r\n',
            )
            return keep
        if urlsplit(target).path not in ("/metrics", "/"):
            await self._send(writer, 404, b"not found; try /metrics\n", "text/plain", keep)
            return keep
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        try:
            body = encoder(self.registry)
        except Exception:  # a collector's bug: the scrape fails, the endpoint stays up
            log.exception("metrics: collecting failed")
            await self._send(writer, 500, b"collecting failed\n", "text/plain", False)
            return False
        await self._send(
            writer, 200, b"" if method == "HEAD" else body, content_type, keep, length=len(body)
        )
        return keep

    def _authorized(self, value: str | None) -> bool:
        if value is None or self.token is None:
            return False
        scheme, _, credentials = value.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            credentials.strip().encode(), self.token
        )

    @staticmethod
    async def _send(
        writer: asyncio.StreamWriter,
        status: int,
        body: bytes,
        content_type: str,
        keep: bool,
        extra: str = "",
        length: int | None = None,
    ) -> None:
        reason = {
            200: "OK",
            400: "Bad Request",
            401: "Unauthorized",
            404: "Not Found",
            405: "Method Not Allowed",
            500: "Internal Server Error",
        }[status]
        head = (
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body) if length is None else length}\r\n{extra}"
            f"Connection: {'keep-alive' if keep else 'close'}\r\n\r\n"
        )
        writer.write(head.encode("latin-1") + body)
        await writer.drain()  # bounded: the caller's wait_for
