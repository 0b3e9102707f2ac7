"""Shadow indexes against a real server: at every quiet point each worker's replica is
exactly the tree's page set, through disconnects, resubscriptions, falling behind the
(tiny) change log, resets and restarts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import SMALL_POOL, ServerThread, make_config, running
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.client import (
    AsyncPrefixCacheClient,
    NotFound,
    PrefixCacheClient,
    RequestHashes,
    ShadowFollower,
)
from prefixcache.client.page_chain import page_key
from prefixcache.server.config import ModelConfig, PoolConfig

MODELS = (
    ModelConfig(name="m", page_size=1, pool=SMALL_POOL),
    ModelConfig(name="p", page_size=4, pool=PoolConfig(size=128, k_heads=1, k_head_dim=4)),
    ModelConfig(name="w", kind="swa", page_size=1, sliding_window_size=4, pool=SMALL_POOL),
)
PAGE_SIZE = {"m": 1, "p": 4, "w": 1}
WORKERS = 3
CAPACITY = 8  # changes the log keeps: small enough that followers fall behind it
WAIT = 10.0
PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 20, 21, 22, 23], [30, 31])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    with running(tmp_path_factory.mktemp("shadow"), MODELS, change_log_capacity=CAPACITY) as srv:
        yield srv


@pytest.fixture(scope="module")
def workers(server: ServerThread) -> Iterator[list[tuple[PrefixCacheClient, dict]]]:
    """Each worker: a client and a follower per model."""
    out = []
    for i in range(WORKERS):
        client = PrefixCacheClient(server.address, timeout=WAIT, client_name=f"w{i}")
        out.append((client, {model: client.shadow(model) for model in PAGE_SIZE}))
    yield out
    for client, _ in out:
        client.close()


def cache(client: PrefixCacheClient, model: str, tokens: list[int], extra_key: str | None) -> None:
    with client.session() as s:
        m = s.match(model, tokens, extra_key=extra_key, lock=True, allocate=True)
        slots = [*m.slots, *m.allocated]
        r = s.insert(model, tokens, slots, extra_key=extra_key, release_lock_id=m.lock_id)
        if r.cached_len < len(tokens):
            s.free(model, slots[r.cached_len :])


def tree_pages(server: ServerThread, model: str) -> tuple[int, dict[Any, frozenset[int]]]:
    """The model's log position and its tree's page keys by namespace, walked from the
    tree on the server's loop; each node's hashes are checked against the chain a
    worker computes from the node's tokens."""

    def walk() -> tuple[int, dict[Any, frozenset[int]]]:
        engine = server.service.engine(model)
        pages: dict[Any, set[int]] = {}
        for ns_root in engine.cache.root_node.children.values():
            stack = [(child, b"") for child in ns_root.children.values()]
            while stack:
                node, above = stack.pop()
                ns = node.namespace
                path = above + node.key_bytes
                chain = RequestHashes(
                    path, page_size=ns.page_size, extra_key=ns.extra_key, token_width=ns.token_width
                ).hex_hashes()
                if chain[len(chain) - len(node.hash_values) :] != list(node.hash_values):
                    raise AssertionError(f"node {node.id}: the tree's hashes are not the chain")
                pages.setdefault((ns.extra_key, ns.token_width), set()).update(
                    page_key(bytes.fromhex(h)) for h in node.hash_values
                )
                stack += [(child, path) for child in node.children.values()]
        return engine.change_log.last_seq, {ns: frozenset(k) for ns, k in pages.items()}

    return server.run(walk)


def assert_converged(server: ServerThread, followers: list[ShadowFollower], model: str) -> None:
    seq, expected = tree_pages(server, model)
    for follower in followers:
        assert follower.wait_for_seq(seq, WAIT), (follower.index, seq)
        assert follower.index.seq == seq
        assert follower.index.pages() == expected
        assert follower.lag.events == 0


def assert_matches(
    client: PrefixCacheClient,
    follower: ShadowFollower,
    model: str,
    queries: list[tuple[list[int], str | None]],
) -> None:
    """A radix model's shadow answers exactly what the service's Match answers."""
    for tokens, key in queries:
        local = follower.match(RequestHashes(tokens, page_size=PAGE_SIZE[model], extra_key=key))
        assert local == client.match(model, tokens, extra_key=key).prefix_len, tokens


