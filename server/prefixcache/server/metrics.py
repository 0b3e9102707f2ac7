"""Prometheus metrics: RPC counters and latency, plus cache gauges read at scrape time.

Names use base units and ``_total`` counters for rates, with the label ``model`` and no
per-request or per-namespace labels (whose values would grow without bound). Cache
numbers are read from the engines when Prometheus scrapes (a custom collector), so the
request path pays nothing for them. Each server has its own registry, so several can
run in one process (tests).
"""

from __future__ import annotations

import importlib.metadata
import platform
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    Info,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .access.limits import LIMIT_NAMES
from .errors import PoolExhaustedError
from .logs import dropped_records
from .metrics_http import MetricsHttpServer

if TYPE_CHECKING:
    from .service import CacheService

# Unix-socket RPCs take ~0.3-3 ms here; the low buckets resolve the cache's own cost.
_LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)


def build_info() -> dict[str, str]:
    """The labels of ``prefixcache_build_info``."""
    try:
        version = importlib.metadata.version("prefixcache")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        version = "unknown"
    return {"version": version, "python": platform.python_version()}


class Metrics:
    """The metrics of one server and, once started, the HTTP endpoint serving them."""

    def __init__(self, service: CacheService) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.rpc_requests = Counter(
            "prefixcache_rpc_requests",
            "RPCs handled, by method and status code.",
            ["method", "code"],
            registry=self.registry,
        )
        self.rpc_duration = Histogram(
            "prefixcache_rpc_duration_seconds",
            "Time spent handling an RPC in the server, by method and status code.",
            ["method", "code"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_CacheCollector(service))
        # Limits: every refusal by a configured limit, by the setting's name.
        self.refusals = Counter(
            "prefixcache_refusals",
            "Requests refused by a configured limit, by limit.",
            ["limit"],
            registry=self.registry,
        )
        for limit in LIMIT_NAMES:
            self.refusals.labels(limit)  # exported from the start, at 0
        # Allocations the pool refused, by why: the PoolExhausted alert keys on
        # pool_exhausted only, not on every RESOURCE_EXHAUSTED (over-long prompts).
        self.allocation_refusals = Counter(
            "prefixcache_allocation_refusals",
            "Allocations the pool refused after eviction, by model and reason "
            "(pool_exhausted: locks and sessions pin the slots; larger_than_pool: one "
            "request asks for more than the whole pool).",
            ["model", "reason"],
            registry=self.registry,
        )
        for model in service.engines:
            for reason in PoolExhaustedError.REASONS:
                self.allocation_refusals.labels(model, reason)  # exported from the start
        self.registry.register(_LivenessCollector(service))
        # RSS, CPU seconds, open fds (Linux /proc), and which build answers.
        ProcessCollector(registry=self.registry)
        Info(
            "prefixcache_build",
            "The running prefixcache's version and Python.",
            registry=self.registry,
        ).info(build_info())
        self._children: dict[tuple[str, grpc.StatusCode], tuple[Counter, Histogram]] = {}
        self._httpd: MetricsHttpServer | None = None
        self.port = 0

    def observe_rpc(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        children = self._children.get((method, code))
        if children is None:  # labels() costs a few µs; resolve each pair once
            name = code.name
            children = (
                self.rpc_requests.labels(method, name),
                self.rpc_duration.labels(method, name),
            )
            self._children[(method, code)] = children
        children[0].inc()
        children[1].observe(seconds)

    def refused(self, limit: str) -> None:
        self.refusals.labels(limit).inc()

    def allocation_refused(self, model: str, reason: str) -> None:
        self.allocation_refusals.labels(model, reason).inc()

    def watch_kv_events(self, publishers: Mapping[str, Any]) -> None:
        """Export the KV-event publishers' counters (``server.kv_events``), per model."""
        self.registry.register(_KvEventsCollector(publishers))

    def serve(self, host: str, port: int, token: str | None = None) -> int:
        """Start the HTTP endpoint (one thread, metrics_http.py); returns the bound port.
        With ``token``, a scrape must carry it as a bearer token."""
        self._httpd = MetricsHttpServer(self.registry, host, port, token)
        self.port = self._httpd.start()
        return self.port

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.close()
            self._httpd = None


class _CacheCollector(Collector):
    """Reads every engine's counters and sizes at scrape time."""

    def __init__(self, service: CacheService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        svc = self.service
        query = CounterMetricFamily(
            "prefixcache_query_tokens", "Tokens looked up by Match.", labels=["model"]
        )
        hit = CounterMetricFamily(
            "prefixcache_hit_tokens",
            "Tokens Match found in the cache; hit ratio = hit / query.",
            labels=["model"],
        )
        ops = CounterMetricFamily(
            "prefixcache_cache_operations",
            "Cache operations performed, by operation.",
            labels=["model", "operation"],
        )
        evicted = CounterMetricFamily(
            "prefixcache_evicted_tokens",
            "Tokens removed from the cache, by reason (requested, pressure, reset).",
            labels=["model", "reason"],
        )
        cached = GaugeMetricFamily(
            "prefixcache_cached_tokens",
            "Tokens in the cache by state (evictable, protected; swa_* for SWA models).",
            labels=["model", "state"],
        )
        slots = GaugeMetricFamily(
            "prefixcache_pool_slots",
            "KV pool slots by state: free, used (tree, sessions, tier fetches), session (held by "
            "sessions, not yet cached).",
            labels=["model", "state"],
        )
        capacity = GaugeMetricFamily(
            "prefixcache_pool_capacity_slots", "Usable KV pool slots.", labels=["model"]
        )
        locks = GaugeMetricFamily("prefixcache_locks", "Locks held by sessions.", labels=["model"])
        outcomes = CounterMetricFamily(
            "prefixcache_lookup_tokens",
            "Looked-up tokens by outcome (Match, Step admissions, ExistsPages): hit, "
            "miss_cold, miss_evicted, miss_namespace, below_page sum to the tokens "
            "answered; capacity counts refused lookups; lease_expired and load_failed "
            "count hits whose lock went unused.",
            labels=["model", "outcome"],
        )
        requested = CounterMetricFamily(
            "prefixcache_lookup_pages",
            "Whole pages looked up (the ceiling's denominator).",
            labels=["model"],
        )
        distinct = GaugeMetricFamily(
            "prefixcache_lookup_distinct_pages",
            "Distinct pages among those looked up (a HyperLogLog estimate).",
            labels=["model"],
        )
        ceiling = GaugeMetricFamily(
            "prefixcache_hit_ratio_ceiling",
            "The hit ratio an infinite pool would reach: 1 - distinct / looked-up pages.",
            labels=["model"],
        )
        retained = GaugeMetricFamily(
            "prefixcache_retained_tokens",
            "Cached tokens under a client's retention (evicted after unretained ones).",
            labels=["model"],
        )
        hints = CounterMetricFamily(
            "prefixcache_retention_hints",
            "Retention hints by outcome (accepted, clipped, rejected).",
            labels=["model", "outcome"],
        )
        retained_evicted = CounterMetricFamily(
            "prefixcache_retained_evicted_tokens",
            "Tokens evicted while retained: the pool had no unretained tokens left.",
            labels=["model"],
        )
        for engine in list(svc.engines.values()):
            m = engine.name
            query.add_metric([m], engine.match_tokens)
            hit.add_metric([m], engine.hit_tokens)
            for op, n in engine.ops.items():
                ops.add_metric([m, op], n)
            for reason, n in engine.evicted_tokens.items():
                evicted.add_metric([m, reason], n)
            sizes = engine.sizes()
            for state in ("evictable", "protected"):
                cached.add_metric([m, state], sizes[state])
            if engine.kind == "swa":
                for state in ("swa_evictable", "swa_protected"):
                    cached.add_metric([m, state], sizes[state])
            slots.add_metric([m, "free"], sizes["free_slots"])
            slots.add_metric([m, "used"], sizes["used_slots"])
            slots.add_metric([m, "session"], engine.session_slots)
            capacity.add_metric([m], engine.pool_size)
            locks.add_metric([m], engine.num_locks)
            lookups = engine.lookups
            for outcome, n in list(lookups.tokens.items()):
                outcomes.add_metric([m, outcome], n)
            requested.add_metric([m], lookups.pages_requested)
            seen, best = lookups.ceiling()
            distinct.add_metric([m], seen)
            ceiling.add_metric([m], best)
            kept = engine.retentions
            retained.add_metric([m], kept.retained_tokens())
            for outcome, n in kept.outcomes.items():
                hints.add_metric([m, outcome], n)
            retained_evicted.add_metric([m], kept.evicted_tokens())
        yield from (
            query,
            hit,
            ops,
            evicted,
            cached,
            slots,
            capacity,
            locks,
            outcomes,
            requested,
            distinct,
            ceiling,
            retained,
            hints,
            retained_evicted,
        )
        yield GaugeMetricFamily(
            "prefixcache_sessions", "Open sessions (leased and streams).", value=len(svc.sessions)
        )
        yield CounterMetricFamily(
            "prefixcache_leases_expired",
            "Sessions closed because their lease lapsed.",
            value=svc.sessions.expired_total,
        )
        yield GaugeMetricFamily(
            "prefixcache_draining",
            "1 while the server drains for shutdown.",
            value=int(svc.draining),
        )
        integrity = CounterMetricFamily(
            "prefixcache_integrity_failures",
            "Pages refused, never served, because their seal did not check, by where they "
            "came from (tier, snapshot, disk) and why (seal_mismatch: bytes or identity "
            "changed; bad_seal: no seal; wrong_kind: a digest where a MAC is required, or "
            "the reverse; size: not a page and its seal; changed_after_checkpoint: after a "
            "crash, slots that took other KV after the last checkpoint).",
            labels=["source", "reason"],
        )
        for (source, reason), n in list(svc.integrity.counts.items()):
            integrity.add_metric([source, reason], n)
        yield integrity


class _LivenessCollector(Collector):
    """What keeps one client from hurting the others, read at scrape time: the loop's
    stalls (leases were extended by them) and the log records a slow sink cost."""

    def __init__(self, service: CacheService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "prefixcache_loop_stall_seconds",
            "Time the event loop ran late (busy or stopped); leases were extended by it.",
            value=self.service.sessions.stalled,
        )
        yield CounterMetricFamily(
            "prefixcache_log_records_dropped",
            "Log records dropped because the log sink (stderr) did not keep up.",
            value=dropped_records(),
        )


class _KvEventsCollector(Collector):
    """The KV-event publishers' counters, read at scrape time (events/publisher.py)."""

    _COUNTERS = (
        (
            "prefixcache_kv_event_batches_published",
            "batches_published",
            "KV-event batches sent on the model's ZMQ socket.",
        ),
        (
            "prefixcache_kv_events_published",
            "events_published",
            "KV events (BlockStored, BlockRemoved, AllBlocksCleared) in the batches sent.",
        ),
        (
            "prefixcache_kv_event_replays",
            "replays_served",
            "KV-event replay requests answered in full.",
        ),
        (
            "prefixcache_kv_event_replays_refused",
            "replays_refused",
            "KV-event replay requests refused: max_replays or max_replays_per_peer in flight.",
        ),
        (
            "prefixcache_kv_event_replays_dropped",
            "replays_dropped",
            "KV-event replay answers dropped: the requester read nothing for replay_timeout "
            "or left.",
        ),
        (
            "prefixcache_kv_event_replay_requests_invalid",
            "replay_requests_invalid",
            "Malformed KV-event replay requests ignored.",
        ),
        (
            "prefixcache_kv_event_replay_snapshots",
            "replay_snapshots",
            "Page-set snapshots built for replay requests older than the buffer (shared).",
        ),
    )

    def __init__(self, publishers: Mapping[str, Any]) -> None:
        self.publishers = publishers

    def collect(self) -> Iterator[Metric]:
        for name, attr, doc in self._COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["model"])
            for model, publisher in list(self.publishers.items()):
                family.add_metric([model], getattr(publisher, attr))
            yield family
