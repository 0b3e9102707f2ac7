"""A scheduler loop over the ``MambaRadixCache`` API (a hybrid model's prefix cache).

One ``step()`` makes, for every request of the step, the calls serving code written for
the in-process ``MambaRadixCache`` makes (as docs/clients.md shows them):

1. **Prefill.** While the batch has room, the next waiting request: ``match_prefix``
   (the prefix up to the last state snapshot), ``inc_lock_ref``, a track slot for the
   state after the prompt (``evict(0, mamba_num=1)`` when none is free), KV slots for
   the rest (``evict`` when the pool is short), ``insert`` with the state, the caller's
   frees (the duplicates, a state the tree had), then a match of the prompt to move the
   request onto the tree's slots, its lock, and the old lock released.
2. **Decode.** One ``alloc`` for a slot per running request.
3. **Finish.** A request that reached its output length: a track slot, ``insert`` of its
   whole pages with the state, the frees (duplicates, the unaligned tail, a state the
   tree had) and its lock released.

There is no model (no state is computed or copied): a step is all cache work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from bench.sglang_sched import OUT_BASE, Req, StepResult
from prefixcache.cache import RadixKey


@dataclass(eq=False)
class _Seq:
    req: Req
    tokens: list[int]
    slots: torch.Tensor
    node: Any
    cached: int  # tokens whose slots are the tree's
    generated: int = 0


@dataclass
class MambaScheduler:
    cache: Any
    page_size: int
    batch: int = 128
    waiting: list[Req] = field(default_factory=list)
    running: list[_Seq] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.allocator = self.cache.token_to_kv_pool_allocator
        self.states = self.cache.mamba_pool

    def _track(self) -> int | None:
        track = self.states.alloc_track_slot()
        if track is None:
            self.cache.evict(0, mamba_num=1)
            track = self.states.alloc_track_slot()
        return track

    def _slots(self, n: int) -> torch.Tensor | None:
        short = n - self.allocator.available_size()
        if short > 0:
            self.cache.evict(short)
        return self.allocator.alloc(n)

    def step(self) -> StepResult:
        out = StepResult()
        while self.waiting and len(self.running) < self.batch:
            seq = self._prefill(self.waiting[0])
            if seq is None:
                break
            self.waiting.pop(0)
            self.running.append(seq)
            out.admitted += 1
            out.prompt_tokens += len(seq.req.origin_input_ids)
            out.hit_tokens += seq.req.hit_tokens
        if self.running:
            new = self._slots(len(self.running))
            if new is not None:
                for seq, slot in zip(self.running, new.reshape(-1, 1), strict=True):
                    seq.slots = torch.cat([seq.slots, slot])
                    seq.tokens.append(OUT_BASE + seq.req.rid * 4096 + seq.generated)
                    seq.generated += 1
        done = [s for s in self.running if s.generated >= s.req.max_new_tokens]
        for seq in done:
            self._finish(seq)
            self.running.remove(seq)
        out.finished = len(done)
        return out

    def _prefill(self, req: Req) -> _Seq | None:
        cache, ps = self.cache, self.page_size
        tokens = list(req.origin_input_ids)
        key = RadixKey(tokens)
        hit = cache.match_prefix(key)
        cache.inc_lock_ref(hit.last_node)
        track = self._track()
        new = self._slots(len(tokens) - hit.prefix_len) if track is not None else None
        if new is None:
            if track is not None:
                self.states.free_track_slot(track)
            cache.dec_lock_ref(hit.last_node)
            return None
        req.hit_tokens = hit.prefix_len
        slots = torch.cat([hit.indices, new])
        aligned = len(tokens) // ps * ps
        done = cache.insert(key[:aligned], slots[:aligned], mamba_value=track)
        self.allocator.free(slots[hit.prefix_len : done.prefix_len])
        if done.mamba_exist:
            self.states.free_track_slot(track)
        now = cache.match_prefix(key)  # the request's KV is the tree's from here on
        cache.inc_lock_ref(now.last_node)
        cache.dec_lock_ref(hit.last_node)
        slots = torch.cat([now.indices, slots[now.prefix_len :]])
        return _Seq(req, tokens, slots, now.last_node, now.prefix_len)

    def _finish(self, seq: _Seq) -> None:
        cache, ps = self.cache, self.page_size
        aligned = len(seq.tokens) // ps * ps
        track = self._track() if aligned > seq.cached else None
        if track is not None:
            key = RadixKey(seq.tokens[:aligned])
            done = cache.insert(key, seq.slots[:aligned], mamba_value=track)
            self.allocator.free(seq.slots[seq.cached : done.prefix_len])
            if done.mamba_exist:
                self.states.free_track_slot(track)
            self.allocator.free(seq.slots[aligned:])
        else:  # nothing new to cache (or no state slot): the request's own slots go
            self.allocator.free(seq.slots[seq.cached :])
        cache.dec_lock_ref(seq.node)
