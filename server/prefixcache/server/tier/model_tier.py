"""ModelTier: one model's side of a tier: new pages out to its store, and counters.

It listens to the model's tree (it wraps the cache's listener, passing every event on),
so every way pages enter the tree (Insert, Step, Session streams, SetPages) writes them
to the store with no hook in those paths:

* ``pages_stored(node)`` only notes the node (inside the cache operation, which must
  stay cheap); once the call that made it has run, ``flush`` pins each noted node with
  a lock of the tier's session, so its slots cannot be evicted and reused while their
  rows are being read, and queues a put of its pages from the pool's memory. The put
  job's answer, back on the loop, releases the lock.
* ``cleared`` (a Reset) bumps ``generation``: a put or fetch begun before it touched
  rows that mean nothing now, so its result is dropped (and a put's objects removed).
* Pages fetched from the store are inserted with ``suppressed`` set: they came from
  there, and are not written back.
* With ``tier.min_hits`` > 0 a node is written only once lookups that consult the tier
  (Match, Step admits, the Session stream's) hit it that many times (``hit``).
* With ``tier.write: on_evict`` (write-back; the disk tier always) nothing is written
  at insert: the cache's ``before_free`` hook (``evicting``) shows each node eviction
  takes while its slots still hold its KV; its rows are copied into a bounded staging
  buffer (staging.py) at once, if the put queue and the staging buffer have room (else
  a counted drop), and put from there in the background. Pages the store says it holds
  already (the disk tier's index: ``Tier.held``) are not staged again. A Reset frees no
  node through eviction, so writes nothing back. Each tier's hook calls the one set
  before it (the disk tier's and Mooncake's both see every eviction).
* A tier that keeps retentions (``Tier.keeps_retention``: the disk tier) is given the
  node's retention with its pages, while it is in force (``page_retention``): the put
  job carries it, and a page the store holds already takes it too.
* Every page put carries its seal (seals.py), computed on the put thread into a seal
  slot the job holds until it is answered; no free seal slot is a counted drop
  (``seal_slots``). A write-through job sealed after a Reset is not put (the rows it
  sealed may be another page's by then); rows that change after it was sealed no
  longer match their seal, so a fetch refuses them.

Counters: a lookup's hit tokens by where they were found (``local``: the pool, counted
by the first tier a model's lookups go through only; then this tier's ``found`` label),
and its result by outcome (``Tier.kind``). The results of the last ``RECENT`` lookups
that asked the store are remembered by the key of the request's last page looked for
(``recent``), for the Explain RPC: why that request did or did not hit here.

Not thread-safe: the loop's, like the engine.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np

from prefixcache.cache.pools.allocator import host_indices

from ..memory.page_seal import SEAL_BYTES, MemoryRegions
from .backend import OBJECT_ALREADY_EXISTS, RPC_FAIL, PageRetention, Parts, code_name
from .keys import KeyMaker, page_names
from .layout import PageLayout
from .seals import SealSlots, seal_pages, sealed
from .staging import Staging
from .writer import PutJob

log = logging.getLogger("prefixcache.server")

# Pages of one put job at most (a longer node is written as several jobs).
MAX_JOB_PAGES = 256
# Why a page was not written (prefixcache_*_dropped_pages_total{reason}, exported from
# 0); a write a bug refused is counted under its exception's name too.
DROP_REASONS = (
    "queue_full",
    "staging_full",
    "seal_slots",
    "pin_limit",
    "reset",
    "unavailable",
    "breaker_open",
    "disk_full",
)
# Lookups whose results are remembered for Explain (about 200 bytes each).
RECENT = 4096
# Bytes of one write-back job (at least a page): staged and queued in turn, so that the
# write of one overlaps the copy of the next.
WRITE_JOB_BYTES = 4 << 20


class _Listener:
    """The cache's listener: tells the model tier, then whoever listened before."""

    def __init__(self, forward: Any, owner: ModelTier) -> None:
        self.forward = forward
        self.owner = owner

    def cleared(self, cache: Any) -> None:
        if self.forward is not None:
            self.forward.cleared(cache)
        self.owner.generation += 1
        self.owner.pinned = 0  # the Reset dropped every lock

    def pages_stored(self, node: Any) -> None:
        if self.forward is not None:
            self.forward.pages_stored(node)
        self.owner.stored(node)

    def pages_removed(self, node: Any) -> None:
        if self.forward is not None:
            self.forward.pages_removed(node)


