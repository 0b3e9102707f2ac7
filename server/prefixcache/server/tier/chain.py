"""The tiers below the pools, in the order a lookup consults them: the pool, then the
local disk tier (``server.disk``, disk/), then the shared Mooncake tier
(``server.tier``).

Each tier's step brings in the pages that follow the lookup's hit as it stands when the
step runs, so the disk tier's pages extend the hit the Mooncake tier then looks past,
and the handler that follows answers all of them as hits. A model's pool hits are
counted by the first tier its lookups go through (``ModelTier.counts_local``), so
``prefixcache_tier_hit_tokens_total`` adds up: ``local`` + ``disk`` + ``remote``.
"""

from __future__ import annotations

from typing import Any

from .explain import TierPart, explain_part
from .service import Tier, start_tier


class Tiers:
    """The server's tiers (``tiers``, lookup order), as one hook for the servicer."""

    def __init__(self, tiers: list[Tier]) -> None:
        self.tiers = tiers
        seen: set[str] = set()
        for tier in tiers:
            for name, mt in tier.models.items():
                mt.counts_local = name not in seen
                seen.add(name)
        # Models some tier serves: a miss in their tree may be a hit of the service.
        self.models = {name: [t.models[name] for t in tiers if name in t.models] for name in seen}

    async def before_match(self, request: Any) -> None:
        for tier in self.tiers:
            await tier.before_match(request)

    async def before_step(self, request: Any) -> None:
        for tier in self.tiers:
            await tier.before_step(request)

    async def before_stream_op(self, request: Any) -> None:
        for tier in self.tiers:
            await tier.before_stream_op(request)

    async def before_exists_pages(self, request: Any) -> None:
        for tier in self.tiers:
            await tier.before_exists_pages(request)

    def explain(self, model: str, key: Any, hit: int) -> list[TierPart]:
        """Each tier's part of ``key`` (explain.py), which hits ``model``'s pool for
        ``hit`` tokens: the tiers that can tell without a store call."""
        parts = []
        for tier in self.tiers:
            mt = tier.models.get(model)
            if mt is not None and not tier.closed:
                part = explain_part(tier, mt, key, hit)
                if part is not None:
                    parts.append(part)
        return parts

    def close(self) -> None:
        """Close the lowest first: a tier's hooks were set over the ones above it."""
        for tier in reversed(self.tiers):
            tier.close()


def start_tiers(server: Any, service: Any) -> Tiers | None:
    """The tiers ``server`` (ServerConfig) turns on, or None. The disk tier opens its
    stores now (a path it cannot use fails the start: ConfigError); the Mooncake tier
    connects in the background. Call on the service's event loop."""
    from .disk import start_disk

    tiers: list[Tier] = []
    try:
        disk = start_disk(server.disk, service, server.tier)
        if disk is not None:
            tiers.append(disk)
        shared = start_tier(server.tier, service)
        if shared is not None:
            tiers.append(shared)
    except BaseException:
        for tier in reversed(tiers):
            tier.close()
        raise
    return Tiers(tiers) if tiers else None
