"""RemoteRadixTrie: MAX's RadixTrie API over a radix model of a real server.

* A state machine runs the same calls against the in-process ``RadixTrie`` and the
  remote one (pages from ``evict_blocks``, paired with the in-process trie's own block
  ids): inserts (below the root or a handle, with the tree's blocks or the caller's own
  for pages already there), matches, marks and releases with their errors. Without pool
  pressure the answers must be equal op for op: the blocks (through the pairing), the
  node each names (its whole prefix), the errors, and which blocks are the caller's to
  reuse. It runs with the shadow index answering and without it.
* Against a ``prefixcache serve`` process: a MAX-style manager's loop (free set from
  ``evict_blocks``, fetch, commit, release) under pool pressure, where marked prefixes
  must survive and evicted ones go; a worker killed with marks held loses them with its
  lease; a retried mark takes no second lock.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cache_model import machine_settings
from harness import SOURCE_PATH, ServerThread, running, serve_process
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from prefixcache.cache import InvalidInputError, LockError, RadixTrie
from prefixcache.client import InvalidArgument, PrefixCacheClient, RemoteRadixTrie
from prefixcache.server.config import MambaConfig, ModelConfig, PoolConfig

PAGE = 2
MODELS = (
    ModelConfig(name="t", page_size=PAGE, pool=PoolConfig(size=4096, k_heads=1, k_head_dim=2)),
    ModelConfig(name="t1", page_size=1, pool=PoolConfig(size=4096, k_heads=1, k_head_dim=2)),
    ModelConfig(
        name="h",
        kind="mamba",
        page_size=2,
        mamba=MambaConfig(state_slots=4),
        pool=PoolConfig(size=16, k_heads=1, k_head_dim=2),
    ),
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    with running(tmp_path_factory.mktemp("trie"), MODELS) as srv:
        yield srv


def _outcome(call: Any) -> tuple[str, Any]:
    try:
        return "ok", call()
    except InvalidInputError:
        return "value", None
    except LockError:
        return "lock", None


def _prefix(node: Any) -> list[int]:
    """An in-process node's whole prefix, root first."""
    parts = []
    while node is not None and node.parent is not None:
        parts.append(node.tokens.tolist())
        node = node.parent
    return [t for part in reversed(parts) for t in part]


