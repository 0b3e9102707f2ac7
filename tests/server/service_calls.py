"""Shared by the v1 API tests (test_service*.py): the models, and the calls those
tests make over and over (a model's Stats, a refusal with its code, the two-RPC prefill).
"""

from __future__ import annotations

import grpc
import pytest
from harness import EVERY_KIND, pb, slots, toks

MODELS = EVERY_KIND
CODE = grpc.StatusCode


def stats(stub, model: str) -> pb.ModelStats:
    return stub.Stats(pb.StatsRequest(model=model)).models[0]


def refused(call, request, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call(request)
    assert err.value.code() == code, err.value.details()
    return err.value.details()


def prefill(stub, sid: str, model: str, tokens: list[int], *, keep_lock: bool = False,
            **key) -> pb.InsertResponse:
    """The two-RPC prefill: match+lock+allocate, then insert with lock handover."""
    m = stub.Match(pb.MatchRequest(model=model, token_ids=toks(tokens), session_id=sid,
                                   lock=True, allocate=True, **key))
    assert m.prefix_len + len(slots(m.allocated_slots)) == len(tokens)
    return stub.Insert(pb.InsertRequest(
        model=model, token_ids=toks(tokens), session_id=sid, lock=keep_lock,
        slot_indices=m.slot_indices + m.allocated_slots, release_lock_id=m.lock_id, **key))
