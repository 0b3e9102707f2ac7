"""A scheduler loop shaped like Modular MAX's paged KV manager, over a ``RadixTrie``.

One ``step()`` makes the trie calls MAX's manager makes (``paged_cache``: ``fetch``,
``step``, ``release``), for every request of the step:

1. **Fetch.** While the batch has room, the next waiting request: ``match_prefix`` of
   its prompt but the last token, ``mark_in_use_by`` of the node, then blocks for the
   rest from the manager's free set, which ``evict_blocks`` refills (a share of the
   pool) when it runs dry; a request that finds no blocks waits for the next step.
2. **Forward.** Every running request gets one token (a synthetic id), and a block when
   its last one is full.
3. **Commit.** Every request with a new whole page: ``match_prefix`` of its uncommitted
   whole pages from its node (the tree's blocks replace its own, which go back to the
   free set unless the trie holds them), ``insert`` of the rest from there, and
   ``mark_in_use_by`` of the new node.
4. **Release.** A request that reached its output length: ``mark_not_in_use_by`` of
   its node, and its blocks back to the free set unless the trie holds them.

With ``own_pool`` (the in-process trie) the free set starts as every block of the pool;
a ``RemoteRadixTrie`` owns no pool, so the free set starts empty and every block comes
from ``evict_blocks``. There is no model: a step is all cache work.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

from bench.sglang_sched import OUT_BASE, Req, StepResult


class _NoRoom(Exception):
    pass


@dataclass(eq=False)
class _Seq:
    req: Req
    tokens: array
    blocks: list[int]
    node: Any
    committed: int
    generated: int = 0


@dataclass
class MaxScheduler:
    """MAX's manager calls over ``trie`` (see the module docstring)."""

    trie: Any
    page_size: int
    total_pages: int
    batch: int = 128
    own_pool: bool = True
    evict_share: float = 0.01  # of the pool's blocks, each time the free set is empty
    waiting: list[Req] = field(default_factory=list)
    running: list[_Seq] = field(default_factory=list)
    available: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.own_pool:
            self.available = set(range(1, self.total_pages))

    def alloc_block(self) -> int:
        if not self.available:
            want = max(1, int(self.total_pages * self.evict_share))
            self.available.update(self.trie.evict_blocks(want))
            if not self.available:
                raise _NoRoom
        return self.available.pop()

    def release_block(self, block: int) -> None:
        if block not in self.trie.get_all_blocks():
            self.available.add(block)

    def step(self) -> StepResult:
        out = StepResult()
        ps, trie = self.page_size, self.trie
        while self.waiting and len(self.running) < self.batch:
            req = self.waiting[0]
            prompt = req.origin_input_ids
            node, blocks = trie.match_prefix(prompt[:-1]) if len(prompt) > 1 else (trie.root, [])
            trie.mark_in_use_by(node, req.rid)
            need = -(-(len(prompt) + 1) // ps) - len(blocks)
            got: list[int] = []
            try:
                for _ in range(need):
                    got.append(self.alloc_block())
            except _NoRoom:
                self.available.update(got)
                trie.mark_not_in_use_by(node, req.rid)
                break
            self.waiting.pop(0)
            self.running.append(_Seq(req, array("I", prompt), blocks + got, node, len(blocks) * ps))
            out.admitted += 1
            out.prompt_tokens += len(prompt)
            out.hit_tokens += len(blocks) * ps
        for seq in self.running:
            seq.tokens.append(OUT_BASE + seq.req.rid * 4096 + seq.generated)
            seq.generated += 1
            if len(seq.tokens) >= len(seq.blocks) * ps:
                seq.blocks.append(self.alloc_block())
        for seq in self.running:
            self._commit(seq)
        done = [s for s in self.running if s.generated >= s.req.max_new_tokens]
        for seq in done:
            trie.mark_not_in_use_by(seq.node, seq.req.rid)
            for block in seq.blocks:
                self.release_block(block)
            self.running.remove(seq)
        out.finished = len(done)
        return out

    def _commit(self, seq: _Seq) -> None:
        ps, trie = self.page_size, self.trie
        end = len(seq.tokens) // ps * ps
        if end <= seq.committed:
            return
        todo = seq.tokens[seq.committed : end]
        node, have = trie.match_prefix(todo, node=seq.node)
        first = seq.committed // ps
        for mine, tree in zip(seq.blocks[first:], have, strict=False):
            if mine != tree:
                self.release_block(mine)
        seq.blocks[first : first + len(have)] = have
        seq.committed += len(have) * ps
        if seq.committed < end:
            first = seq.committed // ps
            node = trie.insert(
                seq.tokens[seq.committed : end], seq.blocks[first : end // ps], node=node
            )
            seq.committed = end
        seq.node = node
        trie.mark_in_use_by(node, seq.req.rid)
