"""``prefixcache serve`` as a process: the server started, and on SIGTERM, SIGINT, SIGHUP
or another stop signal (signals.py) drained within the grace period, its files removed,
exit code 0. A second stop signal cuts the drain short: the calls still in flight are
cancelled, and the files are removed all the same."""

from __future__ import annotations

import asyncio
import logging
import signal

from .app import PrefixCacheServer
from .config import Config
from .signals import STOP_SIGNALS, SignalLatch

log = logging.getLogger("prefixcache.server")


async def _serve(config: Config, latch: SignalLatch) -> int:
    # Until the loop's handlers are in place, the latch only records a stop signal; it is
    # checked before the pools are made and again after (signals.py explains why).
    if latch.received is not None:
        log.info("stopped before start", extra={"signal": latch.received.name})
        return 0
    server = PrefixCacheServer(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if not stop.is_set():
            log.info("stop signal", extra={"signal": sig.name})
            stop.set()
        else:  # an operator who does not want to wait out the grace period
            log.warning("second stop signal: cutting the drain short", extra={"signal": sig.name})
            server.hurry()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    if latch.received is not None:
        on_signal(latch.received)
        # Nothing bound yet: only the pools to free (or, warm, to keep: nothing was
        # served, so what was restored is still exactly what the snapshot said).
        keep = server.warm.save(server.service) if server.warm is not None else frozenset()
        server.service.close(keep)
        log.info("stopped before start")
        return 0
    await server.start()
    waiter = asyncio.create_task(server.wait())
    await asyncio.wait(
        [asyncio.create_task(stop.wait()), waiter], return_when=asyncio.FIRST_COMPLETED
    )
    await server.stop()
    waiter.cancel()
    return 0


def serve(config: Config, latch: SignalLatch | None = None) -> int:
    """Run the service until a stop signal (signals.py); returns the exit code, 0.

    ``latch``: installed early by the caller, so that a signal during imports is kept;
    without one, stop signals are caught from here on.
    """
    if latch is None:
        latch = SignalLatch()
        latch.install()
    return asyncio.run(_serve(config, latch))
