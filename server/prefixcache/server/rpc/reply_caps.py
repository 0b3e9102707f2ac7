"""Replies that could not be sent are refused before the work they report.

gRPC refuses to send a message over ``server.max_message_bytes`` (RESOURCE_EXHAUSTED),
but only once the handler has returned it: a Match that allocated, an Alloc, a Step or
a GetPages over the limit would already have taken slots and locks, which the session
keeps without ever learning their ids (9000 locks from one such call). Slot indices are
what makes a reply large (8 bytes each, where a request's token ids are 4), so the
calls whose reply can outgrow their request are checked here, from the size the
request implies, before they change anything:

* Match with ``lock`` or ``allocate``: its prefix's and its new slots, one per token
  rounded up to a page (a plain Match changes nothing, and is left to gRPC);
* Alloc: the slots asked for (whole pages), their versions (kind slot), state slots;
* Step: each admission as a Match, each decode as an Alloc, each finish its freed tail
  (at most the slots it sends), ``ITEM`` bytes per item besides (ids, flags, an error);
* GetPages: ``page_size`` slots and a lock id per page named.

Counts are capped at the model's pool (a request for more fails on the pool anyway, with
its own answer). The refusal is RESOURCE_EXHAUSTED naming ``max_message_bytes``, like a
message too large; ``BASE`` bytes are kept for the reply's other fields. With the
default 64 MiB that is a Match or Alloc of about 8 million slots, far past any prompt.
"""

from __future__ import annotations

from typing import Any

from ..access.limits import Limits
from ..errors import OverLimitError

# A reply's scalars, counters, field tags and short repeated fields beyond the slots
# counted here (a Match or Alloc reply's are under 100 bytes, a Step's counters 200).
BASE = 1024
# A Step item's reply besides its slots: ids, lengths, flags, or an error's message.
ITEM = 256
SLOT = 8  # a packed int64 slot index, version or lock id (as a varint, at most 10)
LOCK_ID = 10


def check(limits: Limits, what: str, size: int) -> None:
    """Refuse a call whose reply may be ``size`` bytes (beyond ``BASE``).

    Raises:
        OverLimitError: naming ``max_message_bytes``; nothing was done.
    """
    cap = limits.max_message_bytes
    if size + BASE > cap:
        raise OverLimitError(
            f"the {what} reply could be {size + BASE} bytes, more than the {cap} a message "
            "may carry (server.max_message_bytes): refused before doing anything; ask for "
            "fewer tokens, slots or pages per call",
            "max_message_bytes",
        )


def _tokens(item: Any) -> int:
    return len(item.token_ids) // (4 * max(item.token_width, 1))


def _slots(engine: Any, count: int) -> int:
    """Bytes of ``count`` slots as an allocation hands them out (whole pages; a slot
    model's come with a version each), at most the pool."""
    count = min(max(count, 0), engine.pool_size)
    page = max(engine.page_size, 1)
    count = -(-count // page) * page
    return SLOT * count * (2 if engine.kind == "slot" else 1)


def match_size(engine: Any, req: Any) -> int:
    """A Match reply's slot bytes (0 when it locks nothing and allocates nothing): the
    prefix's slots and the new ones together cover the tokens, rounded up to a page."""
    if not (req.lock or req.allocate):
        return 0
    return _slots(engine, _tokens(req))


def alloc_size(engine: Any, num_slots: int, num_state_slots: int) -> int:
    return _slots(engine, num_slots) + SLOT * min(max(num_state_slots, 0), engine.pool_size)


def step_size(engine: Any, req: Any) -> int:
    size = ITEM * (
        len(req.finishes) + len(req.unlocks) + len(req.frees) + len(req.decodes) + len(req.admits)
    )
    size += sum(match_size(engine, item) for item in req.admits)
    size += sum(_slots(engine, count) for count in req.decodes)
    size += sum(len(item.slot_indices) for item in req.finishes)
    return size


def get_pages_size(engine: Any, pages: int) -> int:
    return _slots(engine, pages * engine.page_size) + LOCK_ID * pages