class ModelTier:
    """The tier's hooks into one radix model (``engine``) and its counters."""

    def __init__(
        self,
        tier: Any,
        engine: Any,
        secret: bytes | None = None,
        *,
        backend: Any = None,
        staging_stride: int | None = None,
    ) -> None:
        self.tier = tier
        self.engine = engine
        # The store this model's pages go to (Mooncake's client, set once connected; a
        # disk store of its own).
        self.backend = backend
        self.name = engine.name
        self.page_size = engine.page_size
        self.keys = KeyMaker(engine.config, tier.service.limits.tenants, secret)
        self.layout = PageLayout(engine.kv_pool, engine.page_size)
        # A store object: the page, then its seal.
        self.object_bytes = self.layout.page_bytes + SEAL_BYTES
        # Slots the tier's fetches hold at once (tier.max_fetch_slots; 0: half the pool).
        self.max_fetch_slots = tier.cfg.max_fetch_slots or engine.pool_size // 2
        self.fetching = 0
        self.generation = 0
        # Tokens pinned by writes in flight, at most a quarter of the pool.
        self.pinned = 0
        self.max_pinned = max(engine.pool_size // 4, engine.page_size)
        # Admission (tier.min_hits): hits per node, written once they reach it.
        self.min_hits = tier.cfg.min_hits
        self._hits: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.suppressed = False
        self._pending: list[Any] = []
        self._flush_scheduled = False
        cache = engine.cache
        self._listener = _Listener(cache.listener, self)
        # Page hashes must exist when a node enters the tree; with a listener the cache
        # computes them then (about 2 us a page).
        cache.listener = self._listener
        cache.eager_page_hashes = True
        self.write_back = tier.cfg.write == "on_evict"
        self.staging: Staging | None = None
        if self.write_back:
            self.staging = Staging.for_pool(self.layout, engine.pool_size, staging_stride)
            self._forward_free = cache.before_free
            cache.before_free = self._before_free
        self.write_job_pages = max(
            1, min(MAX_JOB_PAGES, WRITE_JOB_BYTES // max(self.layout.page_bytes, 1))
        )
        self.seal_slots = SealSlots(
            seal_slot_count(
                engine.pool_size // self.page_size,
                self.max_fetch_slots // self.page_size,
                self.staging.pages if self.staging is not None else 0,
            )
        )
        # Views of the memory objects are made of, for sealing and checking in place.
        self.memory = MemoryRegions(self.regions())
        # Counters (read by metrics.py at scrape time).
        self.found = tier.kind.found
        # False where a tier above this one serves the model: it counts the pool's hits.
        self.counts_local = True
        self.hit_tokens = {"local": 0, self.found: 0}
        self.lookups: dict[str, int] = {}
        self.fetch_bytes = 0
        self.fetch_seconds = 0.0
        self.put_pages = 0
        self.put_bytes = 0
        self.put_failed = 0
        self.drops: dict[str, int] = dict.fromkeys(DROP_REASONS, 0)
        self.refused = 0  # fetched pages whose seal did not check
        # The last lookups' results and tokens found here, by their last page's key.
        self.recent: OrderedDict[str, tuple[str, int]] = OrderedDict()

    def count(self, table: dict[str, int], label: str, n: int = 1) -> None:
        table[label] = table.get(label, 0) + n

    def looked_up(self, local: int, got: int, why: str) -> None:
        """Count a lookup: ``local`` tokens hit above this tier, ``got`` found here, and
        its result (``why`` when nothing was found)."""
        if self.counts_local:
            self.hit_tokens["local"] += local
        self.hit_tokens[self.found] += got
        self.count(self.lookups, self.found if got else why)

    def remember(self, key: str, result: str, tokens: int = 0) -> None:
        """The result of a lookup that asked the store, by its last page's ``key``."""
        recent = self.recent
        recent[key] = (result, tokens)
        recent.move_to_end(key)
        if len(recent) > RECENT:
            recent.popitem(last=False)

    def close(self) -> None:
        """Give the cache its listener back."""
        cache = self.engine.cache
        if cache.listener is self._listener:
            cache.listener = self._listener.forward
        if self.staging is not None and getattr(cache, "before_free", None) == self._before_free:
            cache.before_free = self._forward_free

    def regions(self) -> list[tuple[int, int]]:
        """The memory puts and fetches use, to register with the store."""
        staged = self.staging.regions() if self.staging is not None else []
        return [*self.layout.regions(), *staged, self.seal_slots.region()]

    def sealed_job(
        self,
        keys: list[str],
        ptrs: Parts,
        sizes: Parts,
        ns: Any,
        hashes: list[str],
        seals: np.ndarray,
        generation: int | None,
    ) -> PutJob:
        """A put job of pages ``hashes`` (of namespace ``ns``) with their seal slots
        ``seals``: each object the page's parts, then its seal, computed on the put
        thread; ``done`` is set by the caller (and must release ``seals``). With a
        ``generation`` (parts in the pool), the job is put only if no Reset came before
        its seals were made: rows only change after a Reset freed them, so the sealed
        bytes are then the page's."""
        ptrs, sizes = sealed(ptrs, sizes, self.seal_slots.ptrs(seals))
        idents = [ns.ident(h) for h in hashes]
        memory, slots = self.memory, self.seal_slots

        def seal() -> bool:
            seal_pages(ns.seal, idents, ptrs, sizes, memory, slots, seals)
            return generation is None or generation == self.generation

        put = self.backend.put_from if self.backend is not None else None
        return PutJob(keys, ptrs, sizes, lambda c: None, seal, put)

    # ------------------------------------------------------------ write path

    def stored(self, node: Any) -> None:
        if self.suppressed or self.tier.closed or self.min_hits or self.write_back:
            return
        self._note(node)

    def _note(self, node: Any) -> None:
        self._pending.append(node)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.tier.loop.call_soon(self.flush)

    def hit(self, node: Any) -> None:
        """A lookup's local hit ended at ``node`` (``tier.min_hits`` admission): every
        node on its path was hit once more; one that reaches ``min_hits`` is written.
        Counts live as long as their node (weakly held), so a split's new upper part
        starts again from zero."""
        if not self.min_hits or self.tier.closed:
            return
        while node is not None and node.key_len:
            n = self._hits.get(node, 0) + 1
            self._hits[node] = n
            if n == self.min_hits and not self.write_back:
                self._note(node)
            node = node.parent

    def flush(self) -> None:
        """Queue a put of every noted node still in the tree (see the module doc)."""
        self._flush_scheduled = False
        nodes, self._pending = self._pending, []
        for node in nodes:
            if node.evicted or not node.key_len:
                continue
            pages = node.key_len // self.page_size
            why = self.tier.available()
            if why is not None or self.tier.puts is None:
                self.count(self.drops, why or "unavailable", pages)
                continue
            try:
                self._queue(node)
            except Exception as exc:  # a quota on the tier's locks, a stale node
                self.count(self.drops, type(exc).__name__, pages)

    def _queue(self, node: Any) -> None:
        engine, tier = self.engine, self.tier
        extra_key, width, hashes = page_names(node)
        slots = host_indices(node.value)
        ns = self.keys.namespace(extra_key, width)
        keys = self.keys.keys(extra_key, width, hashes)
        tokens = node.key_len
        if self.pinned and self.pinned + tokens > self.max_pinned:
            # A slow store must not pin the pool: past the cap the write is dropped (one
            # write of any size may go when nothing is pinned, or no long prompt would).
            self.count(self.drops, "pin_limit", len(keys))
            return
        seals = self.seal_slots.take(len(keys))
        if seals is None:
            self.count(self.drops, "seal_slots", len(keys))
            return
        try:
            lock_id = engine.lock(tier.session, engine._handle(node))
        except Exception:
            self.seal_slots.release(seals)
            raise
        self.pinned += tokens
        generation = self.generation
        jobs = []
        for at in range(0, len(keys), MAX_JOB_PAGES):
            part = slots[at * self.page_size : (at + MAX_JOB_PAGES) * self.page_size]
            ptrs, sizes = self.layout.parts(np.ascontiguousarray(part))
            end = at + MAX_JOB_PAGES
            jobs.append(
                self.sealed_job(
                    keys[at:end], ptrs, sizes, ns, hashes[at:end], seals[at:end], generation
                )
            )
        left = [len(jobs)]

        def done(job: PutJob, mine: np.ndarray, codes: list[int]) -> None:
            self.seal_slots.release(mine)
            self._put_done(job, codes, generation)
            left[0] -= 1
            if left[0] == 0:
                self._unlock(lock_id, generation, tokens)

        for i, job in enumerate(jobs):
            mine = seals[i * MAX_JOB_PAGES : (i + 1) * MAX_JOB_PAGES]
            job.done = lambda codes, job=job, mine=mine: done(job, mine, codes)
            if tier.puts is None or not tier.puts.offer(job):
                self.count(self.drops, "queue_full", sum(len(j.keys) for j in jobs[i:]))
                self.seal_slots.release(seals[i * MAX_JOB_PAGES :])
                left[0] -= len(jobs) - i  # those never queued; the others answer later
                if left[0] == 0:
                    self._unlock(lock_id, generation, tokens)
                return

    def _before_free(self, node: Any, slots: Any) -> None:
        if self._forward_free is not None:
            try:
                self._forward_free(node, slots)
            except Exception:  # counted as the cache counts its hook's failures
                self.engine.cache.before_free_errors += 1
        self.evicting(node, slots)

    def evicting(self, node: Any, slots: Any) -> None:
        """The cache's ``before_free`` (write-back): stage ``node``'s pages and queue
        their put, or count a drop. Inside an eviction: a copy, never a store call."""
        tier, ps = self.tier, self.page_size
        pages = node.key_len // ps
        if tier.closed or not pages or self.staging is None:
            return
        if self.min_hits and self._hits.get(node, 0) < self.min_hits:
            return  # not admitted
        why = tier.write_refusal(self)
        if why is not None or tier.puts is None:
            self.count(self.drops, why or "unavailable", pages)
            return
        extra_key, width, hashes = page_names(node)
        keys = self.keys.keys(extra_key, width, hashes[:pages])
        rows = host_indices(slots)[: pages * ps]
        retain = page_retention(node, self.engine.cache) if tier.keeps_retention else None
        held = tier.held(self, keys, retain)
        if held is not None:  # the store has some already: stage the others only
            wanted = [i for i, h in enumerate(held) if not h]
            if len(wanted) < pages:
                keys = [keys[i] for i in wanted]
                hashes = [hashes[i] for i in wanted]
                rows = rows.reshape(pages, ps)[wanted].reshape(-1)
                pages = len(wanted)
        # As many leading pages as the staging buffer holds (the pages after a missing
        # one are never found: lookups fetch a leading run).
        fit = min(pages, self.staging.available)
        if fit < pages:
            self.count(self.drops, "staging_full", pages - fit)
            pages = fit
        if not pages:
            return
        step = self.write_job_pages
        if not tier.puts.has_room(-(-pages // step)):
            self.count(self.drops, "queue_full", pages)
            return
        seals = self.seal_slots.take(pages)
        if seals is None:
            self.count(self.drops, "seal_slots", pages)
            return
        ns = self.keys.namespace(extra_key, width)
        staging, seal_slots = self.staging, self.seal_slots
        # A job per few MiB, each queued as soon as it is copied: the put thread writes
        # one while this copies the next.
        for at in range(0, pages, step):
            end = min(at + step, pages)
            mine = staging.copy(rows[at * ps : end * ps])
            if mine is None:  # cannot be (room checked), but never raise in an eviction
                seal_slots.release(seals[at:])
                self.count(self.drops, "staging_full", pages - at)
                return
            my_seals = seals[at:end]
            ptrs, sizes = staging.parts(mine)
            # Staged bytes are private: no Reset changes them.
            job = self.sealed_job(keys[at:end], ptrs, sizes, ns, hashes[at:end], my_seals, None)
            job.retain = retain

            def done(
                codes: list[int],
                job: PutJob = job,
                mine: list[int] = mine,
                my_seals: np.ndarray = my_seals,
            ) -> None:
                staging.release(mine)
                seal_slots.release(my_seals)
                # Staged bytes are the page's whatever a Reset did since: no generation.
                self._put_done(job, codes, self.generation)

            job.done = done
            tier.puts.offer(job)  # room checked above; only the loop offers

    def _put_done(self, job: PutJob, codes: list[int], generation: int) -> None:
        tier = self.tier
        if generation != self.generation:
            # A Reset freed the rows while they were read: what was stored may be
            # another page's bytes. Remove it (best effort, off the loop).
            if tier.ready and self.backend is not None and codes:
                tier.loop.run_in_executor(tier._pool, self.backend.remove, job.keys)
            self.count(self.drops, "reset", len(job.keys))
            return
        if not codes:
            tier.error("put", "FAILED")
            self.put_failed += len(job.keys)
            return
        for code in codes:
            if code == 0:
                self.put_pages += 1
                self.put_bytes += self.layout.page_bytes
            elif code != OBJECT_ALREADY_EXISTS:
                self.put_failed += 1
                tier.error("put", code_name(code))
                if code == RPC_FAIL:
                    tier.trip()

    def _unlock(self, lock_id: int, generation: int, tokens: int) -> None:
        if generation != self.generation or self.tier.session.closed:
            return  # a Reset already dropped the lock (and zeroed ``pinned``)
        self.pinned -= tokens
        try:
            self.engine.unlock(self.tier.session, lock_id)
        except Exception:  # released by a Reset in between: nothing to do
            log.debug("tier lock already released", exc_info=True)


def page_retention(node: Any, cache: Any) -> PageRetention | None:
    """``node``'s retention while it is in force, on the wall clock (None: none)."""
    book = getattr(cache, "retention", None)
    if book is None or not node.retain_priority:
        return None
    left = node.retain_until - book.clock()
    if left <= 0:
        return None
    return PageRetention(
        int(node.retain_priority), float(node.retain_seconds), time.time() + left, node.retain_owner
    )


def seal_slot_count(pool_pages: int, fetch_pages: int, staging_pages: int) -> int:
    """Seal slots a model gets (32 bytes each): a put holds one per page it writes, which
    the pool holds at most once each (the rest of a Reset's puts in flight, if any, are
    dropped as ``seal_slots``), a fetch one per page of ``tier.max_fetch_slots``, a
    write-back one per staging page, and one put job's more."""
    return pool_pages + fetch_pages + staging_pages + MAX_JOB_PAGES
