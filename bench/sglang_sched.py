"""A scheduler shaped like SGLang's, over any cache with SGLang's ``BasePrefixCache`` API.

One ``step()`` is one iteration of SGLang's event loop in mixed-chunk mode, making the
cache calls SGLang's scheduler makes, in its order (``schedule_policy.py``,
``schedule_batch.py``, ``mem_cache/common.py``):

1. **Ranking (LPM).** ``match_prefix(MatchPrefixParams(key, req=req))`` for every
   waiting request; the queue is sorted by matched length (device plus host hit).
2. **Admission (PrefillAdder).** A chunked request in progress goes first. Then, in
   rank order, while the batch has room: the budget is read as
   ``available_size() + evictable_size() - reserved`` under a temporary lock of the
   request's node; a host hit is loaded with ``init_load_back`` (a None answer ends
   admission for this step); the admitted request's ``inc_lock_ref`` receipt is kept.
   With a chunk size, a request longer than the chunk budget left is cut, one at a time.
3. **Extend.** ``alloc_extend`` for the admitted requests (``evict`` first when
   ``available_size()`` is short), their prefix and new slots written into the
   request-to-token table.
4. **Decode.** ``alloc_decode``: one slot per running request.
5. **Results.** Each request that reached its output length: ``cache_finished_req``;
   the chunked request: ``cache_unfinished_req``.

There is no model: a "forward" appends one synthetic output token per request. Left out
of SGLang's policy: in-batch prefix deprioritisation, retraction, priorities.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from prefixcache.client.worker.sglang_api import EvictParams, InitLoadBackParams, MatchPrefixParams

OUT_BASE = 1 << 31  # synthetic output token ids sit above every trace token
CLIP_MAX_NEW_TOKENS = 4096
NEW_TOKEN_RATIO = 0.7


@dataclass(eq=False)
class Req:
    """The fields of SGLang's ``Req`` the scheduler and the cache read."""

    rid: int
    origin_input_ids: array
    max_new_tokens: int
    extra_key: str | None = None
    output_ids: array = field(default_factory=lambda: array("I"))
    fill_ids: array = field(default_factory=lambda: array("I"))
    req_pool_idx: int | None = None
    prefix_indices: Any = None
    last_node: Any = None
    last_host_node: Any = None
    best_match_node: Any = None
    host_hit_length: int = 0
    cache_protected_len: int = 0
    lock_receipt: Any = None
    num_matched_prefix_tokens: int = 0
    extend_input_len: int = 0
    hit_tokens: int = -1  # prefix at first admission (-1: not admitted yet)

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)


class _Rows:
    def __init__(self, rows: dict[int, torch.Tensor]) -> None:
        self._rows = rows

    def __getitem__(self, index: tuple[int, slice]) -> torch.Tensor:
        idx, span = index
        return self._rows[idx][span]


class ReqToTokenPool:
    """SGLang's request-to-token table, one row per live request (sized to it: the
    trace's long prompts would make a dense table large)."""

    def __init__(self) -> None:
        self._rows: dict[int, torch.Tensor] = {}
        self._next = 0
        self.req_to_token = _Rows(self._rows)

    def alloc(self, size: int) -> int:
        self._next += 1
        self._rows[self._next] = torch.full((size,), -1, dtype=torch.int64)
        return self._next

    def free(self, idx: int) -> None:
        del self._rows[idx]

    def write(self, index: tuple[int, slice], values: torch.Tensor) -> None:
        idx, span = index
        self._rows[idx][span] = values


@dataclass
class StepResult:
    admitted: int = 0
    finished: int = 0
    prompt_tokens: int = 0  # of requests admitted for the first time
    hit_tokens: int = 0
    extend_tokens: int = 0
    decode_tokens: int = 0


