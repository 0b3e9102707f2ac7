"""SGLang's paged allocation calls for the drop-in allocator: ``alloc_extend`` and
``alloc_decode``, one Alloc for the whole batch.

SGLang's paged allocator keeps every token at the slot whose offset in its page is the
token's position modulo the page size: a request fills its last page before it takes a
new one, and the scheduler passes each request's last slot (``last_loc``, -1 for none)
so that the allocator knows where that page is. Here the service hands out whole pages
(its Alloc of a multiple of the page size), so the slots a request has not reached yet
stay the session's, ready for its next tokens. SGLang frees whole pages (freeing any
slot of a page frees the page), so ``widen`` turns a free into the whole pages this
allocator took.

Pure Python over ints: no torch here (the allocator makes the tensors).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..errors import InvalidArgument


def ints(values: Any) -> list[int]:
    """A tensor, array or sequence of ints as a flat list."""
    if hasattr(values, "reshape") and hasattr(values, "tolist"):
        return [int(x) for x in values.reshape(-1).tolist()]
    return [int(x) for x in values]


def extend(
    prefix_lens: Sequence[int],
    seq_lens: Sequence[int],
    last_loc: Sequence[int],
    page_size: int,
    take: Callable[[int], Sequence[int] | None],
) -> list[int] | None:
    """The slots of tokens ``prefix_lens[i] .. seq_lens[i]`` of every request, request by
    request: first the rest of the request's last page, then new pages, all taken by one
    ``take(n)`` (n whole pages' worth of slots, page by page; None: the pool is short)."""
    if not len(prefix_lens) == len(seq_lens) == len(last_loc):
        raise InvalidArgument("prefix_lens, seq_lens and last_loc must have one entry per request")
    plans, pages = [], 0
    for pre, seq, last in zip(prefix_lens, seq_lens, last_loc, strict=True):
        if seq < pre or pre < 0:
            raise InvalidArgument(f"seq_len {seq} is below prefix_len {pre}")
        own = 0 if pre % page_size == 0 else min(seq - pre, page_size - pre % page_size)
        if own and (last < 0 or last % page_size != (pre - 1) % page_size):
            raise InvalidArgument(
                f"last_loc {last} is not the slot of token {pre - 1} (page size {page_size})"
            )
        fresh = seq - pre - own
        need = -(-fresh // page_size)
        plans.append((last, own, fresh, pages))
        pages += need
    slots = _take(take, pages, page_size)
    if slots is None:
        return None
    out: list[int] = []
    for last, own, fresh, first_page in plans:
        out.extend(range(last + 1, last + 1 + own))
        start = first_page * page_size
        out.extend(slots[start : start + fresh])
    return out


def decode(
    seq_lens: Sequence[int],
    last_loc: Sequence[int],
    page_size: int,
    take: Callable[[int], Sequence[int] | None],
) -> list[int] | None:
    """One slot per request for its token ``seq_lens[i] - 1``: the next slot of its last
    page, or the first of a new page (one ``take`` for all new pages)."""
    if len(seq_lens) != len(last_loc):
        raise InvalidArgument("seq_lens and last_loc must have one entry per request")
    fresh = [(seq - 1) % page_size == 0 for seq in seq_lens]
    slots = _take(take, sum(fresh), page_size)
    if slots is None:
        return None
    out, page = [], 0
    for new, last in zip(fresh, last_loc, strict=True):
        if new:
            out.append(slots[page * page_size])
            page += 1
        else:
            out.append(last + 1)
    return out


def _take(
    take: Callable[[int], Sequence[int] | None], pages: int, page_size: int
) -> Sequence[int] | None:
    if not pages:
        return []
    slots = take(pages * page_size)
    if slots is None:
        return None
    for i in range(0, len(slots), page_size):  # whole pages, each from its first slot
        if slots[i] % page_size:
            raise InvalidArgument(
                f"the service handed out slot {slots[i]} as the start of a page of {page_size}"
            )
    return slots


def pages_of(slots: Sequence[int], page_size: int) -> set[int]:
    return {s // page_size for s in slots}


def widen(values: list[int], whole: set[int], page_size: int) -> list[int]:
    """``values`` with every page of ``whole`` they touch freed whole (as SGLang's paged
    free does); those pages leave ``whole``."""
    hit = [p for p in dict.fromkeys(v // page_size for v in values) if p in whole]
    if not hit:
        return values
    whole.difference_update(hit)
    touched = set(hit)
    out = [v for v in values if v // page_size not in touched]
    for p in hit:
        out.extend(range(p * page_size, (p + 1) * page_size))
    return out


class PagedCalls:
    """``alloc_extend`` / ``alloc_decode``, and the page bookkeeping, of the drop-in
    allocators (``RemoteAllocator``, ``sglang_local.LocalAllocator``).

    ``_whole``: the pages taken whole and not freed since (a free of any of their slots
    frees them whole). ``_server_freed``: slots the service already freed, which a free
    skips (the remote allocator's; always empty in-process). ``_take(n)``: the source
    of whole pages (by default an Alloc in ``_cache``'s session).
    """

    _cache: Any

    def __init__(self, page_size: int, size: int, device: Any) -> None:
        self.page_size = page_size
        self.size = size
        self.device = device
        self._server_freed: set[int] = set()
        self._whole: set[int] = set()

    def forget_pages(self, slots: Any) -> None:
        """The tree takes (or the service frees) these slots: their pages are no
        longer freed whole."""
        if self._whole and len(slots):
            self._whole.difference_update(pages_of(ints(slots), self.page_size))

    def clear_pages(self) -> None:
        """After a reset: every slot is free again, none freed whole by us."""
        self._server_freed.clear()
        self._whole.clear()

    def _handed_out(self, slots: Sequence[int]) -> None:
        """``alloc`` handed these slots out: the service no longer counts them freed,
        and their pages are partly the caller's now, not whole."""
        if self._server_freed:
            self._server_freed.difference_update(slots)
        if self._whole:
            self._whole.difference_update(pages_of(slots, self.page_size))

    def _took_pages(self, slots: Sequence[int]) -> None:
        """``_take`` took these whole pages (each from its first slot)."""
        if self._server_freed:
            self._server_freed.difference_update(slots)
        if self.page_size > 1:
            ps = self.page_size
            self._whole.update(s // ps for s in slots[::ps])

    def alloc_extend(self, prefix_lens: Any, *args: Any) -> Any:
        """SGLang's paged ``alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens,
        seq_lens_cpu, last_loc, extend_num_tokens)`` (or, as older SGLang calls it,
        ``(prefix_lens, seq_lens, last_loc, extend_num_tokens)``): the slots of every
        request's new tokens, page-aligned, in one Alloc; None when the pool is short."""
        if len(args) == 5:
            prefix_lens, seq_lens, _, last_loc, total = args  # the CPU copies
        elif len(args) == 3:
            seq_lens, last_loc, total = args
        else:
            raise TypeError(f"alloc_extend takes 4 or 6 arguments, got {len(args) + 1}")
        out = extend(ints(prefix_lens), ints(seq_lens), ints(last_loc), self.page_size, self._take)
        if out is not None and len(out) != int(total):
            raise InvalidArgument(
                f"extend_num_tokens is {int(total)}, but the requests extend by {len(out)} tokens"
            )
        return self._tensor(out)

    def alloc_decode(self, seq_lens: Any, *args: Any) -> Any:
        """SGLang's paged ``alloc_decode(seq_lens, seq_lens_cpu, last_loc)`` (or
        ``(seq_lens, last_loc)``): one slot per request, in one Alloc; None when the
        pool is short."""
        if len(args) == 2:
            seq_lens, last_loc = args  # the CPU copy
        elif len(args) == 1:
            (last_loc,) = args
        else:
            raise TypeError(f"alloc_decode takes 2 or 3 arguments, got {len(args) + 1}")
        return self._tensor(decode(ints(seq_lens), ints(last_loc), self.page_size, self._take))

    def _take(self, n: int) -> Sequence[int] | None:
        from ..errors import ResourceExhausted

        try:
            reply = self._cache.session.alloc(self._cache.model, n)
        except ResourceExhausted:
            return None
        slots: Sequence[int] = reply.slots
        self._took_pages(slots)
        return slots

    def _tensor(self, slots: list[int] | None) -> Any:
        if slots is None:
            return None
        from array import array

        from .._wire import as_tensor

        return as_tensor(array("q", slots), self.device)
