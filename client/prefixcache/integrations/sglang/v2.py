"""SGLang's pool-transfer calls (``batch_exists_v2``, ``batch_get_v2``, ``batch_set_v2``).

Hybrid models keep state beside the KV pages: Mamba and SWA pools (whose pages only
need to exist at the end of a prefix, ``trailing_pages``), DSA indexer pools and draft
pools (``all_pages``). The KV pool's pages go through the core (the same pages as
``batch_get_v1``/``batch_set_v1``); the pages of every other pool SGLang registered
(``register_mem_host_pool_v2``) through ``AuxPools`` (aux_pools.py). A pool never
registered is answered as missing: an existence check that names it finds no usable
prefix, and SGLang recomputes instead of loading KV without the state it needs.
"""

from __future__ import annotations

from typing import Any

from .aux_pools import KV, AuxPools, pool_name

TRAILING = "trailing_pages"
BLOCK_GROUPS = "block_groups"

__all__ = ["BLOCK_GROUPS", "KV", "TRAILING", "exists_v2", "pool_name", "restorable", "transfer_v2"]


def restorable(held: list[bool], policy: str, trailing: int) -> list[int]:
    """The prefix lengths (in pages, ascending) at which a pool whose pages under the
    prefix's keys are ``held`` can restore: ``all_pages`` needs every page of the
    prefix, ``trailing_pages`` the last ``trailing`` (fewer in a shorter prefix)."""
    if policy != TRAILING:
        run = held.index(False) if False in held else len(held)
        return list(range(1, run + 1))
    out, run = [], 0  # run: held pages ending at the prefix's end
    for i, page in enumerate(held):
        run = run + 1 if page else 0
        if run >= min(trailing, i + 1):
            out.append(i + 1)
    return out


def exists_v2(
    core: Any, keys: list[str], pool_transfers: list[Any] | None, pools: AuxPools | None = None
) -> tuple[int, dict[str, int], list[int]]:
    """``(usable pages, hits per pool, restorable prefix lengths)``, as SGLang's
    ``PoolTransferResult``: from the KV pool's leading run, each named pool keeps the
    prefix lengths it can restore (SGLang's ``PoolHitPolicy``; a TRAILING_PAGES pool
    leaves holes, so the lengths are a set, not a count); the usable prefix is the
    longest length left. A pool's hits are its own longest restorable prefix.
    ``block_groups`` pools (DeepSeek V4's compressed pages) are not stored: they get
    no verdict and never gate the prefix, as that policy says."""
    kv = core.exists(keys)
    hits = {KV: kv} if kv else {}
    usable = list(range(1, kv + 1))
    for transfer in pool_transfers or ():
        name = pool_name(transfer.name)
        policy = pool_name(getattr(transfer, "hit_policy", ""))
        if not usable:
            break
        if name == KV or policy == BLOCK_GROUPS:
            continue
        held = pools.present(name, keys[:kv]) if pools is not None else [False] * kv
        own = restorable(held, policy, max(1, len(transfer.keys or ())))
        if own:
            hits[name] = own[-1]
        kept = set(own)
        usable = [p for p in usable if p in kept]
    return (usable[-1] if usable else 0), hits, usable


def transfer_v2(
    core: Any, transfers: list[Any], prior: str | None, load: bool, pools: AuxPools | None = None
) -> dict[str, list[bool]]:
    """Each transfer's per-page results: the KV pool's through the core, a registered
    pool's through ``pools``, any other pool's all False."""
    out: dict[str, list[bool]] = {}
    for transfer in transfers:
        name, keys = pool_name(transfer.name), list(transfer.keys or ())
        if name == KV and transfer.host_indices is not None:
            out[name] = (
                core.get(keys, transfer.host_indices)
                if load
                else core.set(keys, transfer.host_indices, prior)
            )
        elif pools is not None and name in pools.pools:
            out[name] = (
                pools.load(name, keys, transfer.host_indices)
                if load
                else pools.store(name, keys, transfer.host_indices)
            )
        else:
            out[name] = [False] * len(keys)
    return out
