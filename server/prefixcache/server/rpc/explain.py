"""The Explain RPC: for one request, how far it hits and why it stops.

A request is named by its tokens (as a Match names them) or by the chained page hash of
its last whole page (as KV events and SGLang name pages). The answer is the outcome of
each range (``prefixcache.cache.radix.lookup_outcomes``), as ``prefixcache_lookup_tokens_total``
would count a lookup of it, but nothing is counted and, for a radix model, nothing in
the tree is touched. A tenant's token is answered about its own namespaces only: the
other namespaces looked into are the tenant's, so it cannot learn what another tenant
has cached. For a radix model's request named by its tokens, the tiers below the pool
that can tell without a store call (the disk tier) add their part after the hit: what
they hold, what a lookup would do with it now, and what the last lookup of the request
there did (tier/explain.py).
"""

from __future__ import annotations

from typing import Any

from prefixcache.cache import InvalidInputError, RadixKey
from prefixcache.cache.index.page_ids import namespace_salt, sha_page_id
from prefixcache.cache.index.page_index import is_hash_namespace
from prefixcache.cache.radix.lookup_outcomes import (
    HIT,
    MISS_COLD,
    MISS_EVICTED,
    MISS_NAMESPACE,
    Classified,
    cached_bytes,
)
from prefixcache.v1 import prefix_cache_pb2 as pb

from ..access.limits import Limits, request_tokens
from ..access.tenants import CALLER, PEER, client_identity
from ..access.turns import Turns
from ..codec import MAX_TOKEN_WIDTH, decode_key
from ..engine.lookups import outcome_value
from ..errors import PreconditionError

_HEX = frozenset("0123456789abcdef")


def explain_key(engine: Any, key: RadixKey, namespaces: Any = None) -> Classified:
    """Why ``key`` hits as far as it does. A radix model's hit is read without
    touching the tree; an SWA or Mamba model's is a match (its window and states
    decide it), which refreshes the prefix as a Match would."""
    if engine.kind not in ("radix", "swa", "mamba"):
        raise PreconditionError(
            f"model {engine.name!r} is CACHE_KIND_{engine.kind.upper()}: "
            "Explain needs a radix, SWA or Mamba model"
        )
    if engine.kind == "radix":
        packed, width = key.packed()
        page_bytes = 4 * width * engine.page_size
        end = len(packed) - len(packed) % page_bytes
        root = engine.cache.root_node.children.get((key.extra_key, width))
        hit = cached_bytes(root, packed, end, page_bytes) // (4 * width)
    else:
        hit = engine.cache.match_prefix(key).prefix_len
    return engine.lookups.classify(
        engine.cache, key, hit, check_same=engine.kind != "radix", namespaces=namespaces
    )


def explain_hash(
    engine: Any, namespace: tuple[str | None, int], page_hash: str, namespaces: Any = None
) -> Classified:
    """Why the page ``page_hash`` (and so the prompt it ends) hits or not: a hit
    through it (its chain's pages), or one page's range saying why not."""
    index = getattr(engine, "page_index", None)
    if index is None:
        raise PreconditionError(
            f"model {engine.name!r} has no page hashes to look "
            "prompt_hash up by (a radix model with "
            "server.change_log_capacity > 0)"
        )
    size = engine.page_size
    out = Classified()
    if index.find(namespace, page_hash) is not None:
        _, depth = index.path(namespace, page_hash)
        out.add(HIT, 0, depth * size)
        return out
    for other in index.namespaces():
        extra_key = other[0]
        if (
            other == namespace
            or other[1] != namespace[1]
            or is_hash_namespace(extra_key)
            or (namespaces is not None and not namespaces(extra_key))
        ):
            continue
        if index.find(other, page_hash) is not None:
            _, depth = index.path(other, page_hash)
            out.add(MISS_NAMESPACE, 0, depth * size)
            out.namespace = extra_key
            return out
    evicted = sha_page_id(page_hash, namespace_salt(*namespace)) in engine.lookups.record
    out.add(MISS_EVICTED if evicted else MISS_COLD, 0, size)
    return out


async def explain(
    service: Any, limits: Limits, turns: Turns, req: pb.ExplainRequest, tiers: Any = None
) -> pb.ExplainResponse:
    """The RPC: decode, explain, encode, in one slice that takes its turn with the other
    long calls (access/turns.py). ``tiers``: the tiers below the pools (tier/chain.py's
    ``Tiers``), whose part is told for a radix model's request named by its tokens."""
    engine = service.engine(req.model)
    async with turns.admit(client_identity(CALLER.get(), PEER.get(), "")) as turn:
        await turn.next()
        return _explain(service, engine, limits, req, tiers)


def _explain(
    service: Any, engine: Any, limits: Limits, req: pb.ExplainRequest, tiers: Any = None
) -> pb.ExplainResponse:
    caller = CALLER.get()
    namespaces = caller.may_use if caller.bound else None
    extra_key = req.extra_key if req.HasField("extra_key") else None
    key = None
    if req.prompt_hash:
        if req.token_ids:
            raise InvalidInputError("name the request by token_ids or by prompt_hash, not both")
        page_hash = req.prompt_hash.lower()
        if len(page_hash) != 64 or not set(page_hash) <= _HEX:
            raise InvalidInputError("prompt_hash must be 64 hex digits (a SHA-256 page hash)")
        width = req.token_width or 1
        if width > MAX_TOKEN_WIDTH:
            raise InvalidInputError(f"token_width {width} is above the supported {MAX_TOKEN_WIDTH}")
        classified = explain_hash(engine, (extra_key, width), page_hash, namespaces)
    else:
        key = decode_key(
            req.token_ids,
            req.token_width,
            extra_key,
            engine.config.vocab_size,
            request_tokens(limits, engine.config),
        )
        classified = explain_key(engine, key, namespaces)
    ranges = classified.ranges
    reply = pb.ExplainResponse(
        num_tokens=ranges[-1][2] if ranges else 0,
        page_size=engine.page_size,
        server_epoch=service.epoch,
        ranges=[pb.ExplainRange(outcome=outcome_value(o), start=a, end=b) for o, a, b in ranges],
    )
    hit = ranges[0][2] if ranges and ranges[0][0] == HIT else 0
    reply.prefix_len = hit
    after = [o for o, a, _ in ranges if a == hit and o != HIT]
    reply.stop = outcome_value(after[0] if after else HIT)
    if classified.namespace is not None:
        reply.other_extra_key = classified.namespace
    if tiers is not None and key is not None and engine.kind == "radix":
        for part in tiers.explain(engine.name, key, hit):
            reply.tiers.append(
                pb.ExplainTier(
                    tier=part.tier,
                    tokens=part.tokens,
                    state=part.state,
                    last=part.last,
                    last_tokens=part.last_tokens,
                )
            )
    return reply
