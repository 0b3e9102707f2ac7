"""RemoteMambaRadixCache runs code written for the in-process MambaRadixCache unchanged.

A state machine drives the in-process ``MambaRadixCache`` (with its
``TokenToKVPoolAllocator`` and ``MambaPool``) and the remote one over a real server in
lockstep, with serving code as written for the in-process cache: prefills (match, lock,
a track slot, evicting a snapshot when none is free, KV evicting when short, insert with
the state, the caller's frees, a lock kept now and then), bare matches, evictions of KV
and of snapshots, releases of kept locks and of handles already released or evicted.
Every answer must be equal op for op: KV slots, state slots, ``mamba_branching_seqlen``,
``mamba_exist``, what eviction freed, the errors, and all six sizes after each step.
A scripted prefill also runs against a ``prefixcache serve`` process.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_model import machine_settings
from harness import ServerThread, running, serve_process
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from prefixcache.cache import (
    BasePrefixCache,
    InvalidInputError,
    LockError,
    MambaPool,
    MambaRadixCache,
    RadixKey,
    TokenToKVPoolAllocator,
)
from prefixcache.client import InvalidArgument, RemoteMambaRadixCache, RemoteRadixCache
from prefixcache.client.worker.sglang_api import MatchPrefixParams
from prefixcache.server.config import MambaConfig, ModelConfig, PoolConfig

PAGE, POOL, STATES, CHUNK = 2, 40, 4, 2
MODEL = ModelConfig(
    name="h",
    kind="mamba",
    page_size=PAGE,
    pool=PoolConfig(size=POOL, k_heads=1, k_head_dim=2),
    mamba=MambaConfig(
        state_slots=STATES,
        working_slots=1,
        layers=1,
        conv_state_shape=(2, 2),
        temporal_state_shape=(1, 2, 2),
        chunk_size=CHUNK,
    ),
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    with running(
        tmp_path_factory.mktemp("mamba"),
        (
            MODEL,
            ModelConfig(name="r", page_size=1, pool=PoolConfig(size=16, k_heads=1, k_head_dim=2)),
        ),
    ) as srv:
        yield srv


def in_process() -> tuple[MambaRadixCache, TokenToKVPoolAllocator, MambaPool]:
    allocator = TokenToKVPoolAllocator(POOL, "cpu", PAGE)
    states = MambaPool(
        max_reqs=1,
        max_track_slots=STATES,
        num_layers=1,
        conv_state_shape=(2, 2),
        temporal_state_shape=(1, 2, 2),
    )
    cache = MambaRadixCache(PAGE, allocator, states, mamba_cache_chunk_size=CHUNK)
    return cache, allocator, states


def _ints(t: Any) -> list[int]:
    return [int(x) for x in t.tolist()]


def _state(node: Any) -> int | None:
    value = getattr(node, "mamba_value", None)
    return None if value is None or not value.numel() else int(value.reshape(-1)[0])


class World:
    """One cache with its pools, driven by code written for the in-process API."""

    def __init__(self, cache: Any, allocator: Any, states: Any) -> None:
        self.cache, self.allocator, self.states = cache, allocator, states
        self.kept: list[Any] = []  # nodes this world holds a lock on

    def sizes(self) -> tuple[int, ...]:
        c = self.cache
        return (
            c.evictable_size(),
            c.protected_size(),
            c.mamba_evictable_size(),
            c.mamba_protected_size(),
            self.allocator.available_size(),
            self.states.available_track_slots(),
        )

    def match(self, tokens: list[int]) -> tuple[Any, ...]:
        hit = self.cache.match_prefix(RadixKey(tokens))
        return (
            hit.prefix_len,
            _ints(hit.indices),
            _state(hit.last_node),
            hit.mamba_branching_seqlen,
        )

    def prefill(self, tokens: list[int], keep: bool) -> tuple[Any, ...]:
        cache, allocator, states = self.cache, self.allocator, self.states
        key = RadixKey(tokens)
        hit = cache.match_prefix(key)
        cache.inc_lock_ref(hit.last_node)
        out: list[Any] = [
            hit.prefix_len,
            _ints(hit.indices),
            _state(hit.last_node),
            hit.mamba_branching_seqlen,
        ]
        track = states.alloc_track_slot()
        if track is None:
            out.append(("snapshot evicted", cache.evict(0, mamba_num=1).mamba_evicted))
            track = states.alloc_track_slot()
        need = len(tokens) - hit.prefix_len
        if allocator.available_size() < need:
            out.append(("kv evicted", cache.evict(need - allocator.available_size()).full_evicted))
        new = allocator.alloc(need) if track is not None else None
        if new is None:
            if track is not None:
                states.free_track_slot(track)
            cache.dec_lock_ref(hit.last_node)
            return (*out, "no room")
        slots = torch.cat([hit.indices, new])
        aligned = len(tokens) // PAGE * PAGE
        done = cache.insert(key[:aligned], slots[:aligned], mamba_value=track)
        allocator.free(slots[hit.prefix_len : done.prefix_len])
        allocator.free(slots[aligned:])
        if done.mamba_exist:
            states.free_track_slot(track)
        if keep and done.last_node is not cache.root_node:
            cache.inc_lock_ref(done.last_node)
            self.kept.append(done.last_node)
        cache.dec_lock_ref(hit.last_node)
        return (*out, track, _ints(new), done.prefix_len, done.mamba_exist)


def _evicted(result: Any) -> tuple[int, int, int]:
    return (result.full_evicted, result.swa_evicted, result.mamba_evicted)


def _outcome(call: Any) -> tuple[str, Any]:
    try:
        return "ok", call()
    except InvalidInputError:
        return "invalid", None
    except LockError:
        return "lock", None


class SameStory(RuleBasedStateMachine):
    address = ""

    @initialize()
    def start(self) -> None:
        self.local = World(*in_process())
        remote = RemoteMambaRadixCache(self.address, "h")
        remote.reset()
        self.remote = World(remote, remote.token_to_kv_pool_allocator, remote.mamba_pool)
        self.released: list[tuple[Any, Any]] = []

    def teardown(self) -> None:
        if hasattr(self, "remote"):
            for node in self.remote.kept:
                self.remote.cache.dec_lock_ref(node)
            self.remote.cache.close()

    def _both(self, op: Any) -> Any:
        got, want = _outcome(lambda: op(self.remote)), _outcome(lambda: op(self.local))
        assert got == want
        return got

    @rule(
        pages=st.lists(st.sampled_from([0, 1, 2]), min_size=1, max_size=5),
        tail=st.booleans(),
        keep=st.integers(0, 4),
    )
    def prefill(self, pages: list[int], tail: bool, keep: int) -> None:
        tokens = [t for p in pages for t in (p, 10 + p)] + ([7] if tail else [])
        self._both(lambda w: w.prefill(tokens, keep == 0))

    @rule(pages=st.lists(st.sampled_from([0, 1, 2]), max_size=6))
    def match(self, pages: list[int]) -> None:
        tokens = [t for p in pages for t in (p, 10 + p)]
        self._both(lambda w: w.match(tokens))

    @rule(n=st.integers(0, 12), m=st.integers(0, 2))
    def evict(self, n: int, m: int) -> None:
        self._both(lambda w: _evicted(w.cache.evict(n, mamba_num=m)))

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if self.local.kept:
            i = data.draw(st.integers(0, len(self.local.kept) - 1))
            pair = (self.remote.kept.pop(i), self.local.kept.pop(i))
            self.released.append(pair)
            self._both(lambda w: self._unlock(w, pair))
        elif self.released:  # again: refused by both
            pair = data.draw(st.sampled_from(self.released))
            self._both(lambda w: self._unlock(w, pair))

    def _unlock(self, world: World, pair: tuple[Any, Any]) -> None:
        world.cache.dec_lock_ref(pair[world is self.local])  # the answer is not compared

    @invariant()
    def same_sizes(self) -> None:
        if hasattr(self, "local"):
            self.local.cache.check_integrity()
            assert self.remote.sizes() == self.local.sizes()


def test_remote_answers_as_in_process(server: ServerThread) -> None:
    machine = type("Same", (SameStory,), {"address": server.address})
    run_state_machine_as_test(machine, settings=machine_settings(25, 30))
    server.check_integrity()


def test_the_mamba_contract_and_its_refusals(server: ServerThread) -> None:
    with RemoteMambaRadixCache(server.address, "h") as cache:
        cache.reset()
        assert isinstance(cache, BasePrefixCache) and cache.mamba_pool.max_track_slots == STATES
        allocator, states = cache.token_to_kv_pool_allocator, cache.mamba_pool
        track = states.alloc_track_slot()
        slots = allocator.alloc(4)
        with pytest.raises(InvalidInputError):  # new tokens need their state
            cache.insert(RadixKey([1, 2, 3, 4]), slots)
        with pytest.raises(InvalidInputError):  # a state for an unaligned key
            cache.insert(RadixKey([1, 2, 3]), slots[:3], mamba_value=track)
        done = cache.insert(RadixKey([1, 2, 3, 4]), slots, mamba_value=torch.tensor([track]))
        assert (done.prefix_len, done.mamba_exist, _state(done.last_node)) == (0, False, track)
        hit = cache.match_prefix(RadixKey([1, 2, 3, 4, 5, 6]))
        assert (hit.prefix_len, _state(hit.last_node)) == (4, track)
        calls = cache.calls
        cache.inc_lock_ref(hit.last_node)  # the match's own lock: no call
        assert cache.calls == calls and cache.mamba_protected_size() == 1
        cache.dec_lock_ref(hit.last_node)
        with pytest.raises(LockError):
            cache.dec_lock_ref(hit.last_node)
        again = states.alloc_track_slot()
        done = cache.insert(RadixKey([1, 2, 3, 4]), slots, mamba_value=again)
        assert done.mamba_exist
        states.free_track_slot(again)  # the service freed it already: skipped
        with pytest.raises(Exception, match=r"not held|DoubleFree|double"):
            states.free_track_slot(again)
        assert cache.evict(0, mamba_num=1).mamba_evicted == 1
        for sglang in (
            lambda: cache.match_prefix(MatchPrefixParams(RadixKey([1]))),
            lambda: cache.cache_finished_req(None),
        ):
            with pytest.raises(InvalidInputError):
                sglang()
    with pytest.raises(InvalidArgument):
        RemoteMambaRadixCache(server.address, "r")
    with pytest.raises(InvalidArgument):
        RemoteRadixCache(server.address, "h")
    server.check_integrity()


CONFIG = """\
models:
  - name: h
    kind: mamba
    page_size: 2
    pool: {size: 40, layers: 1, k_heads: 1, k_head_dim: 2}
    mamba: {state_slots: 4, working_slots: 1, layers: 1, conv_state_shape: [2, 2],
            temporal_state_shape: [1, 2, 2], chunk_size: 2}
"""


def test_prefills_over_a_serve_process_tell_the_in_process_story(tmp_path: Path) -> None:
    prompts = [
        [1, 2, 3, 4, 5, 6],
        [1, 2, 3, 4, 5, 6, 7, 8, 9],
        [1, 2, 3, 4, 40, 41],
        [1, 2, 9],
        [50 + i for i in range(12)],
        [60 + i for i in range(12)],
        [1, 2, 3, 4, 5, 6, 7, 8],
    ]
    local = World(*in_process())
    want = [local.prefill(p, keep=i == 1) for i, p in enumerate(prompts)]
    want.append(local.sizes())
    with (
        serve_process(tmp_path, CONFIG) as (_, address),
        RemoteMambaRadixCache(address, "h") as cache,
    ):
        remote = World(cache, cache.token_to_kv_pool_allocator, cache.mamba_pool)
        got = [remote.prefill(p, keep=i == 1) for i, p in enumerate(prompts)]
        got.append(remote.sizes())
    assert got == want
    assert any("evicted" in str(step) for step in got)  # pressure on both pools
