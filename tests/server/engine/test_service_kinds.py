"""The v1 API on the cache kinds other than plain radix: SWA, chunk, Mamba and slot.

The server runs with the integrity check after every mutating call, so a corrupted
cache would surface as INTERNAL in whichever test caused it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc
import pytest
from harness import pb, slots, toks
from service_calls import CODE, prefill, refused, service_fixtures, stats

server, stub, session = service_fixtures("svc_kinds")


@pytest.fixture
def stub_session_pair(stub) -> Iterator[tuple[str, str]]:
    ids = [stub.OpenSession(pb.OpenSessionRequest()).session_id for _ in range(2)]
    yield ids[0], ids[1]
    for sid in ids:
        with contextlib.suppress(grpc.RpcError):  # unless the test closed it
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


def test_swa_model_prefill_and_hit(stub, session) -> None:
    tokens = list(range(400, 410))
    prefill(stub, session, "w", tokens)
    again = prefill(stub, session, "w", [*tokens, 410, 411])
    assert (again.prefix_len, again.cached_len) == (10, 12)
    s = stats(stub, "w")
    assert s.swa_evictable_tokens == 12 and s.session_slots == 0
    evicted = stub.Evict(pb.EvictRequest(model="w", num_tokens=0, swa_num_tokens=4))
    assert evicted.swa_evicted_tokens >= 4


def test_chunk_model_caches_nothing(stub, session) -> None:
    ins = prefill(stub, session, "c", [1, 2, 3])
    assert (ins.prefix_len, ins.cached_len, ins.node_id) == (0, 0, 0)
    assert stub.Match(pb.MatchRequest(model="c", token_ids=toks([1, 2, 3]))).prefix_len == 0
    assert stats(stub, "c").session_slots == 3  # still the session's to free


def test_mamba_model_caches_a_state_per_prefix(stub, session) -> None:
    tokens = [1, 2, 3, 4]
    m = stub.Match(
        pb.MatchRequest(
            model="h", token_ids=toks(tokens), session_id=session, lock=True, allocate=True
        )
    )
    assert m.prefix_len == 0 and not m.HasField("state_slot")
    state = m.allocated_state_slot
    assert 3 <= state < 7  # after the padding slot and the two working slots
    ins = stub.Insert(
        pb.InsertRequest(
            model="h",
            token_ids=toks(tokens),
            session_id=session,
            slot_indices=m.allocated_slots,
            state_slot=state,
        )
    )
    assert (ins.cached_len, ins.state_exist) == (4, False)
    s = stats(stub, "h")
    assert (s.mamba_evictable_slots, s.free_state_slots, s.session_state_slots) == (1, 3, 0)

    hit = stub.Match(
        pb.MatchRequest(
            model="h",
            token_ids=toks([1, 2, 3, 4, 5, 6]),
            session_id=session,
            lock=True,
            allocate=True,
        )
    )
    assert (hit.prefix_len, hit.state_slot) == (4, state)
    assert stats(stub, "h").mamba_protected_slots == 1
    # A second request for the same tokens: the tree already has the state, so the
    # request's own state slot is freed rather than cached.
    again = stub.Insert(
        pb.InsertRequest(
            model="h",
            token_ids=toks(tokens),
            session_id=session,
            state_slot=hit.allocated_state_slot,
            slot_indices=hit.slot_indices,
            release_lock_id=hit.lock_id,
        )
    )
    assert again.state_exist
    # Tokens not cached yet need a state; a state slot the session does not hold is refused.
    refused(
        stub.Insert,
        pb.InsertRequest(
            model="h",
            token_ids=toks([1, 2, 3, 4, 5, 6]),
            session_id=session,
            slot_indices=hit.slot_indices + hit.allocated_slots,
        ),
        CODE.INVALID_ARGUMENT,
    )
    refused(
        stub.Insert,
        pb.InsertRequest(
            model="h",
            token_ids=toks([1, 2, 3, 4, 5, 6]),
            session_id=session,
            state_slot=state,
            slot_indices=hit.slot_indices + hit.allocated_slots,
        ),
        CODE.FAILED_PRECONDITION,
    )
    got = stub.Alloc(pb.AllocRequest(model="h", num_slots=0, num_state_slots=2, session_id=session))
    assert len(slots(got.state_slots)) == 2 and stats(stub, "h").session_state_slots == 2
    stub.Free(pb.FreeRequest(model="h", state_slots=got.state_slots, session_id=session))
    refused(
        stub.Free,
        pb.FreeRequest(model="h", state_slots=got.state_slots, session_id=session),
        CODE.FAILED_PRECONDITION,
    )
    refused(
        stub.Alloc,
        pb.AllocRequest(model="m", num_state_slots=1, session_id=session),
        CODE.FAILED_PRECONDITION,
    )
    stub.Free(pb.FreeRequest(model="h", slot_indices=hit.allocated_slots, session_id=session))
    evicted = stub.Evict(pb.EvictRequest(model="h", mamba_num=1))
    assert evicted.mamba_evicted == 1
    assert stats(stub, "h").free_state_slots == 4


def test_slot_model_reuses_a_sequence_slot_by_copy_or_in_place(
    server, stub, stub_session_pair
) -> None:
    a, b = stub_session_pair
    pool = stub.DescribePool(pb.DescribePoolRequest(model="s"))
    assert (pool.num_rows, pool.max_seq_len, pool.layer_num, pool.k_head_dim) == (4, 16, 1, 2)
    tokens = [1, 2, 3, 4, 5, 6]
    first = stub.Match(
        pb.MatchRequest(model="s", token_ids=toks(tokens), session_id=a, allocate=True)
    )
    assert first.prefix_len == 0 and first.HasField("allocated_slot_version")
    (slot_a,) = slots(first.allocated_slots)
    k_cache = server.service.engine("s").k_cache
    server.run(lambda: k_cache[slot_a, :6].fill_(7.0))  # "prefill" writes the KV
    ins = stub.Insert(
        pb.InsertRequest(
            model="s",
            token_ids=toks(tokens),
            session_id=a,
            slot_indices=first.allocated_slots,
            slot_version=first.allocated_slot_version,
        )
    )
    assert ins.cached_len == 6

    # Session b: the prefix lives in a's slot, which a still holds: b gets a copy.
    hit = stub.Match(
        pb.MatchRequest(
            model="s", token_ids=toks([*tokens, 7, 8]), session_id=b, lock=True, allocate=True
        )
    )
    assert (hit.prefix_len, slots(hit.slot_indices)) == (6, [slot_a])
    assert hit.slot_version == first.allocated_slot_version and hit.lock_id and hit.node_id
    (slot_b,) = slots(hit.allocated_slots)
    assert slot_b != slot_a
    assert bool(server.run(lambda: (k_cache[slot_b, :6] == 7.0).all().item()))
    stub.Unlock(pb.UnlockRequest(lock_id=hit.lock_id, session_id=b))

    # a is done and frees its slot; the next match reuses it in place at a new version.
    stub.Free(pb.FreeRequest(model="s", slot_indices=first.allocated_slots, session_id=a))
    again = stub.Match(
        pb.MatchRequest(model="s", token_ids=toks(tokens), session_id=a, allocate=True)
    )
    assert slots(again.allocated_slots) == [slot_a]
    assert again.allocated_slot_version != first.allocated_slot_version
    refused(
        stub.Insert,
        pb.InsertRequest(
            model="s",
            token_ids=toks(tokens),
            session_id=a,
            slot_indices=again.allocated_slots,
            slot_version=first.allocated_slot_version,
        ),
        CODE.INVALID_ARGUMENT,
    )  # a stale version
    refused(
        stub.Insert,
        pb.InsertRequest(
            model="s",
            token_ids=toks(tokens),
            session_id=b,
            slot_indices=again.allocated_slots,
            slot_version=again.allocated_slot_version,
        ),
        CODE.FAILED_PRECONDITION,
    )  # not b's slot
    got = stub.Alloc(pb.AllocRequest(model="s", num_slots=2, session_id=b))
    assert len(slots(got.slot_versions)) == 2
    refused(
        stub.Alloc, pb.AllocRequest(model="s", num_slots=1, session_id=b), CODE.RESOURCE_EXHAUSTED
    )
    closed = stub.CloseSession(pb.CloseSessionRequest(session_id=b))
    assert closed.slots_freed == 3
    server.check_integrity()
