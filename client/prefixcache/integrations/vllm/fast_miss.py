"""Fast misses (``fast_miss``): a request the service surely holds nothing for is
answered "no hit" at its first probe, without a lookup.

Why. A lookup answers ``(None, False)`` first ("ask again"): the request waits a
scheduling step, and the round trip before the next, for nothing when it misses. On a
miss that step is all the connector costs the engine before the request's save.

How. The backend follows the service's page set in a shadow index (the Subscribe
stream, ``prefixcache.client.shadow``). Where the shadow is current and holds no whole
block of the prompt beyond what vLLM has itself, the request is a miss now: no call, no
lock, no step. A shadow that has no snapshot yet, is not connected, or knows it is
behind the service's change log answers nothing, and the request is looked up;
so does every request the shadow holds a block for (a hit needs the lookup's lock).

What it may cost. The shadow trails the service by the stream's delivery (a few
milliseconds): a prompt another engine saved within that window is computed again,
never loaded wrong. This engine's own saves are covered: from the moment an Insert
leaves until the shadow holds its tokens (or the Insert failed, or ``grace`` seconds
passed), no miss is answered from the shadow.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable

from .backend import SaveCommit

ShadowHit = Callable[[array, "str | None"], "int | None"]


class FastMiss:
    """Answers "certainly a miss" from the shadow index (see the module docstring).

    Args:
        shadow_hit: the backend's ``shadow_hit``: tokens the shadow holds, or None.
        block_size: vLLM's block size; hits are whole blocks.
        clock: seconds (monotonic).
        grace: seconds after which an own Insert the shadow never showed is given up
            (it was evicted before the stream told of it).
    """

    def __init__(
        self, shadow_hit: ShadowHit, block_size: int, clock: Callable[[], float], grace: float
    ) -> None:
        self._shadow_hit = shadow_hit
        self.block_size = block_size
        self._clock = clock
        self._grace = grace
        # This engine's Inserts the shadow may not show yet: id(op) -> (op, sent at).
        self._unseen: dict[int, tuple[SaveCommit, float]] = {}

    def certain(self, tokens: array, extra_key: str | None, num_computed: int) -> bool:
        """Whether the shadow holds no whole block of ``tokens`` beyond vLLM's own
        ``num_computed``; False when it cannot tell."""
        if self._unseen and not self._settle():
            return False
        cached = self._shadow_hit(tokens, extra_key)
        return cached is not None and cached // self.block_size * self.block_size <= num_computed

    def inserting(self, op: SaveCommit) -> None:
        """An Insert of this engine's leaves now."""
        self._unseen[id(op)] = (op, self._clock())

    def inserted(self, op: SaveCommit, ok: bool) -> None:
        """An Insert came back; one that inserted nothing is nothing to wait for."""
        if not ok:
            self._unseen.pop(id(op), None)

    def _settle(self) -> bool:
        """Forget the Inserts the shadow shows (or gave up on); True if none is left."""
        expired = self._clock() - self._grace
        for key, (op, sent) in list(self._unseen.items()):
            held = self._shadow_hit(op.tokens, op.extra_key)
            if sent < expired or (held is not None and held >= len(op.tokens)):
                del self._unseen[key]
        return not self._unseen
