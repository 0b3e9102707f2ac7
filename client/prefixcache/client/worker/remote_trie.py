"""RemoteRadixTrie: Modular MAX's ``RadixTrie`` API over a radix model of the service.

MAX-style serving code keeps its trie calls unchanged::

    trie = RemoteRadixTrie(client, "llama")                  # was: RadixTrie(page_size)
    node, blocks = trie.match_prefix(prompt[:-1])
    trie.mark_in_use_by(node, seq_id)
    fresh = trie.evict_blocks(n)                             # n pages for this worker
    node = trie.insert(tokens, blocks, node=node)
    trie.mark_in_use_by(node, seq_id)
    trie.mark_not_in_use_by(node, seq_id)

Blocks are the model's pool pages (page ``p`` is slots ``[p * page_size, (p + 1) *
page_size)``, the rows a worker writes through the mapped pool or ``write_kv``). The
pool is the service's, so the worker's free set starts empty and every block comes from
``evict_blocks(n)``: ``n`` pages the cache's session now holds, taken from the service's
free pages or, when it has none, from its least recently used unlocked entries (MAX's
block manager already calls ``evict_blocks`` when its free set is empty).

How the calls map onto the service, and what each costs:

* ``mark_in_use_by(node, seq_id)`` holds one service lock per marked node for the
  sequence, in the cache's session (a lock covers the path to the root, as a mark
  does). A mark of a node the sequence already marks, or marks below, is a no-op, so a
  retried mark is harmless; Step calls carry request ids, so a retried call is answered
  once. The session's lease ends with the worker, and with it every mark.
* ``match_prefix`` first asks the shadow index (the model's cached pages, followed over
  Subscribe): when it holds nothing past ``node``, the answer is ``(node, [])`` with no
  call (a decode step's commit, a cold prompt). Otherwise one Step admission answers
  with the service's pages, under a lock taken in the same call that the following
  ``mark_in_use_by`` takes over (no second call). Locks that no mark takes are released
  with the next insert or eviction.
* ``insert`` is queued and returns at once: its node is known when the queued call is
  answered. A mark of it sets the insert's own lock; a mark of a node another of this
  cache's locks protects is queued too. Releases are queued (and held back one call
  when an earlier queued mark relies on them). Queued items go with the next call made
  anyway, or when ``max_queued`` are waiting, or with ``flush()``.
* ``evict_blocks`` is one Step with everything queued.

Where it differs from the in-process ``RadixTrie`` (docs/clients.md):

* Eviction is the service's: whole least recently used unlocked leaves, when an
  allocation finds the pool short; ``evict_blocks`` hands out free pages first.
* Recency is the service's: matches that reach it refresh it, releases do not.
* A node handle names a prefix: its ``tokens`` and ``blocks`` are the whole prefix from
  the root (the service's edges are its own and change as others insert).
* The caller's blocks for pages the trie had already stay the caller's, as in process
  (the insert asks the service to keep them, ``keep_duplicates``).
* The trie is shared: another worker may cache or evict between two calls; only what
  this cache's marks protect stays.
* ``get_all_blocks()`` answers ``block in ...`` as "not this worker's to reuse" (the
  service holds it), ``get_evictable_blocks()`` counts what ``evict_blocks`` could hand
  out (the service's free and evictable pages); neither lists block ids.
* ``pretty_format()`` lists the nodes this cache marks or inserted, not the service's
  tree.
* A queued insert's error is logged and kept in ``errors``; its node is then
  ``failed`` (marks of it are refused) and its blocks are the caller's again.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._wire import _numpy, pack_slots, pack_tokens
from ..errors import (
    InvalidArgument,
    NotFound,
    PrefixCacheError,
    ResourceExhausted,
)
from ..page_chain import RequestHashes
from ..results import MatchReply, ModelStats
from ..sessions.session import ClientSession
from ..step import Admit, Finish, Free
from ..sync import PrefixCacheClient

log = logging.getLogger("prefixcache.client")

__all__ = ["RemoteRadixTrie", "RemoteTrieNode"]


def _errors() -> Any:
    """``prefixcache.cache``, for its error classes (imported when first needed)."""
    import prefixcache.cache as cache

    return cache


class RemoteTrieNode:
    """A handle to a cached prefix of a ``RemoteRadixTrie``'s model.

    Attributes:
        prefix: the prefix's tokens, packed (uint32 little-endian).
        blocks: the page of each of its pages, from the root.
        node_id: the service's node where it ends (0: the root, or not known yet).
        state: ``"ok"``; ``"pending"`` while its insert is queued; ``"failed"`` when the
            insert did not happen.
    """

    __slots__ = (
        "__weakref__",
        "_hashes",
        "blocks",
        "exact",
        "node_id",
        "prefix",
        "server_epoch",
        "state",
        "trie_tag",
    )

    def __init__(
        self,
        prefix: bytes,
        blocks: list[int],
        node_id: int,
        server_epoch: int,
        trie_tag: int,
        state: str = "ok",
    ) -> None:
        self.prefix = prefix
        self.blocks = blocks
        self.node_id = node_id
        self.server_epoch = server_epoch
        self.trie_tag = trie_tag
        self.state = state
        self.exact = True  # blocks are the tree's own pages (not a caller's duplicates)
        self._hashes: RequestHashes | None = None

    @property
    def tokens(self) -> list[int]:
        """The prefix's token ids, from the root."""
        return array("I", self.prefix).tolist()

    @property
    def id(self) -> int:
        return self.node_id

    def __repr__(self) -> str:
        return (
            f"RemoteTrieNode({len(self.prefix) // 4} tokens, node {self.node_id}"
            f"{'' if self.state == 'ok' else ', ' + self.state})"
        )


