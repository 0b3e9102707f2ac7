"""OwnPages: a worker's queued inserts, noted in its shadow index when queued.

A scheduler's inserts (a finished request, a chunk of a chunked prefill) are queued and
go with the next step's first call, which the next step makes only after ranking its
waiting requests; the Subscribe stream tells of them later still. An in-process cache
ranks the next step with those pages cached. So the pages of an insert are noted in the
shadow index's local overlay (shadow/overlay.py) as the insert is queued: the service
runs a Step's finishes before its admissions, so by the time an admission ranked on them
reaches it they are cached, unless the insert fails or caches less, which its reply
tells and ``answered`` takes back.

A chunked request inserts a longer prefix of the same tokens each step: its hashes are
kept (for at most ``keep`` requests: a scheduler has one chunked request at a time) and
only its new pages hashed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ..errors import PrefixCacheError
from ..page_chain import RequestHashes

Answered = Callable[[Any], None]


class OwnPages:
    """Notes inserts of one model in ``shadow`` (a follower or a ``ShadowIndex``).

    Attributes:
        noted: pages noted so far; taken_back: of those, pages a reply took back.
    """

    def __init__(self, shadow: Any, page_size: int, *, keep: int = 16) -> None:
        self.shadow = shadow
        self.page_size = page_size
        self.keep = keep
        self.noted = self.taken_back = 0
        self._by_req: OrderedDict[int, RequestHashes] = OrderedDict()

    def queued(
        self, req: Any, packed: bytes, token_width: int, extra_key: str | None, *, last: bool
    ) -> Answered:
        """An insert of ``packed`` tokens for ``req`` was queued (``last``: its final
        one); returns what to call with the insert's reply."""
        hashes = self._hashes(req, packed, token_width, extra_key, last)
        pages = hashes.num_pages
        self.shadow.note(hashes, pages)
        self.noted += pages

        def answered(result: Any) -> None:
            if isinstance(result, PrefixCacheError) or result.skipped:
                cached = 0
            else:
                cached = min(result.cached_len // self.page_size, pages)
            if cached < pages:
                self.shadow.unnote(hashes, cached, pages)
                self.taken_back += pages - cached

        return answered

    def forget(self, req: Any) -> None:
        """``req`` will insert no more (it was aborted)."""
        self._by_req.pop(id(req), None)

    def _hashes(
        self, req: Any, packed: bytes, width: int, extra_key: str | None, last: bool
    ) -> RequestHashes:
        key = id(req)
        hashes = self._by_req.pop(key, None)
        if hashes is None or hashes.extra_key != extra_key or not hashes.grow_to(packed, width):
            hashes = RequestHashes(
                packed, page_size=self.page_size, extra_key=extra_key, token_width=width
            )
        if not last:
            self._by_req[key] = hashes
            while len(self._by_req) > self.keep:
                self._by_req.popitem(last=False)
        return hashes
