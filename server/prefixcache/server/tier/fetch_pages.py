"""The read path of the page RPCs (SGLang's HiCache backend): ExistsPages by hash.

SGLang names pages by their chained page hash and never sends their tokens, so the
pages the store has after the local leading run are brought in as *hash pages*
(hash_pages.py, page_index.py): fetched into fresh slots of the tier's session, then
stored as SetPages stores them (page_store.store_now), so that the ExistsPages handler that
follows counts them and a GetPages finds them. The keys are those of the same pages as
token pages (keys.py), so what a vLLM or token-level client cached on another node is
found by hash here, and the other way round.

As in fetch.py: one deadline for the lookup's store calls (grown by the fetch's bytes),
every page's seal checked before it is stored, and the read's slots kept by
store_read.py: quarantined until its thread has returned (a timeout or a Reset
meanwhile hands none of them out), a Reset in between voiding the fetch.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from prefixcache.cache.index.page_index import DIGEST_BYTES

from ..engine.hash_pages import HashPages
from ..engine.page_store import store_now
from .backend import code_name
from .fetch import fetch_limit
from .keys import Namespace
from .model_tier import ModelTier
from .store_read import Deadline, StoreRead, leading_run, safely

log = logging.getLogger("prefixcache.server")

# Local pages looked up between two turns of the loop (as ExistsPages does).
SLICE = 4096


def _hash(data: bytes, i: int) -> str:
    return data[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES].hex()


async def prefetch_pages(
    tier: Any, mt: ModelTier, namespace: tuple[str | None, int], data: bytes
) -> int:
    """Bring the pages after the local leading run of the packed page hashes ``data``
    in from the store as hash pages; returns the pages brought in (0 on any miss)."""
    engine, ps = mt.engine, mt.page_size
    pages = HashPages(engine)
    count = len(data) // DIGEST_BYTES
    local = 0
    while local < count:
        if local and local % SLICE == 0:
            await asyncio.sleep(0)  # a long local run: the other calls' turn
        if pages._locate(namespace, _hash(data, local)) is None:
            break
        local += 1
    if local == count:
        mt.looked_up(local * ps, 0, "local")
        return 0
    why = tier.available()
    if why is not None:
        mt.looked_up(local * ps, 0, why)
        return 0
    limit = fetch_limit(mt)
    if limit <= 0:
        mt.looked_up(local * ps, 0, "capacity")
        return 0
    wanted = [_hash(data, i) for i in range(local, min(local + limit, count))]
    keys = mt.keys.keys(namespace[0], namespace[1], wanted)
    deadline = Deadline(tier.cfg)
    codes = await tier.probe(mt, keys, deadline)
    found = leading_run(codes, lambda c: c == 1)
    failed = codes is None or (found < len(codes) and codes[found] < 0)
    if failed and codes is not None:
        tier.error("exists", code_name(codes[found]))
    got, why = 0, "error" if failed else "miss"
    if found:
        prior = _hash(data, local - 1) if local else None
        got, why = await _fetch_pages(
            tier, mt, pages, namespace, prior, wanted[:found], keys[:found], deadline
        )
    mt.looked_up(local * ps, got * ps, why)
    return got


async def _fetch_pages(
    tier: Any,
    mt: ModelTier,
    pages: HashPages,
    namespace: tuple[str | None, int],
    prior: str | None,
    hashes: list[str],
    keys: list[str],
    deadline: Deadline,
) -> tuple[int, str]:
    """The pages brought in, and the lookup's result when none were (fetch.py's)."""
    read = StoreRead(tier, mt)
    why = read.take(len(keys))
    if why is not None:
        return 0, why
    ns: Namespace = mt.keys.namespace(*namespace)
    whole = await read.read(ns, hashes, keys, deadline)
    if whole == 0:
        return 0, read.outcome
    ps = mt.page_size
    kept = 0
    mt.suppressed = True
    try:
        # Stored pages take their slots, pages held meanwhile free theirs (set's rules).
        store_now(pages, namespace, prior, hashes[:whole], read.slots[: whole * ps], read.session)
        kept = whole * ps
    except Exception:
        log.exception("tier fetch of hash pages failed to store them")
        tier.error("fetch", "INSERT")
        whole = 0
    finally:
        mt.suppressed = False
    safely(read.release, kept)
    return whole, "miss"
