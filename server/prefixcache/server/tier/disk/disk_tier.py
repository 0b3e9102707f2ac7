"""DiskTier: the local disk tier of one server (``server.disk``), one store per model.

A tier like the Mooncake one (service.py: the same lookup steps, deadlines, breaker,
fetches into quarantined pool slots, seals and write-back staging), whose store is a
DiskStore per model (store.py) opened at start: a path it cannot use fails the start.
It differs where a local index can:

* ``probe`` asks the store's index on the loop (no thread hop: a dict lookup per page,
  stopping at the first page it lacks);
* ``peek`` answers Explain from that index (explain.py), touching nothing;
* ``held`` lets write-back skip pages the disk holds already (a page read from disk
  and evicted again is not written twice);
* ``write_refusal`` adds ``disk_full`` while the file system is full;
* it keeps retentions (``keeps_retention``): a retained page the pool evicts keeps its
  priority on disk, and one tenant retains at most its share of the slots
  (``server.retention.tenant_share``, as of the pool; none with retention off); a
  page promoted while its retention is in force is retained in the pool again
  (``promoted``), as its tenant's hint would be.

Trust: pages are sealed like the tier's objects: with ``server.tier.secret_file`` set
(the secret is read from there), a MAC under a key per tenant and keyed object keys,
so that whoever can write the volume but lacks the secret cannot plant a page this
sidecar serves; without it a digest, which catches a torn or changed page. A secret
that changes makes the next start empty (its keys name other pages).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any

from prefixcache.cache.eviction import get_eviction_policy

from ...config.disk import DiskConfig
from ...config.retention import retention_share
from ...config.tier import TierConfig, read_tier_secret
from ...config.values import ConfigError
from ...memory.page_seal import derive_key
from ...sessions.retention import granted
from ..backend import PageRetention
from ..keys import model_fingerprint
from ..layout import PageLayout
from ..model_tier import ModelTier
from ..service import DISK, Tier
from ..store_read import Deadline
from ..writer import PutQueue
from .journal import VERSION
from .place import Place, model_folder
from .slot_file import FULL_ERRNOS, probe_direct
from .slot_index import owner_id
from .store import DiskStore, slots_for

log = logging.getLogger("prefixcache.server")


class DiskTier(Tier):
    """The disk tier of one server.

    Args:
        cfg: ``server.disk``.
        service: The CacheService whose tree models it serves (``models[].disk`` on).
        loop: The service's event loop.
        secret: The cluster secret (``server.tier.secret_file``), or None.

    Raises:
        ConfigError: ``disk.path`` cannot be used, or cannot hold ``disk.bytes``.
    """

    keeps_retention = True

    def __init__(
        self,
        cfg: DiskConfig,
        service: Any,
        loop: asyncio.AbstractEventLoop,
        secret: bytes | None = None,
    ) -> None:
        super().__init__(cfg, service, loop, DISK)
        self.place: Place | None = None
        try:
            self._open(cfg, service, secret)
        except BaseException:
            self.close()
            raise
        self.puts = PutQueue(None, loop.call_soon_threadsafe)
        self.connected = True

    def _open(self, cfg: DiskConfig, service: Any, secret: bytes | None) -> None:
        engines = [e for e in service.engines.values() if self.serves(e)]
        self.place = Place(cfg.path)
        if not engines:
            return
        layouts = {e.name: PageLayout(e.kv_pool, e.page_size) for e in engines}
        pool_bytes = {
            e.name: layouts[e.name].page_bytes * (e.pool_size // e.page_size) for e in engines
        }
        total = sum(pool_bytes.values()) or 1
        align = probe_direct(self.place.path)
        if not align:
            log.warning(
                "disk tier: the file system refuses O_DIRECT; pages are read and "
                "written through the page cache",
                extra={"path": str(self.place.path)},
            )
        keys_id = _keys_id(secret)
        limits = service.limits
        share = (
            retention_share(limits.retention, len(limits.tenants))
            if limits.retention.enabled
            else 0.0
        )
        shares = {e.name: cfg.bytes * pool_bytes[e.name] // total for e in engines}
        plans = {}
        for e in engines:
            page = layouts[e.name].page_bytes
            slot = -(-page // align) * align if align else page
            slots = slots_for(shares[e.name], slot)
            if slots < 1:
                raise ConfigError(
                    f"server.disk.bytes: model {e.name!r}'s share "
                    f"({shares[e.name]} bytes) holds no page of {slot} bytes"
                )
            plans[e.name] = (model_folder(e.config), slots, slot)
        self.place.prepare({folder: shares[name] for name, (folder, _, _) in plans.items()})
        for e in engines:
            folder, slots, slot = plans[e.name]
            identity = hashlib.blake2b(
                repr(
                    (
                        VERSION,
                        model_fingerprint(e.config),
                        layouts[e.name].page_bytes,
                        slot,
                        keys_id,
                    )
                ).encode(),
                digest_size=16,
            ).digest()
            try:
                store = DiskStore(
                    self.place.path / folder,
                    layouts[e.name].page_bytes,
                    slots,
                    slot,
                    align,
                    identity,
                    get_eviction_policy(e.config.eviction_policy),
                    e.name,
                    int(share * slots),
                )
            except OSError as exc:
                if exc.errno in FULL_ERRNOS:
                    raise ConfigError(
                        f"server.disk.bytes: the file system under "
                        f"{self.place.path} could not hold model {e.name!r}'s "
                        f"{slots * slot} bytes of pages"
                    ) from exc
                raise ConfigError(
                    f"server.disk.path: cannot make model {e.name!r}'s files "
                    f"under {self.place.path}: {exc.strerror or exc}"
                ) from exc
            mt = ModelTier(self, e, secret, backend=store, staging_stride=slot)
            for ptr, size in mt.regions():
                store.register(ptr, size)
            self.models[e.name] = mt
        log.info(
            "disk tier ready",
            extra={
                "path": str(self.place.path),
                "models": ",".join(self.models),
                "bytes": cfg.bytes,
                "direct_io": bool(align),
                "keyed": secret is not None,
            },
        )

    # ----------------------------------------------------------------- hooks

    async def probe(self, mt: ModelTier, keys: list[str], deadline: Deadline) -> list[int] | None:
        why = self.available()
        if why is not None:
            return None
        return mt.backend.exists(keys)

    def peek(self, mt: ModelTier, keys: list[str]) -> list[int] | None:
        return mt.backend.exists(keys)

    def held(
        self, mt: ModelTier, keys: list[str], retain: PageRetention | None = None
    ) -> list[bool] | None:
        return mt.backend.holds(keys, retain)

    def promoted(self, mt: ModelTier, key: Any, start: int, keys: list[str]) -> None:
        """Retain in the pool the promoted prefix up to its deepest page whose disk
        retention is in force, with that page's priority, seconds (renewed from now, as
        a hit in the pool renews) and tenant, as a hint of that tenant would be: within
        the server's bounds and the tenant's share of the pool. A lapsed retention, or
        one whose tenant is no longer configured, gives none."""
        retentions = mt.engine.retentions
        if not retentions.on:
            return
        found = mt.backend.retentions(keys)
        deepest = len(found) - 1
        while deepest >= 0 and found[deepest] is None:
            deepest -= 1
        held = found[deepest] if deepest >= 0 else None
        if held is None:
            return
        priority, seconds, owner = held
        tenants = {owner_id(None): None} | {
            owner_id(t.name): t.name for t in self.service.limits.tenants
        }
        if owner not in tenants:
            return
        hint = granted(seconds, priority, retentions.config)
        end = start + (deepest + 1) * mt.page_size
        cache = mt.engine.cache
        node, length = cache.peek_node(key[:end])
        if length != end:  # the prefix ends inside a node: split it there
            match = cache.match_prefix(key[:end])
            node, length = match.last_node, match.prefix_len
            if length != end:
                return
        cache.retain(node, hint.seconds, hint.priority, tenants[owner], retentions.limit)

    def write_refusal(self, mt: ModelTier) -> str | None:
        if mt.backend.full:
            return "disk_full"
        return super().write_refusal(mt)

    def _leave(self) -> None:
        for mt in self.models.values():
            try:
                mt.backend.close()
            except Exception:
                log.exception("disk tier close failed", extra={"model": mt.name})
        if self.place is not None:
            self.place.close()


def _keys_id(secret: bytes | None) -> str:
    """What names the key scheme: pages under another secret (or none) are not ours."""
    if secret is None:
        return "digest"
    return hashlib.blake2b(derive_key(secret, "disk-index", None), digest_size=16).hexdigest()


def start_disk(cfg: DiskConfig | None, service: Any, tier: TierConfig | None) -> DiskTier | None:
    """The server's disk tier, its stores open; None when ``server.disk`` is off or no
    model takes part. Call on the service's event loop.

    Raises:
        ConfigError: its path cannot be used (missing, read-only, locked, too small).
    """
    if cfg is None:
        return None
    secret = read_tier_secret(tier.secret_file) if tier is not None and tier.secret_file else None
    disk = DiskTier(cfg, service, asyncio.get_running_loop(), secret)
    if not disk.models:
        disk.close()
        log.warning(
            "server.disk is on but no model uses it (radix models with CPU pools; "
            "models[].disk: false opts out)"
        )
        return None
    return disk
