"""Long read-only calls take turns, slice by slice and client by client.

Explain and ExistsPages may name a 1M-token prompt, and do that much work on the one
event loop that runs every cache operation: eight of them in parallel, each in one go,
would make every other client wait for all eight (a prefill then takes tens of times
as long). Their work goes in slices (page_rpcs.SLICE pages, or a whole Explain),
and each slice waits for its turn here: one long slice runs at a time, every other call
(a Match, an Insert) runs between two of them, and the turns go round the clients that
wait, so one client's flood gets one slice per round, however many calls it sends, and
another client's small call waits for at most one slice of each. A client is what it
cannot choose (``tenants.client_identity``, or its session's client).

A client has at most ``PER_CLIENT`` such calls admitted, running or waiting; one more is
refused at once, RESOURCE_EXHAUSTED (``long_calls_per_client``), before it does any work:
what waiting calls hold (their requests, up to 32 MiB each) stays bounded per client.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from ..errors import OverLimitError

# Long calls one client may have admitted (running or waiting) at once.
PER_CLIENT = 8
LIMIT = "long_calls_per_client"


class Turn:
    """One admitted call's turns: ``await next()`` before each slice of its work."""

    __slots__ = ("client", "holding", "turns")

    def __init__(self, turns: Turns, client: str) -> None:
        self.turns = turns
        self.client = client
        self.holding = False

    async def next(self) -> None:
        """Wait for this call's next slice (the loop runs other calls meanwhile)."""
        self.turns._release(self)
        # Always a loop turn: a turn granted at once would not yield (a done future's
        # await does not), and the slices would run back to back.
        await asyncio.sleep(0)
        await self.turns._wait(self)


class Turns:
    """The turns of long calls (see the module docstring)."""

    def __init__(self, per_client: int = PER_CLIENT) -> None:
        self.per_client = per_client
        self.admitted: dict[str, int] = {}
        # Clients with a slice waiting, in the order their turns come; each with its
        # calls' waiting futures, first come first served.
        self._waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()
        self._busy = False  # a slice holds the turn
        self._last = ""  # the client the turn went to last
        self.granted = 0  # turns given (slices run)
        self.refused = 0

    @asynccontextmanager
    async def admit(self, client: str) -> AsyncIterator[Turn]:
        """Admit a call of ``client``.

        Raises:
            OverLimitError: ``client`` has ``per_client`` calls admitted already.
        """
        held = self.admitted.get(client, 0)
        if held >= self.per_client:
            self.refused += 1
            raise OverLimitError(
                f"this client has {held} long calls (Explain, ExistsPages) admitted, the most "
                f"one client may have at once ({self.per_client}): wait for their answers",
                LIMIT,
            )
        self.admitted[client] = held + 1
        turn = Turn(self, client)
        try:
            yield turn
        finally:
            self._release(turn)
            left = self.admitted[client] - 1
            if left:
                self.admitted[client] = left
            else:
                del self.admitted[client]

    def waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    async def _wait(self, turn: Turn) -> None:
        future = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(turn.client, deque()).append(future)
        self._grant()
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # granted, never taken
                self._busy = False
                self._grant()
            else:
                self._forget(turn.client, future)
            raise
        turn.holding = True

    def _release(self, turn: Turn) -> None:
        if turn.holding:
            turn.holding = False
            self._busy = False
            self._grant()

    def _grant(self) -> None:
        """Give the turn to the next client's first waiting slice, if it is free."""
        while not self._busy and self._waiting:
            clients = iter(self._waiting)
            client = next(clients)
            if client == self._last and len(self._waiting) > 1:
                client = next(clients)  # one that came meanwhile goes first
            queue = self._waiting[client]
            future = queue.popleft()
            if queue:
                self._waiting.move_to_end(client)  # its next slice waits for the others'
            else:
                del self._waiting[client]
            if not future.done():  # a cancelled waiter is passed over
                self._busy, self._last = True, client
                self.granted += 1
                future.set_result(None)

    def _forget(self, client: str, future: asyncio.Future[None]) -> None:
        queue = self._waiting.get(client)
        if queue is None:
            return
        try:
            queue.remove(future)
        except ValueError:
            return
        if not queue:
            del self._waiting[client]