tokens_st = st.builds(
    lambda base, k, tail: base[:k] + tail,
    st.sampled_from(PREFIXES),
    st.integers(0, 12),
    st.lists(st.integers(0, 40), max_size=10),
).filter(bool)
cache_op = st.tuples(
    st.just("cache"),
    st.integers(0, WORKERS - 1),
    st.sampled_from(list(PAGE_SIZE)),
    st.sampled_from([None, "a"]),
    tokens_st,
)
ops = st.lists(
    st.one_of(
        *(cache_op.map(tuple) for _ in range(4)),  # mostly caching: trees that hold something
        st.tuples(st.just("evict"), st.sampled_from(list(PAGE_SIZE)), st.integers(1, 40)),
        st.tuples(st.just("burst"), st.sampled_from(list(PAGE_SIZE))),
        st.tuples(st.just("reset"), st.sampled_from(list(PAGE_SIZE))),
        st.tuples(st.just("reconnect"), st.integers(0, WORKERS - 1)),
        st.tuples(
            st.just("quiet"),
        ),
    ),
    min_size=4,
    max_size=30,
)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(steps=ops)
def test_every_shadow_equals_the_tree_at_quiet_points(
    server: ServerThread, workers: list[tuple[PrefixCacheClient, dict]], steps: list[tuple]
) -> None:
    admin = workers[0][0]
    for model in PAGE_SIZE:  # each example starts from empty trees
        admin.reset(model)
    seen: list[tuple[list[int], str | None]] = []

    def quiet() -> None:
        for model in PAGE_SIZE:
            assert_converged(server, [w[1][model] for w in workers], model)
        for model in ("m", "p"):
            for client, followers in workers:
                assert_matches(client, followers[model], model, [*seen[-4:], ([1, 2, 3], None)])

    for step in steps:
        kind = step[0]
        if kind == "cache":
            _, worker, model, key, tokens = step
            cache(workers[worker][0], model, tokens, key)
            seen.append((tokens, key))
        elif kind == "evict":
            admin.evict(step[1], step[2])
        elif kind == "burst":  # many leaves evicted in one loop turn: more than the log
            for i in range(CAPACITY):
                cache(admin, step[1], [90, i, 91, 92], None)
            admin.evict(step[1], 10_000)
        elif kind == "reset":
            admin.reset(step[1])
        elif kind == "reconnect":  # the stream breaks; the followers resubscribe
            for follower in workers[step[1]][1].values():
                if follower._call is not None:
                    follower._call.cancel()
        else:
            quiet()
    quiet()
    server.check_integrity()


def test_falling_behind_converges_through_a_snapshot(
    server: ServerThread, workers: list[tuple[PrefixCacheClient, dict]]
) -> None:
    client, followers = workers[1]
    follower = followers["m"]
    assert_converged(server, [follower], "m")
    before = follower.index.snapshots["behind"]
    for i in range(CAPACITY + 2):
        cache(client, "m", [70, i, 71], None)
    client.evict("m", 10_000)  # CAPACITY + 2 removals in one turn
    assert_converged(server, [follower], "m")
    assert follower.index.snapshots["behind"] > before


def test_reconnect_resumes_without_a_snapshot(
    server: ServerThread, workers: list[tuple[PrefixCacheClient, dict]]
) -> None:
    client, followers = workers[2]
    follower = followers["p"]
    assert_converged(server, [follower], "p")
    snapshots, streams = sum(follower.index.snapshots.values()), follower.subscriptions
    follower._call.cancel()
    cache(client, "p", [5, 6, 7, 8, 9], None)  # one change: the log still has it
    assert_converged(server, [follower], "p")
    assert follower.subscriptions > streams
    assert sum(follower.index.snapshots.values()) == snapshots
    samples = follower.index.lag_samples()
    assert samples and samples[-1].ms >= 0


def test_unknown_model_stops_the_follower(server: ServerThread) -> None:
    with PrefixCacheClient(server.address) as client, client.shadow("nope") as follower:
        with pytest.raises(NotFound):
            follower.wait_ready(WAIT)
        assert isinstance(follower.error, NotFound)
        assert follower.match(RequestHashes([1], page_size=1)) == 0


def test_restart_is_noticed_and_resynchronised(tmp_path: Path) -> None:
    first = ServerThread(make_config(tmp_path, MODELS[:1]))
    running_first = True
    try:
        with PrefixCacheClient(first.address, timeout=WAIT) as client:
            cache(client, "m", [1, 2, 3], None)
            follower = client.shadow("m")
            assert follower.wait_ready(WAIT) and len(follower.index) == 3
            old = follower.index.server_epoch
            first.stop()
            running_first = False
            with running(tmp_path, MODELS[:1]) as second:
                deadline = time.monotonic() + WAIT
                while follower.index.server_epoch == old and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert follower.index.server_epoch == second.service.epoch != old
                assert follower.index.snapshots["epoch"] == 1
                assert len(follower.index) == 0  # the new service caches nothing yet
                assert client.restarts == 1
                cache(client, "m", [4, 5], None)
                assert_converged(second, [follower], "m")
    finally:
        if running_first:
            first.stop()


def test_async_follower(server: ServerThread) -> None:
    async def scenario() -> None:
        async with AsyncPrefixCacheClient(server.address, timeout=WAIT) as client:
            follower = client.shadow("m", namespaces=["b"])
            assert await follower.wait_ready(WAIT)
            async with client.session() as s:
                m = await s.match("m", [8, 9, 10], extra_key="b", allocate=True)
                await s.insert("m", [8, 9, 10], m.allocated, extra_key="b")
            seq = await asyncio.to_thread(lambda: tree_pages(server, "m")[0])
            assert await follower.wait_for_seq(seq, WAIT)
            request = follower.request_hashes([8, 9, 10, 11], extra_key="b")
            assert follower.match(request) == 3
            assert set(follower.index.pages()) == {("b", 1)}

    asyncio.run(scenario())
