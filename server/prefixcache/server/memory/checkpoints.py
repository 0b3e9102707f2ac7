"""Checkpoints of the trees while serving (``server.warm_checkpoint_interval``), so that
a crash loses seconds of the cache, not all of it (warm_restart.py).

Every interval the trees are taken on the event loop (one pass over the nodes: no
token or slot is copied), the units that entered them since the last checkpoint are
sealed in slices of at most ``_SLICE`` seconds with the loop free between them, and
the file is written on a thread (the tree's bytes are immutable by then). The cost on
the loop is bounded twice over: per slice, and in all, since the next checkpoint waits
until the loop time of the last one is at most ``MAX_SHARE`` of the time between them.
A checkpoint that would not fit (``warm_checkpoint_max_bytes``, or the free space of
``shm_dir``) is skipped, logged and counted; the last one that fitted stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from prefixcache.cache import CacheError

from .warm_restart import WarmRestart

log = logging.getLogger("prefixcache.server")

_SLICE = 0.01  # seconds of sealing at a time on the loop
MAX_SHARE = 0.05  # of the loop's time, at most, over a checkpoint and the wait after it


class Checkpoints:
    """The checkpoint task of one server: ``start`` it once serving, ``close`` it
    before the stop's snapshot (it waits for a write in flight, so that no
    checkpoint lands over the snapshot)."""

    def __init__(self, warm: WarmRestart, service: Any, interval: float) -> None:
        self.warm = warm
        self.service = service
        self.interval = interval
        self._task: asyncio.Task[None] | None = None
        self._writing: asyncio.Future[int] | None = None
        self._closed = False
        self._logged_room = False

    def start(self, first: float | None = None) -> None:
        """Begin; the first checkpoint after ``first`` seconds (default: one interval)."""
        self._task = asyncio.create_task(self._run(self.interval if first is None else first))

    async def close(self) -> None:
        self._closed = True
        if self._writing is not None:  # a write on its thread cannot be cancelled
            with contextlib.suppress(Exception):
                await asyncio.shield(self._writing)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self, delay: float) -> None:
        while not self._closed:
            await asyncio.sleep(delay)
            if self._closed:
                return
            loop_seconds = await self.checkpoint()
            delay = max(self.interval, loop_seconds / MAX_SHARE)

    async def checkpoint(self) -> float:
        """Write one checkpoint; returns the seconds it took on the loop."""
        warm = self.warm
        why = warm.writable(self.service)
        if why is not None:
            return 0.0
        started = time.perf_counter()
        on_loop = 0.0
        try:
            capture = warm.capture(self.service)
            on_loop += time.perf_counter() - started
            while True:
                begun = time.perf_counter()
                done = warm.seal(self.service, capture, _SLICE)
                on_loop += time.perf_counter() - begun
                if done or self._closed:
                    break
                await asyncio.sleep(0)
            if self._closed:
                return on_loop
            begun = time.perf_counter()
            body = warm.body(self.service, capture, clean=False)
            on_loop += time.perf_counter() - begun
            del capture
            self._writing = asyncio.ensure_future(asyncio.to_thread(warm.write, self.service, body))
            size = await asyncio.shield(self._writing)
        except OSError as exc:
            outcome = "no_room" if exc.errno == 28 else "failed"
            warm.checkpoints[outcome] += 1
            if outcome == "failed" or not self._logged_room:
                self._logged_room = outcome == "no_room"
                log.warning(
                    "warm restart: a checkpoint was not written; a crash now "
                    "restores the last one written",
                    extra={"outcome": outcome, "reason": exc.strerror or str(exc)},
                )
            return on_loop
        except CacheError as exc:  # a Reset during the checkpoint: the next one
            log.info("warm restart: checkpoint abandoned", extra={"reason": str(exc)})
            return on_loop
        finally:
            self._writing = None
        warm.checkpoints["written"] += 1
        warm.checkpoint_bytes = size
        warm.checkpoint_seconds = on_loop
        self._logged_room = False
        log.debug(
            "warm restart: checkpoint written",
            extra={
                "bytes": size,
                "loop_seconds": round(on_loop, 4),
                "seconds": round(time.perf_counter() - started, 3),
            },
        )
        return on_loop
