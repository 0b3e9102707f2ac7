"""A tier's part of the Explain RPC: what a lookup of one request would find in it after
the pool's hit, and what the last lookup of that request there did.

Only a tier that can answer without a store call (``Tier.peek``: the disk tier's index)
takes part: Explain reads and touches nothing, in the tree or in the store. Its answer
(``TierPart``):

* ``tokens``: the tokens right after the pool's hit that the tier holds, from the first;
* ``state``: what a lookup would do with them now: ``promote``, ``not_held``,
  ``capacity`` (its fetches hold ``max_fetch_slots`` already), ``breaker_open`` or
  ``unavailable`` (the tier skips reads now), or ``hit`` (nothing after the pool's hit);
* ``last``: the result of the last lookup of this request through the tier
  (``ModelTier.remember``, by the key of the last page it looked for): the tier's
  ``found`` label when it read pages, ``miss``, ``timeout``, ``refused``, ``capacity``,
  ``error``; empty when not remembered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefixcache.cache.hashing import hash_pages
from prefixcache.cache.key import TOKEN_BYTES

from .fetch import MAX_FETCH_PAGES, fetch_limit
from .model_tier import ModelTier
from .store_read import leading_run


@dataclass(frozen=True, slots=True)
class TierPart:
    """One tier's part of an explained request (see the module doc)."""

    tier: str
    tokens: int
    state: str
    last: str = ""
    last_tokens: int = 0


def explain_part(tier: Any, mt: ModelTier, key: Any, hit: int) -> TierPart | None:
    """``tier``'s part of ``key``, which hits the pool for ``hit`` tokens (whole pages);
    None where the tier cannot tell without a store call."""
    ps = mt.page_size
    n = len(key)
    pages = (n - n % ps) // ps
    done = hit // ps
    packed, width = key.packed()
    page_bytes = ps * TOKEN_BYTES * width
    # The chain from the namespace's root: the hashes the tree and the tier name pages by.
    hashes = hash_pages(packed[: pages * page_bytes], page_bytes, None) if pages else []
    keys = mt.keys.keys(key.extra_key, width, hashes)
    rest = keys[done:]
    held = tier.peek(mt, rest) if rest else []
    if held is None:
        return None
    found = leading_run(held, lambda c: c == 1)
    if not rest:
        state = "hit"
    elif not found:
        state = "not_held"
    else:
        why = tier.available()
        if why in ("breaker_open", "unavailable"):
            state = why
        elif fetch_limit(mt) <= 0:
            state = "capacity"
        else:
            state = "promote"
    reach = min(pages, done + MAX_FETCH_PAGES) if rest else pages
    last, last_tokens = mt.recent.get(keys[reach - 1], ("", 0)) if reach else ("", 0)
    return TierPart(tier.kind.name, found * ps, state, last, last_tokens)
