"""ExistsPages, GetPages and SetPages over a real server: the page hashes of the spec's
test vectors, the pages SetPages stores, eviction, and every refusal (with nothing
changed)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from harness import ServerThread, pack_slots, pb, running, stub_for

from prefixcache.cache import hash_token_ids
from prefixcache.server.config import ModelConfig, PoolConfig

POOL = PoolConfig(size=16, layers=1, k_heads=1, k_head_dim=4)
MODELS = (
    ModelConfig(name="p2", page_size=2, pool=POOL),
    ModelConfig(name="p1", page_size=1, pool=POOL),  # hash pages of one width-8 token
    ModelConfig(name="p3", page_size=3, pool=POOL),  # three width-3 tokens
    ModelConfig(name="w", kind="swa", page_size=2, sliding_window_size=4, pool=POOL),
)
# Test vectors of docs/semantics.md, page size 2: [1,2], [3,4], [5,6] chained; [5,6] alone.
H12 = "34fb5c825de7ca4aea6e712f19d439c1da0c92c37b423936c5f618545ca4fa1f"
H34 = "c57b445f90651b9a650e516ab2238c965b21af35608a31c303e6d9e407f2915c"
H56 = "4a8a26efbf98ddb0eca98c8913c209b45b7241fb0ccbdb559f74dafba44b7c60"
H56_ALONE = "f1833c11f88585608c320b53224d2642b97af5fdb9cae59c13fcab53f37c4b06"


def digests(*hexes: str) -> bytes:
    return b"".join(bytes.fromhex(h) for h in hexes)


def chain(seed: int, pages: int) -> list[str]:
    keys, prior = [], None
    for p in range(pages):
        prior = hash_token_ids([seed, p], prior)
        keys.append(prior)
    return keys


@pytest.fixture
def srv(tmp_path) -> Iterator[ServerThread]:
    with running(tmp_path, MODELS) as server:
        yield server


@pytest.fixture
def stub(srv: ServerThread) -> Iterator[object]:
    channel, stub = stub_for(srv.address)
    with channel:
        yield stub


def session(stub) -> str:
    return stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=30)).session_id


def alloc(stub, sid: str, n: int, model: str = "p2") -> list[int]:
    reply = stub.Alloc(pb.AllocRequest(model=model, num_slots=n, session_id=sid))
    return np.frombuffer(reply.slot_indices, "<i8").tolist()


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def test_token_pages_answer_the_spec_hashes(srv, stub) -> None:
    sid = session(stub)
    tokens = np.array([1, 2, 3, 4, 5, 6], "<u4").tobytes()
    slots = alloc(stub, sid, 6)
    stub.Insert(
        pb.InsertRequest(
            model="p2", token_ids=tokens, slot_indices=pack_slots(slots), session_id=sid
        )
    )
    reply = stub.ExistsPages(
        pb.ExistsPagesRequest(model="p2", page_hashes=digests(H12, H34, H56, H56_ALONE))
    )
    assert (reply.leading_pages, reply.present) == (3, b"\x01\x01\x01\x00")
    # Pages of another namespace are other pages.
    other = stub.ExistsPages(
        pb.ExistsPagesRequest(model="p2", extra_key="", page_hashes=digests(H12))
    )
    assert other.leading_pages == 0
    got = stub.GetPages(
        pb.GetPagesRequest(model="p2", page_hashes=digests(H34, H56), session_id=sid)
    )
    assert got.found_pages == 2 and len(got.lock_ids) == 1
    assert np.frombuffer(got.slot_indices, "<i8").tolist() == slots[2:]
    stats = stub.Stats(pb.StatsRequest(model="p2")).models[0]
    assert (stats.locks, stats.match_tokens_total, stats.hit_tokens_total) == (1, 10, 6)
    stub.Unlock(pb.UnlockRequest(lock_id=got.lock_ids[0], session_id=sid))


def test_set_pages_stores_and_dedups(srv, stub) -> None:
    sid = session(stub)
    keys = chain(7, 3)
    slots = alloc(stub, sid, 6)
    reply = stub.SetPages(
        pb.SetPagesRequest(
            model="p2", page_hashes=digests(*keys), slot_indices=pack_slots(slots), session_id=sid
        )
    )
    assert reply.states == b"\x01\x01\x01"
    # Again, with new slots for the middle page and none for the others: all held, and the
    # session's slots for the page it already had go back to the pool.
    again = alloc(stub, sid, 2)
    reply = stub.SetPages(
        pb.SetPagesRequest(
            model="p2",
            page_hashes=digests(*keys, chain(8, 1)[0]),
            slot_indices=pack_slots([0, 0, *again, 0, 0, 0, 0]),
            session_id=sid,
        )
    )
    assert reply.states == b"\x02\x02\x02\x00"
    stats = stub.Stats(pb.StatsRequest(model="p2")).models[0]
    assert (stats.session_slots, stats.evictable_tokens) == (0, 6)
    got = stub.GetPages(
        pb.GetPagesRequest(model="p2", page_hashes=digests(*keys), session_id=sid, request_id=5)
    )
    assert np.frombuffer(got.slot_indices, "<i8").tolist() == slots
    # A retry with the same request id gets the same answer, not a second lock.
    assert (
        stub.GetPages(
            pb.GetPagesRequest(model="p2", page_hashes=digests(*keys), session_id=sid, request_id=5)
        )
        == got
    )
    assert stub.Stats(pb.StatsRequest(model="p2")).models[0].locks == 1
    # Pages stored by hash are no token pages: no change-log record, no snapshot entry.
    log = srv.service.engines["p2"].change_log
    assert [type(r).__name__ for r in log.since(-1)] == ["AllCleared"]
    assert log.snapshot().pages == ()


def test_chains_are_evicted_from_their_end(srv, stub) -> None:
    """Like token pages, a chain leaves the pool from its end: here chain a, stored one
    page a call (a path of three nodes), and b, stored in one call (one node)."""
    sid = session(stub)
    a, b = chain(1, 3), chain(2, 3)
    for i, page in enumerate(a):
        stub.SetPages(
            pb.SetPagesRequest(
                model="p2",
                page_hashes=digests(page),
                prior_hash=digests(a[i - 1]) if i else b"",
                slot_indices=pack_slots(alloc(stub, sid, 2)),
                session_id=sid,
            )
        )
    stub.SetPages(
        pb.SetPagesRequest(
            model="p2",
            page_hashes=digests(*b),
            slot_indices=pack_slots(alloc(stub, sid, 6)),
            session_id=sid,
        )
    )
    alloc(stub, sid, 8)  # 4 slots were free: two pages go, the older chain's last two
    exists = [
        stub.ExistsPages(pb.ExistsPagesRequest(model="p2", page_hashes=digests(*k))).leading_pages
        for k in (a, b)
    ]
    assert exists == [1, 3]


def test_a_continued_chain_is_one_path(srv, stub) -> None:
    sid = session(stub)
    keys = chain(3, 4)
    stub.SetPages(
        pb.SetPagesRequest(
            model="p2",
            page_hashes=digests(*keys[:2]),
            slot_indices=pack_slots(alloc(stub, sid, 4)),
            session_id=sid,
        )
    )
    stub.SetPages(
        pb.SetPagesRequest(
            model="p2",
            prior_hash=digests(keys[1]),
            page_hashes=digests(*keys[2:]),
            slot_indices=pack_slots(alloc(stub, sid, 4)),
            session_id=sid,
        )
    )
    got = stub.GetPages(pb.GetPagesRequest(model="p2", page_hashes=digests(*keys), session_id=sid))
    assert got.found_pages == 4 and len(got.lock_ids) == 1


def test_refusals_change_nothing(srv, stub) -> None:
    sid = session(stub)
    keys = chain(4, 2)
    mine = alloc(stub, sid, 4)
    before = stub.Stats(pb.StatsRequest(model="p2")).models[0]

    def set_pages(**fields):
        request = {
            "model": "p2",
            "page_hashes": digests(*keys),
            "session_id": sid,
            "slot_indices": pack_slots(mine),
            **fields,
        }
        return lambda: stub.SetPages(pb.SetPagesRequest(**request))

    invalid, precondition = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
    assert code_of(set_pages(page_hashes=b"x" * 33)) is invalid
    assert code_of(set_pages(prior_hash=b"x" * 5)) is invalid
    assert code_of(set_pages(slot_indices=pack_slots(mine[:3]))) is invalid
    assert code_of(set_pages(slot_indices=pack_slots([mine[0], 0, *mine[2:]]))) is invalid
    assert code_of(set_pages(slot_indices=pack_slots([mine[0]] * 4))) is invalid
    assert code_of(set_pages(slot_indices=pack_slots([*mine[:3], 15]))) is precondition
    assert code_of(set_pages(session_id="")) is precondition
    assert code_of(set_pages(token_width=9)) is invalid
    # A repeated hash would put a page on its own path (the index's walk would loop).
    assert code_of(set_pages(page_hashes=digests(keys[0], keys[0]))) is invalid
    assert code_of(set_pages(model="w")) is precondition  # not a radix model
    assert code_of(set_pages(model="nope")) is grpc.StatusCode.NOT_FOUND
    assert (
        code_of(lambda: stub.GetPages(pb.GetPagesRequest(model="p2", page_hashes=digests(*keys))))
        is precondition
    )
    # Token calls cannot name the namespaces of pages stored by hash.
    hidden = "\x00prefixcache/hash-pages/w1"
    assert (
        code_of(
            lambda: stub.Match(
                pb.MatchRequest(
                    model="p2", token_ids=np.zeros(8, "<u4").tobytes(), extra_key=hidden
                )
            )
        )
        is invalid
    )
    assert stub.Stats(pb.StatsRequest(model="p2")).models[0] == before
    srv.check_integrity()


@pytest.mark.parametrize(("model", "size"), [("p1", 1), ("p3", 3)])
def test_hash_pages_of_any_page_size(srv, stub, model: str, size: int) -> None:
    sid = session(stub)
    keys = chain(9, 3)
    slots = alloc(stub, sid, 3 * size, model)
    reply = stub.SetPages(
        pb.SetPagesRequest(
            model=model, page_hashes=digests(*keys), slot_indices=pack_slots(slots), session_id=sid
        )
    )
    assert reply.states == b"\x01\x01\x01"
    got = stub.GetPages(pb.GetPagesRequest(model=model, page_hashes=digests(*keys), session_id=sid))
    assert (got.found_pages, len(got.lock_ids)) == (3, 1)
    assert np.frombuffer(got.slot_indices, "<i8").tolist() == slots
