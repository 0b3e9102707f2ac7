"""HashPages: one model's pages looked up, read and stored by chained page hash.

What SGLang's HiCache storage backend asks of an L3 page store (ExistsPages, GetPages,
SetPages), answered from the model's tree: token pages through the page index (their
chained hashes, as ``hash_pages`` computes them, byte-identical to SGLang's), and
*hash pages*, stored by SetPages under a hash namespace of the same tree because SGLang
hands a page's KV and hash but never its tokens (``prefixcache.cache.index.page_index`` says
how and why). Every page a request names is looked up in the token namespace first,
then in its hash namespace.

* ``exists``: the leading run of pages held, and which are. It counts as a lookup in
  the model's query and hit tokens, so the service's hit ratio covers SGLang's.
* ``get``: the slots of the leading run, locked for the session with one lock per run
  of pages that lies on one tree path, so the worker can read them (ReadKV, or its
  attached pool) and unlock. Reading refreshes the pages' place in the eviction order.
* ``set`` (page_store.py, in slices): the session's slots (Alloc, then WriteKV or the
  attached pool) become the tree's hash pages. A page already held is not stored
  again and the session's slots for it are freed; a page the caller sends no slots for
  is reported missing. A run of new pages that follows a hash page is stored under it
  (one path, one lock, evicted from its end); one that follows a token page or
  nothing starts a path of its own.

Every check runs before anything changes. Radix models only (the page index needs the
model's eager page hashes: ``server.change_log_capacity > 0``).

Not thread-safe: called on the service's event loop, like the engine.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from prefixcache.cache import RadixKey
from prefixcache.cache.index.page_index import (
    PageIndex,
    hash_namespace,
    hash_page_width,
)
from prefixcache.cache.pools.allocator import host_indices

from ..errors import PreconditionError
from ..sessions.quotas import prefix_tokens
from ..sessions.session import Session
from .base import needs_session

Namespace = tuple[str | None, int]

# GetPages' pages looked at (or path pages walked) per slice of its plan.
SLICE = 4096


class PlannedRun(NamedTuple):
    """A run of a GetPages request's pages along one tree path: its namespace, the
    packed key from the root through its last page, that key's pages, the run's."""

    namespace: Namespace
    packed: bytes
    depth: int
    count: int


@dataclass(slots=True)
class GetOutcome:
    """The leading run of pages found: their slots (``page_size`` each) and the locks
    that protect them, for the session to release once it has read them."""

    found: int
    slots: np.ndarray
    lock_ids: list[int]


class HashPages:
    """The page-hash operations of one radix model (see the module docstring).

    Raises:
        PreconditionError: the model has no page index (not radix, or no page hashes).
    """

    def __init__(self, engine: Any) -> None:
        index = getattr(engine, "page_index", None)
        if index is None:
            raise PreconditionError(
                f"model {engine.name!r} cannot look pages up by hash: that needs a radix "
                "model with page hashes (server.change_log_capacity > 0)"
            )
        self.engine = engine
        self.index: PageIndex = index
        self.page_size: int = engine.page_size

    # ---------------------------------------------------------------- reads

    def exists(
        self, namespace: Namespace, page_hashes: list[str], lookup: bool = True
    ) -> tuple[int, bytes]:
        """The number of pages held from the first, and one byte (1/0) per page;
        ``lookup``: count it in the model's query and hit tokens."""
        return self.count(self.presence(namespace, page_hashes), lookup)

    def presence(self, namespace: Namespace, page_hashes: list[str]) -> bytes:
        """One byte per page: 1 where it is held, 0 where not (nothing counted)."""
        # _locate's two lookups, with the hash namespace named once for the call.
        hidden = (hash_namespace(*namespace), hash_page_width(self.page_size))
        find = self.index.find
        return bytes(
            find(namespace, h) is not None or find(hidden, h) is not None for h in page_hashes
        )

    def count(self, present: bytes, lookup: bool = True) -> tuple[int, bytes]:
        """``exists``' answer from ``presence``' bytes (of one chain, in order)."""
        leading = present.find(0)
        leading = len(present) if leading < 0 else leading
        if not lookup:
            return leading, present
        engine = self.engine
        engine.ops["match"] += 1
        engine.match_tokens += len(present) * self.page_size
        engine.hit_tokens += leading * self.page_size
        return leading, present

    def get(
        self, namespace: Namespace, page_hashes: list[str], session: Session | None
    ) -> GetOutcome:
        """Lock the leading run of pages for ``session`` and answer their slots (in one
        go: the RPC runs ``plan`` in slices, then ``lock``)."""
        steps = self.plan(namespace, page_hashes)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return self.lock(done.value, session)

    def plan(
        self, namespace: Namespace, page_hashes: list[str]
    ) -> Generator[None, None, list[PlannedRun]]:
        """The leading run of held pages as runs along one tree path each, with each
        run's path; reads only, and yields every ``SLICE`` pages looked at, so that
        the caller can let other calls run between slices.

        The run ends at a page that neither chains on the page before it (its parent
        in the index) nor starts a path of its own: a prompt's pages always do one or
        the other, and each run's path is walked from its namespace's root. Without
        runs a request of pages that do not chain (a long chain's pages in reverse
        order) would cost a whole path per page: minutes of loop time for a few hundred."""
        runs: list[tuple[Namespace, str, int]] = []
        previous: str | None = None
        for i, page_hash in enumerate(page_hashes):
            if i and i % SLICE == 0:
                yield
            ns = self._locate(namespace, page_hash)
            if ns is None:
                break
            entry = self.index.find(ns, page_hash)
            if entry is None:  # cannot happen: _locate just found it
                break
            if runs and entry.parent != previous and entry.parent is not None:
                break  # not this chain's next page: the leading run ends here
            if runs and runs[-1][0] == ns and entry.parent == previous:
                runs[-1] = (ns, page_hash, runs[-1][2] + 1)
            else:
                runs.append((ns, page_hash, 1))
            previous = page_hash
        planned: list[PlannedRun] = []
        for ns, last, count in runs:
            parts: list[bytes] = []
            current: str | None = last
            while current is not None:
                if self.index.find(ns, current) is None:
                    return planned  # evicted since it was looked up: the answer ends
                part, current = self.index.path_part(ns, current, SLICE, len(parts))
                parts += part
                if current is not None:
                    yield
            parts.reverse()
            planned.append(PlannedRun(ns, b"".join(parts), len(parts), count))
        return planned

    def lock(self, planned: list[PlannedRun], session: Session | None) -> GetOutcome:
        """Lock the planned runs' pages for ``session`` (those still cached, from the
        first) and answer their slots."""
        owner = needs_session(session, "GetPages")
        engine, cache, size = self.engine, self.engine.cache, self.page_size
        found, parts, lock_ids = 0, [], []
        try:
            for ns, packed, depth, count in planned:
                key = RadixKey.from_bytes(packed, ns[1], ns[0])
                result = cache.match_prefix(key)
                # A radix match reaches every indexed page; anything short of that ends
                # the run (and the answer) where the match ended (and so does a page
                # evicted since the plan).
                matched = result.prefix_len // size
                usable = max(0, count - (depth - matched))
                if usable:
                    node = result.last_node
                    tokens = prefix_tokens(node)
                    engine.quota.check_lock(owner, tokens)  # quotas.py; undone below
                    # The lookup's hit is the run's pages (ExistsPages counted them),
                    # not the prefix the lock protects (the quota's).
                    lock_ids.append(
                        engine._hold(
                            owner, node, cache.inc_lock_ref(node), tokens, hit=usable * size
                        )
                    )
                    first = (depth - count) * size
                    parts.append(host_indices(result.indices)[first : first + usable * size])
                    found += usable
                if usable < count:
                    break
        except BaseException:
            for lock_id in lock_ids:
                engine.unlock(owner, lock_id)
            raise
        slots = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return GetOutcome(found, slots, lock_ids)

    # -------------------------------------------------------------- helpers

    def _locate(self, namespace: Namespace, page_hash: str) -> Namespace | None:
        """Where a page is held: its token namespace, its hash namespace, or nowhere."""
        if self.index.find(namespace, page_hash) is not None:
            return namespace
        hidden = (hash_namespace(*namespace), hash_page_width(self.page_size))
        if self.index.find(hidden, page_hash) is not None:
            return hidden
        return None
