"""Evict policy: how much of a shared cache one caller may flush, and who flushed it.

An Evict frees cached tokens that everybody shares, so one call of ``Evict(2**64-1)``
empties the cache for every worker. Two things keep that in check:

- **A budget.** With ``server.max_evict_tokens`` set, each client may evict that much
  (tokens, SWA tokens or Mamba state slots, each) per ``server.evict_interval``
  seconds without the admin token that Reset takes: a token bucket that holds
  ``max_evict_tokens`` and refills at that rate. A cap per call would not bound a
  flush: 203 calls of ``Evict(64)`` empty another tenant's 12,928 tokens in 0.29 s.
  One call asking for more than the whole budget is
  PERMISSION_DENIED (it never fits); a call the bucket cannot cover yet is
  RESOURCE_EXHAUSTED, saying when it will; both change nothing and count in
  ``prefixcache_refusals_total{limit="max_evict_tokens"}``. The bucket is charged what
  a call asks for (the largest of its three amounts), evicted or not, and then what it
  freed beyond that (eviction takes whole entries). It is kept per
  client (``tenants.client_identity``: the session's client, or for a call without
  a session its caller's), not per session, since sessions are cheap to open: a
  tenant has one budget however many sessions its workers hold. 0, the default, lets
  any caller evict any amount (workers evict to make room; allocations evict what
  they need by themselves, outside this budget).
- **Attribution.** Evict takes an optional ``session_id`` (a Session stream's own
  session inside the stream), and every call is counted by who made it in
  ``prefixcache_evict_calls_total`` and ``prefixcache_evict_call_tokens_total``,
  labelled by ``model`` and ``caller`` (session, anonymous or admin: a fixed set, so
  no label grows with the clients). The client behind a call is named in the log:
  at INFO for a call that asks for a quarter of the pool or more (a flush), at DEBUG
  for the rest, so routine evictions under memory pressure do not flood the log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from ..access.tenants import PEER, Caller, client_identity
from ..errors import DeniedError, OverLimitError
from .session import Session

log = logging.getLogger("prefixcache.server")

CALLERS = ("session", "anonymous", "admin")
LIMIT = "max_evict_tokens"
# Buckets kept at most; beyond, the full ones (as good as none) go first, then the
# oldest, so clients that come and go cannot grow the table.
MAX_BUCKETS = 4096


def caller_kind(caller: Caller, session: Session | None) -> str:
    if caller.admin:
        return "admin"
    return "session" if session is not None else "anonymous"


class EvictPolicy:
    """The cap on Evict, and its counters by model and kind of caller.

    Args:
        max_tokens: ``server.max_evict_tokens`` (0: no cap).
        models: The hosted models, so every counter exists from the start.
        interval: ``server.evict_interval``: seconds in which a client's bucket refills
            from empty to ``max_tokens``.
        clock: Monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        max_tokens: int,
        models: list[str],
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_tokens = max_tokens
        self.interval = interval
        self.clock = clock
        self.calls = {(m, c): 0 for m in models for c in CALLERS}
        self.tokens = {(m, c): 0 for m in models for c in CALLERS}
        # Client -> [tokens left, when last counted]; insertion order is age.
        self._buckets: dict[str, list[float]] = {}

    def check(self, request: Any, caller: Caller, session: Session | None = None) -> None:
        """Refuse, before anything is evicted, an ask the caller's budget cannot cover
        (no admin token); otherwise charge it.

        Raises:
            DeniedError: PERMISSION_DENIED naming ``max_evict_tokens``: more than the
                whole budget.
            OverLimitError: RESOURCE_EXHAUSTED naming it: more than is left now.
        """
        cap = self.max_tokens
        if not cap or caller.admin:
            return
        asked = max(request.num_tokens, request.swa_num_tokens, request.mamba_num)
        if asked > cap:
            raise DeniedError(
                f"Evict of {asked} is more than server.max_evict_tokens "
                f"({cap}) allows without the admin token",
                LIMIT,
            )
        bucket = self._bucket(_client(caller, session))
        if asked > bucket[0]:
            wait = (asked - bucket[0]) * self.interval / cap
            raise OverLimitError(
                f"Evict of {asked}: this client may evict {cap} per {self.interval:g} s "
                f"without the admin token (server.max_evict_tokens, "
                f"server.evict_interval) and has {int(bucket[0])} left; retry in "
                f"{wait:.2f} s",
                LIMIT,
            )
        bucket[0] -= asked

    def _bucket(self, client: str) -> list[float]:
        """``client``'s bucket, refilled up to now."""
        now, cap = self.clock(), self.max_tokens
        bucket = self._buckets.get(client)
        if bucket is None:
            if len(self._buckets) >= MAX_BUCKETS:
                self._prune(now)
            bucket = self._buckets[client] = [float(cap), now]
        else:
            bucket[0] = min(float(cap), bucket[0] + (now - bucket[1]) * cap / self.interval)
            bucket[1] = now
        return bucket

    def _prune(self, now: float) -> None:
        cap, rate = self.max_tokens, self.max_tokens / self.interval
        full = [c for c, (left, at) in self._buckets.items() if left + (now - at) * rate >= cap]
        for client in full:
            del self._buckets[client]
        while len(self._buckets) >= MAX_BUCKETS:
            del self._buckets[next(iter(self._buckets))]

    def record(
        self, engine: Any, request: Any, evicted: int, caller: Caller, session: Session | None
    ) -> None:
        """Count a done eviction, charge the caller's budget what it freed beyond its
        ask (eviction takes whole entries), and log who asked for it."""
        if self.max_tokens and not caller.admin:
            over = evicted - max(request.num_tokens, request.swa_num_tokens, request.mamba_num)
            bucket = self._buckets.get(_client(caller, session)) if over > 0 else None
            if bucket is not None:  # may go below 0: the next ask waits for the refill
                bucket[0] -= over
        kind = caller_kind(caller, session)
        key = (engine.name, kind)
        if key in self.calls:  # a model added after start has no counters
            self.calls[key] += 1
            self.tokens[key] += evicted
        asked = max(request.num_tokens, request.swa_num_tokens, request.mamba_num)
        level = logging.INFO if asked >= max(engine.pool_size // 4, 1) else logging.DEBUG
        if log.isEnabledFor(level):
            log.log(
                level,
                "evict",
                extra={
                    "model": engine.name,
                    "caller": kind,
                    "asked": asked,
                    "evicted": evicted,
                    "client": session.name if session is not None and session.name else "-",
                    "session": session.id[:8] if session is not None else "-",
                },
            )


def _client(caller: Caller, session: Session | None) -> str:
    """Whose budget an Evict is charged to: its session's client, else its caller's."""
    if session is not None and session.client:
        return session.client
    return client_identity(caller, PEER.get(), "")


class EvictCollector(Collector):
    """``EvictPolicy``'s counters, read at scrape time."""

    def __init__(self, policy: EvictPolicy) -> None:
        self.policy = policy

    def collect(self) -> Iterator[Metric]:
        calls = CounterMetricFamily(
            "prefixcache_evict_calls",
            "Evict calls, by kind of caller (session, anonymous, admin).",
            labels=["model", "caller"],
        )
        tokens = CounterMetricFamily(
            "prefixcache_evict_call_tokens",
            "Tokens freed by Evict calls, by kind of caller.",
            labels=["model", "caller"],
        )
        for (model, kind), n in list(self.policy.calls.items()):
            calls.add_metric([model, kind], n)
            tokens.add_metric([model, kind], self.policy.tokens[(model, kind)])
        yield calls
        yield tokens
