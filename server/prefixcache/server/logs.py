"""Structured logs: one line per event, as text (key=value) or JSON.

Events pass their fields with ``extra={...}``; both formats print every such field, so
a log line can be grepped by people and parsed by machines.
"""

from __future__ import annotations

import json
import logging
import sys
import time

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
        line: dict[str, object] = {"ts": _timestamp(record), "level": record.levelname.lower(),
                                   "logger": record.name, "event": record.getMessage()}
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


def setup_logging(fmt: str = "text", level: str = "info") -> None:
    """Send the ``prefixcache`` loggers to stderr in the chosen format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logger = logging.getLogger("prefixcache")
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False
