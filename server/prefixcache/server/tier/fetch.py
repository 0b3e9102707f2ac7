"""The read path: after a local hit, the pages that follow it, from a tier's store.

``prefetch(tier, engine, key)`` runs before a lookup is answered (servicer.py's Match):

1. On the loop: the local hit, and the chained hashes of the whole pages after it
   (chained on the hit's last page, so they are the hashes the writer used).
2. One ``exists`` over their keys (``Tier.probe``: off the loop for Mooncake, in the
   disk tier's index on it); the leading run found is wanted.
3. On the loop: the local hit again (the tree may have grown meanwhile), locked for the
   tier's session; fresh slots for the wanted pages, allocated to that session and
   moved at once into the model's quarantine (store_read.py, engine/slots.py).
4. Off the loop: ``get_into`` those slots' rows (and each page's seal) straight from
   the store, then every page's seal checked against the page's identity (seals.py).
   A store that stops at the deadline (the disk tier) answers its leading pages; the
   rest is a miss.
5. On the loop, once that thread has returned: the slots go back to the session, the
   leading run read whole and checked (every byte of every page) is inserted after the
   local hit, and the rest freed; a tier that keeps retentions gives the inserted
   pages theirs (``Tier.promoted``). The lookup that follows finds it in the tree, so
   it is answered as a hit like any local one.

Tiers stack (chain.py): the disk tier's prefetch runs first, so Mooncake's sees its
pages as part of the local hit and fetches only what follows them.

The lookup's store calls together are bounded by its deadline (``timeout``, grown
by each fetch's bytes: store_read.Deadline); a failure, a timeout or anything short
counts as a miss and leaves the tree as it was (the lookup's result: ``timeout`` when
the read missed the deadline, ``error`` when it failed); a page refused for its seal is
counted and ends the hit before it. Each result is remembered by the request's last
page's key (``ModelTier.remember``) for the Explain RPC. No room for a fetch (the
pool, ``tier.max_fetch_slots``) is the lookup result ``capacity``. The store call
cannot be cancelled, so its slots stay quarantined until its thread has returned,
whatever happens meanwhile (a timeout, a Reset: which voids the fetch): store_read.py,
shared with the hash-page fetch (fetch_pages.py).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from prefixcache.cache.hashing import hash_pages
from prefixcache.cache.key import TOKEN_BYTES
from prefixcache.cache.pools.allocator import host_indices

from .backend import code_name
from .keys import Namespace
from .model_tier import ModelTier
from .store_read import Deadline, StoreRead, leading_run, safely

log = logging.getLogger("prefixcache.server")

# Pages one lookup fetches at most (and never more than tier.max_fetch_slots hold).
MAX_FETCH_PAGES = 2048


def fetch_limit(mt: ModelTier) -> int:
    """Pages a fetch may take now: MAX_FETCH_PAGES, within the room left under
    ``tier.max_fetch_slots``."""
    return min(MAX_FETCH_PAGES, (mt.max_fetch_slots - mt.fetching) // mt.page_size)


async def prefetch(tier: Any, mt: ModelTier, key: Any, deadline: Deadline | None = None) -> int:
    """Bring the pages after ``key``'s local hit in from the store; returns the tokens
    fetched (0 on any miss). Never raises for a store failure. ``deadline``: of the
    lookup's store calls (default: a new one, ``tier.timeout`` from now)."""
    engine, ps = mt.engine, mt.page_size
    cache = engine.cache
    packed, width = key.packed()
    n = len(key)
    aligned = n - n % ps
    hit = cache.match_prefix(key)
    local = hit.prefix_len
    if local:
        mt.hit(hit.last_node)
    if local >= aligned:
        mt.looked_up(local, 0, "local")
        return 0
    why = tier.available()
    if why is not None:
        mt.looked_up(local, 0, why)
        return 0
    want = min((aligned - local) // ps, fetch_limit(mt))
    node = hit.last_node if local else None
    if want <= 0:
        reach = min((aligned - local) // ps, MAX_FETCH_PAGES)
        last = _hashes_after(cache, node, local, reach, packed, width, ps)[-1:]
        mt.remember(mt.keys.keys(key.extra_key, width, last)[0], "capacity")
        mt.looked_up(local, 0, "capacity")
        return 0
    hashes = _hashes_after(cache, node, local, want, packed, width, ps)
    keys = mt.keys.keys(key.extra_key, width, hashes)
    # One deadline for the whole lookup, grown by what it fetches.
    if deadline is None:
        deadline = Deadline(tier.cfg)
    codes = await tier.probe(mt, keys, deadline)
    found = leading_run(codes, lambda c: c == 1)
    failed = codes is None or (found < len(codes) and codes[found] < 0)
    if failed and codes is not None:
        tier.error("exists", code_name(codes[found]))
    if found == 0:
        why = "error" if failed else "miss"
        mt.remember(keys[-1], why)
        mt.looked_up(local, 0, why)
        return 0
    got, why = await _fetch(
        tier,
        mt,
        key,
        local,
        mt.keys.namespace(key.extra_key, width),
        hashes[:found],
        keys[:found],
        deadline,
    )
    mt.remember(keys[-1], mt.found if got else why, got)
    mt.looked_up(local, got, why)
    return got


def _hashes_after(
    cache: Any, node: Any, local: int, pages: int, packed: bytes, width: int, ps: int
) -> list[str]:
    """The chained hashes of ``pages`` pages after the first ``local`` tokens, which
    end at ``node`` (None for none)."""
    prior = None
    if node is not None:
        prior = bytes.fromhex(cache.compute_node_hash(node)[-1])
    token_bytes = TOKEN_BYTES * width
    tail = packed[local * token_bytes : (local + pages * ps) * token_bytes]
    return hash_pages(tail, ps * token_bytes, prior)


async def _fetch(
    tier: Any,
    mt: ModelTier,
    key: Any,
    local: int,
    ns: Namespace,
    hashes: list[str],
    keys: list[str],
    deadline: Deadline,
) -> tuple[int, str]:
    """Steps 3 to 5 of the module doc for the pages ``hashes`` (``keys``) that follow
    ``local``: the tokens fetched, and the lookup's result when none were (``miss``,
    ``error``: the store's read failed on its first page, ``refused``: its seal did not
    check, ``capacity``)."""
    engine, ps, session = mt.engine, mt.page_size, tier.session
    cache = engine.cache
    # 3. The tree may have grown while we asked: fetch only what it still lacks.
    result = cache.match_prefix(key[: local + len(keys) * ps])
    now = result.prefix_len
    if now < local or (now - local) % ps:
        return 0, "miss"  # the local hit shrank (evicted): leave it to the next lookup
    skip = (now - local) // ps
    keys, hashes = keys[skip:], hashes[skip:]
    if not keys:
        return 0, "miss"
    read = StoreRead(tier, mt)
    why = read.take(len(keys), result.last_node if now else None)
    if why is not None:
        return 0, why
    whole = await read.read(ns, hashes, keys, deadline)
    if whole == 0:
        return 0, read.outcome
    slots = read.slots
    # 5. Insert the run read whole after the (locked, so unchanged) local hit.
    end = now + whole * ps
    head = (
        host_indices(cache.match_prefix(key[:now]).indices)[:now]
        if now
        else np.zeros(0, dtype=np.int64)
    )
    inserted = 0
    mt.suppressed = True
    try:
        out = engine.insert(key[:end], np.concatenate([head, slots[: whole * ps]]), session)
        inserted = whole * ps
        got = end - max(out.prefix_len, now)
    except Exception:
        log.exception("tier fetch insert failed")
        tier.error("fetch", "INSERT")
        got = 0
    finally:
        mt.suppressed = False
    if inserted:
        try:
            tier.promoted(mt, key, now, keys[:whole])
        except Exception:
            log.exception("tier fetch could not retain what it promoted")
            tier.error("fetch", "RETAIN")
    safely(read.release, inserted)
    return got, "miss"
