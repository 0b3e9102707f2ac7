"""A large tree, and a victim that times its calls, for the tests of what one client or
ZMQ peer can make every other client wait (issue 21's event surfaces).

``grow_tree`` caches two-token prompts through the engine on the server's loop (one
node each, under a few hundred first tokens: the shape of a tree of many short
sessions), a chunk per loop turn, at about a tenth of the cost of doing it over gRPC.
``Victim`` is another client's calls, in a thread of its own, timed.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from harness import ServerThread, pb, stub_for, toks

from prefixcache.cache import RadixKey

# Nodes the abuse tests' trees have: a whole-tree walk in one loop turn held the loop
# for 0.3-0.8 s here (the walk, and the full garbage collection its records set off).
# At 50k nodes that was 0.3 s, too close to what a loaded machine's noise can give a
# victim for a test to tell the two apart with a generous bound.
NODES = 100_000
_FANOUT = 512  # second tokens under each first token


def grow_tree(srv: ServerThread, model: str, nodes: int = NODES, first: int = 0,
              chunk: int = 4096) -> None:
    """Cache ``nodes`` two-token prompts in ``model`` (page size 1), numbered from
    ``first``; each call to the loop caches ``chunk`` of them (one KV-event batch)."""
    engine = srv.service.engines[model]

    def grow(start: int, count: int) -> None:
        session = srv.service.open_session(600)
        slots, _ = engine.alloc(session, 2 * count)
        for i in range(count):
            n = start + i
            key = RadixKey([n // _FANOUT + 1, n % _FANOUT + 1])
            engine.insert(key, slots[2 * i:2 * i + 2], session)
        srv.service.close_session(session)

    for start in range(first, first + nodes, chunk):
        srv.run(grow, start, min(chunk, first + nodes - start))


class Victim(threading.Thread):
    """Another client's calls (``call(stub)``), timed, until ``stop`` is set."""

    def __init__(self, address: str, call: Any = None) -> None:
        super().__init__(daemon=True)
        self.channel, self.stub = stub_for(address)
        self.call = call or (lambda stub: stub.Stats(pb.StatsRequest(), timeout=30))
        self.latencies: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                started = time.perf_counter()
                self.call(self.stub)
                self.latencies.append(time.perf_counter() - started)
                time.sleep(0.005)
        finally:
            self.channel.close()

    def finish(self) -> float:
        """Stop; the worst call's seconds."""
        self.stop.set()
        self.join(30)
        return max(self.latencies, default=0.0)


def match_call(model: str) -> Any:
    """A victim call: a Match of a short prompt."""
    prompt = toks(range(7, 71))
    return lambda stub: stub.Match(pb.MatchRequest(model=model, token_ids=prompt), timeout=30)
