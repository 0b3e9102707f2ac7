"""``RadixTrie`` op for op against the reference model (tests/trie_model.py).

A state machine drives both with the same calls: inserts below the root or below a
handle from an earlier call (fresh blocks, and now and then a block the trie holds, one
named twice, a short or unaligned insert), matches (a partial last page too), marks and
releases by a few sequences (releases that the path does not hold, or that sit above a
node the sequence still marks), and evictions of 0..7 blocks. Every answer must be the
model's: the same blocks, the same error kind, and the same node (a handle the caller
holds must name the same node in both, so a split keeps the lower part's identity).
After every step: ``check_integrity()``, the printed trie with blocks, both block sets,
and every handle's tokens, blocks, users and whether it left the trie.
"""

from __future__ import annotations

from typing import Any

import pytest
from cache_model import LONG, machine_settings
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from trie_model import MNode, ModelTrie, Refused

from prefixcache.cache import InvalidInputError, LockError, RadixTrie, TrieNode

SEQS = (0, 1, 2)


def _pages(ps: int) -> list[list[int]]:
    if ps == 1:
        return [[0], [1], [2]]
    return [[0] * ps, [1] * ps, [0] * (ps - 1) + [1]]


def _outcome(call: Any) -> tuple[str, Any]:
    try:
        return "ok", call()
    except InvalidInputError:
        return "value", None
    except LockError:
        return "lock", None


def _expected(call: Any) -> tuple[str, Any]:
    try:
        return "ok", call()
    except Refused as refused:
        return refused.kind, None


class TrieMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.trie: RadixTrie
        self.model: ModelTrie
        self.handles: list[tuple[TrieNode, MNode]] = []
        self.pairs: dict[int, MNode] = {}  # id(trie node) -> its model node
        self.next_block = 100

    @initialize(ps=st.sampled_from([1, 2, 4]))
    def start(self, ps: int) -> None:
        self.trie, self.model = RadixTrie(page_size=ps), ModelTrie(ps)
        self.pages = _pages(ps)

    # ------------------------------------------------------------------ inputs

    def _tokens(self, data: st.DataObject, partial: bool = False) -> list[int]:
        pages = data.draw(st.lists(st.sampled_from(range(len(self.pages))), max_size=5))
        tokens = [t for p in pages for t in self.pages[p]]
        if partial and data.draw(st.booleans()):
            tokens += [2] * data.draw(st.integers(1, self.trie.page_size))
        return tokens

    def _start(self, data: st.DataObject) -> tuple[TrieNode | None, MNode | None]:
        if not self.handles or data.draw(st.booleans()):
            return None, None
        return data.draw(st.sampled_from(self.handles))

    def _pair(self, got: TrieNode, want: MNode) -> None:
        """``got`` and ``want`` must be the same node of their tries."""
        known = self.pairs.get(id(got))
        if known is not None:
            assert known is want, "the trie answered another node than the model"
        else:
            assert want not in self.pairs.values(), "a node the model knows is new here"
            self.pairs[id(got)] = want
            self.handles.append((got, want))

    def _compare(self, got: tuple[str, Any], want: tuple[str, Any]) -> None:
        assert got[0] == want[0], (got, want)
        event(f"outcome {got[0]}")

    # ------------------------------------------------------------------- rules

    @rule(data=st.data(), mode=st.sampled_from(["fresh"] * 6 + ["held", "twice", "count"]))
    def insert(self, data: st.DataObject, mode: str) -> None:
        tokens = self._tokens(data, partial=data.draw(st.integers(0, 9)) == 0)
        pages = len(tokens) // self.trie.page_size
        blocks = list(range(self.next_block, self.next_block + pages))
        self.next_block += pages
        held = self.model.all_blocks()
        if mode == "held" and held and blocks:
            blocks[-1] = data.draw(st.sampled_from(held))
        elif mode == "twice" and len(blocks) > 1:
            blocks[-1] = blocks[0]
        elif mode == "count":
            blocks = blocks[:-1] if blocks and data.draw(st.booleans()) else [*blocks, 0]
        node, mnode = self._start(data)
        got = _outcome(lambda: self.trie.insert(tokens, blocks, node))
        want = _expected(lambda: self.model.insert(tokens, blocks, mnode))
        self._compare(got, want)
        if got[0] == "ok":
            self._pair(got[1], want[1])

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        tokens = self._tokens(data, partial=True)
        node, mnode = self._start(data)
        got = _outcome(lambda: self.trie.match_prefix(tokens, node))
        want = _expected(lambda: self.model.match(tokens, mnode))
        self._compare(got, want)
        if got[0] == "ok":
            assert got[1][1] == want[1][1]
            self._pair(got[1][0], want[1][0])

    @rule(data=st.data(), seq=st.sampled_from(SEQS))
    def mark(self, data: st.DataObject, seq: int) -> None:
        if not self.handles:
            return
        node, mnode = data.draw(st.sampled_from(self.handles))
        self._compare(
            _outcome(lambda: self.trie.mark_in_use_by(node, seq)),
            _expected(lambda: self.model.mark(mnode, seq)),
        )

    @rule(data=st.data(), seq=st.sampled_from(SEQS))
    def unmark(self, data: st.DataObject, seq: int) -> None:
        if not self.handles:
            return
        node, mnode = data.draw(st.sampled_from(self.handles))
        self._compare(
            _outcome(lambda: self.trie.mark_not_in_use_by(node, seq)),
            _expected(lambda: self.model.unmark(mnode, seq)),
        )

    @rule(n=st.integers(-1, 7))
    def evict(self, n: int) -> None:
        got, want = self.trie.evict_blocks(n), self.model.evict(n)
        assert got == want
        event(f"evicted {min(len(got), 3)}+")

    # -------------------------------------------------------------- invariants

    @invariant()
    def same_trie(self) -> None:
        if not hasattr(self, "trie"):
            return
        self.trie.check_integrity()
        assert self.trie.pretty_format(True) == self.model.pretty_format(True)
        assert self.trie.pretty_format() == self.model.pretty_format()
        assert sorted(self.trie.get_all_blocks()) == sorted(self.model.all_blocks())
        assert set(self.trie.get_evictable_blocks()) == self.model.evictable_blocks()
        for node, mnode in self.handles:
            assert node.evicted == mnode.gone
            assert node.tokens.tolist() == mnode.tokens and node.blocks == mnode.blocks
            assert node.active_seqs == mnode.seqs


def test_trie_machine() -> None:
    run_state_machine_as_test(TrieMachine, settings=machine_settings(80, 60))


@pytest.mark.slow
@LONG
def test_trie_machine_long() -> None:
    run_state_machine_as_test(TrieMachine, settings=machine_settings(600, 100))
