"""A large tree, and a victim that times its calls, for the tests of what one client or
ZMQ peer can make every other client wait (the event surfaces).

``grow_tree`` caches two-token prompts through the engine on the server's loop (one
node each, under a few hundred first tokens: the shape of a tree of many short
sessions), a chunk per loop turn, at about a tenth of the cost of doing it over gRPC.
``Victim`` is another client's calls, in a thread of its own. ``LoopWatch`` finds the
longest the server's loop spent in one callback, in its thread's CPU time: what a call
that does not yield holds every other call up by, told apart from the load other
processes put on a shared machine (which stretches a victim's wall-clock latency by as
much, whatever the server does). The tests assert both: the loop never held for long
(what fails on code that walks a whole tree in one turn), and every one of the victim's
calls answered within a generous deadline of its own (liveness), never a bound on how
long they took.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from types import TracebackType
from typing import Any

import grpc
from harness import ServerThread, pb, stub_for, toks

from prefixcache.cache import RadixKey

# Nodes the abuse tests' trees have: a whole-tree walk in one loop turn held the loop
# for 0.3-0.8 s here (the walk, and the full garbage collection its records set off).
# At 50k nodes that was 0.3 s, too close to what a loaded machine's noise can give a
# victim for a test to tell the two apart with a generous bound.
NODES = 100_000
# The most CPU time one loop callback may take while an attack runs: a few slices' worth
# (slices are ~4 ms), far below a whole walk of a NODES tree (0.2 s or more).
HELD = 0.1
# Each victim call's deadline while an attack runs: liveness only (a call never held
# for good behind it). On this shared 2-core machine at load 5-10 a victim's wall-clock
# latency is other processes' doing as much as the server's (1.9 s once, with no loop
# callback over 16 ms of CPU), so HELD is what tells a loop held by a whole-tree walk
# apart, and this deadline only a victim that is never answered.
VICTIM_DEADLINE = 10.0
_FANOUT = 512  # second tokens under each first token


def grow_tree(
    srv: ServerThread, model: str, nodes: int = NODES, first: int = 0, chunk: int = 4096
) -> None:
    """Cache ``nodes`` two-token prompts in ``model`` (page size 1), numbered from
    ``first``; each call to the loop caches ``chunk`` of them (one KV-event batch)."""
    engine = srv.service.engines[model]

    def grow(start: int, count: int) -> None:
        session = srv.service.open_session(600)
        slots, _ = engine.alloc(session, 2 * count)
        for i in range(count):
            n = start + i
            key = RadixKey([n // _FANOUT + 1, n % _FANOUT + 1])
            engine.insert(key, slots[2 * i : 2 * i + 2], session)
        srv.service.close_session(session)

    for start in range(first, first + nodes, chunk):
        srv.run(grow, start, min(chunk, first + nodes - start))


class Victim(threading.Thread):
    """Another client's calls (``call(stub)``, each with a ``VICTIM_DEADLINE``) until
    ``stop`` is set or one fails. Each call's seconds are kept, for the report only."""

    def __init__(self, address: str, call: Any = None) -> None:
        super().__init__(daemon=True)
        self.channel, self.stub = stub_for(address)
        self.call = call or (lambda stub: stub.Stats(pb.StatsRequest(), timeout=VICTIM_DEADLINE))
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                started = time.perf_counter()
                try:
                    self.call(self.stub)
                except grpc.RpcError as exc:
                    self.failures.append(f"{exc.code().name}: {exc.details()}")
                    return
                self.latencies.append(time.perf_counter() - started)
                time.sleep(0.005)
        finally:
            self.channel.close()

    def finish(self) -> int:
        """Stop; how many calls were answered. Fails the test if one was not (by its
        deadline or otherwise), or if the last never returned."""
        self.stop.set()
        self.join(VICTIM_DEADLINE + 30)
        assert not self.is_alive(), "a victim's call never returned"
        assert self.failures == [], f"a victim's call failed: {self.failures}"
        return len(self.latencies)

    def report(self) -> str:
        """The victim's calls, for the test's output."""
        worst = max(self.latencies, default=0.0)
        return f"worst victim call {worst:.3f} s over {len(self.latencies)} calls"


def match_call(model: str) -> Any:
    """A victim call: a Match of a short prompt."""
    prompt = toks(range(7, 71))
    return lambda stub: stub.Match(
        pb.MatchRequest(model=model, token_ids=prompt), timeout=VICTIM_DEADLINE
    )


class LoopWatch:
    """While entered: the most CPU time one callback of ``srv``'s loop took
    (``worst``, seconds) and what it was (``what``)."""

    def __init__(self, srv: ServerThread) -> None:
        self.loop = srv.loop
        self.worst = 0.0
        self.what = ""
        self._original: Any = None

    def __enter__(self) -> LoopWatch:
        # What earlier tests in this process left is collected now, and what lives on
        # (the tree, this process's test machinery) is kept out of the collections
        # during the watch: a full collection traces the whole process's heap, test
        # and all, and would hold the loop (and the GIL) by that, whatever the attack.
        gc.collect()
        gc.freeze()
        original = self._original = asyncio.Handle._run
        watch, loop = self, self.loop

        def run(handle: asyncio.Handle) -> None:
            if handle._loop is not loop:  # type: ignore[attr-defined]
                original(handle)
                return
            started = time.thread_time()
            try:
                original(handle)
            finally:
                took = time.thread_time() - started
                if took > watch.worst:
                    watch.worst, watch.what = took, _describe(handle)

        asyncio.Handle._run = run  # type: ignore[method-assign]
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        asyncio.Handle._run = self._original  # type: ignore[method-assign]
        gc.unfreeze()


def _describe(handle: asyncio.Handle) -> str:
    """A callback, by the coroutine of the task it steps where it is one."""
    task = getattr(getattr(handle, "_callback", None), "__self__", None)
    coro = task.get_coro() if isinstance(task, asyncio.Task) else None
    frame = getattr(coro, "cr_frame", None)
    if coro is not None:
        where = f" at line {frame.f_lineno}" if frame is not None else ""
        return f"task {getattr(coro, '__qualname__', coro)}{where}"
    return repr(handle)[:160]
