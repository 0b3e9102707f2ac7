"""Which signals stop the server, and how one that arrives during start-up is kept.

Every catchable signal whose default action ends the process stops the server the
same way: drain in-flight calls within the grace period, remove the socket and the
shared-memory files, exit 0. A second one (an operator's second Ctrl-C) cuts the drain
short: what is still in flight is cancelled, and the files are removed all the same.
SIGHUP is no reload (the config is read once); SIGQUIT, SIGUSR1 and friends would
otherwise kill it mid-call and leave its files behind.

Python's own defaults apply until ``SignalLatch.install`` runs, which ``prefixcache
serve`` does first, before the slow imports. From then until the event loop takes the
signals over, a signal is only recorded: start-up then stops at its next checkpoint
and cleans up, instead of dying of it (exit -15) with half-made pools. Imports only
the standard library, so that it can be installed before torch loads. A signal in the
few tens of milliseconds before that still ends the process by default: nothing has
been made yet that could be left behind.
"""

from __future__ import annotations

import signal
from types import FrameType

# Not the faults (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT: the process is broken, the
# default is right), not SIGPIPE or SIGXFSZ (Python ignores them), not the real-time
# signals (nobody sends them by accident, and libraries may use them).
_NAMES = (
    "SIGTERM",
    "SIGINT",
    "SIGHUP",
    "SIGQUIT",
    "SIGUSR1",
    "SIGUSR2",
    "SIGALRM",
    "SIGVTALRM",
    "SIGPROF",
    "SIGXCPU",
    "SIGIO",
    "SIGPWR",
    "SIGSTKFLT",
)
STOP_SIGNALS: tuple[signal.Signals, ...] = tuple(
    dict.fromkeys(getattr(signal, name) for name in _NAMES if hasattr(signal, name))
)


class SignalLatch:
    """Records the first stop signal while nothing can act on it yet."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None

    def install(self) -> None:
        """Catch every stop signal from now on (main thread only)."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._record)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)
