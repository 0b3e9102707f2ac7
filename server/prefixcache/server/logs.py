"""Structured logs: one line per event, as text (key=value) or JSON.

Events pass their fields with ``extra={...}``; both formats print every such field, so
a log line can be grepped by people and parsed by machines.

Logging never blocks the service: a line is formatted by the caller and handed to a
writer thread through a bounded queue. A slow sink (stderr a pipe nobody reads, a
stalled log collector) fills the queue, and then records are dropped and counted
(``prefixcache_log_records_dropped_total``) instead of freezing the event loop, health
checks included, on a full pipe.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import sys
import threading
import time
from typing import TextIO

# Lines waiting for the sink; past this many, new records are dropped.
QUEUE_LINES = 10_000
# At exit, how long to wait for queued lines to reach a slow sink.
FLUSH_SECONDS = 2.0

# Attributes every LogRecord has; anything else on a record came from ``extra``.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def _fields(record: logging.LogRecord) -> dict[str, object]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD}


def _timestamp(record: logging.LogRecord) -> str:
    ms = int(record.msecs)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{ms:03d}Z"


class JsonFormatter(logging.Formatter):
    """``{"ts": ..., "level": ..., "logger": ..., "event": ..., <fields>}`` per line."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        line.update(_fields(record))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    """``<ts> <level> <event> key=value ...`` per line."""

    def format(self, record: logging.LogRecord) -> str:
        extra = " ".join(f"{k}={v}" for k, v in _fields(record).items())
        line = f"{_timestamp(record)} {record.levelname.lower():7s} {record.getMessage()}"
        line = f"{line} {extra}" if extra else line
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class NonBlockingHandler(logging.Handler):
    """Formats on the caller's thread, writes on its own: ``emit`` never waits on the sink.

    Attributes:
        dropped: Records dropped because the queue was full (or unformattable).
    """

    def __init__(self, stream: TextIO, capacity: int = QUEUE_LINES) -> None:
        super().__init__()
        self.stream = stream
        try:
            # The raw descriptor: a thread stuck writing a buffered stream holds its lock,
            # and the interpreter aborts at exit when it cannot flush that stream.
            self._fd: int | None = stream.fileno()
        except (AttributeError, OSError, ValueError):
            self._fd = None
        self._queue: queue.Queue[str | None] = queue.Queue(capacity)
        self.dropped = 0
        self._reported = 0
        self._thread = threading.Thread(target=self._run, name="prefixcache-log", daemon=True)
        self._thread.start()

    def emit(self, record: logging.LogRecord) -> None:
        # handle() holds self.lock around emit, so the counter needs no lock of its own.
        try:
            line = self.format(record)
        except Exception:
            self.dropped += 1  # handleError would print to the (maybe stuck) stderr
            return
        try:
            self._queue.put_nowait(line)
        except queue.Full:
            self.dropped += 1

    def flush(self) -> None:
        """Wait, at most FLUSH_SECONDS, for the queued lines to reach the sink."""
        deadline = time.monotonic() + FLUSH_SECONDS
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        # The writer ends after the lines before the sentinel; with a stuck sink the
        # queue may be full, and the daemon writer dies with the process instead.
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        super().close()

    def _run(self) -> None:
        while True:
            line = self._queue.get()
            try:
                if line is None:
                    return
                self._write(line)
                if self.dropped > self._reported and self._queue.empty():
                    self._report_drops()
            except Exception:
                pass  # a closed or broken sink: there is nowhere to say so
            finally:
                self._queue.task_done()

    def _report_drops(self) -> None:
        """Once the sink keeps up again, one line says how many records were lost."""
        dropped = self.dropped
        record = logging.makeLogRecord(
            {
                "name": "prefixcache.logs",
                "levelno": logging.WARNING,
                "levelname": "WARNING",
                "msg": "log records dropped: the log sink was too slow",
                "dropped_since_last": dropped - self._reported,
                "dropped_total": dropped,
            }
        )
        self._reported = dropped
        self._write(self.format(record))

    def _write(self, line: str) -> None:
        if self._fd is None:
            self.stream.write(line + "\n")
            self.stream.flush()
            return
        data = (line + "\n").encode("utf-8", "backslashreplace")
        while data:
            data = data[os.write(self._fd, data) :]


_handler: NonBlockingHandler | None = None


def dropped_records() -> int:
    """Log records dropped so far by the handler ``setup_logging`` installed."""
    return _handler.dropped if _handler is not None else 0


def setup_logging(fmt: str = "text", level: str = "info", queue_lines: int = QUEUE_LINES) -> None:
    """Send the ``prefixcache`` loggers to stderr in the chosen format, without blocking
    (at most ``queue_lines`` lines wait for a slow stderr; the rest are dropped).

    Other libraries' records (asyncio, grpc) go through the same handler when the root
    logger has none: Python's last-resort handler writes stderr directly, and would block.
    """
    global _handler
    handler = NonBlockingHandler(sys.stderr, queue_lines)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logger = logging.getLogger("prefixcache")
    root = logging.getLogger()
    old, _handler = _handler, handler
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False
    if old is not None and old in root.handlers:
        root.removeHandler(old)
    if not root.handlers:
        root.addHandler(handler)
    if old is not None:
        old.close()
