"""SetPages' store in slices (page_store.py): each slice leaves the cache consistent,
and a session that ends, a Reset, an eviction or a retry between two slices is dealt
with as the module docstring says. The slices are stepped one by one on the server's
loop, with the service's own calls (close, Reset, evict) between them."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Generator, Iterator

import numpy as np
import pytest
from harness import ServerThread, pack_slots, pb, running

from prefixcache.server.config import ModelConfig, PoolConfig
from prefixcache.server.engine.hash_pages import HashPages
from prefixcache.server.engine.page_store import HELD, MISSING, SLICE, STORED, store
from prefixcache.server.errors import NotFoundError, PreconditionError
from prefixcache.server.rpc import page_rpcs

PAGES = 3 * SLICE + 5  # four slices at least
NAMESPACE = ("a", 1)


@pytest.fixture
def srv(tmp_path) -> Iterator[ServerThread]:
    models = (
        ModelConfig(
            name="m",
            page_size=1,
            pool=PoolConfig(size=2 * PAGES + 64, layers=1, k_heads=1, k_head_dim=4),
        ),
    )
    with running(tmp_path, models) as server:
        yield server


def hashes(count: int) -> list[str]:
    return [os.urandom(32).hex() for _ in range(count)]


def steps(srv: ServerThread, count: int) -> tuple[HashPages, object, np.ndarray]:
    """A session holding ``count`` slots, on the server's loop."""
    engine = srv.service.engines["m"]
    session = srv.service.open_session(600)
    slots, _ = engine.alloc(session, count)
    return HashPages(engine), session, slots


def run_all(srv: ServerThread, gen: Generator[None, None, bytes]) -> bytes:
    """Step ``gen`` to its end, the whole service checked after every slice."""
    while True:
        try:
            next(gen)
        except StopIteration as done:
            srv.service.check_integrity()
            return done.value
        srv.service.check_integrity()


def first_slice(pages: HashPages, gen: Generator[None, None, bytes]) -> int:
    """Step ``gen`` through its checks and its first slice stored; the pages cached."""
    while not pages.engine.cache.total_size():
        next(gen)
    return pages.engine.cache.total_size()


def test_every_slice_leaves_the_cache_consistent(srv: ServerThread) -> None:
    def go() -> None:
        pages, session, slots = steps(srv, PAGES + 8)
        chain = hashes(PAGES + 8)
        # The chain's first 8 pages stored first; then the rest after them (prior_hash:
        # walked), with some pages held already (stored by another call) and some not
        # sent (missing).
        assert run_all(srv, store(pages, NAMESPACE, None, chain[:8], slots[:8], session)) == bytes(
            [STORED] * 8
        )
        rest, sent = chain[8:], slots[8:].copy()
        middle = [SLICE + 3, SLICE + 4]
        other = srv.service.open_session(600)
        extra, _ = pages.engine.alloc(other, 1)
        run_all(srv, store(pages, NAMESPACE, None, [rest[2 * SLICE]], extra, other))
        sent[middle] = 0
        states = run_all(srv, store(pages, NAMESPACE, chain[7], rest, sent, session))
        expected = [STORED] * len(rest)
        expected[middle[0]] = expected[middle[1]] = MISSING
        expected[2 * SLICE] = HELD
        assert states == bytes(expected)
        # Each stored run on the path before it: the index chains them.
        hidden = pages._locate(NAMESPACE, rest[0])
        assert pages.index.find(hidden, rest[0]).parent == chain[7]
        assert pages.index.find(hidden, rest[SLICE + 2]).parent == rest[SLICE + 1]
        assert pages.index.find(hidden, rest[SLICE + 5]).parent is None
        assert pages.index.find(hidden, rest[-1]).parent == rest[-2]
        # The session keeps only its unsent slots; the held page's slot was freed.
        assert session.slots["m"] == 2
        assert pages.engine.cache.total_size() == len(chain) - 2  # all but the missing

    srv.run(go)


def test_a_session_that_ends_between_slices_stops_the_store(srv: ServerThread) -> None:
    def go() -> None:
        pages, session, slots = steps(srv, PAGES)
        chain = hashes(PAGES)
        gen = store(pages, NAMESPACE, None, chain, slots, session)
        stored = first_slice(pages, gen)
        assert 0 < stored < PAGES
        srv.service.close_session(session)
        with pytest.raises(NotFoundError, match="session ended"):
            next(gen)
        srv.service.check_integrity()
        # What was stored stays the cache's; the rest went back with the session.
        assert pages.engine.cache.total_size() == stored
        assert pages.engine.allocator.num_allocated() == stored

    srv.run(go)


def test_a_reset_between_slices_stops_the_store(srv: ServerThread) -> None:
    def go() -> None:
        pages, session, slots = steps(srv, PAGES)
        gen = store(pages, NAMESPACE, None, hashes(PAGES), slots, session)
        first_slice(pages, gen)
        srv.service.reset("m")
        with pytest.raises(PreconditionError, match="no longer held"):
            next(gen)
        srv.service.check_integrity()
        assert pages.engine.cache.total_size() == 0 and not session.slots.get("m")

    srv.run(go)


def test_a_path_evicted_between_slices_is_not_built_on(srv: ServerThread) -> None:
    def go() -> None:
        pages, session, slots = steps(srv, PAGES)
        chain = hashes(PAGES)
        gen = store(pages, NAMESPACE, None, chain, slots, session)
        stored = first_slice(pages, gen)
        pages.engine.evict(stored)  # the whole path so far
        assert pages.engine.cache.total_size() == 0
        assert run_all(srv, gen) == bytes([STORED] * PAGES)
        # The rest started a path of its own where the evicted one ended.
        hidden = pages._locate(NAMESPACE, chain[-1])
        assert pages.index.find(hidden, chain[stored]).parent is None
        assert pages.engine.cache.total_size() == PAGES - stored

    srv.run(go)


def test_a_retry_during_its_first_try_gets_its_answer(srv: ServerThread) -> None:
    engine = srv.service.engines["m"]
    session = srv.run(srv.service.open_session, 600)
    slots, _ = srv.run(engine.alloc, session, PAGES)
    request = pb.SetPagesRequest(
        model="m",
        extra_key="a",
        request_id=7,
        page_hashes=bytes.fromhex("".join(hashes(PAGES))),
        slot_indices=pack_slots(slots),
        session_id=session.id,
    )

    async def both() -> list[pb.SetPagesResponse]:
        calls = [
            page_rpcs.set_pages(srv.service, srv.service.limits, request, session) for _ in range(2)
        ]
        return list(await asyncio.gather(*calls))

    first, retry = srv.call(both())
    assert first.states == retry.states == bytes([STORED] * PAGES)
    assert srv.run(engine.cache.total_size) == PAGES
    srv.service.check_integrity()
