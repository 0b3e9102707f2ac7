"""ExistsPages, GetPages and SetPages: decode a request, one call into the model's
``HashPages`` (hash_pages.py), encode the reply.

The wire layouts: page hashes are 32 raw bytes each, slots packed little-endian int64
(codec.py), per-page answers one byte each. A request may name at most
``max_request_tokens / page_size`` pages, like any request's tokens, and at most a
1M-token prompt's pages (``MAX_PROMPT_TOKENS / page_size``): more is no prompt's.

ExistsPages is the one page RPC without a session of its own, and the cheapest to
flood with. So it needs a session where tenants or per-session quotas are configured
(FAILED_PRECONDITION without one), and it decodes and looks its hashes up in slices
of ``SLICE`` pages (a millisecond or two each), each slice in its turn with the other
long calls' (access/turns.py: one at a time, round the clients, at most
``turns.PER_CLIENT`` calls admitted per client), with the loop free to serve other
calls between them. A page stored or evicted meanwhile may or may not be counted:
the answer is a hint of what the next GetPages will find, never a promise; its
counting by outcome (lookups.py) goes in slices too. GetPages decodes its hashes, looks
them up and walks their paths in slices (``HashPages.plan``: a request whose pages do
not chain ends where they stop chaining, so the walk is linear in the request), then
locks in one go what is still cached. SetPages decodes its hashes in slices too, and
stores its pages in slices (``page_store``): a session that ends, or a Reset, between
two slices stops it there, refused (NOT_FOUND, FAILED_PRECONDITION) with what was
stored before kept by the cache (or gone with the Reset).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Generator
from contextlib import asynccontextmanager
from typing import Any, TypeVar
from weakref import WeakKeyDictionary

from prefixcache.cache import InvalidInputError
from prefixcache.cache.index.page_index import DIGEST_BYTES
from prefixcache.v1 import prefix_cache_pb2 as pb

from ..access.limits import Limits, check_count, request_tokens, sessions_required
from ..access.tenants import CALLER, PEER, client_identity
from ..access.turns import Turns
from ..codec import MAX_TOKEN_WIDTH, decode_slots, encode_slots
from ..engine.hash_pages import HashPages
from ..engine.page_store import store
from ..errors import NotFoundError, PreconditionError
from ..sessions import replays
from ..sessions.session import Session
from . import reply_caps

# Pages one call may name at most: a 1M-token prompt's (at the model's page size).
MAX_PROMPT_TOKENS = 1 << 20
# ExistsPages' pages per slice: a few milliseconds of lookups between two loop turns.
SLICE = 2048
T = TypeVar("T")


def decode_hashes(
    data: bytes | memoryview, field: str = "page_hashes", max_count: int = 0
) -> list[str]:
    """Packed 32-byte digests as hex strings (the form the page index keys them by)."""
    if len(data) % DIGEST_BYTES:
        raise InvalidInputError(
            f"{field} has {len(data)} bytes, not a multiple of "
            f"{DIGEST_BYTES} (one SHA-256 digest per page)"
        )
    count = len(data) // DIGEST_BYTES
    check_count(field, count, max_count)
    text = bytes(data).hex()  # one conversion, then slices: 5x faster than per digest
    step = 2 * DIGEST_BYTES
    return [text[i : i + step] for i in range(0, len(text), step)]


def _namespace(req: Any) -> tuple[str | None, int]:
    width = req.token_width or 1
    if width > MAX_TOKEN_WIDTH:
        raise InvalidInputError(f"token_width {width} is above the supported {MAX_TOKEN_WIDTH}")
    return (req.extra_key if req.HasField("extra_key") else None), width


def max_pages(limits: Limits, engine: Any) -> int:
    """Pages one request may name for ``engine`` (see the module docstring)."""
    tokens = min(request_tokens(limits, engine.config), MAX_PROMPT_TOKENS)
    return max(-(-tokens // engine.page_size), 1)


async def exists(
    service: Any,
    limits: Limits,
    turns: Turns,
    req: pb.ExistsPagesRequest,
    session: Session | None = None,
) -> pb.ExistsPagesResponse:
    if session is None and sessions_required(limits):
        if req.session_id:  # not open (any more): as every call that needs one answers
            raise NotFoundError(
                "ExistsPages: the session is not open (closed, expired or never opened)"
            )
        raise PreconditionError(
            "ExistsPages needs a session_id where the service has "
            "tenants or per-session quotas (OpenSession first)"
        )
    engine = service.engine(req.model)
    pages, namespace, data = HashPages(engine), _namespace(req), req.page_hashes
    if len(data) % DIGEST_BYTES:
        decode_hashes(data)  # refuses it, naming the field
    check_count("page_hashes", len(data) // DIGEST_BYTES, max_pages(limits, engine))
    client = (
        session.client
        if session is not None and session.client
        else client_identity(CALLER.get(), PEER.get(), "")
    )
    async with turns.admit(client) as turn:
        view, step = memoryview(data), SLICE * DIGEST_BYTES
        present = bytearray()
        for start in range(0, len(data), step):
            await turn.next()  # each slice in its turn: the other calls run between
            present += pages.presence(namespace, decode_hashes(view[start : start + step]))
        leading, present_bytes = pages.count(bytes(present), lookup=not req.before_set)
        if not req.before_set:  # by outcome, beyond the leading run (lookups.py), in slices
            for _ in engine.lookups.count_pages(pages.index, namespace, data, leading):
                await turn.next()
    return pb.ExistsPagesResponse(leading_pages=leading, present=present_bytes)


async def _decoded(data: bytes, cap: int) -> list[str]:
    """``decode_hashes`` in slices of ``SLICE`` pages, the loop free between them."""
    if len(data) % DIGEST_BYTES:
        decode_hashes(data)  # refuses it, naming the field
    check_count("page_hashes", len(data) // DIGEST_BYTES, cap)
    view, step, out = memoryview(data), SLICE * DIGEST_BYTES, []
    for start in range(0, len(data), step):
        if start:
            await asyncio.sleep(0)
        out += decode_hashes(view[start : start + step])
    return out


async def get(
    service: Any, limits: Limits, req: pb.GetPagesRequest, session: Session | None
) -> pb.GetPagesResponse:
    engine = service.engine(req.model)
    pages, namespace = HashPages(engine), _namespace(req)
    hashes = await _decoded(req.page_hashes, max_pages(limits, engine))
    if reply := replays.replayed(session, "get_pages", req):
        return reply
    # The pages are looked up and their paths walked in slices too (reading only);
    # from the second replay check on, the call runs whole, so a retry racing its
    # first try is answered from the window.
    planned = await drive(pages.plan(namespace, hashes))
    if reply := replays.replayed(session, "get_pages", req):
        return reply
    if session is not None and session.closed:
        raise NotFoundError("GetPages: the session ended while its pages were looked up")
    reply_caps.check(limits, "GetPages", reply_caps.get_pages_size(pages.engine, len(hashes)))
    out = pages.lock(planned, session)
    reply = pb.GetPagesResponse(
        found_pages=out.found,
        slot_indices=encode_slots(out.slots),
        lock_ids=out.lock_ids,
        server_epoch=service.epoch,
    )
    replays.remember(session, "get_pages", req, reply)
    return reply


async def drive(steps: Generator[None, None, T]) -> T:
    """Run a generator that yields between slices of its work, the loop free between
    them; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        await asyncio.sleep(0)


