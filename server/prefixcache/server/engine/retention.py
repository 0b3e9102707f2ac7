"""A model's retentions as the service grants them (prefixcache.cache.retention).

A hint (sessions/retention.py) retains the prefix that ends at a node, owned by the
caller's tenant (every caller without a tenant's token counts as one tenant, None), and
the tokens one tenant retains stay within its share of the pool (config/retention.py).
Radix models keep retentions; on other kinds, or with retention off, a hint is rejected
and the call it came with goes on as if it had none. Every hint is counted by outcome.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefixcache.cache.retention import ACCEPTED, CLIPPED, REJECTED

from ..config import RetentionConfig
from ..config.retention import retention_share
from ..sessions.retention import Hint

OUTCOMES = (ACCEPTED, CLIPPED, REJECTED)


@dataclass(frozen=True, slots=True)
class Grant:
    """What a hint did: its outcome, the tokens of its prefix retained now, and the
    seconds and priority granted."""

    outcome: str
    tokens: int
    seconds: float
    priority: int


class Retentions:
    """The retention side of one engine (its ``cache`` is read when a hint comes)."""

    def __init__(self, config: RetentionConfig, engine: Any, tenants: int = 0) -> None:
        self.config = config
        self.engine = engine
        self.on = config.enabled and engine.kind == "radix"
        self.limit = int(retention_share(config, tenants) * engine.config.pool.size)
        self.outcomes = dict.fromkeys(OUTCOMES, 0)  # fixed keys: the metrics thread reads

    def grant(self, node: Any, hint: Hint, tenant: str | None) -> Grant:
        """Apply ``hint`` to the prefix ending at ``node`` (None: nothing cached, so
        nothing to retain) for ``tenant``."""
        if not self.on:
            return self._counted(Grant(REJECTED, 0, hint.seconds, hint.priority))
        tokens, outcome = 0, ACCEPTED
        if node is not None:
            result = self.engine.cache.retain(node, hint.seconds, hint.priority, tenant, self.limit)
            tokens, outcome = result.tokens, result.outcome
        if outcome == ACCEPTED and hint.clipped:
            outcome = CLIPPED
        return self._counted(Grant(outcome, tokens, hint.seconds, hint.priority))

    def of_prefix(self, key: Any, hint: Hint, tenant: str | None) -> tuple[int, Grant]:
        """Apply ``hint`` to the longest cached prefix of ``key`` that ends at a node,
        found without a lookup (nothing is touched or counted as a hit); returns that
        prefix's length too."""
        node, cached = self.engine.cache.peek_node(key) if self.on else (None, 0)
        return cached, self.grant(node if cached else None, hint, tenant)

    def lapse(self, batch: int) -> int:
        """End up to about ``batch`` retentions whose time has passed."""
        book = getattr(self.engine.cache, "retention", None) if self.on else None
        return book.lapse_due(limit=batch) if book is not None else 0

    def retained_tokens(self) -> int:
        return int(self.engine.cache.retained_tokens()) if self.on else 0

    def evicted_tokens(self) -> int:
        """Tokens eviction took while retained (the pool had no other room)."""
        book = getattr(self.engine.cache, "retention", None) if self.on else None
        return book.evicted if book is not None else 0

    def _counted(self, grant: Grant) -> Grant:
        self.outcomes[grant.outcome] += 1
        return grant
