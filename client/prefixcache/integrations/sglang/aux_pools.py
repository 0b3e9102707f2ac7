"""SGLang's other host pools (Mamba, SWA, DSA indexer, draft) kept beside the KV pages.

SGLang's v2 calls move, beside the KV pool's pages, pages of other host pools: a Mamba
pool's state at a prefix's last page and an SWA pool's window KV of its last pages (both
``trailing_pages``: only the last N pages of a prefix need them), an indexer pool's page
of every page (``all_pages``). A page of such a pool is one *flat page* of its host pool
(``get_data_page(flat=True)``), of one size per pool.

The sidecar keeps them the way SGLang's own backends do (HiCacheFile, Mooncake: one
object per page key and pool), as opaque bytes in the model's KV pool: a pool page is
cut into as many of the KV host pool's flat pages as it takes (the last one padded with
zeros) and those *parts* are stored as hash pages, by the same ExistsPages / GetPages /
SetPages and Alloc / pool-copy path as the KV pages (``HiCacheCore``), so they share the
pool, eviction, locks, sessions and integrity checks, and a failure is a miss. A part's
hash is the SHA-256 of a tag, the pool's name, the pool page's size, the page key and
the part's number: no part is ever taken for a KV page, for another pool's page, or for
a page of a pool of another shape (another model's Mamba state).

A pool page is held when all its parts are. The parts of one transfer are stored as one
chain (one tree path): eviction takes them from its end, a get reads the leading run.
KV pages and their state are evicted independently, which the v2 contract allows:
``batch_exists_v2`` answers the longest KV prefix at which every pool can restore
(v2.py), and a get that finds a part gone answers that page False, so SGLang recomputes
instead of loading KV without its state.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("prefixcache.integrations.sglang")

KV = "kv"
_TAG = b"prefixcache/sglang-hicache-pool\x00"
# Parts per ExistsPages / GetPages / SetPages call (SGLang's own STORAGE_BATCH_SIZE);
# a pool page larger than that goes whole in one call.
BATCH_PARTS = 128
# Bytes of parts in flight per call (like the core's GROUP_BYTES).
BATCH_BYTES = 64 << 20


def pool_name(name: Any) -> str:
    """A ``PoolName`` (a str enum) or a plain string as its value."""
    return str(getattr(name, "value", name))


def part_hashes(pool: str, page_bytes: int, key: str, parts: int) -> list[str]:
    """The hashes the parts of pool ``pool``'s page under page key ``key`` are stored by."""
    base = _TAG + pool.encode() + b"\x00" + page_bytes.to_bytes(8, "little") + bytes.fromhex(key)
    return [hashlib.sha256(base + i.to_bytes(4, "little")).hexdigest() for i in range(parts)]


@dataclass(frozen=True, slots=True)
class AuxPool:
    """One registered host pool: its positions a page and the bytes of a flat page."""

    name: str
    host: Any
    page_size: int
    page_bytes: int


@dataclass(frozen=True, slots=True)
class _Parts:
    """How a pool page is cut into KV flat pages."""

    count: int  # parts a pool page
    elems: int  # elements of one KV flat page
    dtype: Any  # the KV host pool's dtype

    @property
    def nbytes(self) -> int:
        return self.elems * self.dtype.itemsize


