"""``RadixTrie``: Modular MAX's behaviour call by call, and where it differs on purpose.

The state machine in test_trie_properties.py checks the whole behaviour against the
reference model; these name each rule once, with MAX's own kind of example, and each
difference from MAX (docs/clients.md lists them with the reason).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefixcache.cache import IntegrityError, InvalidInputError, LockError, RadixTrie, TrieNode


def test_errors_are_value_errors_raised_before_any_change() -> None:
    trie = RadixTrie(page_size=2)
    trie.insert([1, 2, 3, 4], [10, 11])
    before = trie.pretty_format(True)
    for tokens, blocks in (
        ([1, 2, 3], [10, 11]),
        ([1, 2, 3, 4, 5, 6], [10, 11]),
        ([], []),
        ([1, 2], [10, 11]),
    ):
        with pytest.raises(ValueError):
            trie.insert(tokens, blocks)
    with pytest.raises(ValueError):
        trie.match_prefix([])
    with pytest.raises(ValueError):
        trie.insert([-1, 2], [5])  # token ids are uint32
    assert trie.pretty_format(True) == before
    node, blocks = trie.match_prefix([1])  # shorter than a page: nothing to match
    assert (node, blocks) == (trie.root, [])
    trie.check_integrity()


def test_insert_keeps_the_blocks_already_there_and_returns_the_end_node() -> None:
    trie = RadixTrie()
    a = trie.insert(np.array([1, 2, 3]), [10, 11, 12])
    b = trie.insert([1, 2, 3, 4, 5], [20, 21, 22, 23, 24])  # 20..22 are the caller's
    assert trie.pretty_format(True) == ["[1, 2, 3] : [10, 11, 12]", "--[4, 5] : [23, 24]"]
    assert b.parent is a and b.tokens.tolist() == [4, 5] and b.blocks == [23, 24]
    assert sorted(trie.get_all_blocks()) == [10, 11, 12, 23, 24]
    mid = trie.insert([1, 2], [30, 31])  # ends inside a node: split, the upper part back
    assert mid.tokens.tolist() == [1, 2] and mid.blocks == [10, 11] and a.parent is mid
    assert trie.insert(torch.tensor([1, 2, 3]), torch.tensor([7, 8, 9])) is a
    trie.check_integrity()


def test_insert_and_match_below_a_given_node() -> None:
    trie = RadixTrie(page_size=2)
    a = trie.insert([1, 1, 2, 2], [10, 11])
    b = trie.insert([3, 3], [12], node=a)  # continues a's tokens
    assert trie.match_prefix([1, 1, 2, 2, 3, 3]) == (b, [10, 11, 12])
    assert trie.match_prefix([3, 3, 9], node=a) == (b, [12])
    assert trie.match_prefix([9, 9], node=a) == (a, [])


def test_match_splits_where_it_ends_and_the_lower_part_keeps_its_identity() -> None:
    trie = RadixTrie(page_size=2)
    leaf = trie.insert([1, 1, 2, 2, 3, 3], [10, 11, 12])
    trie.mark_in_use_by(leaf, "s")
    node, blocks = trie.match_prefix([1, 1, 2, 2, 9, 9])
    assert blocks == [10, 11] and node.children == {leaf.key_bytes[:8]: leaf}
    assert node.active_seqs == {"s"} and node.last_access_time == leaf.last_access_time
    assert leaf.tokens.tolist() == [3, 3] and leaf.parent is node
    trie.check_integrity()


def test_matches_do_not_refresh_recency_releases_do() -> None:
    trie = RadixTrie()
    old = trie.insert([1, 2], [10, 11])
    trie.insert([5, 6], [20, 21])
    for _ in range(3):
        trie.match_prefix([1, 2])
    assert trie.evict_blocks(1) == [11]  # still the least recently used
    trie.mark_in_use_by(old, 0)
    trie.mark_not_in_use_by(old, 0)  # now the most recent
    assert trie.evict_blocks(2) == [20, 21]


def test_marks_stop_early_and_protect_the_whole_path() -> None:
    trie = RadixTrie()
    a = trie.insert([1, 2], [10, 11])
    b = trie.insert([3], [12], node=a)
    trie.mark_in_use_by(b, 7)
    trie.mark_in_use_by(b, 7)  # idempotent
    trie.mark_in_use_by(a, 7)  # a has it already: stops at once
    assert a.active_seqs == b.active_seqs == {7}
    assert set(trie.get_evictable_blocks()) == set()
    assert trie.evict_blocks(5) == []
    trie.mark_not_in_use_by(b, 7)
    assert a.active_seqs == b.active_seqs == set()
    assert b.last_access_time < a.last_access_time  # the release walks up
    assert set(trie.get_evictable_blocks()) == {10, 11, 12}
    trie.mark_in_use_by(trie.root, 1)  # the root: nothing to mark
    trie.check_integrity()


def test_eviction_takes_leaf_tails_exactly_as_many_as_asked() -> None:
    trie = RadixTrie(page_size=2)
    a = trie.insert([1, 1, 2, 2], [10, 11])
    b = trie.insert([3, 3, 4, 4, 5, 5], [12, 13, 14], node=a)
    c = trie.insert([6, 6], [15], node=a)
    trie.mark_in_use_by(c, 1)
    assert trie.evict_blocks(2) == [13, 14]  # b's tail only
    assert b.tokens.tolist() == [3, 3] and b.blocks == [12] and not b.evicted
    assert trie.evict_blocks(3) == [12]  # b goes; a is c's parent and c is marked
    assert b.evicted and trie.pretty_format() == ["[1, 1, 2, 2]", "--[6, 6]"]
    trie.mark_not_in_use_by(c, 1)
    assert trie.evict_blocks(10) == [15, 10, 11]  # c, then its parent, now a leaf
    assert trie.pretty_format() == [] and not list(trie.get_all_blocks())
    assert trie.evict_blocks(0) == trie.evict_blocks(-1) == []
    with pytest.raises(InvalidInputError):
        trie.evict_blocks(1.5)  # type: ignore[arg-type]
    trie.check_integrity()


def test_pretty_format_is_maxs() -> None:
    trie = RadixTrie()
    trie.insert([1, 2, 3], ["a", "b", "c"])
    trie.insert([1, 2, 4], ["a", "b", "d"])
    trie.insert([7], ["e"])
    assert trie.pretty_format() == ["[1, 2]", "--[3]", "--[4]", "[7]"]
    assert trie.pretty_format(print_blocks=True) == [
        "[1, 2] : ['a', 'b']",
        "--[3] : ['c']",
        "--[4] : ['d']",
        "[7] : ['e']",
    ]


def test_pretty_print_prints_blocks_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    trie = RadixTrie()
    trie.insert([1], [5])
    trie.pretty_print()
    assert capsys.readouterr().out == "[1] : [5]\n"


# --------------------------------------------------------- differences from MAX


def test_a_release_the_path_does_not_hold_is_refused_whole() -> None:
    # MAX asserts on the first node without the mark, after changing the nodes below it.
    trie = RadixTrie()
    a = trie.insert([1], [10])
    b = trie.insert([2], [11], node=a)
    trie.mark_in_use_by(b, "x")
    a.active_seqs.discard("x")  # a path a caller's bug left inconsistent
    with pytest.raises(IntegrityError):
        trie.check_integrity()
    a.active_seqs.add("x")
    trie.mark_not_in_use_by(b, "x")
    with pytest.raises(LockError):
        trie.mark_not_in_use_by(b, "x")  # released already
    trie.mark_in_use_by(a, "y")
    times = (a.last_access_time, b.last_access_time)
    with pytest.raises(LockError):
        trie.mark_not_in_use_by(b, "y")  # "y" marks a, not b
    assert a.active_seqs == {"y"} and (a.last_access_time, b.last_access_time) == times
    trie.check_integrity()


def test_a_release_above_a_node_the_sequence_still_marks_is_refused() -> None:
    # MAX would unmark a and leave b marked under it: a's blocks would count as evictable
    # although b pins them, and evict_blocks' final assertion would fail after evicting.
    trie = RadixTrie()
    a = trie.insert([1], [10])
    b = trie.insert([2], [11], node=a)
    trie.mark_in_use_by(b, 3)
    with pytest.raises(LockError):
        trie.mark_not_in_use_by(a, 3)
    assert a.active_seqs == b.active_seqs == {3}
    trie.check_integrity()


def test_a_sequence_marking_two_branches_releases_them_one_by_one() -> None:
    # MAX's release of one branch unmarks the shared ancestors the other still needs.
    trie = RadixTrie()
    a = trie.insert([1], [10])
    b = trie.insert([2], [11], node=a)
    c = trie.insert([3], [12], node=a)
    trie.mark_in_use_by(b, 0)
    trie.mark_in_use_by(c, 0)
    trie.mark_not_in_use_by(b, 0)
    assert (a.active_seqs, b.active_seqs, c.active_seqs) == ({0}, set(), {0})
    assert trie.evict_blocks(5) == [11]  # a stays: c still uses it
    trie.mark_not_in_use_by(c, 0)
    assert not a.active_seqs
    trie.check_integrity()


def test_nodes_that_left_the_trie_are_refused() -> None:
    # MAX would mark through a deleted node's stale parent, or grow a detached subtree
    # whose blocks stay in all_blocks for good.
    trie, other = RadixTrie(), RadixTrie()
    gone = trie.insert([1], [10])
    assert trie.evict_blocks(1) == [10] and gone.evicted
    for call in (
        lambda: trie.insert([2], [11], node=gone),
        lambda: trie.match_prefix([2], node=gone),
        lambda: trie.insert([2], [11], node=other.root),
    ):
        with pytest.raises(InvalidInputError):
            call()
    with pytest.raises(LockError):
        trie.mark_in_use_by(gone, 0)
    with pytest.raises(LockError):
        trie.mark_not_in_use_by(other.root, 0)
    assert not list(trie.get_all_blocks())
    trie.check_integrity()


def test_a_block_is_stored_once() -> None:
    # MAX's sets fold a block stored at two nodes: evicting one drops it from all_blocks
    # while the other still hands it out, so the block manager reuses a block in use.
    trie = RadixTrie()
    trie.insert([1], [10])
    with pytest.raises(InvalidInputError):
        trie.insert([2], [10])
    with pytest.raises(InvalidInputError):
        trie.insert([3, 4], [11, 11])
    with pytest.raises(InvalidInputError):
        trie.insert([5], [[1]])  # unhashable
    trie.insert([1, 6], [10, 12])  # 10 again, for the page already there: fine
    assert sorted(trie.get_all_blocks()) == [10, 12]
    trie.check_integrity()


def test_block_sets_are_live_read_only_views() -> None:
    trie = RadixTrie()
    every, evictable = trie.get_all_blocks(), trie.get_evictable_blocks()
    trie.insert([1, 2], [10, 11])
    assert 10 in every and set(evictable) == {10, 11} and evictable - {10} == {11}
    assert not hasattr(every, "add") and not hasattr(evictable, "discard")


def test_trie_nodes_order_by_recency_and_show_their_state() -> None:
    trie = RadixTrie()
    a = trie.insert([1], [10])
    b = trie.insert([2], [11])
    assert a < b and not b < a and isinstance(a, TrieNode)
    assert "tokens=1" in repr(a) and a.is_leaf() and trie.root.is_root()
    with pytest.raises(InvalidInputError):
        RadixTrie(page_size=0)
    with pytest.raises(InvalidInputError):
        trie.insert([[1, 2]], [5])  # tuple tokens: one id a token here
