"""Evict policy: how much of a shared cache one caller may flush, and who flushed it.

An Evict frees cached tokens that everybody shares, so one call of ``Evict(2**64-1)``
empties the cache for every worker. Two things keep that in check:

- **A cap.** With ``server.max_evict_tokens`` set, a call asking for more than that
  (tokens, SWA tokens or Mamba state slots, each) needs the admin token that Reset
  takes; anyone else gets PERMISSION_DENIED, counted in
  ``prefixcache_refusals_total{limit="max_evict_tokens"}``, and nothing is evicted.
  0, the default, lets any caller evict any amount (workers evict to make room).
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
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from .errors import DeniedError
from .sessions import Session
from .tenants import Caller

log = logging.getLogger("prefixcache.server")

CALLERS = ("session", "anonymous", "admin")
LIMIT = "max_evict_tokens"


def caller_kind(caller: Caller, session: Session | None) -> str:
    if caller.admin:
        return "admin"
    return "session" if session is not None else "anonymous"


class EvictPolicy:
    """The cap on Evict, and its counters by model and kind of caller.

    Args:
        max_tokens: ``server.max_evict_tokens`` (0: no cap).
        models: The hosted models, so every counter exists from the start.
    """

    def __init__(self, max_tokens: int, models: list[str]) -> None:
        self.max_tokens = max_tokens
        self.calls = {(m, c): 0 for m in models for c in CALLERS}
        self.tokens = {(m, c): 0 for m in models for c in CALLERS}

    def check(self, request: Any, caller: Caller) -> None:
        """Refuse, before anything is evicted, an ask over the cap without admin.

        Raises:
            DeniedError: PERMISSION_DENIED naming ``max_evict_tokens``.
        """
        cap = self.max_tokens
        if not cap or caller.admin:
            return
        asked = max(request.num_tokens, request.swa_num_tokens, request.mamba_num)
        if asked > cap:
            raise DeniedError(f"Evict of {asked} is more than server.max_evict_tokens "
                              f"({cap}) allows without the admin token", LIMIT)

    def record(self, engine: Any, request: Any, evicted: int, caller: Caller,
               session: Session | None) -> None:
        """Count a done eviction, and log who asked for it."""
        kind = caller_kind(caller, session)
        key = (engine.name, kind)
        if key in self.calls:  # a model added after start has no counters
            self.calls[key] += 1
            self.tokens[key] += evicted
        asked = max(request.num_tokens, request.swa_num_tokens, request.mamba_num)
        level = logging.INFO if asked >= max(engine.pool_size // 4, 1) else logging.DEBUG
        if log.isEnabledFor(level):
            log.log(level, "evict", extra={
                "model": engine.name, "caller": kind, "asked": asked, "evicted": evicted,
                "client": session.name if session is not None and session.name else "-",
                "session": session.id[:8] if session is not None else "-"})


class EvictCollector(Collector):
    """``EvictPolicy``'s counters, read at scrape time."""

    def __init__(self, policy: EvictPolicy) -> None:
        self.policy = policy

    def collect(self) -> Iterator[Metric]:
        calls = CounterMetricFamily("prefixcache_evict_calls",
                                    "Evict calls, by kind of caller (session, anonymous, "
                                    "admin).", labels=["model", "caller"])
        tokens = CounterMetricFamily("prefixcache_evict_call_tokens",
                                     "Tokens freed by Evict calls, by kind of caller.",
                                     labels=["model", "caller"])
        for (model, kind), n in list(self.policy.calls.items()):
            calls.add_metric([model, kind], n)
            tokens.add_metric([model, kind], self.policy.tokens[(model, kind)])
        yield calls
        yield tokens
