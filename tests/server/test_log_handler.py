"""The non-blocking log handler: a stuck sink costs records (counted), never time."""

from __future__ import annotations

import io
import json
import logging
import threading

from prefixcache.server.logs import JsonFormatter, NonBlockingHandler


class StuckSink(io.StringIO):
    """A sink whose writes wait until ``release`` is set (a pipe nobody reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.written = 0

    def write(self, text: str) -> int:
        self.release.wait(30)
        self.written += 1
        return super().write(text)


def test_a_stuck_sink_drops_and_counts_then_says_how_many() -> None:
    sink = StuckSink()
    handler = NonBlockingHandler(sink, capacity=5)
    handler.setFormatter(JsonFormatter())
    logger = logging.Logger("test.nonblocking")
    logger.addHandler(handler)
    for i in range(50):
        logger.warning("event", extra={"i": i})
    # All 50 calls returned while the sink's first write was still stuck: none waited.
    assert sink.written == 0 and not sink.release.is_set()
    assert 40 <= handler.dropped <= 45  # 5 queued, and maybe one in the writer's hands
    dropped = handler.dropped
    sink.release.set()
    handler.flush()
    lines = [json.loads(line) for line in sink.getvalue().splitlines()]
    assert [line["i"] for line in lines[:-1]] == sorted(line["i"] for line in lines[:-1])
    assert len(lines) == 50 - dropped + 1
    summary = lines[-1]
    assert summary["event"].startswith("log records dropped")
    assert summary["level"] == "warning"
    assert summary["dropped_total"] == dropped == summary["dropped_since_last"]
    handler.close()