class Scheduler:
    """SGLang's scheduling loop over ``cache`` (see the module docstring).

    Args:
        cache: ``LocalSGLangCache`` or ``RemoteRadixCache`` (its allocator is taken).
        batch: at most this many requests running.
        chunk: the prefill token budget of a step (None: no chunked prefill).
    """

    def __init__(self, cache: Any, *, batch: int, chunk: int | None = None) -> None:
        self.cache = cache
        self.alloc = cache.token_to_kv_pool_allocator
        self.page_size = cache.page_size
        self.pool = ReqToTokenPool()
        cache.req_to_token_pool = self.pool
        self.batch = batch
        self.chunk = chunk
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.stopped_by: dict[str, int] = {}

    # ------------------------------------------------------------------- a step

    def step(self) -> StepResult:
        out = StepResult()
        self._rank()
        admitted = self._admit(out)
        self._extend(admitted, out)
        decoding = [r for r in self.running if r not in admitted]
        self._decode(decoding, out)
        self._results(admitted, decoding, out)
        return out

    def _rank(self) -> None:
        for req in self.waiting:
            tokens = (
                req.origin_input_ids + req.output_ids if req.output_ids else req.origin_input_ids
            )
            # As SGLang: one token is always computed, so the match stops before it.
            result = self.cache.match_prefix(
                MatchPrefixParams(_Key(tokens, req.extra_key, limit=len(tokens) - 1), req=req)
            )
            req.prefix_indices, req.last_node = result.device_indices, result.last_device_node
            req.last_host_node, req.best_match_node = result.last_host_node, result.best_match_node
            req.host_hit_length = result.host_hit_length
            req.num_matched_prefix_tokens = len(req.prefix_indices) + req.host_hit_length
        self.waiting.sort(key=lambda r: -r.num_matched_prefix_tokens)

    def _budget(self, reserved: int) -> int:
        return self.alloc.available_size() + self.cache.evictable_size() - reserved

    @contextmanager
    def _lock_node(self, node: Any) -> Iterator[None]:
        receipt = self.cache.inc_lock_ref(node).to_dec_params()
        try:
            yield
        finally:
            self.cache.dec_lock_ref(node, receipt)

    def _admit(self, out: StepResult) -> list[Req]:
        reserved = sum(
            int(min(r.max_new_tokens - len(r.output_ids), CLIP_MAX_NEW_TOKENS) * NEW_TOKEN_RATIO)
            for r in self.running
            if r is not self.chunked
        )
        rem_chunk = self.chunk
        admitted: list[Req] = []
        if self.chunked is not None:  # the chunked request goes on first
            req = self.chunked
            left = len(req.origin_input_ids) - len(req.prefix_indices)
            take = left if rem_chunk is None else min(left, rem_chunk)
            req.fill_ids = req.origin_input_ids[: len(req.prefix_indices) + take]
            req.extend_input_len = take
            if rem_chunk is not None:
                rem_chunk -= take
            reserved += take
            admitted.append(req)
            if take == left:
                self.chunked = None
        stop, going_on = None, len(admitted)
        for req in list(self.waiting):
            if len(self.running) + len(admitted) - going_on >= self.batch:
                stop = "batch"
                break
            if rem_chunk is not None and rem_chunk <= 0:
                stop = "chunk"
                break
            max_new = min(req.max_new_tokens, CLIP_MAX_NEW_TOKENS)
            prefix = len(req.prefix_indices) + req.host_hit_length
            extend = len(req.origin_input_ids) - prefix
            total = extend + max_new + self.page_size
            with self._lock_node(req.last_node):
                if total >= self._budget(reserved):
                    stop = "budget"
                    break
                if req.host_hit_length:
                    loaded = self.cache.init_load_back(
                        InitLoadBackParams(req.best_match_node, req.host_hit_length, req=req)
                    )
                    if loaded is None:
                        stop = "load_back"
                        break
                    indices, req.last_node = loaded
                    req.prefix_indices = torch.cat([req.prefix_indices, indices])
                    req.host_hit_length = 0
                prefix = len(req.prefix_indices)
                extend = len(req.origin_input_ids) - prefix
                if rem_chunk is not None and extend > rem_chunk:
                    if self.chunked is not None:
                        stop = "chunk"
                        break
                    extend = rem_chunk
                    self.chunked = req
                req.fill_ids = req.origin_input_ids[: prefix + extend]
                req.extend_input_len = extend
                req.cache_protected_len = prefix
                req.lock_receipt = self.cache.inc_lock_ref(req.last_node).to_dec_params()
            reserved += extend + (0 if self.chunked is req else max_new)
            if rem_chunk is not None:
                rem_chunk -= extend
            req.hit_tokens = prefix
            out.prompt_tokens += len(req.origin_input_ids)
            out.hit_tokens += prefix
            self.waiting.remove(req)
            admitted.append(req)
        if stop:
            self.stopped_by[stop] = self.stopped_by.get(stop, 0) + 1
        out.admitted = len(admitted)
        return admitted

    def _extend(self, admitted: list[Req], out: StepResult) -> None:
        if not admitted:
            return
        prefix_lens, seq_lens, last_loc = [], [], []
        for req in admitted:
            if req.req_pool_idx is None:
                req.req_pool_idx = self.pool.alloc(len(req.origin_input_ids) + req.max_new_tokens)
            prefix = len(req.prefix_indices)
            prefix_lens.append(prefix)
            seq_lens.append(prefix + req.extend_input_len)
            last_loc.append(int(req.prefix_indices[-1]) if prefix else -1)
        need = sum(seq_lens) - sum(prefix_lens)
        slots = self._alloc(
            lambda: self.alloc.alloc_extend(
                _t(prefix_lens), _t(prefix_lens), _t(seq_lens), _t(seq_lens), _t(last_loc), need
            ),
            need + len(admitted) * self.page_size,
        )
        at = 0
        for req, pre, seq in zip(admitted, prefix_lens, seq_lens, strict=True):
            row = (req.req_pool_idx, slice(0, seq))
            self.pool.write(row, torch.cat([req.prefix_indices, slots[at : at + seq - pre]]))
            at += seq - pre
            if req not in self.running:
                self.running.append(req)
        out.extend_tokens = need

    def _decode(self, decoding: list[Req], out: StepResult) -> None:
        reqs = [r for r in decoding if r is not self.chunked]
        if not reqs:
            return
        seq_lens = [r.seq_len for r in reqs]
        last_loc = [
            int(self.pool.req_to_token[r.req_pool_idx, r.seq_len - 2 : r.seq_len - 1]) for r in reqs
        ]
        slots = self._alloc(
            lambda: self.alloc.alloc_decode(_t(seq_lens), _t(seq_lens), _t(last_loc)),
            len(reqs) * self.page_size,
        )
        for req, slot in zip(reqs, slots, strict=True):
            self.pool.write(
                (req.req_pool_idx, slice(req.seq_len - 1, req.seq_len)), slot.reshape(1)
            )
        out.decode_tokens = len(reqs)

    def _alloc(self, call: Any, need: int) -> torch.Tensor:
        """An allocation as SGLang makes it: evict first when the pool is short."""
        if self.alloc.available_size() < need:
            self.cache.evict(EvictParams(num_tokens=need))
        slots = call()
        if slots is None:
            raise RuntimeError("out of KV slots: the pool is too small for this batch")
        return slots

    def _results(self, admitted: list[Req], decoding: list[Req], out: StepResult) -> None:
        for req in [*decoding, *admitted]:
            if req is self.chunked:
                continue
            req.output_ids.append(OUT_BASE + (req.rid * 4096 + len(req.output_ids)) % (1 << 30))
        for req in list(self.running):
            if req is self.chunked:
                self.cache.cache_unfinished_req(req, chunked=True)
            elif len(req.output_ids) >= req.max_new_tokens:
                self.cache.cache_finished_req(req)
                self.pool.free(req.req_pool_idx)
                self.running.remove(req)
                out.finished += 1


@dataclass(frozen=True)
class _Key:
    """SGLang's ``RadixKey`` shape: token ids, a namespace, a match limit."""

    token_ids: Any
    extra_key: str | None = None
    limit: int | None = None


def _t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)
