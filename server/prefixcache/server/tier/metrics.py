"""The tier's Prometheus metrics, read from its counters at scrape time.

Hit tokens by tier (``local``: the pool's own hit; ``remote``: fetched from the store
and answered as a hit), lookups by outcome, fetch bytes and seconds, put pages, bytes,
failures, queue depth and drops, and store errors by op and code.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class TierCollector(Collector):
    """``Tier``'s counters (service.py), per model."""

    def __init__(self, tier: Any) -> None:
        self.tier = tier

    def collect(self) -> Iterator[Metric]:
        tier = self.tier
        hits = CounterMetricFamily(
            "prefixcache_tier_hit_tokens", "Tokens of lookups that went through the tier, "
            "answered as hits, by where they were found (local pool, remote store).",
            labels=["model", "tier"])
        lookups = CounterMetricFamily(
            "prefixcache_tier_lookups", "Lookups that consulted the tier, by outcome "
            "(local: all local; remote: pages fetched; miss; error; refused: the first page's "
            "seal did not check; capacity: no room for the fetch; unavailable; "
            "breaker_open; busy).", labels=["model", "result"])
        fetch_bytes = CounterMetricFamily(
            "prefixcache_tier_fetch_bytes", "Bytes fetched from the store into the pool.",
            labels=["model"])
        fetch_seconds = CounterMetricFamily(
            "prefixcache_tier_fetch_seconds", "Seconds spent in fetches that succeeded.",
            labels=["model"])
        put_pages = CounterMetricFamily(
            "prefixcache_tier_put_pages", "Pages written to the store.", labels=["model"])
        put_bytes = CounterMetricFamily(
            "prefixcache_tier_put_bytes", "Bytes written to the store.", labels=["model"])
        put_failed = CounterMetricFamily(
            "prefixcache_tier_put_failed_pages", "Pages the store refused.", labels=["model"])
        drops = CounterMetricFamily(
            "prefixcache_tier_put_dropped_pages", "Pages never queued for the store, by "
            "reason (queue_full, unavailable, breaker_open, busy, reset, seal_slots, ...).",
            labels=["model", "reason"])
        for name, mt in list(tier.models.items()):
            for where, n in list(mt.hit_tokens.items()):
                hits.add_metric([name, where], n)
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
            "prefixcache_tier_errors", "Store calls that failed, by op and store error code "
            "(Mooncake's name, TIMEOUT past tier.timeout).", labels=["op", "code"])
        for (op, code), n in list(tier.errors.items()):
            errors.add_metric([op, code], n)
        depth = GaugeMetricFamily("prefixcache_tier_put_queue_depth",
                                  "Put jobs waiting or being written.")
        depth.add_metric([], tier.puts.depth if tier.puts is not None else 0)
        up = GaugeMetricFamily("prefixcache_tier_connected",
                               "1 while the store client is set up.")
        up.add_metric([], 1 if tier.ready else 0)
        yield from (hits, lookups, fetch_bytes, fetch_seconds, put_pages, put_bytes,
                    put_failed, drops, errors, depth, up)
