"""Shared by the v1 API tests (test_service*.py): the models, and the calls those
tests make over and over (a model's Stats, a refusal with its code, the two-RPC prefill).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from harness import EVERY_KIND, pb, serve_module, session_of, slots, stub_of, toks

MODELS = EVERY_KIND
CODE = grpc.StatusCode


def stats(stub, model: str) -> pb.ModelStats:
    return stub.Stats(pb.StatsRequest(model=model)).models[0]


def refused(call, request, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call(request)
    assert err.value.code() == code, err.value.details()
    return err.value.details()


def prefill(
    stub, sid: str, model: str, tokens: list[int], *, keep_lock: bool = False, **key
) -> pb.InsertResponse:
    """The two-RPC prefill: match+lock+allocate, then insert with lock handover."""
    m = stub.Match(
        pb.MatchRequest(
            model=model, token_ids=toks(tokens), session_id=sid, lock=True, allocate=True, **key
        )
    )
    assert m.prefix_len + len(slots(m.allocated_slots)) == len(tokens)
    return stub.Insert(
        pb.InsertRequest(
            model=model,
            token_ids=toks(tokens),
            session_id=sid,
            lock=keep_lock,
            slot_indices=m.slot_indices + m.allocated_slots,
            release_lock_id=m.lock_id,
            **key,
        )
    )


def service_fixtures(name: str) -> tuple[Any, Any, Any]:
    """The ``server``, ``stub`` and ``session`` fixtures of one test module of the v1
    service: its own server (every model kind, short minimum leases), a stub on it, and
    a fresh session per test. Assign them to those names in the module."""

    @pytest.fixture(scope="module", name="server")
    def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
        yield from serve_module(tmp_path_factory, name, MODELS, session_ttl_min=0.2)

    @pytest.fixture(scope="module", name="stub")
    def stub(server: Any) -> Iterator:
        yield from stub_of(server)

    @pytest.fixture(name="session")
    def session(stub: Any) -> Iterator[str]:
        yield from session_of(stub)

    return server, stub, session