class AuxPools:
    """The non-KV pools of one backend, stored through ``core`` (see the module doc)."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.pools: dict[str, AuxPool] = {}

    def register(self, name: Any, host: Any) -> None:
        """Take SGLang's host pool ``name`` (``register_mem_host_pool_v2``); the KV pool
        is the core's (``register_mem_pool_host``).

        A pool whose flat pages are empty or cannot be had (SGLang's logical anchor
        pools) is not taken: its pages answer missing.
        """
        name = pool_name(name)
        if name == KV:
            return
        try:
            dummy = host.get_dummy_flat_data_page()
            page_bytes = int(dummy.numel()) * int(dummy.element_size())
        except Exception as exc:  # SGLang's start must not fail on a pool we skip
            page_bytes, why = 0, repr(exc)
        else:
            why = "its pages hold no bytes"
        if page_bytes < 1:
            log.warning(
                "prefixcache HiCache: host pool %r is not stored (%s); prefixes "
                "that need it are misses",
                name,
                why,
            )
            return
        page_size = int(getattr(host, "page_size", 1) or 1)
        self.pools[name] = AuxPool(name, host, page_size, page_bytes)

    # ------------------------------------------------------------ the calls

    def present(self, name: str, keys: list[str]) -> list[bool]:
        """Whether pool ``name``'s page under each key is held (False throughout for a
        pool never registered, or when the sidecar cannot answer)."""
        pool, parts = self.pools.get(name), self._parts(name)
        valid = self.core._hashes(keys) if pool is not None and parts is not None else []
        if not valid or pool is None or parts is None:
            return [False] * len(keys)
        hashes = [h for key in valid for h in part_hashes(name, pool.page_bytes, key, parts.count)]
        held = self.core._guard("exists", functools.partial(self._exists, hashes))
        if held is None:
            return [False] * len(keys)
        n = parts.count
        found = [all(held[i * n : (i + 1) * n]) for i in range(len(valid))]
        return found + [False] * (len(keys) - len(valid))

    def store(self, name: str, keys: list[str], host_indices: Any) -> list[bool]:
        """Store pool ``name``'s pages at ``host_indices`` under ``keys``; per key,
        held after."""
        pool, parts = self.pools.get(name), self._parts(name)
        starts = None if pool is None else _starts(pool, len(keys), host_indices)
        if (
            pool is None
            or parts is None
            or starts is None
            or len(self.core._hashes(keys)) < len(keys)
        ):
            return [False] * len(keys)
        held: list[bool] = []
        prior: str | None = None
        step = self._per_call(parts)
        for first in range(0, len(keys), step):
            chunk = keys[first : first + step]
            hashes = [
                h for key in chunk for h in part_hashes(name, pool.page_bytes, key, parts.count)
            ]
            got = self.core._guard(
                "set",
                functools.partial(
                    self._store_parts, pool, parts, hashes, starts[first : first + step], prior
                ),
            )
            n = parts.count
            held += [got is not None and all(got[j * n : (j + 1) * n]) for j in range(len(chunk))]
            prior = hashes[-1]  # the next chunk continues this chain
        self.core._count(aux_pages_stored=sum(held))
        return held

    def load(self, name: str, keys: list[str], host_indices: Any) -> list[bool]:
        """Copy the leading run of held pages of pool ``name`` into its host pool at
        ``host_indices``; per key, loaded."""
        pool, parts = self.pools.get(name), self._parts(name)
        starts = None if pool is None else _starts(pool, len(keys), host_indices)
        if pool is None or parts is None or starts is None:
            return [False] * len(keys)
        valid = self.core._hashes(keys)
        loaded, step = 0, self._per_call(parts)
        while loaded < len(valid):
            chunk = valid[loaded : loaded + step]
            hashes = [
                h for key in chunk for h in part_hashes(name, pool.page_bytes, key, parts.count)
            ]
            whole = (
                self.core._guard(
                    "get",
                    functools.partial(
                        self._load_parts, pool, parts, hashes, starts[loaded : loaded + step]
                    ),
                )
                or 0
            )
            loaded += whole
            if whole < len(chunk):
                break
        self.core._count(aux_pages_loaded=loaded)
        return [True] * loaded + [False] * (len(keys) - loaded)

    # ------------------------------------------------------------- helpers

    def _store_parts(
        self, pool: AuxPool, parts: _Parts, hashes: list[str], starts: list[int], prior: str | None
    ) -> list[bool]:
        """Cut the pages at ``starts`` into parts and store them as one chain after
        ``prior``; per part, held after."""
        import torch

        values = []
        for start in starts:
            page = pool.host.get_data_page(start, flat=True).contiguous()
            padded = torch.zeros(parts.count * parts.nbytes, dtype=torch.uint8)
            padded[: pool.page_bytes] = page.reshape(-1).view(torch.uint8)
            values += list(padded.view(parts.dtype).view(parts.count, parts.elems))
        return self.core._store(hashes, None, values, prior)

    def _load_parts(
        self, pool: AuxPool, parts: _Parts, hashes: list[str], starts: list[int]
    ) -> int:
        """Read the leading run of parts; put each page read whole into the host pool
        at its start; the pages put."""
        import torch

        targets = torch.zeros(len(hashes), parts.elems, dtype=parts.dtype)
        whole = self.core._load(hashes, None, list(targets)) // parts.count
        data = targets.view(len(starts), -1).view(torch.uint8)
        for j in range(min(whole, len(starts))):
            page = pool.host.get_dummy_flat_data_page().contiguous()
            page.view(-1).view(torch.uint8).copy_(data[j, : pool.page_bytes])
            pool.host.set_from_flat_data_page(starts[j], page)
        return whole

    def _exists(self, hashes: list[str]) -> list[bool]:
        settings, held = self.core.settings, []
        session = self.core._ready()[0]  # needed where the service has tenants or quotas
        for i in range(0, len(hashes), BATCH_PARTS):
            # before_set: a probe of the state is no lookup (the KV probe counted it).
            held += self.core.client.exists_pages(
                settings.model,
                hashes[i : i + BATCH_PARTS],
                extra_key=settings.namespace,
                token_width=settings.token_width,
                before_set=True,
                session=session,
            ).present
        return held

    def _parts(self, name: str) -> _Parts | None:
        """How pool ``name``'s pages are cut, or None (no such pool, no KV host pool)."""
        pool, host = self.pools.get(name), self.core.host
        if pool is None or host is None:
            return None
        elems = (1 if host.is_mla else 2) * math.prod(host.page_dims(host.head_num, host.head_dim))
        nbytes = elems * host.dtype.itemsize
        return _Parts(-(-pool.page_bytes // nbytes), elems, host.dtype)

    @staticmethod
    def _per_call(parts: _Parts) -> int:
        """Pool pages a call: at most BATCH_PARTS parts and BATCH_BYTES, at least one."""
        return max(1, min(BATCH_PARTS, BATCH_BYTES // parts.nbytes) // parts.count)


def _starts(pool: AuxPool, count: int, host_indices: Any) -> list[int] | None:
    """The first host position of each of ``count`` pages (``page_size`` positions a
    page, as SGLang passes them), or None when they do not add up."""
    if host_indices is None:
        return None
    import torch

    flat = torch.as_tensor(host_indices).reshape(-1)
    if flat.numel() != count * pool.page_size:
        return None
    return [int(v) for v in flat[:: pool.page_size].tolist()]