class SameAnswers(RuleBasedStateMachine):
    """One in-process trie and one remote trie, driven alike."""

    address = ""
    model = "t"
    use_shadow = False

    def __init__(self) -> None:
        super().__init__()
        self.handles: list[tuple[Any, Any]] = []
        self.mine: list[tuple[int, int]] = []  # (local block, remote page) the caller holds
        self.to_page: dict[int, int] = {}
        self.next_block = 1

    @initialize()
    def start(self) -> None:
        self.client = PrefixCacheClient(self.address)
        self.client.reset(self.model)
        self.remote = RemoteRadixTrie(self.client, self.model, shadow=self.use_shadow)
        self.ps = self.remote.page_size
        self.local = RadixTrie(page_size=self.ps)

    def teardown(self) -> None:
        if hasattr(self, "remote"):
            self.remote.close()
            self.client.close()

    def _pages(self, data: st.DataObject, partial: bool = False) -> list[int]:
        pages = data.draw(st.lists(st.sampled_from([0, 1, 2]), max_size=4))
        tokens = [t for p in pages for t in ([p] * (self.ps - 1) + [7 + p])]
        if partial and data.draw(st.booleans()):
            tokens.append(5)
        return tokens

    def _start(self, data: st.DataObject) -> tuple[Any, Any]:
        if not self.handles or data.draw(st.booleans()):
            return None, None
        return data.draw(st.sampled_from(self.handles))

    def _blocks(self, n: int) -> list[tuple[int, int]]:
        pages = self.remote.evict_blocks(n)
        assert len(pages) == n  # the pool has room: free pages
        pairs = [(self.next_block + i, p) for i, p in enumerate(pages)]
        self.next_block += n
        self.to_page.update(pairs)
        self.mine.extend(pairs)
        return pairs

    def _same_node(self, local: Any, remote: Any) -> None:
        assert remote.tokens == _prefix(local)
        self.remote.flush()
        assert remote.state == "ok"
        self.handles.append((local, remote))

    @rule(data=st.data(), reuse=st.booleans())
    def insert(self, data: st.DataObject, reuse: bool) -> None:
        tokens = self._pages(data, partial=data.draw(st.integers(0, 7)) == 0)
        node, rnode = self._start(data)
        n = len(tokens) // self.ps
        if reuse and n:  # the tree's own blocks where it has the pages, as MAX commits
            _, have = self.local.match_prefix(tokens, node)
            _, rhave = self.remote.match_prefix(tokens, rnode)
            assert [self.to_page[b] for b in have] == rhave
            fresh = self._blocks(n - len(have))
            blocks, pages = have + [b for b, _ in fresh], rhave + [p for _, p in fresh]
        else:
            fresh = self._blocks(n) if n else []
            blocks, pages = [b for b, _ in fresh], [p for _, p in fresh]
        got = _outcome(lambda: self.local.insert(tokens, blocks, node))
        want = _outcome(lambda: self.remote.insert(tokens, pages, rnode))
        assert got[0] == want[0]
        if got[0] == "ok":
            self._same_node(got[1], want[1])
            stored = set(self.local.get_all_blocks())
            self.mine = [(b, p) for b, p in self.mine if b not in stored]

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        tokens = self._pages(data, partial=True)
        node, rnode = self._start(data)
        got = _outcome(lambda: self.local.match_prefix(tokens, node))
        want = _outcome(lambda: self.remote.match_prefix(tokens, rnode))
        assert got[0] == want[0]
        if got[0] == "ok":
            assert [self.to_page[b] for b in got[1][1]] == want[1][1]
            self._same_node(got[1][0], want[1][0])

    @rule(data=st.data(), seq=st.sampled_from([0, 1]), release=st.booleans())
    def mark(self, data: st.DataObject, seq: int, release: bool) -> None:
        if not self.handles:
            return
        node, rnode = data.draw(st.sampled_from(self.handles))
        if release:
            got = _outcome(lambda: self.local.mark_not_in_use_by(node, seq))
            want = _outcome(lambda: self.remote.mark_not_in_use_by(rnode, seq))
        else:
            got = _outcome(lambda: self.local.mark_in_use_by(node, seq))
            want = _outcome(lambda: self.remote.mark_in_use_by(rnode, seq))
        assert got[0] == want[0]

    @invariant()
    def same_blocks(self) -> None:
        if not hasattr(self, "remote"):
            return
        self.local.check_integrity()
        every, remote_every = self.local.get_all_blocks(), self.remote.get_all_blocks()
        for block, page in self.mine:  # the caller's to reuse in both, or in neither
            assert (block in every) == (page in remote_every)
        assert self.remote.held_blocks() == {p for b, p in self.mine if b not in every}
        # ... and the service agrees: the session holds exactly those pages.
        assert self.remote.stats().session_slots == len(self.remote.held_blocks()) * self.ps
        assert not self.remote.errors


@pytest.mark.parametrize(("model", "shadow"), [("t", False), ("t", True), ("t1", True)])
def test_remote_answers_as_in_process(server: ServerThread, model: str, shadow: bool) -> None:
    machine = type(
        "Same", (SameAnswers,), {"address": server.address, "model": model, "use_shadow": shadow}
    )
    run_state_machine_as_test(machine, settings=machine_settings(25, 40))
    server.check_integrity()


