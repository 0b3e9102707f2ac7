"""AdmissionWindow: a scheduling step's candidates, ranked from the shadow index and
admitted at the service in batches.

SGLang's scheduler ranks every waiting request by its cached prefix (``match_prefix``),
then walks the ranked queue and admits requests one by one until its budget or batch is
full; only then does it allocate. Ranking here costs no call: each request's chained
page hashes are kept (``RequestHashes``) and matched against the shadow index. Admission
must be the service's own answer (match and lock, so the prefix cannot be evicted under
the request), and asking for each admitted request alone would cost a call per request.

So admissions go out in batches, speculatively: with the first size read of a step that
has queued work to send anyway, the window admits the top ``expected`` candidates,
``expected`` being the requests finished since the last window (in steady state a
scheduler admits about as many as finished). A candidate the scheduler then asks for that
is not admitted yet is admitted with the next few in rank order, twice as many each time
within a window (one call per ~log2(n) admissions when many are admitted at once, as at
start-up). The window closes at the next allocation: admissions the scheduler did not
use, or used and did not lock for itself, are released with that call.

Nothing here gives out anything the service has not confirmed: a candidate's estimate only
ranks it and sizes its budget; its admission reply is the authority.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count
from typing import Any

from .._wire import pack_tokens
from ..errors import PrefixCacheError
from ..page_chain import RequestHashes
from ..results import MatchReply
from .sglang_api import key_len, key_namespace, key_parts


@dataclass(eq=False)
class Candidate:
    """A waiting request as the window knows it: its match key, its page hashes (kept
    across steps), its estimate, and this window's admission, if any.

    ``state``: ``ranked`` (not admitted), ``admitted`` (locked at the service for it),
    ``used`` (handed to the scheduler by ``init_load_back``), ``claimed`` (its lock is
    now the scheduler's, through ``inc_lock_ref``).
    """

    req: Any
    packed: bytes
    width: int
    extra_key: str | None
    hashes: RequestHashes
    num_tokens: int
    estimate: int = 0
    ceiling: int | None = None  # the service's answer after a shortfall ...
    ceiling_round: int = 0  # ... in this round (it caps the next round's estimate)
    order: int = 0
    round: int = 0
    reply: MatchReply | None = None
    state: str = "ranked"

    @property
    def id(self) -> int:  # SGLang logs node ids; a candidate is no tree node
        return 0


class AdmissionWindow:
    """Candidates of the current step and their admissions.

    Attributes:
        expected: admissions to make speculatively at the next batch (the requests
            finished since the window last closed).
        speculated, used, released, shortfalls, on_demand_calls: counts, for reports.
    """

    def __init__(self, shadow: Any, page_size: int, *, max_batch: int = 128) -> None:
        self.shadow = shadow
        self.page_size = page_size
        self.max_batch = max_batch
        self.expected = 0
        self._by_req: dict[int, Candidate] = {}
        self._round = 0
        self._closed = False
        self._order = count()
        self._batch = 1
        self.speculated = self.used = self.released = self.shortfalls = 0
        self.on_demand_calls = 0

    # ------------------------------------------------------------------ ranking

    def rank(self, key: Any, req: Any) -> Candidate:
        """The candidate for ``key`` (of ``req``, when given), with its estimate.

        A request is recognised by identity and length: its hashes are computed once
        and reused while it waits (a waiting request's tokens do not change, except by
        growing, which a new length shows).
        """
        if self._closed:  # the first ranking since the last window: a new round
            self._round, self._closed = self._round + 1, False
        extra, n = key_namespace(key), key_len(key)
        cand = self._by_req.get(id(req)) if req is not None else None
        if cand is None or cand.req is not req or cand.extra_key != extra or cand.num_tokens != n:
            tokens, extra = key_parts(key)
            data, width = pack_tokens(tokens)
            cand = Candidate(
                req,
                data,
                width,
                extra,
                RequestHashes(data, page_size=self.page_size, extra_key=extra, token_width=width),
                n,
            )
            # A match without a request is kept too (until the window closes), so that
            # its admission can be claimed or released like any other.
            self._by_req[id(req) if req is not None else id(cand)] = cand
        cand.round, cand.order = self._round, next(self._order)
        if cand.reply is not None:  # admitted in this window: the service's answer
            cand.estimate = cand.reply.prefix_len
        else:
            estimate = self.shadow.match(cand.hashes)
            if cand.ceiling is not None:
                if self._round - cand.ceiling_round <= 1:
                    estimate = min(estimate, cand.ceiling)
                else:  # a round later the shadow has caught up: trust it again
                    cand.ceiling = None
            cand.estimate = estimate
        return cand

    def _ranked(self, exclude: Candidate | None = None) -> list[Candidate]:
        """This round's candidates not admitted yet that hold a hit, best first (none
        once the window closed: they are ranked again first)."""
        if self._closed:
            return []
        ready = [
            c
            for c in self._by_req.values()
            if c.round == self._round
            and c.state == "ranked"
            and c.estimate > 0
            and c.req is not None
            and c is not exclude
        ]
        ready.sort(key=lambda c: (-c.estimate, c.order))
        return ready

    # --------------------------------------------------------------- admitting

    def speculative(self) -> list[Candidate]:
        """The candidates to admit with the next call made anyway (``expected`` of
        them, best first); resets ``expected``."""
        k, self.expected = min(self.expected, self.max_batch), 0
        chosen = self._ranked()[:k] if k else []
        self.speculated += len(chosen)
        return chosen

    def on_demand(self, first: Candidate) -> list[Candidate]:
        """``first``, which the scheduler asks for, and the next candidates in rank
        order: one more batch of this window, twice the size of the last."""
        size, self._batch = self._batch, min(self._batch * 2, self.max_batch)
        self.on_demand_calls += 1
        return [first, *self._ranked(exclude=first)[: size - 1]]

    def admitted(self, cands: list[Candidate], results: tuple[Any, ...]) -> None:
        for cand, result in zip(cands, results, strict=True):
            if isinstance(result, PrefixCacheError) or result.skipped:
                # Recompute rather than wait on it (for the next round).
                cand.reply, cand.ceiling, cand.ceiling_round = None, 0, self._round
                cand.estimate = 0
                continue
            cand.reply, cand.state = result, "admitted"
            if result.prefix_len > cand.estimate:  # the service holds more than we knew
                self.shadow.note(cand.hashes, result.prefix_len // self.page_size)

    def take(self, cand: Candidate, promised: int) -> MatchReply | None:
        """The admission of ``cand`` for ``init_load_back``, or None when the service
        holds less than ``promised`` (its lock, if any, is released at close)."""
        reply = cand.reply
        if reply is None or reply.prefix_len < promised:
            cand.ceiling = reply.prefix_len if reply is not None else 0
            cand.ceiling_round = self._round
            self.shortfalls += 1
            return None
        cand.state = "used"
        self.used += 1
        return reply

    def claim(self, node_id: int) -> int:
        """The lock of a used, unclaimed admission of ``node_id`` (0: none): the
        scheduler's ``inc_lock_ref`` takes it over instead of locking again."""
        for key, cand in self._by_req.items():
            reply = cand.reply
            if (
                cand.state == "used"
                and reply is not None
                and reply.node_id == node_id
                and reply.lock_id
            ):
                cand.state = "claimed"
                del self._by_req[key]  # admitted: no longer waiting
                return reply.lock_id
        return 0

    def close(self) -> list[int]:
        """End the window: the locks of admissions nobody claimed, to release.
        Candidates not ranked in the last ranking round are forgotten."""
        release = []
        for key, cand in list(self._by_req.items()):
            if cand.reply is not None and cand.state in ("admitted", "used") and cand.reply.lock_id:
                release.append(cand.reply.lock_id)
            if cand.state == "claimed" or cand.round < self._round:
                del self._by_req[key]
                continue
            cand.reply, cand.state = None, "ranked"
        self.released += len(release)
        self._closed = True
        self._batch = 1
        return release

    def __len__(self) -> int:
        return len(self._by_req)
