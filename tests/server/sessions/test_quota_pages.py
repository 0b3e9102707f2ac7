"""The slot quota counts whole pages.

An allocation takes whole pages and a page comes back only when none of its slots is
held, so ``max_session_slots`` counts what a session really takes from the pool. Before,
it counted slots: with 16-slot pages and a cap of 512, 256 x ``Alloc(1)`` took the
whole 4096-slot pool. Against a real server in invariant mode (the integrity check also
recomputes each session's pages from the slot owners).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from harness import pack_slots, pb, serve_module, slots, stub_of, toks

from prefixcache.server.config import ModelConfig, PoolConfig

PAGE, POOL, CAP = 16, 4096, 512
MODELS = (
    ModelConfig(
        name="p", page_size=PAGE, pool=PoolConfig(size=POOL, layers=1, k_heads=1, k_head_dim=2)
    ),
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    yield from serve_module(tmp_path_factory, "quota_pages", MODELS, max_session_slots=CAP)


@pytest.fixture(scope="module")
def stub(server) -> Iterator:
    yield from stub_of(server)


@pytest.fixture
def sid(stub) -> Iterator[str]:
    session_id = stub.OpenSession(pb.OpenSessionRequest(client_name="pages")).session_id
    yield session_id
    stub.CloseSession(pb.CloseSessionRequest(session_id=session_id))


def free_slots(stub) -> int:
    return stub.Stats(pb.StatsRequest(model="p")).models[0].free_slots


def alloc(stub, sid: str, n: int) -> list[int]:
    return slots(
        stub.Alloc(pb.AllocRequest(model="p", num_slots=n, session_id=sid), timeout=10).slot_indices
    )


def test_one_slot_allocations_are_charged_whole_pages(server, stub, sid) -> None:
    """The issue's attack: Alloc(1) until refused takes CAP slots of the pool, not
    the whole pool."""
    before = free_slots(stub)
    got = []
    with pytest.raises(grpc.RpcError) as err:
        for _ in range(POOL // PAGE):
            got += alloc(stub, sid, 1)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "server.max_session_slots" in err.value.details()
    assert "whole pages" in err.value.details()
    assert len(got) == CAP // PAGE  # one page each, up to the cap
    assert before - free_slots(stub) == CAP  # what the pool lost is what was counted
    server.check_integrity()
    # Another session still finds room.
    other = stub.OpenSession(pb.OpenSessionRequest()).session_id
    try:
        assert len(alloc(stub, other, CAP)) == CAP
    finally:
        stub.CloseSession(pb.CloseSessionRequest(session_id=other))


def test_freeing_a_pages_last_slot_gives_its_page_back_to_the_quota(server, stub, sid) -> None:
    first = alloc(stub, sid, 20)  # two pages: 32 of the cap
    alloc(stub, sid, CAP - 2 * PAGE)  # the rest of it
    with pytest.raises(grpc.RpcError):
        alloc(stub, sid, 1)
    # Half of the first page is not enough: the page is still held.
    stub.Free(pb.FreeRequest(model="p", session_id=sid, slot_indices=pack_slots(first[:8])))
    with pytest.raises(grpc.RpcError):
        alloc(stub, sid, 1)
    stub.Free(pb.FreeRequest(model="p", session_id=sid, slot_indices=pack_slots(first[8:16])))
    assert len(alloc(stub, sid, PAGE)) == PAGE  # the whole page came back
    server.check_integrity()


def test_an_insert_hands_its_whole_pages_over_and_keeps_the_tail_page(server, stub, sid) -> None:
    tokens = list(range(1000, 1020))  # 20 tokens: one whole page and a tail of 4
    m = stub.Match(
        pb.MatchRequest(model="p", token_ids=toks(tokens), allocate=True, session_id=sid)
    )
    stub.Insert(
        pb.InsertRequest(
            model="p",
            token_ids=toks(tokens),
            session_id=sid,
            slot_indices=m.slot_indices + m.allocated_slots,
        )
    )
    # The tree took the first page; the tail's page (4 slots held) still counts 16.
    assert len(alloc(stub, sid, CAP - PAGE)) == CAP - PAGE
    with pytest.raises(grpc.RpcError) as err:
        alloc(stub, sid, 1)
    assert "holds 512 slots" in err.value.details()
    server.check_integrity()
