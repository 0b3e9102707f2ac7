"""What Stats shows a tenant: its own namespaces' numbers, not the other tenants'.

A model's counters are the whole cache's, so a tenant that read them would see the
others' hits (a side channel: whether somebody else's prompts are being served from the
cache). With ``server.tenants`` set, each model also counts lookups
by the tenants whose namespaces they fall in, and a caller bound to a tenant's token
sees, in Stats and in Step replies:

* ``match_tokens_total`` and ``hit_tokens_total``: of Match (and Step admissions) in
  its own namespaces, whoever made them;
* ``session_slots``, ``locks``, ``session_state_slots`` and ``evicted_tokens_total``:
  0, since they add up every tenant's sessions and evictions;
* the pool's room as everyone sees it (``pool_size``, ``free_slots``, the evictable
  and protected sizes, ``free_state_slots``): a worker needs them to admit requests
  (SGLang's scheduler counts on the evictable size), and they sum the whole pool
  without telling whose entries are in it.

Stats's ``sessions`` is the tenant's own open sessions, and ``top_sessions`` is refused
to tenants (servicer_ops.py). Page-hash lookups (ExistsPages) are counted in the
model's totals only.
"""

from __future__ import annotations

from typing import Any

from prefixcache.v1 import prefix_cache_pb2 as pb

from ..config.tenants import TenantConfig
from .tenants import CALLER, client_identity

# Namespaces whose owners are remembered; beyond, the memo starts over (a lookup is a
# few prefix tests per tenant, so the memo only saves time, never bounds anything).
_MEMO = 4096
# ModelStats fields that sum every tenant's sessions and evictions.
_HIDDEN = ("session_slots", "locks", "session_state_slots", "evicted_tokens_total")


class TenantCounts:
    """One model's lookups by tenant: the tenants whose prefixes an ``extra_key``
    starts with (``tenants.Caller.may_use``) each count it."""

    __slots__ = ("_memo", "_tenants", "hit", "match")

    def __init__(self, tenants: tuple[TenantConfig, ...]) -> None:
        self._tenants = tuple((t.name, t.namespaces) for t in tenants)
        self._memo: dict[str, tuple[str, ...]] = {}
        self.match: dict[str, int] = {}
        self.hit: dict[str, int] = {}

    def owners(self, extra_key: str | None) -> tuple[str, ...]:
        key = extra_key or ""
        found = self._memo.get(key)
        if found is None:
            found = tuple(
                name
                for name, spaces in self._tenants
                if any(key.startswith(prefix) for prefix in spaces)
            )
            if len(self._memo) >= _MEMO:
                self._memo.clear()
            self._memo[key] = found
        return found

    def count(self, extra_key: str | None, tokens: int, hit: int) -> None:
        for name in self.owners(extra_key):
            self.match[name] = self.match.get(name, 0) + tokens
            self.hit[name] = self.hit.get(name, 0) + hit


def sessions_seen(sessions: Any) -> int:
    """Stats's ``sessions`` for the caller of the call being handled: a tenant's own
    open sessions, or every open session for anyone else."""
    caller = CALLER.get()
    if caller.tenant is None or not caller.bound:
        return len(sessions)
    return sessions.count_of(client_identity(caller, "", ""))


def tenant_view(stats: pb.ModelStats, engine: Any) -> pb.ModelStats:
    """``stats`` of ``engine`` as the caller of the call being handled may see them:
    unchanged for a caller bound to no tenant."""
    caller = CALLER.get()
    if caller.tenant is None or not caller.bound:
        return stats
    counts: TenantCounts | None = getattr(engine, "tenant_counts", None)
    stats.match_tokens_total = counts.match.get(caller.tenant, 0) if counts else 0
    stats.hit_tokens_total = counts.hit.get(caller.tenant, 0) if counts else 0
    for name in _HIDDEN:
        setattr(stats, name, 0)
    return stats