@dataclass(eq=False)
class _Lock:
    """A service lock this cache holds or is about to (``lock_id`` 0 until answered)."""

    prefix: bytes
    lock_id: int = 0
    lost: bool = False  # its call failed: nothing is held


@dataclass(eq=False)
class _Insert:
    """A queued insert, and the lock a mark of its node asked for."""

    start: RemoteTrieNode
    node: RemoteTrieNode
    tokens: bytes
    slots: bytes
    new_blocks: list[int]
    hashes: RequestHashes | None
    lock: _Lock | None = None
    temp_lock: int = 0  # a lock that protected the start's prefix: released after it
    held: frozenset[int] = frozenset()  # of new_blocks, those the session held


@dataclass(eq=False)
class _Queue:
    inserts: list[_Insert] = field(default_factory=list)
    admits: list[tuple[Admit, Callable[[Any], None]]] = field(default_factory=list)
    unlocks: list[int] = field(default_factory=list)
    later: list[int] = field(default_factory=list)  # held back a call (see _unlock)
    frees: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return (
            len(self.inserts)
            + len(self.admits)
            + len(self.unlocks)
            + len(self.later)
            + len(self.frees)
        )


class NotHeldBlocks:
    """``get_all_blocks()``: ``block in view`` is True for every page this cache's
    session does not hold (the service's, or another worker's: never to be reused)."""

    def __init__(self, held: set[int], pages: int) -> None:
        self._held, self._pages = held, pages

    def __contains__(self, block: object) -> bool:
        return block not in self._held

    def __len__(self) -> int:
        return max(self._pages - len(self._held), 0)


