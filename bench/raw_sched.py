"""The scheduler of ``sglang_sched.py`` written straight against the client: one Step
call per scheduling step.

Same requests, same policy (LPM over the waiting queue, a budget of free plus evictable
slots minus what running requests will still need, one decode slot per running request,
finish = insert + unlock + free), but the cache work of a step is built by hand as the
items of one ``session.step``: the previous step's finishes, this step's decode pages
and its admissions (match, lock and allocate, the shadow's estimate as the hint). The
budget reads the counters of the previous reply. No chunked prefill here.

Slots are kept the way SGLang's paged allocator keeps them: a request's tokens fill its
last page before it takes a new one, so the decode pages of a step are one entry of
whole pages, dealt out to the requests that need one.

A finished request's insert goes with the next step, after that step's ranking: its
pages are noted in the shadow index's local overlay when it is queued (``OwnPages``), so
the ranking counts them as an in-process cache would.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

from bench.sglang_sched import CLIP_MAX_NEW_TOKENS, NEW_TOKEN_RATIO, OUT_BASE, Req, StepResult
from prefixcache.client import Admit, Finish, MatchReply
from prefixcache.client.page_chain import RequestHashes
from prefixcache.client.worker.own_pages import OwnPages


@dataclass(eq=False)
class _Running:
    req: Req
    slots: array  # one per token position written
    lock_id: int
    spare: list[int] = field(default_factory=list)  # the unwritten rest of its last page


class RawScheduler:
    """One Step per scheduling step, over ``client`` (see the module docstring)."""

    def __init__(
        self,
        client: Any,
        model: str,
        *,
        page_size: int,
        batch: int,
        ttl: float = 60.0,
        shadow_wait: float = 10.0,
    ) -> None:
        self.client = client
        self.model = model
        self.page_size = page_size
        self.batch = batch
        self.session = client.session(ttl, name="bench-raw")
        self.shadow = client.shadow(model)
        self.shadow.wait_ready(shadow_wait)
        self.counters = client.stats(model)[model]
        self.waiting: list[Req] = []
        self.running: list[_Running] = []
        self._hashes: dict[int, RequestHashes] = {}
        self._finishes: list[Finish] = []
        self._answers: list[Any] = []  # OwnPages' reply callback of each finish
        self.own = OwnPages(self.shadow, page_size)
        self._frees: list[list[int]] = []
        self.stale_hints = 0
        self.failed_admissions = 0

    def close(self) -> None:
        self.shadow.close()
        self.session.close()

    def _key_len(self, req: Req) -> int:
        n = len(req.origin_input_ids) - 1  # as SGLang: one token is always computed
        return n - n % self.page_size

    def step(self) -> StepResult:
        out = StepResult()
        ps = self.page_size
        # Ranking: the shadow's estimate of every waiting request, hashes kept.
        for req in self.waiting:
            hashes = self._hashes.get(req.rid)
            if hashes is None:
                hashes = RequestHashes(
                    req.origin_input_ids[: self._key_len(req)],
                    page_size=ps,
                    extra_key=req.extra_key,
                )
                self._hashes[req.rid] = hashes
            req.num_matched_prefix_tokens = self.shadow.match(hashes)
        self.waiting.sort(key=lambda r: -r.num_matched_prefix_tokens)
        # Admission within the batch and the budget (counters of the last reply).
        c = self.counters
        budget = (
            c.free_slots
            + c.evictable_tokens
            - sum(
                int(
                    min(r.req.max_new_tokens - len(r.req.output_ids), CLIP_MAX_NEW_TOKENS)
                    * NEW_TOKEN_RATIO
                )
                for r in self.running
            )
        )
        chosen: list[Req] = []
        for req in self.waiting:
            if len(self.running) + len(chosen) >= self.batch:
                break
            total = (
                len(req.origin_input_ids)
                - req.num_matched_prefix_tokens
                + min(req.max_new_tokens, CLIP_MAX_NEW_TOKENS)
                + ps
            )
            if total >= budget:
                break
            budget -= total
            chosen.append(req)
        # Decode pages: one per running request whose last page is full, one per
        # admission (its prompt's last page).
        need = [r for r in self.running if not r.spare]
        pages = len(need) + len(chosen)
        reply = self.session.step(
            self.model,
            finishes=self._finishes,
            frees=self._frees,
            decodes=[pages * ps] if pages else [],
            admits=[
                Admit(
                    req.origin_input_ids[: self._key_len(req)],
                    req.extra_key,
                    hint=req.num_matched_prefix_tokens,
                )
                for req in chosen
            ],
        )
        for answered, result in zip(self._answers, reply.finishes, strict=True):
            answered(result)
        self._finishes, self._frees, self._answers = [], [], []
        if not reply.ok:
            for name, i, err in reply.errors():
                if name == "admits":
                    self.failed_admissions += 1
                elif name == "decodes":
                    raise RuntimeError(f"out of KV slots: {err}")
                else:
                    raise RuntimeError(f"step item {name}[{i}] failed: {err}")
        if reply.counters is not None:
            self.counters = reply.counters
        self.stale_hints += reply.stale_hints
        pool = list(reply.decoded_slots())
        for r in need:  # decode: a new page where the last one is full
            r.spare = pool[:ps]
            del pool[:ps]
        for r in self.running:
            r.slots.append(r.spare.pop(0))
        out.decode_tokens = len(self.running)
        for req, result in zip(chosen, reply.admits, strict=True):
            if not isinstance(result, MatchReply):
                continue
            slots = result.all_slots()
            page, pool = pool[:ps], pool[ps:]
            rest = len(req.origin_input_ids) - len(slots)
            slots.extend(page[:rest])
            self.running.append(_Running(req, slots, result.lock_id, page[rest:]))
            self.waiting.remove(req)
            hashes = self._hashes.pop(req.rid)
            if result.prefix_len > req.num_matched_prefix_tokens:  # more than we knew
                self.shadow.note(hashes, result.prefix_len // ps)
            req.hit_tokens = result.prefix_len
            out.admitted += 1
            out.prompt_tokens += len(req.origin_input_ids)
            out.hit_tokens += result.prefix_len
            out.extend_tokens += len(req.origin_input_ids) - result.prefix_len
        if pool:  # pages of admissions that failed
            self._frees.append(pool)
        # The forward: an output token each; the finished go with the next step.
        for r in list(self.running):
            req = r.req
            req.output_ids.append(OUT_BASE + (req.rid * 4096 + len(req.output_ids)) % (1 << 30))
            if len(req.output_ids) >= req.max_new_tokens:
                n = len(r.slots)  # committed: every written position
                tokens = req.origin_input_ids + req.output_ids[: n - len(req.origin_input_ids)]
                self._finishes.append(
                    Finish(tokens, r.slots, release_lock_id=r.lock_id, extra_key=req.extra_key)
                )
                self._answers.append(
                    self.own.queued(req, tokens.tobytes(), 1, req.extra_key, last=True)
                )
                if r.spare:
                    self._frees.append(r.spare)
                self.running.remove(r)
                out.finished += 1
        return out
