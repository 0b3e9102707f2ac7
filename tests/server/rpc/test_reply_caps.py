"""A reply too large to send is refused before the work.

Match(allocate), Alloc, Step and GetPages used to do their work and then fail to send
the reply (gRPC's RESOURCE_EXHAUSTED), leaving the session holding slots and locks it
never learned of. Now the size the request implies is checked first (reply_caps.py):
the refusal is RESOURCE_EXHAUSTED naming server.max_message_bytes, and the cache, the
pool and the session are as they were.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from harness import pb, serve_module, session_of, stub_of, toks

from prefixcache.cache import hash_token_ids
from prefixcache.server.config import ModelConfig, PoolConfig

MAX_MESSAGE = 256 * 1024
POOL = PoolConfig(size=65536, layers=1, k_heads=1, k_head_dim=4)
MODELS = (
    ModelConfig(name="m", page_size=1, vocab_size=100000, pool=POOL),
    ModelConfig(name="g", page_size=16, pool=POOL),
)
# More slots than a 256 KiB reply can carry (8 bytes each), fewer than the pool holds.
TOO_MANY = 40000


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    yield from serve_module(tmp_path_factory, "replycaps", MODELS, max_message_bytes=MAX_MESSAGE)


@pytest.fixture(scope="module")
def stub(server) -> Iterator:
    yield from stub_of(server)


@pytest.fixture
def session(server, stub) -> Iterator[str]:
    yield from session_of(stub)
    server.check_integrity()


def state(server, stub) -> tuple:
    server.check_integrity()
    stats = stub.Stats(pb.StatsRequest())
    return tuple(
        (m.model, m.locks, m.session_slots, m.free_slots, m.evictable_tokens, m.protected_tokens)
        for m in stats.models
    )


def refused(call, request) -> None:
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
    assert "server.max_message_bytes" in err.value.details()
    assert "refused before doing anything" in err.value.details()


def test_match_alloc_and_step_are_refused_before_the_work(server, stub, session) -> None:
    before = state(server, stub)
    tokens = toks(np.arange(TOO_MANY) % 90000 + 1)
    refused(stub.Alloc, pb.AllocRequest(model="m", num_slots=TOO_MANY, session_id=session))
    refused(
        stub.Match,
        pb.MatchRequest(model="m", token_ids=tokens, session_id=session, lock=True, allocate=True),
    )
    refused(
        stub.Step,
        pb.StepRequest(
            model="m",
            session_id=session,
            admits=[pb.StepAdmit(token_ids=tokens, lock=True, allocate=True)],
        ),
    )
    refused(
        stub.Step,
        pb.StepRequest(model="m", session_id=session, decodes=[TOO_MANY // 2, TOO_MANY // 2]),
    )
    assert state(server, stub) == before
    # Within the limit the same calls work (and a plain Match is never refused here).
    assert stub.Match(pb.MatchRequest(model="m", token_ids=tokens)).prefix_len == 0
    alloc = stub.Alloc(pb.AllocRequest(model="m", num_slots=20000, session_id=session))
    assert len(alloc.slot_indices) == 8 * 20000
    stub.Free(pb.FreeRequest(model="m", slot_indices=alloc.slot_indices, session_id=session))
    assert state(server, stub) == before


def test_get_pages_is_refused_before_it_locks(server, stub, session) -> None:
    pages, chunk, prior = 2500, 500, None
    keys = []
    for p in range(pages):
        prior = hash_token_ids([7, p], prior)
        keys.append(bytes.fromhex(prior))
    for start in range(0, pages, chunk):
        slots = stub.Alloc(
            pb.AllocRequest(model="g", num_slots=chunk * 16, session_id=session)
        ).slot_indices
        stub.SetPages(
            pb.SetPagesRequest(
                model="g",
                session_id=session,
                slot_indices=slots,
                prior_hash=keys[start - 1] if start else b"",
                page_hashes=b"".join(keys[start : start + chunk]),
            )
        )
    before = state(server, stub)
    refused(
        stub.GetPages, pb.GetPagesRequest(model="g", session_id=session, page_hashes=b"".join(keys))
    )
    assert state(server, stub) == before
    got = stub.GetPages(
        pb.GetPagesRequest(model="g", session_id=session, page_hashes=b"".join(keys[:1000]))
    )
    assert got.found_pages == 1000
    for lock_id in got.lock_ids:
        stub.Unlock(pb.UnlockRequest(lock_id=lock_id, session_id=session))
    assert state(server, stub) == before
    stub.Reset(pb.ResetRequest(model="g"))
