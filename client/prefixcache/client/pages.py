"""Pages by chained page hash on the client: ExistsPages, GetPages and SetPages.

A page hash is the hex (or the 32 raw bytes) of the SHA-256 chain ``hash_token_ids``
computes page by page, which is also SGLang's page hash; see the proto's "Pages by
chained page hash" for what the service answers. The blocking client's
``exists_pages``, ``get_pages`` and ``set_pages`` build their calls here.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prefixcache.v1 import prefix_cache_pb2 as pb

from ._core import ClientBase
from ._requests import Op, SessionLike, session_id_of
from ._wire import pack_slots, unpack_slots
from .errors import InvalidArgument

DIGEST_BYTES = 32
# SetPagesResponse.states, one byte per page.
PAGE_MISSING, PAGE_STORED, PAGE_HELD = 0, 1, 2

PageHashes = Sequence[str | bytes]


@dataclass(frozen=True, slots=True)
class ExistsPagesReply:
    """Pages held from the first one, and each page's presence."""

    leading_pages: int
    present: tuple[bool, ...]


@dataclass(frozen=True, slots=True)
class GetPagesReply:
    """The leading run of pages found, with their slots (``page_size`` each, in chain
    order) and the locks to release once they are read."""

    found_pages: int
    slot_indices: array[int]
    lock_ids: tuple[int, ...]
    server_epoch: int


@dataclass(frozen=True, slots=True)
class SetPagesReply:
    """Each page's state: ``PAGE_STORED``, ``PAGE_HELD`` or ``PAGE_MISSING``."""

    states: bytes
    server_epoch: int

    @property
    def held(self) -> list[bool]:
        """Per page: the service holds it now (stored by this call or before)."""
        return [state != PAGE_MISSING for state in self.states]


def pack_hashes(page_hashes: PageHashes) -> bytes:
    """Page hashes (64-char hex strings or 32-byte digests) as packed digests."""
    out = []
    for page_hash in page_hashes:
        digest = page_hash if isinstance(page_hash, bytes) else _from_hex(page_hash)
        if len(digest) != DIGEST_BYTES:
            raise InvalidArgument(
                f"a page hash is {DIGEST_BYTES} bytes (64 hex digits), got {page_hash!r}"
            )
        out.append(digest)
    return b"".join(out)


def _from_hex(text: Any) -> bytes:
    try:
        return bytes.fromhex(text)
    except (TypeError, ValueError):
        raise InvalidArgument(f"a page hash is 64 hex digits or 32 bytes, got {text!r}") from None


def _request(
    cls: Any,
    model: str,
    page_hashes: PageHashes,
    extra_key: str | None,
    token_width: int,
    **fields: Any,
) -> Any:
    request = cls(
        model=model, page_hashes=pack_hashes(page_hashes), token_width=token_width, **fields
    )
    if extra_key is not None:
        request.extra_key = extra_key
    return request


def op_exists(
    model: str,
    page_hashes: PageHashes,
    extra_key: str | None,
    token_width: int,
    before_set: bool = False,
    session: SessionLike = None,
) -> Op[ExistsPagesReply]:
    # The session is needed where the service has tenants or quotas configured.
    request = _request(
        pb.ExistsPagesRequest,
        model,
        page_hashes,
        extra_key,
        token_width,
        before_set=before_set,
        session_id=session_id_of(session),
    )
    return Op(
        "ExistsPages",
        request,
        lambda m: ExistsPagesReply(m.leading_pages, tuple(bool(b) for b in m.present)),
        True,
    )


def op_get(
    client: ClientBase,
    model: str,
    page_hashes: PageHashes,
    extra_key: str | None,
    token_width: int,
    session: SessionLike,
    request_id: int | None,
) -> Op[GetPagesReply]:
    sid = session_id_of(session)
    rid = client._next_request_id(request_id, bool(sid))
    request = _request(
        pb.GetPagesRequest,
        model,
        page_hashes,
        extra_key,
        token_width,
        session_id=sid,
        request_id=rid,
        server_epoch=client._fence(session, None),
    )
    return Op(
        "GetPages",
        request,
        lambda m: GetPagesReply(
            m.found_pages, unpack_slots(m.slot_indices), tuple(m.lock_ids), m.server_epoch
        ),
        bool(rid),
    )


def op_set(
    client: ClientBase,
    model: str,
    page_hashes: PageHashes,
    slots: Any,
    extra_key: str | None,
    token_width: int,
    prior_hash: str | bytes | None,
    session: SessionLike,
    request_id: int | None,
    server_epoch: int | None,
) -> Op[SetPagesReply]:
    sid = session_id_of(session)
    rid = client._next_request_id(request_id, bool(sid))
    prior = pack_hashes([prior_hash]) if prior_hash else b""
    request = _request(
        pb.SetPagesRequest,
        model,
        page_hashes,
        extra_key,
        token_width,
        prior_hash=prior,
        slot_indices=pack_slots(slots),
        session_id=sid,
        request_id=rid,
        server_epoch=client._fence(session, server_epoch),
    )
    return Op(
        "SetPages", request, lambda m: SetPagesReply(bytes(m.states), m.server_epoch), bool(rid)
    )
