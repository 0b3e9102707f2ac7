"""RadixTrie: Modular MAX's prefix trie, ``max.pipelines.kv_cache.radix_trie``, in process.

A trie of token pages to *blocks*: one block id per page, chosen and owned by the caller
(MAX's paged KV manager keeps its own free set and hands the trie committed blocks).
Sequences mark the nodes they read (``mark_in_use_by``); a node is evictable while no
sequence marks it. The behaviour, which this class keeps exactly:

* ``insert(tokens, blocks, node=None)`` stores ``tokens`` (whole pages, one block per
  page) below ``node`` (the root by default) and returns the node where they end. Nodes
  already there keep their blocks: the caller's blocks for those pages are not stored
  and stay the caller's. It raises ``ValueError`` for a token count that is not a page
  multiple, for a block count that is not one per page, and for an empty insert.
* ``match_prefix(tokens, node=None)`` returns ``(node, blocks)`` for the longest cached
  run of whole pages after ``node``, splitting the node the match ends inside. It raises
  ``ValueError`` on empty input and drops a last, partial page. It does **not** refresh
  recency: only a release does.
* ``mark_in_use_by(node, seq_id)`` adds ``seq_id`` to every node from ``node`` up to the
  root, stopping early at a node that already has it (its ancestors have it too). A
  node's blocks stop being evictable with its first user.
* ``mark_not_in_use_by(node, seq_id)`` removes ``seq_id`` from the same path, making each
  node the most recently used as it goes (the node first, then its ancestors, newer);
  blocks become evictable when their node has no user left.
* A split leaves the lower part the same node object (a handle to the sequence end stays
  valid); the new upper part copies the users and the recency.
* ``evict_blocks(n)`` takes unmarked leaves, least recently used first, and evicts each
  from its tail, page by page, so that exactly ``n`` blocks go (fewer only when nothing
  more is evictable); an emptied leaf is deleted and its parent may be taken next. It
  returns the evicted block ids, which are the caller's again.
* ``pretty_format(print_blocks=False)`` lists the nodes depth first, children in the
  order they were added, as ``'-' * (2 * depth) + str(tokens)`` (and ``' : '`` and the
  blocks); ``pretty_print(print_blocks=True)`` prints those lines.

Where MAX's trie has bugs this one differs, each refused before anything changes (the
list, with the reasons, is in docs/clients.md, "Modular MAX's RadixTrie"): a release
the path does not hold, or one above a node the same sequence still marks, raises
``LockError``; a node that left the trie (or another trie's) is refused as a start or a
mark; a block already stored, or named twice, is refused; recency is a logical clock
(every new node and every released node takes the next tick), so ties do not leave the
eviction order to the heap; the block sets are read-only views.

What it shares with the project's radix tree and what not: tokens are packed once into
uint32 little-endian bytes (``key.pack_tokens``) and compared a page at a time with
memcmp (``radix_cache.common_prefix``); children are keyed by their first page's bytes;
the unmarked leaves wait in an ``EvictionQueue`` kept current as marks and evictions
change, instead of a heap of every leaf built at each call (the same order: recency
ticks are unique among leaves, since only a split copies one, onto an inner node). The
``TreeNode`` and ``RadixCache`` are not reused: a tree node counts locks, owns pool slots
that the cache frees to an allocator and is refreshed by every match, while a trie node
holds a *set* of sequences and blocks the caller owns, is refreshed only by a release,
and loses its tail page by page. Nor are the pools: blocks are opaque to the trie and
never freed by it (``evict_blocks`` gives them back), as in MAX.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, KeysView
from itertools import count
from typing import Any

import numpy as np

from ..errors import IntegrityError, InvalidInputError, LockError
from ..eviction import EvictionQueue
from ..key import TOKEN_BYTES, pack_tokens
from ..node import _node_ids
from ..radix.radix_cache import common_prefix
from .trie_inspection import check_radix_trie, format_trie

BlockId = Any
SeqId = Hashable

_trie_tags = count(1)


def _by_recency(node: TrieNode) -> int:
    return node.last_access_time


class TrieNode:
    """A node of a ``RadixTrie``: a run of whole pages (``tokens``) and one block per
    page (``blocks``), the sequences that use it (``active_seqs``) and its recency
    (``last_access_time``, a tick of the trie's logical clock).

    Only the root has no tokens. ``children`` are keyed by the first page of each
    child's tokens, packed (``bytes``). A node deleted by eviction has ``evicted`` set
    and no tokens or blocks left.
    """

    __slots__ = (
        "__weakref__",
        "active_seqs",
        "blocks",
        "children",
        "evicted",
        "id",
        "key_bytes",
        "last_access_time",
        "parent",
        "trie_tag",
    )

    def __init__(
        self,
        key_bytes: bytes = b"",
        blocks: list[BlockId] | None = None,
        parent: TrieNode | None = None,
        last_access_time: int = 0,
        trie_tag: int = 0,
    ) -> None:
        self.children: dict[bytes, TrieNode] = {}
        self.key_bytes = key_bytes
        self.blocks: list[BlockId] = [] if blocks is None else blocks
        self.parent = parent
        self.active_seqs: set[SeqId] = set()
        self.last_access_time = last_access_time
        self.evicted = False
        self.trie_tag = trie_tag
        self.id = next(_node_ids)

    @property
    def tokens(self) -> np.ndarray:
        """This node's own token ids (int64, a copy)."""
        return np.frombuffer(self.key_bytes, dtype="<u4").astype(np.int64)

    @property
    def num_tokens(self) -> int:
        return len(self.key_bytes) // TOKEN_BYTES

    def is_leaf(self) -> bool:
        return not self.children

    def is_root(self) -> bool:
        return self.parent is None and not self.evicted

    def __lt__(self, other: TrieNode) -> bool:  # MAX's nodes order by recency
        return self.last_access_time < other.last_access_time

    def __repr__(self) -> str:
        return (
            f"TrieNode(id={self.id}, tokens={self.num_tokens}, blocks={len(self.blocks)}, "
            f"seqs={len(self.active_seqs)}{', evicted' if self.evicted else ''})"
        )


class RadixTrie:
    """Modular MAX's ``RadixTrie`` (see the module docstring), page-aligned, in process.

    Args:
        page_size: tokens per block; inserts are whole pages, matches drop a partial
            last page.
    """

    def __init__(self, page_size: int = 1) -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise InvalidInputError(f"page_size must be an int >= 1, got {page_size!r}")
        self.page_size = page_size
        self._page_bytes = TOKEN_BYTES * page_size
        self._tag = next(_trie_tags)
        self._clock = 0
        self.root = TrieNode(trie_tag=self._tag)
        # Block -> the node that stores it; blocks of unmarked nodes (a dict for a
        # read-only keys view); unmarked leaves, least recently used first.
        self._owner: dict[BlockId, TrieNode] = {}
        self._evictable: dict[BlockId, None] = {}
        self._leaves: EvictionQueue[TrieNode] = EvictionQueue(_by_recency)

    # ------------------------------------------------------------------- the API

    def insert(self, tokens: Any, blocks: Any, node: TrieNode | None = None) -> TrieNode:
        """Store ``tokens`` (whole pages) with one block per page below ``node``.

        Returns:
            The node where ``tokens`` end.

        Raises:
            InvalidInputError (a ``ValueError``): a token count that is not a multiple of
                ``page_size``, a block count that is not one per page, no tokens, token
                ids outside uint32, a start ``node`` not in this trie, or a block to
                store that the trie holds already or that is named twice (unhashable
                blocks too). Nothing changes then.
        """
        data = self._packed(tokens)
        n = len(data) // TOKEN_BYTES
        blocks = _block_list(blocks)
        ps = self.page_size
        if n % ps:
            raise InvalidInputError(
                f"Insertion failed: the number of tokens is not divisible by the page "
                f"size. len(tokens) == {n} but page_size == {ps}."
            )
        if n // ps != len(blocks):
            raise InvalidInputError(
                f"Insertion failed: the number of tokens and blocks do not match. "
                f"len(tokens) // page_size == {n // ps} but len(blocks) == {len(blocks)}."
            )
        if n == 0:
            raise InvalidInputError(
                "Insertion failed: attempted to insert 0 tokens into the "
                "trie; provide at least one page."
            )
        start = self._start(node)
        path, child, matched = self._walk(start, data)
        pos = sum(len(p.key_bytes) for p in path) + matched
        new = blocks[pos // self._page_bytes :]
        self._check_new_blocks(new)
        end = path[-1] if path else start
        if child is not None:
            end = self._split(child, matched)
        if pos < len(data):
            end = self._add_leaf(end, data[pos:], new)
        return end

    def match_prefix(
        self, tokens: Any, node: TrieNode | None = None
    ) -> tuple[TrieNode, list[BlockId]]:
        """The longest cached run of whole pages of ``tokens`` after ``node`` (the root
        by default): the node where it ends and its blocks. Does not refresh recency.

        Raises:
            InvalidInputError (a ``ValueError``): no tokens, token ids outside uint32, or
                a start ``node`` not in this trie.
        """
        data = self._packed(tokens)
        if not data:
            raise InvalidInputError(
                "Match failed: attempted to match 0 tokens in the trie; provide at least one token."
            )
        start = self._start(node)
        data = data[: len(data) - len(data) % self._page_bytes]
        path, child, matched = self._walk(start, data)
        blocks: list[BlockId] = []
        for p in path:
            blocks.extend(p.blocks)
        end = path[-1] if path else start
        if child is not None:
            end = self._split(child, matched)
            blocks.extend(end.blocks)
        return end, blocks

    def mark_in_use_by(self, node: TrieNode, seq_id: SeqId) -> None:
        """Mark ``node`` and its ancestors as used by ``seq_id`` (idempotent).

        Raises:
            LockError: ``node`` is not in this trie (evicted, or another trie's).
            InvalidInputError: ``seq_id`` is not hashable.
        """
        cur = self._marked(node)
        _check_seq(seq_id)
        root = self.root
        while cur is not root:
            seqs = cur.active_seqs
            if seq_id in seqs:
                break  # its ancestors have it too
            if not seqs:
                for block in cur.blocks:
                    self._evictable.pop(block, None)
                self._leaves.discard(cur)
            seqs.add(seq_id)
            cur = cur.parent  # type: ignore[assignment]

    def mark_not_in_use_by(self, node: TrieNode, seq_id: SeqId) -> None:
        """Remove ``seq_id``'s mark from ``node`` and its ancestors, each becoming the
        most recently used; blocks of nodes left without users become evictable. The
        walk stops below an ancestor that ``seq_id`` still uses through another branch
        (it marked two nodes that share it), which keeps its mark.

        Raises:
            LockError: ``node`` is not in this trie, a node on its path is not marked by
                ``seq_id``, or ``seq_id`` still marks a node below ``node`` (releasing
                here would leave that node marked under unmarked ancestors). Nothing
                changes then.
        """
        start = self._marked(node)
        _check_seq(seq_id)
        for child in start.children.values():
            if seq_id in child.active_seqs:
                raise LockError(
                    f"sequence {seq_id!r} still uses node {child.id} below node "
                    f"{start.id}: release it from the deepest node it uses"
                )
        path = []
        cur, below = start, None
        while cur is not self.root:
            if seq_id not in cur.active_seqs:
                raise LockError(
                    f"sequence {seq_id!r} does not use node {cur.id} (on the "
                    f"path of node {start.id})"
                )
            if below is not None and any(
                seq_id in c.active_seqs for c in cur.children.values() if c is not below
            ):
                break  # the sequence still uses this node through another branch
            path.append(cur)
            cur, below = cur.parent, cur  # type: ignore[assignment]
        for cur in path:
            self._clock += 1
            cur.last_access_time = self._clock
            seqs = cur.active_seqs
            seqs.remove(seq_id)
            if not seqs:
                for block in cur.blocks:
                    self._evictable[block] = None
                if not cur.children:
                    self._leaves.push(cur)

    def evict_blocks(self, desired_num_evicted: int) -> list[BlockId]:
        """Evict up to ``desired_num_evicted`` blocks (exactly that many while any are
        evictable) from the tails of unmarked leaves, least recently used first.

        Returns:
            The evicted block ids, each leaf's in its order, leaf after leaf.

        Raises:
            InvalidInputError: ``desired_num_evicted`` is not an int (a negative one
                evicts nothing).
        """
        if isinstance(desired_num_evicted, bool):
            raise InvalidInputError("desired_num_evicted must be an int, not a bool")
        try:
            want = operator.index(desired_num_evicted)
        except TypeError:
            raise InvalidInputError(
                f"desired_num_evicted must be an int, not {type(desired_num_evicted).__name__}"
            ) from None
        out: list[BlockId] = []
        leaves, pb = self._leaves, self._page_bytes
        while len(out) < want:
            leaf = leaves.pop()
            if leaf is None:
                break
            take = min(want - len(out), len(leaf.blocks))
            gone = leaf.blocks[len(leaf.blocks) - take :]
            out.extend(gone)
            for block in gone:
                del self._owner[block]
                del self._evictable[block]
            if take < len(leaf.blocks):
                leaf.blocks = leaf.blocks[: len(leaf.blocks) - take]
                leaf.key_bytes = leaf.key_bytes[: len(leaf.key_bytes) - take * pb]
                leaves.push(leaf)
                continue
            parent = leaf.parent
            if parent is None:  # only the root has none, and it is never a candidate
                raise IntegrityError(f"{leaf!r} is an eviction candidate without a parent")
            del parent.children[leaf.key_bytes[:pb]]
            leaf.blocks, leaf.key_bytes, leaf.evicted = [], b"", True
            if parent is not self.root and not parent.children and not parent.active_seqs:
                leaves.push(parent)
        return out

    def get_all_blocks(self) -> KeysView[BlockId]:
        """Every block the trie stores (a live, read-only view)."""
        return self._owner.keys()

    def get_evictable_blocks(self) -> KeysView[BlockId]:
        """The blocks of nodes no sequence marks (a live, read-only view)."""
        return self._evictable.keys()

    def pretty_format(self, print_blocks: bool = False) -> list[str]:
        """The trie, one node a line, depth first: its tokens indented by depth (and
        its blocks)."""
        return format_trie(self.root, print_blocks)

    def pretty_print(self, print_blocks: bool = True) -> None:
        """Print ``pretty_format(print_blocks)``."""
        for line in self.pretty_format(print_blocks):
            print(line)

    def check_integrity(self) -> None:
        """Recompute the block sets, marks and eviction candidates from the nodes.

        Raises:
            IntegrityError: naming every disagreement found.
        """
        check_radix_trie(self)

    # ------------------------------------------------------------------ helpers

    def _packed(self, tokens: Any) -> bytes:
        data, width = pack_tokens(tokens)
        if width != 1:
            raise InvalidInputError(
                "RadixTrie tokens are plain ids, one per token (no tuple tokens)"
            )
        return data

    def _start(self, node: TrieNode | None) -> TrieNode:
        if node is None:
            return self.root
        if not isinstance(node, TrieNode) or node.trie_tag != self._tag or node.evicted:
            raise InvalidInputError(
                f"{node!r} is not a node of this trie (evicted, or another trie's)"
            )
        return node

    def _marked(self, node: TrieNode) -> TrieNode:
        if not isinstance(node, TrieNode) or node.trie_tag != self._tag or node.evicted:
            raise LockError(f"{node!r} is not a node of this trie (evicted, or another trie's)")
        return node

    def _walk(self, start: TrieNode, data: bytes) -> tuple[list[TrieNode], TrieNode | None, int]:
        """Follow whole pages of ``data`` down from ``start``, changing nothing: the
        nodes matched whole, then the child the match ends inside (None if none) and the
        bytes of it that match (whole pages, at least one)."""
        pb, end = self._page_bytes, len(data)
        path: list[TrieNode] = []
        node, pos = start, 0
        while pos < end:
            child = node.children.get(data[pos : pos + pb])
            if child is None:
                break
            if data.startswith(child.key_bytes, pos):
                path.append(child)
                pos += len(child.key_bytes)
                node = child
                continue
            return path, child, common_prefix(child.key_bytes, data, pos, end, pb)
        return path, None, 0

    def _check_new_blocks(self, blocks: list[BlockId]) -> None:
        seen: set[BlockId] = set()
        try:
            for block in blocks:
                if block in self._owner:
                    raise InvalidInputError(
                        f"block {block!r} is stored at node {self._owner[block].id} already"
                    )
                if block in seen:
                    raise InvalidInputError(f"block {block!r} is named twice")
                seen.add(block)
        except TypeError as exc:
            raise InvalidInputError(f"blocks must be hashable: {exc}") from None

    def _add_leaf(self, parent: TrieNode, key_bytes: bytes, blocks: list[BlockId]) -> TrieNode:
        self._clock += 1
        leaf = TrieNode(key_bytes, blocks, parent, self._clock, self._tag)
        parent.children[key_bytes[: self._page_bytes]] = leaf
        for block in blocks:
            self._owner[block] = leaf
            self._evictable[block] = None
        self._leaves.discard(parent)
        self._leaves.push(leaf)
        return leaf

    def _split(self, child: TrieNode, cut: int) -> TrieNode:
        """Cut ``child`` after ``cut`` bytes; the new upper part is returned."""
        pb = self._page_bytes
        pages = cut // pb
        parent: TrieNode = child.parent  # type: ignore[assignment]
        upper = TrieNode(
            child.key_bytes[:cut], child.blocks[:pages], parent, child.last_access_time, self._tag
        )
        upper.active_seqs = set(child.active_seqs)
        child.key_bytes = child.key_bytes[cut:]
        child.blocks = child.blocks[pages:]
        parent.children[upper.key_bytes[:pb]] = upper  # the same key: the same place
        upper.children[child.key_bytes[:pb]] = child
        child.parent = upper
        for block in upper.blocks:
            self._owner[block] = upper
        return upper


def _block_list(blocks: Any) -> list[BlockId]:
    """``blocks`` as a new list; arrays and tensors give Python ints (``tolist``)."""
    tolist = getattr(blocks, "tolist", None)
    if callable(tolist) and not isinstance(blocks, (list, tuple)):
        out = tolist()
        if not isinstance(out, list):
            raise InvalidInputError(f"blocks must be a sequence, not {type(blocks).__name__}")
        return out
    if isinstance(blocks, (str, bytes)) or not hasattr(blocks, "__iter__"):
        raise InvalidInputError(f"blocks must be a sequence, not {type(blocks).__name__}")
    return list(blocks)


def _check_seq(seq_id: Any) -> None:
    try:
        hash(seq_id)
    except TypeError:
        raise InvalidInputError(f"seq_id must be hashable, not {type(seq_id).__name__}") from None
