"""One model's lookup outcomes and hit-rate ceiling: the answer to "why no hit?".

Every lookup (Match, Step admissions, ExistsPages, and so the connectors' lookups)
ends in one outcome per token range (``prefixcache.cache.radix.lookup_outcomes``), counted
here by outcome: ``prefixcache_lookup_tokens_total{model, outcome}``. For the lookups
that answer, ``hit + miss_* + below_page`` is the tokens looked up. Three outcomes are
counted where they happen, on top of that:

* ``capacity``: a lookup that allocates was refused for lack of slots; all of its
  tokens (it was not answered, so it is in no other outcome);
* ``lease_expired``: a lookup's lock (Match or Step admission with ``lock``, GetPages)
  still held when its session's lease lapsed, or released by a client with that
  reason; the tokens its lookup counted as ``hit`` (``HeldLock.hit``: a Match's
  prefix, a GetPages run's pages, not the prefix the run's lock protects);
* ``load_failed``: a lookup's lock released by a client (a connector) with that
  reason: the hit could not be loaded; the same tokens (counted as ``hit``).

The ceiling: the whole pages looked up, against an estimate (HyperLogLog) of how many
distinct ones they were. With an infinite pool only a page's first request misses, so
the hit ratio would be ``1 - distinct / requested``. Pages are fed from a lookup's
first miss on: the pages it hit are cached, so they were asked for (or fetched) before.
Token lookups count pages in blocks of at least 16 tokens (``page_ids.block_pages``:
one page, or 16 pages of one token), as the evicted-page record names them: per-token
pages cost a page size 1 model milliseconds per long prompt. ExistsPages counts its
pages one by one (SGLang names them by hash, from wherever its own cache stops).

Cost (measured on the CI machine, loaded): a lookup that hits every whole page, about
1 us; a 12k-token miss, about 60 us; evicting a 12k-token leaf, about 250 us more.

Not thread-safe: the service's event loop drives it, like the engine; the metrics
thread only reads the counters.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any

import numpy as np

from prefixcache.cache import InvalidInputError, RadixKey
from prefixcache.cache.index.hyperloglog import HyperLogLog
from prefixcache.cache.index.page_ids import (
    DEFAULT_RECORD_PAGES,
    EvictedPages,
    EvictionRecorder,
    PrefixIds,
    block_pages,
    namespace_salt,
    sha_page_id,
    token_namespace_of,
)
from prefixcache.cache.index.page_index import DIGEST_BYTES, is_hash_namespace
from prefixcache.cache.radix.lookup_outcomes import (
    BELOW_PAGE,
    HIT,
    LEASE_EXPIRED,
    LOAD_FAILED,
    MAX_EXAMINED,
    MISS_COLD,
    MISS_EVICTED,
    MISS_NAMESPACE,
    OUTCOMES,
    Classified,
    classify,
)

from ..access.tenants import CALLER

# The outcomes a client may give a lock it releases unused (UnlockRequest).
CLIENT_REASONS = (LOAD_FAILED, LEASE_EXPIRED)
_U64 = np.uint64
# ExistsPages' pages looked up per slice of its counting (a few milliseconds).
COUNT_SLICE = 4096


class Lookups:
    """Outcome counters, the evicted-page record and the distinct-page sketch of one
    model (see the module docstring).

    Args:
        page_size: the model's tokens per page.
        record_pages: evicted blocks remembered (page_ids.EvictedPages: about 80 bytes
            each).
    """

    def __init__(self, page_size: int, record_pages: int = DEFAULT_RECORD_PAGES) -> None:
        self.page_size = page_size
        # Fixed keys: the metrics thread iterates this while the loop updates it.
        self.tokens: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self.block = block_pages(page_size)
        self.record = EvictedPages(record_pages)
        self.ids = PrefixIds()
        self.recorder = EvictionRecorder(self.record, self.ids, self.block)
        self.distinct = HyperLogLog()
        self.pages_requested = 0

    def attach(self, cache: Any) -> None:
        """Hear of ``cache``'s evictions (its ``eviction_observer``)."""
        cache.eviction_observer = self.recorder.observe

    # ------------------------------------------------------------ counting

    def count(self, classified: Classified, num_tokens: int) -> None:
        """Count one answered lookup's ranges, and its whole blocks for the ceiling."""
        tokens = self.tokens
        for outcome, start, end in classified.ranges:
            tokens[outcome] += end - start
        self.pages_requested += num_tokens // (self.page_size * self.block)
        if classified.page_ids is not None:
            self.distinct.add(classified.page_ids)

    def count_plain(self, num_tokens: int, hit: int) -> None:
        """A lookup of a model without a tree to classify by (slot, chunk): the hit,
        the tail below a page, and the rest cold (no ceiling: no page ids)."""
        end = num_tokens - num_tokens % self.page_size
        tokens = self.tokens
        tokens[HIT] += hit
        tokens[MISS_COLD] += max(end - hit, 0)
        tokens[BELOW_PAGE] += num_tokens - end

    def add(self, outcome: str, tokens: int) -> None:
        self.tokens[outcome] += tokens

    def ceiling(self) -> tuple[float, float]:
        """(distinct pages, hit ratio with an infinite pool); (0, 0) before any."""
        requested = self.pages_requested
        if not requested:
            return 0.0, 0.0
        distinct = min(self.distinct.estimate(), float(requested))
        return distinct, max(0.0, 1.0 - distinct / requested)

    # ------------------------------------------------------- classifying

    def classify(
        self,
        cache: Any,
        key: RadixKey,
        hit: int,
        *,
        check_same: bool = False,
        namespaces: Any = None,
    ) -> Classified:
        return classify(
            cache,
            key,
            hit,
            self.record,
            self.ids,
            check_same=check_same,
            namespaces=namespaces,
            block=self.block,
        )

    def count_pages(
        self, index: Any, namespace: tuple[str | None, int], data: bytes, leading: int
    ) -> Iterator[None]:
        """Count an ExistsPages lookup: ``data`` its packed page hashes (32 bytes each),
        ``leading`` pages of them held. Beyond those: pages another namespace's index
        holds, then pages the record knows as evicted, then cold ones.

        A generator: it yields after every ``COUNT_SLICE`` pages it looks up, so that
        the caller can let other calls run between slices (a 1M-page request's runs,
        looked up at once, hold the loop for half a second). The index and the record may change
        between slices: the outcomes are counted as the slices found them."""
        size = self.page_size
        total = len(data) // DIGEST_BYTES
        self.pages_requested += total
        self.tokens[HIT] += leading * size
        if leading >= total:
            return
        salt = namespace_salt(*namespace)
        pos = leading
        other = yield from _other_run(index, namespace, data, pos, total)
        self.tokens[MISS_NAMESPACE] += other * size
        pos += other
        if len(self.record):
            while pos < total and sha_page_id(_hex(data, pos), salt) in self.record:
                self.tokens[MISS_EVICTED] += size
                pos += 1
                if (pos - leading) % COUNT_SLICE == 0:
                    yield
        self.tokens[MISS_COLD] += (total - pos) * size
        heads = np.frombuffer(data, dtype=">u8").reshape(-1, DIGEST_BYTES // 8)[leading:, 0]
        self.distinct.add(heads.astype(_U64) ^ _U64(salt))


def _hex(data: bytes, page: int) -> str:
    return data[page * DIGEST_BYTES : (page + 1) * DIGEST_BYTES].hex()


def _other_run(
    index: Any, namespace: tuple[str | None, int], data: bytes, pos: int, total: int, limit: int = 8
) -> Generator[None, None, int]:
    """Pages from ``pos`` on that one other namespace of the same width holds (as token
    pages or hash pages), the longest run among at most ``limit`` namespaces; yields
    every ``COUNT_SLICE`` pages looked up."""
    first = _hex(data, pos)
    best = 0
    looked = 0
    for examined, (extra_key, width) in enumerate(index.namespaces()):
        if examined >= MAX_EXAMINED:
            break
        if width != namespace[1] and not is_hash_namespace(extra_key):
            continue
        owner = _owner(extra_key, width)
        if owner is None or owner == namespace or owner[1] != namespace[1]:
            continue
        if index.find((extra_key, width), first) is None:
            continue
        looked += 1
        run = 1
        while (
            pos + run < total and index.find((extra_key, width), _hex(data, pos + run)) is not None
        ):
            run += 1
            if run % COUNT_SLICE == 0:
                yield
        best = max(best, run)
        if looked >= limit:
            break
    return best


def _owner(extra_key: str | None, width: int) -> tuple[str | None, int] | None:
    """The token namespace a page-index namespace belongs to."""
    if not is_hash_namespace(extra_key):
        return extra_key, width
    return token_namespace_of(extra_key)


def with_lookups(stats: Any, engine: Any) -> Any:
    """A Stats reply's ModelStats with ``engine``'s lookup outcomes and ceiling (Stats
    only: Step replies go without). A tenant's token sees none: they sum every
    tenant's lookups (tenant_stats.py)."""
    if CALLER.get().bound:
        return stats
    lookups: Lookups = engine.lookups
    stats.lookup_tokens_total.update(lookups.tokens)
    stats.pages_requested_total = lookups.pages_requested
    stats.distinct_pages, stats.hit_ratio_ceiling = lookups.ceiling()
    return stats


def unused_reason(value: int) -> str | None:
    """An UnlockRequest's ``unused_outcome``: None (unset), or an outcome of
    ``CLIENT_REASONS``; anything else is refused before the lock is released."""
    if not value:
        return None
    name = OUTCOMES[value - 1] if 0 < value <= len(OUTCOMES) else None
    if name not in CLIENT_REASONS:
        raise InvalidInputError(
            f"unused_outcome {value} is not LOOKUP_OUTCOME_LOAD_FAILED "
            "or LOOKUP_OUTCOME_LEASE_EXPIRED"
        )
    return name


def outcome_name(value: int) -> str:
    """The outcome label of a ``LookupOutcome`` enum value (1 = hit, ...)."""
    return OUTCOMES[value - 1]


def outcome_value(name: str) -> int:
    return OUTCOMES.index(name) + 1