async def set_pages(
    service: Any, limits: Limits, req: pb.SetPagesRequest, session: Session | None
) -> pb.SetPagesResponse:
    if reply := replays.replayed(session, "set_pages", req):
        return reply
    pages, namespace = HashPages(service.engine(req.model)), _namespace(req)
    prior = decode_hashes(req.prior_hash, "prior_hash") if req.prior_hash else []
    if len(prior) > 1:
        raise InvalidInputError(
            f"prior_hash has {len(req.prior_hash)} bytes: one digest ({DIGEST_BYTES} bytes) or none"
        )
    hashes = await _decoded(req.page_hashes, max_pages(limits, pages.engine))
    slots = decode_slots(req.slot_indices, max_count=request_tokens(limits, pages.engine.config))
    # The store goes in slices (page_store.py), so a retry may come while its first
    # try is under way: it waits for that try's answer rather than storing again.
    async with _first_try(session, req):
        if reply := replays.replayed(session, "set_pages", req):
            return reply
        states = await drive(
            store(pages, namespace, prior[0] if prior else None, hashes, slots, session)
        )
        reply = pb.SetPagesResponse(states=states, server_epoch=service.epoch)
        replays.remember(session, "set_pages", req, reply)
        return reply


class _Try:
    """A SetPages request id under way in a session: its lock, and the calls that
    hold or wait for it."""

    __slots__ = ("calls", "lock")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.calls = 0


# SetPages under way, by session and request id (``_first_try``).
_storing: WeakKeyDictionary[Session, dict[int, _Try]] = WeakKeyDictionary()


@asynccontextmanager
async def _first_try(session: Session | None, req: Any) -> AsyncIterator[None]:
    """Held while a SetPages with a request id runs: a retry of it waits its turn."""
    if session is None or not req.request_id:
        yield
        return
    tries = _storing.setdefault(session, {})
    current = tries.setdefault(req.request_id, _Try())
    current.calls += 1
    try:
        async with current.lock:
            yield
    finally:
        current.calls -= 1
        if not current.calls:
            del tries[req.request_id]
