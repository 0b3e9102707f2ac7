"""LocalOverlay: the pages a worker itself cached, visible in its shadow index at once.

The Subscribe stream tells a worker of its own inserts after the fact: a finished
request's insert is queued and sent with the next scheduling step's first call, and the
stream delivers the change after that, so without more the worker ranks the next step
(or two) as if its own pages were not cached, where an in-process cache would count
them. The overlay holds those pages meanwhile: a worker notes the pages of an insert
when it queues it (and of a match reply that found more than its shadow knew), and
drops what a reply says was not cached.

The stream stays the authority. Every change it delivers for a page ends that page's
overlay entry: a store confirms it (the replica has it now), a removal evicts it (an
entry never outlives an eviction the stream reports), a clear drops all. A snapshot
replaces the replica: entries it holds are confirmed, and entries noted before the
snapshot began may predate it, so they are dropped too (a miss until the stream
confirms, never a hit the service lost). Memory is bounded: past ``capacity`` entries
the oldest go first, a chain's deepest page before its first, so what remains is still
closed under prefixes (a match walks the chain and stops at the first miss).

Not thread-safe by itself: ``ShadowIndex`` calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping

Namespace = tuple[str | None, int]


class LocalOverlay:
    """Page keys by namespace that this worker cached and the stream has not confirmed.

    Attributes:
        capacity: most entries kept.
        generation: notes made so far (an entry keeps the generation of its last note).
        dropped: entries dropped to stay within ``capacity``.
    """

    def __init__(self, capacity: int = 65536) -> None:
        if capacity < 1:
            raise ValueError(f"an overlay's capacity must be >= 1, not {capacity}")
        self.capacity = capacity
        self.generation = 0
        self.dropped = 0
        self._keys: dict[Namespace, set[int]] = {}
        # Oldest first; a note adds a chain deepest page first (see the module docstring).
        self._order: OrderedDict[tuple[Namespace, int], int] = OrderedDict()

    def get(self, ns: Namespace) -> set[int] | None:
        """The overlay's keys in ``ns`` (None when it holds none); do not change it."""
        return self._keys.get(ns)

    def __len__(self) -> int:
        return len(self._order)

    def __bool__(self) -> bool:
        return bool(self._order)

    def pages(self) -> dict[Namespace, frozenset[int]]:
        return {ns: frozenset(keys) for ns, keys in self._keys.items()}

    def add(self, ns: Namespace, chain: list[int], stream: set[int] | None) -> None:
        """Note the keys of a chain of pages from its first (those ``stream``, the
        replica's keys in ``ns``, holds already are confirmed: left out)."""
        self.generation += 1
        gen, order = self.generation, self._order
        held = self._keys.get(ns)
        for key in reversed(chain):
            if stream is not None and key in stream:
                continue
            if held is None:
                held = self._keys[ns] = set()
            entry = (ns, key)
            if entry in order:
                order.move_to_end(entry)
            held.add(key)
            order[entry] = gen
        while len(order) > self.capacity:
            (old_ns, old), _ = order.popitem(last=False)
            self._drop_key(old_ns, old)
            self.dropped += 1

    def discard(self, ns: Namespace, keys: Iterable[int]) -> None:
        """End the entries of ``keys`` in ``ns`` (the stream told of them, or a reply said
        they were not cached)."""
        held = self._keys.get(ns)
        if not held:
            return
        order = self._order
        for key in keys:
            if key in held:
                held.discard(key)
                del order[(ns, key)]
        if not held:
            del self._keys[ns]

    def clear(self) -> None:
        self._keys.clear()
        self._order.clear()

    def after_snapshot(self, pages: Mapping[Namespace, set[int]], begun_at: int) -> None:
        """A snapshot replaced the replica with ``pages``; it began when the generation
        was ``begun_at``: keep only later notes of pages it does not hold."""
        for entry, gen in list(self._order.items()):
            ns, key = entry
            if gen <= begun_at or key in pages.get(ns, ()):
                del self._order[entry]
                self._drop_key(ns, key)

    def _drop_key(self, ns: Namespace, key: int) -> None:
        held = self._keys[ns]
        held.discard(key)
        if not held:
            del self._keys[ns]