def test_marks_are_locks_of_the_session(server: ServerThread) -> None:
    with RemoteRadixTrie(server.address, "t", shadow=False) as trie:
        trie.client.reset("t")
        pages = trie.evict_blocks(3)
        node = trie.insert([1, 2, 3, 4, 5, 6], pages)
        assert node.state == "pending"
        trie.mark_in_use_by(node, "a")  # the insert's own lock: no call of its own
        calls = trie.calls
        trie.flush()
        assert trie.calls == calls + 1 and node.state == "ok"
        assert trie.stats().locks == 1
        trie.mark_in_use_by(node, "a")  # again: harmless
        hit, blocks = trie.match_prefix([1, 2, 3, 4, 9, 9])
        assert blocks == pages[:2] and hit.tokens == [1, 2, 3, 4]
        trie.mark_in_use_by(hit, "a")  # "a" marks below already: nothing to do
        trie.mark_in_use_by(hit, "b")  # takes the match's lock over
        trie.flush()
        assert trie.stats().locks == 2
        with pytest.raises(LockError):
            trie.mark_not_in_use_by(hit, "a")  # "a" still marks node, below hit
        trie.mark_not_in_use_by(node, "a")
        trie.mark_not_in_use_by(hit, "b")
        with pytest.raises(LockError):
            trie.mark_not_in_use_by(hit, "b")
        assert trie.stats().locks == 0
        assert trie.held_blocks() == set()
        assert 5 in trie.get_all_blocks() or 5 in pages
        assert len(trie.get_evictable_blocks()) > 0
        assert trie.pretty_format() == []
    server.check_integrity()


def test_marks_released_before_their_call_is_answered_hold_nothing(server: ServerThread) -> None:
    with RemoteRadixTrie(server.address, "t", shadow=False) as trie:
        trie.client.reset("t")
        node = trie.insert([1, 2, 3, 4], trie.evict_blocks(2))
        trie.mark_in_use_by(node, "a")  # the insert's lock
        trie.mark_in_use_by(node, "b")  # a queued lock, protected by "a"'s
        trie.mark_not_in_use_by(node, "b")  # released before either call went out
        trie.mark_not_in_use_by(node, "a")
        trie.flush()
        assert trie.stats().locks == 0 and not trie.errors
        again = trie.match_prefix([1, 2, 3, 4])[0]
        assert again is node  # one handle a prefix
        trie.release_unused()
        assert trie.stats().locks == 0


def test_an_insert_the_service_refuses_leaves_the_blocks_the_caller_s(server: ServerThread) -> None:
    with RemoteRadixTrie(server.address, "t", shadow=False) as trie:
        trie.client.reset("t")
        mine = trie.evict_blocks(1)
        node = trie.insert([1, 2, 3, 4], [mine[0], 2000])  # 2000: not this session's page
        trie.flush()
        assert node.state == "failed" and trie.errors
        assert trie.held_blocks() == set(mine) and mine[0] not in trie.get_all_blocks()
        with pytest.raises(LockError):
            trie.mark_in_use_by(node, 0)
        with pytest.raises(ValueError):
            trie.insert([1, 2, 3], mine)
        with pytest.raises(ValueError):
            trie.match_prefix([])
        with pytest.raises(InvalidInputError):
            trie.insert([5, 6], [1], node=node)
        other = RadixTrie(2).insert([1, 2], [1])
        with pytest.raises(LockError):
            trie.mark_in_use_by(other, 0)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        RemoteRadixTrie(server.address, "h", shadow=False)  # radix models only


# ---------------------------------------------------------- a real serve process

CONFIG = """\
server:
  change_log_capacity: 4096
  session_ttl_min: 0.5
models:
  - name: t
    kind: radix
    page_size: 4
    pool: {size: 256, layers: 1, k_heads: 1, k_head_dim: 2}
"""


