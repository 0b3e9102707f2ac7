"""The tiers' Prometheus metrics, read from their counters at scrape time.

Hit tokens of lookups through the tiers, by where they were found
(``prefixcache_tier_hit_tokens_total{tier}``: ``local``, the pool's own hit; ``disk``,
read from the disk tier; ``remote``, fetched from the Mooncake store), then per tier:
lookups by outcome, bytes and seconds of the reads that brought pages (promotions),
pages written (demotions to the disk, puts to the store), failures, drops, errors by op
and code and the write queue's depth; the Mooncake tier whether it is connected, the
disk tier each store's bytes, pages and evictions.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Each tier's metric names (by TierKind.name) for its counters: Mooncake's are puts and
# fetches of a store, the disk tier's demotions and promotions.
NAMES = {
    "tier": {
        "lookups": "prefixcache_tier_lookups",
        "fetch_bytes": "prefixcache_tier_fetch_bytes",
        "fetch_seconds": "prefixcache_tier_fetch_seconds",
        "put_pages": "prefixcache_tier_put_pages",
        "put_bytes": "prefixcache_tier_put_bytes",
        "put_failed": "prefixcache_tier_put_failed_pages",
        "drops": "prefixcache_tier_put_dropped_pages",
        "errors": "prefixcache_tier_errors",
        "depth": "prefixcache_tier_put_queue_depth",
    },
    "disk": {
        "lookups": "prefixcache_disk_lookups",
        "fetch_bytes": "prefixcache_disk_promoted_bytes",
        "fetch_seconds": "prefixcache_disk_promote_seconds",
        "put_pages": "prefixcache_disk_demoted_pages",
        "put_bytes": "prefixcache_disk_demoted_bytes",
        "put_failed": "prefixcache_disk_demote_failed_pages",
        "drops": "prefixcache_disk_demote_dropped_pages",
        "errors": "prefixcache_disk_errors",
        "depth": "prefixcache_disk_write_queue_depth",
    },
}
_STORE = {"tier": "the store", "disk": "the disk tier"}


class TierCollector(Collector):
    """The counters of every tier of ``tiers`` (a chain.Tiers), per model."""

    def __init__(self, tiers: Any) -> None:
        self.tiers = tiers

    def collect(self) -> Iterator[Metric]:
        hits = CounterMetricFamily(
            "prefixcache_tier_hit_tokens",
            "Tokens of lookups that went through the tiers, "
            "answered as hits, by where they were found (local: the pool; disk: the disk "
            "tier; remote: the Mooncake store).",
            labels=["model", "tier"],
        )
        for tier in self.tiers.tiers:
            for name, mt in list(tier.models.items()):
                for where, n in list(mt.hit_tokens.items()):
                    if where != "local" or mt.counts_local:
                        hits.add_metric([name, where], n)
        yield hits
        for tier in self.tiers.tiers:
            yield from _tier_metrics(tier)


def _tier_metrics(tier: Any) -> Iterator[Metric]:
    names, store = NAMES[tier.kind.name], _STORE[tier.kind.name]
    lookups = CounterMetricFamily(
        names["lookups"],
        f"Lookups that consulted {store}, by outcome (local: all in the "
        f"pool or a tier above; {tier.kind.found}: pages read from it; miss; timeout: "
        "the read missed the lookup's deadline; error; refused: the first page's seal "
        "did not check; capacity: no room for the read; "
        "unavailable; breaker_open; busy).",
        labels=["model", "result"],
    )
    fetch_bytes = CounterMetricFamily(
        names["fetch_bytes"], f"Bytes read from {store} into the pool.", labels=["model"]
    )
    fetch_seconds = CounterMetricFamily(
        names["fetch_seconds"],
        f"Seconds spent in reads from {store} that brought pages.",
        labels=["model"],
    )
    put_pages = CounterMetricFamily(
        names["put_pages"], f"Pages written to {store}.", labels=["model"]
    )
    put_bytes = CounterMetricFamily(
        names["put_bytes"], f"Bytes written to {store}.", labels=["model"]
    )
    put_failed = CounterMetricFamily(
        names["put_failed"], f"Pages {store} did not take (a write that failed).", labels=["model"]
    )
    drops = CounterMetricFamily(
        names["drops"],
        f"Pages never queued for {store}, by reason (queue_full, "
        "staging_full, unavailable, breaker_open, reset, seal_slots, disk_full, ...).",
        labels=["model", "reason"],
    )
    for name, mt in list(tier.models.items()):
        for result, n in list(mt.lookups.items()):
            lookups.add_metric([name, result], n)
        fetch_bytes.add_metric([name], mt.fetch_bytes)
        fetch_seconds.add_metric([name], mt.fetch_seconds)
        put_pages.add_metric([name], mt.put_pages)
        put_bytes.add_metric([name], mt.put_bytes)
        put_failed.add_metric([name], mt.put_failed)
        for reason, n in list(mt.drops.items()):
            drops.add_metric([name, reason], n)
    errors = CounterMetricFamily(
        names["errors"],
        f"Calls to {store} that failed, by op and code (Mooncake's error "
        "names; TIMEOUT past the tier's timeout; the disk tier's DISK_FULL, IO_ERROR).",
        labels=["op", "code"],
    )
    for (op, code), n in list(tier.errors.items()):
        errors.add_metric([op, code], n)
    depth = GaugeMetricFamily(names["depth"], "Write jobs waiting or being written.")
    depth.add_metric([], tier.puts.depth if tier.puts is not None else 0)
    yield from (
        lookups,
        fetch_bytes,
        fetch_seconds,
        put_pages,
        put_bytes,
        put_failed,
        drops,
        errors,
        depth,
    )
    if tier.kind.name == "tier":
        up = GaugeMetricFamily("prefixcache_tier_connected", "1 while the store client is set up.")
        up.add_metric([], 1 if tier.ready else 0)
        yield up
    else:
        yield from _disk_metrics(tier)


def _disk_metrics(tier: Any) -> Iterator[Metric]:
    used = GaugeMetricFamily(
        "prefixcache_disk_bytes",
        "Bytes of pages the disk tier holds (whole slots).",
        labels=["model"],
    )
    capacity = GaugeMetricFamily(
        "prefixcache_disk_capacity_bytes",
        "Bytes the disk tier's slots take in all (its share of disk.bytes).",
        labels=["model"],
    )
    pages = GaugeMetricFamily(
        "prefixcache_disk_pages", "Pages the disk tier holds.", labels=["model"]
    )
    evicted = CounterMetricFamily(
        "prefixcache_disk_evicted_pages",
        "Pages the disk tier's own eviction took to make room.",
        labels=["model"],
    )
    for name, mt in list(tier.models.items()):
        store = mt.backend
        held = store.pages_held
        used.add_metric([name], held * store.slot_bytes)
        capacity.add_metric([name], store.slots * store.slot_bytes)
        pages.add_metric([name], held)
        evicted.add_metric([name], store.evicted)
    yield from (used, capacity, pages, evicted)