class EvictableCount:
    """``get_evictable_blocks()``: how many pages ``evict_blocks`` could hand out now
    (the service's free and evictable pages). Subtracting blocks a batch will use takes
    all of them off, whether or not the service counted them (the budget errs small)."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __sub__(self, other: Any) -> EvictableCount:
        return EvictableCount(max(self.count - len(set(other)), 0))

    def __repr__(self) -> str:
        return f"EvictableCount({self.count})"


class RemoteRadixTrie:
    """MAX's ``RadixTrie`` over one radix model of a prefix-cache service (see the module
    docstring).

    Args:
        client: a ``PrefixCacheClient``, or a target to make one (with ``client_kwargs``).
        model: the hosted model; its cache kind must be ``radix``.
        session: the session that holds the marks and pages; by default the trie opens
            its own (leased, renewed in the background) and closes it in ``close()``.
        ttl: the lease of that session.
        shadow: answer matches that find nothing new from the shadow index (needs the
            service's change log, ``server.change_log_capacity``); False: every match
            with a whole page is a call.
        shadow_wait: seconds to wait for the shadow index's first snapshot.
        max_queued: queued items that make the next queued one send them.
    """

    def __init__(
        self,
        client: PrefixCacheClient | str | Path,
        model: str,
        *,
        session: ClientSession | None = None,
        ttl: float | None = None,
        shadow: bool = True,
        shadow_wait: float = 5.0,
        max_queued: int = 512,
        **client_kwargs: Any,
    ) -> None:
        self._owns_client = not isinstance(client, PrefixCacheClient)
        self.client = (
            client
            if isinstance(client, PrefixCacheClient)
            else PrefixCacheClient(client, **client_kwargs)
        )
        self.model = model
        try:
            info = self.client.list_models()[model]
        except KeyError:
            raise NotFound(f"model {model!r} is not hosted by {self.client.target}") from None
        if info.cache_kind != "radix":
            raise InvalidArgument(
                f"RemoteRadixTrie needs a radix model; {model!r} is {info.cache_kind}"
            )
        self.page_size = info.page_size
        self._page_bytes = 4 * info.page_size
        self._pool_pages = (info.pool_size + 1) // info.page_size
        self.max_queued = max_queued
        self._owns_session = session is None
        self.session = (
            session
            if session is not None
            else self.client.session(ttl, name=f"RemoteRadixTrie:{model}")
        )
        self._tag = id(self)
        self._epoch = self.session.server_epoch
        self.root = RemoteTrieNode(b"", [], 0, 0, self._tag)
        self._handles: weakref.WeakValueDictionary[bytes, RemoteTrieNode] = (
            weakref.WeakValueDictionary()
        )
        self._marks: dict[Any, dict[bytes, _Lock]] = {}  # seq -> prefix -> its lock
        self._spec: dict[bytes, int] = {}  # prefix -> a match's lock no mark took yet
        self._recent: dict[bytes, RemoteTrieNode] = {}  # query -> its answer, meanwhile
        self._held: set[int] = set()  # pages this cache's session holds
        self._queue = _Queue()
        self._counters: ModelStats | None = None
        self._fresh = False
        self.calls = 0
        self.errors: deque[tuple[str, PrefixCacheError]] = deque(maxlen=64)
        self.stale_dropped = 0
        self._shadow = None
        if shadow:
            self._shadow = self.client.shadow(model)
            self._shadow.wait_ready(shadow_wait)

    def __repr__(self) -> str:
        return f"RemoteRadixTrie({self.client.target!r}, {self.model!r})"

    # ---------------------------------------------------------------- lifecycle

    def flush(self) -> None:
        """Send everything queued now (one call, two when a release was held back)."""
        if len(self._queue):
            self._send()
        if self._queue.later or len(self._queue):
            self._send()

    def close(self) -> None:
        """Send what is queued, then close what this trie opened (its session releases
        every mark and frees every page it holds)."""
        with contextlib.suppress(PrefixCacheError):
            self.flush()
        if self._shadow is not None:
            self._shadow.close()
        if self._owns_session:
            self.session.close()
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> RemoteRadixTrie:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the API

    def match_prefix(
        self, tokens: Any, node: RemoteTrieNode | None = None
    ) -> tuple[RemoteTrieNode, list[int]]:
        """The longest cached run of whole pages of ``tokens`` after ``node``: the node
        where it ends and its pages. No call when the shadow index holds nothing past
        ``node``.

        Raises:
            InvalidInputError (a ``ValueError``): no tokens, or a ``node`` that is not
                this trie's (or whose insert failed).
        """
        self._check_epoch()
        data = self._packed(tokens)
        if not data:
            raise _errors().InvalidInputError(
                "Match failed: attempted to match 0 tokens in the trie; provide at least one token."
            )
        start = self._start(node)
        aligned = data[: len(data) - len(data) % self._page_bytes]
        if not aligned:
            return start, []
        full = start.prefix + aligned
        base = len(start.prefix) // self._page_bytes
        known = self._recent.get(full)
        if known is not None and known.state == "ok" and self._protected(known.prefix):
            return known, known.blocks[base:]  # answered in this window, still locked
        hashes = None
        if self._shadow is not None:
            hashes = self._hashes(start).extended(aligned)
            if self._shadow.match_pages(hashes) <= base:
                return start, []
        answer = self._lookup(full, len(start.prefix))
        if answer is None:
            return start, []
        if hashes is not None and answer._hashes is None:
            answer._hashes = hashes.prefix(len(answer.prefix) // 4)
        self._recent[full] = answer
        return answer, answer.blocks[base:]

    def insert(
        self, tokens: Any, blocks: Any, node: RemoteTrieNode | None = None
    ) -> RemoteTrieNode:
        """Queue the insert of ``tokens`` (whole pages) with one page per page below
        ``node``; returns its node (``state`` ``"pending"`` until the call is answered).

        Raises:
            InvalidInputError (a ``ValueError``): as the in-process ``RadixTrie``: a token
                count that is not a page multiple, a block count that is not one per page,
                no tokens; blocks that are not page ids, or named twice; a ``node`` that
                is not this trie's, or whose prefix is no longer cached.
        """
        self._check_epoch()
        errors = _errors()
        data = self._packed(tokens)
        n, ps = len(data) // 4, self.page_size
        pages = _block_list(blocks)
        if n % ps:
            raise errors.InvalidInputError(
                f"Insertion failed: the number of tokens is not divisible by the page "
                f"size. len(tokens) == {n} but page_size == {ps}."
            )
        if n // ps != len(pages):
            raise errors.InvalidInputError(
                f"Insertion failed: the number of tokens and blocks do not match. "
                f"len(tokens) // page_size == {n // ps} but len(blocks) == {len(pages)}."
            )
        if n == 0:
            raise errors.InvalidInputError(
                "Insertion failed: attempted to insert 0 tokens "
                "into the trie; provide at least one page."
            )
        if len(set(pages)) != len(pages):
            raise errors.InvalidInputError("a block is named twice")
        start = self._start(node)
        temp = 0
        if start is not self.root:
            if not start.exact:
                self._resolve(start)
            if start.state == "ok" and not self._protected(start.prefix):
                temp = self._verify(start)
        full = start.prefix + data
        handle = self._handle(full, start.blocks + pages, 0, "pending")
        if handle.state == "failed":
            handle.blocks = start.blocks + pages
        handle.state = "pending"
        hashes = None
        if self._shadow is not None:
            hashes = self._hashes(start).extended(data)
            handle._hashes = hashes
            # The start's pages are held or noted already (a mark protects them).
            self._shadow.note(hashes, first=len(start.prefix) // self._page_bytes)
        self._close_window()
        held = frozenset(self._held.intersection(pages))
        self._held.difference_update(pages)
        self._queue.inserts.append(
            _Insert(
                start,
                handle,
                full,
                _slots_of(start.blocks + pages, ps),
                pages,
                hashes,
                temp_lock=temp,
                held=held,
            )
        )
        self._maybe_send()
        return handle

    def mark_in_use_by(self, node: RemoteTrieNode, seq_id: Any) -> None:
        """Mark ``node`` (and so its ancestors) as used by ``seq_id``: a service lock in
        this cache's session, taken in a call made anyway where that is safe.

        Raises:
            LockError: ``node`` is not this trie's, its insert failed, or its prefix is no
                longer cached (a node no lock of this cache protected).
        """
        h = self._marked(node)
        if h is None or h is self.root:
            return
        marks = self._marks.setdefault(_hashable(seq_id), {})
        prefix = h.prefix
        if any(q.startswith(prefix) for q in marks):
            return  # marked here or below already
        marks[prefix] = self._take_lock(h)

    def mark_not_in_use_by(self, node: RemoteTrieNode, seq_id: Any) -> None:
        """Release ``seq_id``'s marks from ``node`` up (each a queued unlock), keeping
        those of ancestors it still uses through another marked node.

        Raises:
            LockError: ``seq_id`` does not mark ``node``, or still marks a node below it.
        """
        h = self._marked(node)
        if h is None:
            return
        seq = _hashable(seq_id)
        marks = self._marks.get(seq, {})
        prefix = h.prefix
        for q in marks:
            if q != prefix and q.startswith(prefix):
                raise _errors().LockError(
                    f"sequence {seq_id!r} still uses a node below "
                    f"{h!r}: release it from the deepest node it uses"
                )
        if prefix not in marks:
            if h is self.root:
                return
            raise _errors().LockError(f"sequence {seq_id!r} does not use {h!r}")
        path = [q for q in marks if prefix.startswith(q)]
        rest = [r for r in marks if not prefix.startswith(r)]
        for q in path:
            if any(r.startswith(q) for r in rest):
                continue  # still used through another branch
            self._release(marks.pop(q))
        if not marks:
            del self._marks[seq]

    def evict_blocks(self, desired_num_evicted: int) -> list[int]:
        """``desired_num_evicted`` pages for this worker (fewer when the service has
        fewer free and evictable ones), evicting unlocked entries if its pool is short;
        one call, with everything queued.

        Raises:
            InvalidInputError: ``desired_num_evicted`` is not an int.
        """
        self._check_epoch()
        want = _count(desired_num_evicted)
        if want <= 0:
            return []
        self._close_window()
        ps = self.page_size
        (got,) = self._send(decodes=[want * ps])
        if isinstance(got, ResourceExhausted):
            counters = self._counters
            room = (
                0 if counters is None else (counters.free_slots + counters.evictable_tokens) // ps
            )
            if min(room, want) <= 0:
                return []
            (got,) = self._send(decodes=[min(room, want) * ps])
            if isinstance(got, ResourceExhausted):
                return []
        if isinstance(got, PrefixCacheError):
            raise got
        pages = _pages_of(got.slots, ps)
        self._held.update(pages)
        return pages

    def release_unused(self) -> None:
        """Release (queued) the locks of matches no mark took; ``insert`` and
        ``evict_blocks`` do this first, as the scheduler is done matching by then."""
        self._close_window()

    def free_blocks(self, blocks: Any) -> None:
        """Give pages this worker holds back to the service (queued)."""
        pages = _block_list(blocks)
        self._held.difference_update(pages)
        self._queue.frees.extend(pages)
        self._maybe_send()

    def get_all_blocks(self) -> NotHeldBlocks:
        """A view whose ``in`` is True for every page this worker may not reuse."""
        return NotHeldBlocks(self._held, self._pool_pages)

    def get_evictable_blocks(self) -> EvictableCount:
        """How many pages ``evict_blocks`` could hand out now (after what is queued)."""
        counters = self.stats()
        return EvictableCount((counters.free_slots + counters.evictable_tokens) // self.page_size)

    def held_blocks(self) -> frozenset[int]:
        """The pages this cache's session holds for the worker (handed out by
        ``evict_blocks``, not inserted, not freed)."""
        return frozenset(self._held)

    def stats(self) -> ModelStats:
        """The model's counters at the service, after what is queued."""
        self.flush()
        if not self._fresh or self._counters is None:
            self.calls += 1
            self._counters = self.client.stats(self.model)[self.model]
            self._fresh = True
        return self._counters

    def pretty_format(self, print_blocks: bool = False) -> list[str]:
        """The nodes this cache marks or has inserted, as MAX prints a trie: depth first,
        each line its tokens past the nearest listed ancestor (and its pages)."""
        shown = {q for marks in self._marks.values() for q in marks}
        shown.update(i.node.prefix for i in self._queue.inserts)
        shown.update(self._spec)
        lines = []
        for prefix in sorted(shown):
            above = [q for q in shown if q != prefix and prefix.startswith(q)]
            cut = max((len(q) for q in above), default=0)
            handle = self._handles.get(prefix)
            tokens = array("I", prefix[cut:]).tolist()
            line = f"{'-' * (2 * len(above))}{tokens}"
            if print_blocks:
                blocks = handle.blocks[cut // self._page_bytes :] if handle else "?"
                line = f"{line} : {blocks}"
            lines.append(line)
        return lines

    def pretty_print(self, print_blocks: bool = True) -> None:
        for line in self.pretty_format(print_blocks):
            print(line)

    def check_integrity(self) -> None:
        """Nothing to check here: the tree lives in the service, which checks itself."""

    # -------------------------------------------------------------- the service

    def _lookup(self, full: bytes, floor: int) -> RemoteTrieNode | None:
        """The service's answer for ``full`` under a lock (a speculative one, for the
        mark that usually follows), or None when it holds no more than ``floor`` bytes."""
        (reply,) = self._send(admits=[Admit(full, lock=True, allocate=False)])
        if isinstance(reply, PrefixCacheError):
            raise reply
        if reply.skipped:
            return None
        pages = _pages_of(reply.slots, self.page_size)
        whole = len(pages) * self._page_bytes
        if whole < reply.prefix_len * 4:  # another writer's slots are not whole pages
            self._release_id(reply.lock_id)
            if whole <= floor:
                return None
            return self._lookup(full[:whole], floor)
        matched = reply.prefix_len * 4
        if matched <= floor:
            self._release_id(reply.lock_id)
            return None
        prefix = full[:matched]
        handle = self._handle(prefix, pages, reply.node_id, "ok", reply.server_epoch)
        if reply.lock_id:
            if prefix in self._spec:
                self._release_id(reply.lock_id)
            else:
                self._spec[prefix] = reply.lock_id
        return handle

    def _take_lock(self, h: RemoteTrieNode) -> _Lock:
        lock = _Lock(h.prefix)
        spec = self._spec.pop(h.prefix, 0)
        if spec:
            lock.lock_id = spec
            return lock
        if h.state == "pending":
            ins = next((i for i in self._queue.inserts if i.node is h and i.lock is None), None)
            if ins is not None:
                ins.lock = lock
                return lock
        if self._protected(h.prefix) or h.state == "pending":
            self._queue.admits.append(
                (Admit(h.prefix, lock=True, allocate=False), lambda r: self._locked(lock, r))
            )
            self._maybe_send()
            return lock
        (reply,) = self._send(admits=[Admit(h.prefix, lock=True, allocate=False)])
        self._locked(lock, reply)
        if lock.lost:
            raise _errors().LockError(f"{h!r} is no longer cached at the service: match it again")
        return lock

    def _locked(self, lock: _Lock, reply: Any) -> None:
        """The answer to a mark's lock: it holds only if the whole prefix matched."""
        if lock.lost:  # released before the answer came
            if isinstance(reply, MatchReply):
                self._release_id(reply.lock_id)
            return
        if isinstance(reply, PrefixCacheError) or reply.skipped:
            lock.lost = True
            if isinstance(reply, PrefixCacheError):
                self._failed("marks", reply)
            return
        if reply.prefix_len * 4 < len(lock.prefix):
            lock.lost = True
            self._release_id(reply.lock_id)
            self._failed(
                "marks",
                PrefixCacheError(
                    f"a mark's prefix of {len(lock.prefix) // 4} tokens was evicted before its "
                    f"lock; {reply.prefix_len} are held"
                ),
            )
            return
        lock.lock_id = reply.lock_id

    def _release(self, lock: _Lock) -> None:
        if lock.lock_id:
            self._release_id(lock.lock_id)
        else:
            lock.lost = True  # not answered yet: its answer is released when it comes

    def _release_id(self, lock_id: int) -> None:
        """Queue an unlock; held back one call when a queued mark (an admission sent
        after the step's unlocks) may rely on the lock."""
        if not lock_id:
            return
        (self._queue.later if self._queue.admits else self._queue.unlocks).append(lock_id)

    def _protected(self, prefix: bytes) -> bool:
        """Whether a lock of this cache covers ``prefix`` (one on it or below it)."""
        for q in self._spec:
            if q.startswith(prefix):
                return True
        for marks in self._marks.values():
            for q, lock in marks.items():
                if not lock.lost and q.startswith(prefix):
                    return True
        return any(
            i.lock is not None and i.node.prefix.startswith(prefix) for i in self._queue.inserts
        )

    def _verify(self, start: RemoteTrieNode) -> int:
        """Lock ``start``'s prefix now (no lock of this cache protects it) and check it
        is whole; the lock protects the insert and is released after it."""
        (reply,) = self._send(admits=[Admit(start.prefix, lock=True, allocate=False)])
        if isinstance(reply, PrefixCacheError):
            raise reply
        if reply.prefix_len * 4 < len(start.prefix):
            self._release_id(reply.lock_id)
            raise _errors().InvalidInputError(
                f"{start!r} is no longer cached at the service: match it again"
            )
        pages = _pages_of(reply.slots, self.page_size)
        start.blocks = pages[: len(start.prefix) // self._page_bytes]
        return int(reply.lock_id)

    def _resolve(self, h: RemoteTrieNode) -> None:
        """Learn the tree's own pages of ``h`` (its blocks hold a caller's duplicates)."""
        (reply,) = self._send(admits=[Admit(h.prefix, lock=False, allocate=False)])
        if isinstance(reply, MatchReply) and reply.prefix_len * 4 >= len(h.prefix):
            h.blocks = _pages_of(reply.slots, self.page_size)[: len(h.prefix) // self._page_bytes]
            h.exact = True

    def _close_window(self) -> None:
        """Release the locks of matches no mark took (before an insert or eviction)."""
        for lock_id in self._spec.values():
            self._release_id(lock_id)
        self._spec.clear()
        self._recent.clear()

    def _maybe_send(self) -> None:
        if len(self._queue) >= self.max_queued:
            self._send()

    def _send(
        self, admits: list[Admit] | None = None, decodes: list[int] | None = None
    ) -> tuple[Any, ...]:
        """One Step: the queued items (inserts, releases, frees, marks), then ``admits``
        and ``decodes``; returns the results of those two."""
        q = self._queue
        inserts, queued, unlocks, frees = q.inserts, q.admits, q.unlocks, q.frees
        q.inserts, q.admits, q.unlocks, q.frees = [], [], q.later, []
        q.later = []
        ps = self.page_size
        finishes = [
            Finish(i.tokens, i.slots, keep_tail=True, keep_duplicates=True, lock=i.lock is not None)
            for i in inserts
        ]
        free_items = [Free(_slots_of(frees, ps))] if frees else []
        temps = [i.temp_lock for i in inserts if i.temp_lock]
        self.calls += 1
        try:
            reply = self.session.step(
                self.model,
                finishes=finishes,
                unlocks=unlocks + temps,
                frees=free_items,
                decodes=decodes or [],
                admits=[a for a, _ in queued] + (admits or []),
            )
        except PrefixCacheError as err:
            self._fresh = False
            for ins in inserts:
                self._inserted(ins, err)
            for _, callback in queued:
                callback(err)
            raise
        for ins, result in zip(inserts, reply.finishes, strict=True):
            self._inserted(ins, result)
        for result in (*reply.unlocks, *reply.frees):
            if isinstance(result, PrefixCacheError):
                self._failed("unlocks", result)
        for (_, callback), result in zip(queued, reply.admits, strict=False):
            callback(result)
        if reply.counters is not None:
            self._counters, self._fresh = reply.counters, True
        else:
            self._fresh = False
        mine = reply.admits[len(queued) :]
        return (*mine, *reply.decodes) if admits or decodes else ()

    def _inserted(self, ins: _Insert, result: Any) -> None:
        h, start = ins.node, ins.start
        if isinstance(result, PrefixCacheError) or result.skipped:
            if isinstance(result, PrefixCacheError):
                self._failed("inserts", result)
            h.state = "failed"
            self._held.update(ins.held)  # nothing was taken: they stay the caller's
            if ins.hashes is not None and self._shadow is not None:
                self._shadow.unnote(ins.hashes, len(start.prefix) // self._page_bytes)
            if ins.lock is not None:
                ins.lock.lost = True
            return
        h.state, h.node_id, h.server_epoch = "ok", result.node_id, result.server_epoch
        dup = max(result.prefix_len * 4 - len(start.prefix), 0) // self._page_bytes
        if dup:  # the tree had those pages: the caller's stay the caller's
            self._held.update(ins.held.intersection(ins.new_blocks[:dup]))
            h.exact = False
        if ins.lock is not None:
            if ins.lock.lost:  # released before the answer came
                self._release_id(result.lock_id)
            else:
                ins.lock.lock_id = result.lock_id

    def _failed(self, what: str, err: PrefixCacheError) -> None:
        self.errors.append((what, err))
        log.warning("a queued %s item of %r failed: %s", what, self.model, err)

    # ------------------------------------------------------------------ helpers

    def _packed(self, tokens: Any) -> bytes:
        try:
            data, width = pack_tokens(tokens)
        except InvalidArgument as err:
            raise _errors().InvalidInputError(str(err)) from err
        if width != 1:
            raise _errors().InvalidInputError("RadixTrie tokens are plain ids, one per token")
        return data

    def _handle(
        self, prefix: bytes, blocks: list[int], node_id: int, state: str, epoch: int = 0
    ) -> RemoteTrieNode:
        """The one handle of ``prefix`` (so that equal prefixes give the same object)."""
        h = self._handles.get(prefix)
        if h is None:
            h = RemoteTrieNode(prefix, blocks, node_id, epoch or self._epoch, self._tag, state)
            self._handles[prefix] = h
        elif state == "ok":
            h.blocks, h.node_id, h.state, h.exact = blocks, node_id, "ok", True
            h.server_epoch = epoch or self._epoch
        return h

    def _hashes(self, h: RemoteTrieNode) -> RequestHashes:
        if h._hashes is None:
            h._hashes = RequestHashes(h.prefix, page_size=self.page_size, token_width=1)
        return h._hashes

    def _start(self, node: RemoteTrieNode | None) -> RemoteTrieNode:
        if node is None:
            return self.root
        if (
            not isinstance(node, RemoteTrieNode)
            or node.trie_tag != self._tag
            or node.state == "failed"
            or (node is not self.root and node.server_epoch != self._epoch)
        ):
            raise _errors().InvalidInputError(
                f"{node!r} is not a node of this trie (its "
                "insert failed, or it is another trie's, or "
                "from before a restart)"
            )
        return node

    def _marked(self, node: Any) -> RemoteTrieNode | None:
        """The handle to mark or release (None: one from before a restart, dropped)."""
        self._check_epoch()
        if (
            not isinstance(node, RemoteTrieNode)
            or node.trie_tag != self._tag
            or node.state == "failed"
        ):
            raise _errors().LockError(f"{node!r} is not a node of this trie (or its insert failed)")
        if node is not self.root and node.server_epoch != self._epoch:
            self.stale_dropped += 1
            return None
        return node

    def _check_epoch(self) -> None:
        """After a restart every handle, mark and page is gone: forget them."""
        epoch = self.session.server_epoch
        if epoch != self._epoch:
            self._epoch = epoch
            self._marks.clear()
            self._spec.clear()
            self._recent.clear()
            self._held.clear()
            self._queue = _Queue()


def _count(value: Any) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise _errors().InvalidInputError(
            f"desired_num_evicted must be an int, not {type(value).__name__}"
        )
    return int(value.__index__())


def _hashable(seq_id: Any) -> Any:
    try:
        hash(seq_id)
    except TypeError:
        raise _errors().InvalidInputError(
            f"seq_id must be hashable, not {type(seq_id).__name__}"
        ) from None
    return seq_id


def _block_list(blocks: Any) -> list[int]:
    tolist = getattr(blocks, "tolist", None)
    values = tolist() if callable(tolist) and not isinstance(blocks, (list, tuple)) else blocks
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise _errors().InvalidInputError(
            f"blocks must be a sequence of page ids, not {type(blocks).__name__}"
        )
    out = []
    for b in values:
        if isinstance(b, bool) or not hasattr(b, "__index__") or b.__index__() < 0:
            raise _errors().InvalidInputError(f"blocks are page ids (ints >= 0), not {b!r}")
        out.append(b.__index__())
    return out


def _slots_of(pages: list[int], page_size: int) -> bytes:
    """Every slot of ``pages``, packed."""
    if page_size == 1:
        return pack_slots(pages)
    np = _numpy()
    if np is not None:
        first = np.asarray(pages, dtype=np.int64) * page_size
        packed: bytes = (first[:, None] + np.arange(page_size)).astype("<i8").tobytes()
        return packed
    return pack_slots([p * page_size + i for p in pages for i in range(page_size)])


def _pages_of(slots: array[int], page_size: int) -> list[int]:
    """The leading whole pages of ``slots`` (a page: its ``page_size`` slots in order)."""
    if page_size == 1:
        return list(slots)
    n = len(slots) // page_size
    np = _numpy()
    if np is not None and n:
        rows = np.frombuffer(slots, dtype=np.int64)[: n * page_size].reshape(n, page_size)
        first = rows[:, 0]
        ok = (first % page_size == 0) & (rows == first[:, None] + np.arange(page_size)).all(1)
        good = n if ok.all() else int(np.argmin(ok))
        whole: list[int] = (first[:good] // page_size).tolist()
        return whole
    out = []
    for i in range(n):
        s = slots[i * page_size]
        if s % page_size or list(slots[i * page_size : (i + 1) * page_size]) != list(
            range(s, s + page_size)
        ):
            break
        out.append(s // page_size)
    return out