class MaxStyleManager:
    """The trie calls of MAX's paged KV manager (claim, fetch, step, release), with its
    free set of blocks filled from ``evict_blocks`` as MAX does when it runs dry."""

    def __init__(self, trie: Any, page_size: int) -> None:
        self.trie, self.ps = trie, page_size
        self.available: set[int] = set()
        self.seqs: dict[int, dict[str, Any]] = {}

    def alloc_block(self) -> int:
        if not self.available:
            self.available.update(self.trie.evict_blocks(4))
        return self.available.pop()

    def release_block(self, block: int) -> None:
        if block not in self.trie.get_all_blocks():
            self.available.add(block)

    def fetch(self, seq: int, prompt: list[int]) -> int:
        node, blocks = (
            self.trie.match_prefix(prompt[:-1]) if len(prompt) > 1 else (self.trie.root, [])
        )
        self.trie.mark_in_use_by(node, seq)
        need = -(-len(prompt) // self.ps) - len(blocks)
        self.seqs[seq] = {
            "node": node,
            "blocks": blocks + [self.alloc_block() for _ in range(need)],
            "tokens": prompt,
            "committed": len(blocks) * self.ps,
        }
        return len(blocks) * self.ps

    def commit(self, seq: int) -> None:
        data = self.seqs[seq]
        end = len(data["tokens"]) // self.ps * self.ps
        todo = data["tokens"][data["committed"] : end]
        if not todo:
            return
        node, have = self.trie.match_prefix(todo, node=data["node"])
        first = data["committed"] // self.ps
        for old, new in zip(data["blocks"][first:], have, strict=False):
            if old != new:
                self.release_block(old)
        data["blocks"][first : first + len(have)] = have
        data["committed"] += len(have) * self.ps
        rest = data["tokens"][data["committed"] : end]
        if rest:
            first = data["committed"] // self.ps
            node = self.trie.insert(rest, data["blocks"][first : end // self.ps], node=node)
            data["committed"] = end
        data["node"] = node
        self.trie.mark_in_use_by(node, seq)

    def release(self, seq: int) -> None:
        data = self.seqs.pop(seq)
        self.trie.mark_not_in_use_by(data["node"], seq)
        for block in data["blocks"]:
            self.release_block(block)


def test_a_max_style_manager_over_a_serve_process(tmp_path: Path) -> None:
    with (
        serve_process(tmp_path, CONFIG) as (_, address),
        RemoteRadixTrie(address, "t", ttl=30) as trie,
    ):
        mgr = MaxStyleManager(trie, trie.page_size)
        shared = list(range(100, 124))  # six pages every prompt starts with
        assert mgr.fetch(0, [*shared, 1, 2, 3, 4, 5]) == 0
        mgr.commit(0)
        hits = []
        for seq in range(1, 12):  # more prompts than the pool holds at once
            hits.append(mgr.fetch(seq, [*shared, *[seq] * 41]))
            mgr.commit(seq)
            if seq >= 2:
                mgr.release(seq - 1)
        assert hits[0] == 24 and all(h >= 24 for h in hits)  # seq 0 keeps shared marked
        assert not trie.errors
        # Seq 0's whole prompt survived the pressure: it is marked.
        _, blocks = trie.match_prefix([*shared, 1, 2, 3, 4, 5])
        assert len(blocks) == 7 and blocks == mgr.seqs[0]["blocks"][:7]
        # An early released prompt was evicted for the later ones.
        _, gone = trie.match_prefix([*shared, *[1] * 41])
        assert len(gone) == 6
        # Seq 0 holds its insert's lock; seq 11 its admission's and its insert's (a mark
        # below keeps the one above); the two matches above hold one each.
        assert trie.stats().locks == 1 + 2 + 2
        for seq in list(mgr.seqs):
            mgr.release(seq)
        trie.release_unused()
        assert trie.stats().locks == 0


WORKER = """\
import os, sys
from prefixcache.client import RemoteRadixTrie
trie = RemoteRadixTrie(sys.argv[1], "t", ttl=2, shadow=False)
pages = trie.evict_blocks(2)
node = trie.insert([7, 7, 7, 7, 8, 8, 8, 8], pages)
trie.mark_in_use_by(node, 1)
trie.flush()
print("marked", flush=True)
sys.stdin.read()
"""


def test_a_dead_worker_s_marks_go_with_its_lease(tmp_path: Path) -> None:
    with serve_process(tmp_path, CONFIG) as (_, address):
        worker = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(WORKER), address],
            env={**os.environ, "PYTHONPATH": SOURCE_PATH},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert worker.stdout is not None and worker.stdout.readline() == b"marked\n"
        client = PrefixCacheClient(address)
        stats = client.stats("t")["t"]
        assert (stats.locks, stats.protected_tokens) == (1, 8)
        worker.send_signal(signal.SIGKILL)
        worker.wait(10)
        deadline = time.monotonic() + 20
        while client.stats("t")["t"].locks and time.monotonic() < deadline:
            time.sleep(0.1)
        stats = client.stats("t")["t"]
        assert (stats.locks, stats.evictable_tokens, stats.session_slots) == (0, 8, 0)
        client.close()
