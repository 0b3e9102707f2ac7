"""Byte caps on a request as it arrives, checked on its raw bytes before it is parsed.

The size limits of limits.py are checked on a parsed message, and parsing is where an
oversized request costs: a 50 MiB ``extra_key`` is copied and UTF-8 checked on the one
event loop (and held twice) before ``check_fields`` could refuse it. Every field of a
request is bounded by some limit, so each method has a largest request that can be
valid; bytes beyond it are refused unparsed (RESOURCE_EXHAUSTED, naming
``server.max_request_bytes``, counted like any refusal).

Per request type, the cap is a fixed allowance for scalars, tags and the model name
(``BASE``), plus the string limits, plus what its token ids, slot indices or page
hashes may be at ``max_request_tokens`` (the largest over the hosted models): 4 bytes
per token id times the widest ``token_width`` (8), 8 per slot index, 32 per page hash.
A Step is capped like the others: ``max_step_items`` x the largest item (a finish: its
``extra_key``, token ids and slot indices at ``max_request_tokens``, plus
``STEP_ITEM``), or, when ``max_step_bytes`` is set and smaller, the items x
(``STEP_ITEM`` + ``extra_key``) + max_step_bytes; a Session stream message by the
operation it carries. WriteKV's chunks are not capped here: a data chunk may be as
large as ``max_message_bytes``.
A ``max_request_bytes`` setting other than 0 replaces every derived cap.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..access.limits import STRING_LIMITS, Limits, request_tokens, too_large
from ..codec import MAX_TOKEN_WIDTH
from ..config import ModelConfig
from ..errors import OverLimitError

# Scalars, field tags, the model name and short repeated fields (layers) of a request.
BASE = 64 * 1024
# Per Step item beyond its token ids and slot indices (and its extra_key).
STEP_ITEM = 64
# Page hashes are 32-byte digests (page_rpcs.py); slot indices 8-byte ints (codec.py).
_HASH_BYTES, _SLOT_BYTES = 32, 8
# SessionRequest: its op oneof, by field number (prefix_cache.proto).
_SESSION_OPS = {
    2: "MatchRequest",
    3: "InsertRequest",
    4: "EvictRequest",
    5: "LockRequest",
    6: "UnlockRequest",
    7: "AllocRequest",
    8: "FreeRequest",
    9: "StatsRequest",
    10: "StepRequest",
    11: "KeepAliveRequest",
}
# Subscribe's namespaces (subscriptions.MAX_NAMESPACES), each an extra_key and a width.
_NAMESPACES = 1024
# Fields of a message read from their headers; valid requests have at most a dozen.
_PEEK_FIELDS = 32

_CONTROL = (
    "ListModelsRequest",
    "DescribePoolRequest",
    "StatsRequest",
    "OpenSessionRequest",
    "KeepAliveRequest",
    "CloseSessionRequest",
    "EvictRequest",
    "LockRequest",
    "UnlockRequest",
    "AllocRequest",
    "ResetRequest",
    "WriteFenceRequest",
)


def derive(limits: Limits, models: Iterable[ModelConfig]) -> dict[str, int]:
    """The cap of each request type (by message name) that has one."""
    tokens = max((request_tokens(limits, m) for m in models), default=0)
    strings = (
        limits.max_extra_key_bytes + limits.max_session_id_bytes + limits.max_client_name_bytes
    )
    base = BASE + strings
    ids, slots, hashes = tokens * 4 * MAX_TOKEN_WIDTH, tokens * _SLOT_BYTES, tokens * _HASH_BYTES
    caps = dict.fromkeys(_CONTROL, base)
    caps.update(
        MatchRequest=base + ids,
        ExplainRequest=base + ids,
        RetainRequest=base + ids,
        InsertRequest=base + ids + slots,
        FreeRequest=base + 2 * slots,
        ReadKVRequest=base + 2 * slots,
        ExistsPagesRequest=base + hashes,
        GetPagesRequest=base + hashes,
        SetPagesRequest=base + hashes + _HASH_BYTES + slots,
        SubscribeRequest=BASE + _NAMESPACES * (limits.max_extra_key_bytes + 16),
    )
    # A finish is the largest item (a free's two slot lists are at most its slots and
    # ids); every item is held to it, since the mix is not known before parsing.
    item = STEP_ITEM + limits.max_extra_key_bytes
    caps["StepRequest"] = base + limits.max_step_items * (item + ids + slots)
    if limits.max_step_bytes:
        caps["StepRequest"] = min(
            caps["StepRequest"], base + limits.max_step_bytes + limits.max_step_items * item
        )
    # An op that cannot be found in the first fields (only a hand-made encoding hides
    # it) is held to the largest op's cap.
    caps["SessionRequest"] = max(caps[name] for name in _SESSION_OPS.values()) + 32
    if limits.max_request_bytes:
        caps = dict.fromkeys(caps, limits.max_request_bytes)
        caps["SessionRequest"] = limits.max_request_bytes
        caps["StepRequest"] = limits.max_request_bytes
    return caps


def check(message: Any, data: bytes, cap: int | None, limits: Limits) -> None:
    """Refuse the bytes of a ``message`` request (its class) over ``cap`` (None:
    uncapped), without parsing them. When a string field with a size limit is what
    makes them too big, the refusal is that field's, as check_fields would give it.

    Raises:
        TooLargeError: a string field over its limit (found by reading field headers).
        OverLimitError: naming ``max_request_bytes``.
    """
    if cap is None or len(data) <= cap:
        return
    descriptor = message.DESCRIPTOR
    view = memoryview(data)
    fields = _scan(view, 0, len(data))
    if descriptor.name == "SessionRequest":  # the limited strings are the op's
        ops = [(f, start, end) for f, _, start, end in fields or () if f in _SESSION_OPS]
        if len(ops) == 1:
            field, start, end = ops[0]
            descriptor = descriptor.fields_by_number[field].message_type
            fields = _scan(view, start, end)
        else:
            fields = None
    limited = {
        descriptor.fields_by_name[name].number: (name, setting)
        for name, setting in STRING_LIMITS.items()
        if name in descriptor.fields_by_name
    }
    for field, wire, start, end in fields or ():
        if wire == 2 and field in limited:
            name, setting = limited[field]
            if end - start > getattr(limits, setting):
                raise too_large(name, setting, limits)
    what = descriptor.name.removesuffix("Request")
    raise OverLimitError(
        f"the {what} request is {len(data)} bytes, more than the {cap} one may be "
        "(server.max_request_bytes; by default derived from max_request_tokens, "
        "the string limits and max_step_bytes); refused before parsing",
        "max_request_bytes",
    )


def session_op_cap(caps: dict[str, int], data: bytes) -> tuple[int | None, int]:
    """The cap of a SessionRequest's bytes by the op it carries, and its ``seq`` (so a
    refusal still pairs with its request): read from its field headers, without
    parsing. An op not found, or more than one, takes the cap of the largest op."""
    seq, ops = 0, set()
    for field, wire, start, _end in _scan(memoryview(data), 0, len(data)) or ():
        if field == 1 and wire == 0:
            seq = start
        elif field in _SESSION_OPS and wire == 2:
            ops.add(field)
    if len(ops) != 1:
        return caps.get("SessionRequest"), seq
    cap = caps.get(_SESSION_OPS[ops.pop()])
    return (None if cap is None else cap + 32), seq


# (field number, wire type, start, end) of a field; a varint's value is its start.
_Field = tuple[int, int, int, int]


def _scan(data: memoryview, pos: int, end: int) -> list[_Field] | None:
    """The fields of the message in ``data[pos:end]``, read from their headers only;
    None past ``_PEEK_FIELDS`` fields or when malformed (a valid request of a client
    library has a few fields, each once: only a hand-made encoding has more)."""
    out: list[_Field] = []
    while pos < end:
        if len(out) == _PEEK_FIELDS:
            return None
        tag = _varint(data, pos, end)
        if tag is None:
            return None
        key, pos = tag
        field, wire = key >> 3, key & 7
        if wire == 0:
            value = _varint(data, pos, end)
            if value is None:
                return None
            out.append((field, wire, value[0], value[0]))
            pos = value[1]
        elif wire == 2:
            length = _varint(data, pos, end)
            if length is None or length[1] + length[0] > end:
                return None
            out.append((field, wire, length[1], length[1] + length[0]))
            pos = length[1] + length[0]
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
            out.append((field, wire, pos, pos))
        else:
            return None
    return out if pos == end else None


def _varint(data: memoryview, pos: int, end: int) -> tuple[int, int] | None:
    """The varint at ``pos`` and the position after it; None when malformed."""
    value = shift = 0
    while pos < end and shift < 64:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    return None
