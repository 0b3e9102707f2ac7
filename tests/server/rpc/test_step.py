"""Step items behave exactly like their unary calls, against a real server.

Every scenario runs twice, on twin models of the same kind: once through the unary
RPCs, once with each operation as a one-item Step (a finish keeps its tail, so that it
is a plain Insert; ``finish`` is Insert then Free of the tail). The replies (with node
and lock ids renumbered, server_epoch aside), the errors (code and message) and the
model's counters after every operation must be equal. The server runs in invariant
mode, so a corrupted cache would answer INTERNAL.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from harness import EVERY_KIND, pack_slots, pb, serve_module, slots, stub_of, toks
from step_runners import CODES, Err, Runner, Scenario, Stepped, Unary, drive

TWINS = {m.name: m.name + "2" for m in EVERY_KIND}
MODELS = (*EVERY_KIND, *(replace(m, name=TWINS[m.name]) for m in EVERY_KIND))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    yield from serve_module(tmp_path_factory, "step", MODELS)


@pytest.fixture(scope="module")
def stub(server) -> Iterator:
    yield from stub_of(server)


# ------------------------------------------------------------------- scenarios


def _state(m: Any) -> dict[str, Any]:
    return {"state_slot": m.allocated_state_slot} if m.HasField("allocated_state_slot") else {}


def _prefill(tokens: list[int], op: str = "insert", **kw: Any):
    m = yield "match", {"token_ids": toks(tokens), "lock": True, "allocate": True}
    ids, extra = m.slot_indices + m.allocated_slots, {}
    if m.HasField("allocated_slot_version"):  # a slot model: the one sequence slot
        ids, extra = m.allocated_slots, {"slot_version": m.allocated_slot_version}
    ins = yield (
        op,
        {
            "token_ids": toks(tokens),
            "release_lock_id": m.lock_id,
            **_state(m),
            "slot_indices": ids,
            **extra,
            **kw,
        },
    )
    return m, ins


def _lengths(kind: str) -> tuple[list[int], list[int]]:
    """Two prompts, the second extending the first; both with an unaligned tail on page
    size 4, except for Mamba (page 2), whose inserts with a state must be whole pages."""
    return (
        ([1, 2, 3, 4, 5, 6], list(range(1, 11)))
        if kind == "h"
        else ([1, 2, 3, 4, 5], list(range(1, 10)))
    )


def prefill(kind: str):
    """Miss, insert with lock handover, hit, insert keeping a lock, unlock twice."""
    first, second = _lengths(kind)
    yield from _prefill(first)
    _, ins = yield from _prefill(second, lock=True)
    yield "match", {"token_ids": toks(second[:6])}
    yield "unlock", {"lock_id": ins.lock_id}
    yield "unlock", {"lock_id": ins.lock_id}


def finish(kind: str):
    """The same, each insert a finish that frees the unaligned tail."""
    first, second = _lengths(kind)
    yield from _prefill(first, "finish")
    _, ins = yield from _prefill(second, "finish", lock=True)
    yield "match", {"token_ids": toks(second[:7])}
    yield "unlock", {"lock_id": ins.lock_id}


def bad_inserts(kind: str):
    """test_service's bad insert cases: each refused with its code, changing nothing."""
    yield from _prefill([40, 41, 42])
    mine = slots((yield "alloc", {"num_slots": 3}).slot_indices)
    theirs = slots((yield "alloc_other", {"num_slots": 1}).slot_indices)
    tree = slots((yield "match", {"token_ids": toks([40, 41, 42])}).slot_indices)
    for tokens, ids, kw in (
        ([40, 41, 42, 43], [*tree, *theirs], {}),  # not mine
        ([50, 51], mine[:1], {}),  # count mismatch
        ([50, 51], [mine[0], mine[0]], {}),  # named twice
        ([50, 51], [mine[0], 10_000], {}),  # outside the pool
        ([50, 51], [mine[0], 0], {}),  # the padding slot
        ([50, 51], [mine[0], -3], {}),
        ([50, 1500], mine[:2], {}),  # beyond vocab_size
        ([41, 40], tree[:2], {}),  # tree slots, wrong tokens
        ([40, 41], mine[:2], {"release_lock_id": 10**9}),
        ([40, 41], mine[:2], {"extra_key": "x" * 5000}),
    ):
        yield "insert", {"token_ids": toks(tokens), "slot_indices": pack_slots(ids), **kw}
    yield "insert", {"token_ids": b"\x01\x00\x00"}
    yield "insert", {"token_ids": toks([1]), "slot_indices": b"\x01\x00"}
    yield "insert", {"token_ids": toks([1, 2]), "token_width": 9}
    yield "finish", {"token_ids": toks([60, 61]), "slot_indices": pack_slots(mine[:2])}
    yield "free", {"slot_indices": pack_slots(mine[2:])}


def bad_matches(kind: str):
    """Malformed or oversized lookups, and an allocation the pool cannot supply."""
    yield "match", {"token_ids": b"\x00" * 5}
    yield "match", {"token_ids": toks([1001])}
    yield "match", {"token_ids": toks([1]), "token_width": 100}
    yield "match", {"token_ids": toks([1]), "extra_key": "k" * 5000}
    yield "match", {"token_ids": toks(list(range(300)))}  # more than the pool holds
    big = yield "alloc", {"num_slots": 250}
    yield "match", {"token_ids": toks(list(range(10))), "lock": True, "allocate": True}
    yield "free", {"slot_indices": big.slot_indices}
    yield "match", {"token_ids": toks([7, 8]), "extra_key": "", "allocate": True}


def pool_errors(kind: str):
    """Unknown and double unlocks and frees, hopeless and empty allocations."""
    yield "unlock", {"lock_id": 10**12}
    yield "unlock", {"lock_id": 0}
    got = yield "alloc", {"num_slots": 2}
    yield "free", {"slot_indices": got.slot_indices}
    yield "free", {"slot_indices": got.slot_indices}
    yield "free", {"slot_indices": b"\x01"}
    yield "free", {"slot_indices": pack_slots([10_000])}
    yield "alloc", {"num_slots": 10**6}
    yield "alloc", {"num_slots": 0}


def duplicate_in_prefix(kind: str):
    """A session slot for a token the tree has is freed, reported in freed_slots."""
    yield from _prefill([60, 61, 62])
    tree = slots((yield "match", {"token_ids": toks([60, 61, 62])}).slot_indices)
    mine = slots((yield "alloc", {"num_slots": 2}).slot_indices)
    yield (
        "insert",
        {"token_ids": toks([60, 61, 62, 63]), "slot_indices": pack_slots([*tree[:2], *mine])},
    )


def kept_duplicates(kind: str):
    """With keep_duplicates a session slot for a token the tree has stays the session's
    (not in freed_slots: its free succeeds once); swa and slot models refuse it."""
    yield from _prefill([60, 61, 62, 63])
    tree = slots((yield "match", {"token_ids": toks([60, 61, 62, 63])}).slot_indices)
    mine = slots((yield "alloc", {"num_slots": 3}).slot_indices)
    yield (
        "insert",
        {
            "token_ids": toks([60, 61, 62, 63, 64, 65]),
            "keep_duplicates": True,
            "slot_indices": pack_slots([*tree[:2], *mine, 0][:6]),
        },
    )
    yield "free", {"slot_indices": pack_slots(mine[:2])}
    yield "free", {"slot_indices": pack_slots(mine[:2])}
    yield "free", {"slot_indices": pack_slots(mine[2:])}


def pressure(kind: str):
    """Allocations evict unlocked entries, oldest first."""
    for base in (300, 310, 320):
        yield from _prefill(list(range(base, base + 8)))
    got = yield "alloc", {"num_slots": 60}
    yield "alloc", {"num_slots": 8}
    yield "free", {"slot_indices": got.slot_indices}


def mamba_states(kind: str):
    """test_service's Mamba cases that items can express."""
    m, _ = yield from _prefill([1, 2, 3, 4])
    hit = yield "match", {"token_ids": toks([1, 2, 3, 4, 5, 6]), "lock": True, "allocate": True}
    yield (
        "insert",
        {
            "token_ids": toks([1, 2, 3, 4, 5, 6]),
            "slot_indices": hit.slot_indices + hit.allocated_slots,
        },
    )
    yield (
        "insert",
        {
            "token_ids": toks([1, 2, 3, 4, 5, 6]),
            "state_slot": 9,
            "slot_indices": hit.slot_indices + hit.allocated_slots,
        },
    )
    yield (
        "insert",
        {
            "token_ids": toks([1, 2, 3, 4]),
            "state_slot": hit.allocated_state_slot,
            "slot_indices": hit.slot_indices,
            "release_lock_id": hit.lock_id,
        },
    )
    yield "free", {"slot_indices": hit.allocated_slots}
    yield "free", {"state_slots": pack_slots([m.allocated_state_slot])}


def slot_model(kind: str):
    """Sequence slots: copies, reuse in place, stale versions, a full pool."""
    first, _ = yield from _prefill([1, 2, 3, 4, 5, 6], "finish")
    hit = yield (
        "match",
        {"token_ids": toks([1, 2, 3, 4, 5, 6, 7, 8]), "lock": True, "allocate": True},
    )
    yield "unlock", {"lock_id": hit.lock_id}
    yield "free", {"slot_indices": hit.allocated_slots}
    again = yield "match", {"token_ids": toks([1, 2, 3, 4, 5, 6]), "allocate": True}
    yield (
        "insert",
        {
            "token_ids": toks([1, 2, 3, 4, 5, 6]),
            "slot_indices": again.allocated_slots,
            "slot_version": first.allocated_slot_version,
        },
    )
    yield "alloc", {"num_slots": 2}
    yield "alloc", {"num_slots": 2}


CASES = (
    [(prefill, kind) for kind in "mpwch"]
    + [(finish, kind) for kind in "mpwch"]
    + [
        (bad_inserts, "m"),
        (bad_matches, "m"),
        (pool_errors, "m"),
        (pool_errors, "s"),
        (duplicate_in_prefix, "m"),
        (kept_duplicates, "m"),
        (kept_duplicates, "h"),
        (kept_duplicates, "w"),
        (kept_duplicates, "s"),
        (pressure, "p"),
        (mamba_states, "h"),
        (slot_model, "s"),
        (finish, "s"),
    ]
)


@pytest.mark.parametrize(("scenario", "model"), CASES, ids=[f"{s.__name__}-{m}" for s, m in CASES])
def test_each_item_behaves_like_its_unary_call(
    server, stub, scenario: Scenario, model: str
) -> None:
    unary = drive(scenario, Unary(stub, model))
    stepped = drive(scenario, Stepped(stub, TWINS[model]))
    for want, got in zip(unary, stepped, strict=True):
        assert got == want
    server.check_integrity()


def _fill(stub: Any, runner: Runner) -> None:
    """Cache as many whole pages as leave 4 slots free: allocations must evict."""
    free = stub.Stats(pb.StatsRequest(model=runner.model)).models[0].free_slots
    tokens = toks(list(range((free - 4) // 4 * 4)))
    m = stub.Match(
        pb.MatchRequest(
            model=runner.model, token_ids=tokens, session_id=runner.sid, lock=True, allocate=True
        )
    )
    stub.Insert(
        pb.InsertRequest(
            model=runner.model,
            token_ids=tokens,
            session_id=runner.sid,
            slot_indices=m.slot_indices + m.allocated_slots,
            release_lock_id=m.lock_id,
            **_state(m),
        )
    )


@pytest.mark.parametrize("model", ["m", "p", "w", "h", "s"])
@pytest.mark.parametrize("pressure", [False, True], ids=["room", "pressure"])
def test_a_step_s_decodes_are_its_allocs_one_by_one(
    server, stub, model: str, pressure: bool
) -> None:
    """Several decodes in one step (allocated at once where that changes nothing) answer
    what as many Allocs in a row would: the same slots, evictions, errors and counters."""
    counts = [1, 2, 3, 10**6, 1] if pressure else [1, 2, 3, 1]
    traces = []
    for runner in (Unary(stub, model), Stepped(stub, TWINS[model])):
        if pressure and model != "s":
            _fill(stub, runner)
        ops = dict(server.service.engine(runner.model).ops)
        if isinstance(runner, Unary):
            results = [runner("alloc", num_slots=n) for n in counts]
        else:
            reply = stub.Step(
                pb.StepRequest(model=runner.model, session_id=runner.sid, decodes=counts)
            )
            results = [
                r.decode if r.HasField("decode") else Err(CODES[r.error.code].name, r.error.message)
                for r in reply.decodes
            ]
        after = server.service.engine(runner.model).ops
        traces.append(
            (
                [runner.norm(r) for r in results],
                runner.stats(),
                {op: after[op] - ops[op] for op in ops},
            )
        )
        runner.close()
    assert traces[1] == traces[0]
    server.check_integrity()


def test_kept_duplicates_stay_the_session_s(server, stub) -> None:
    """The insert reports no freed slot and the session still holds its duplicates;
    without keep_duplicates the service frees them (the contrast)."""
    for keep in (True, False):
        sid = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=60)).session_id
        tokens = toks([70 + keep, 71, 72, 73])
        m = stub.Match(pb.MatchRequest(model="m", token_ids=tokens, session_id=sid, allocate=True))
        stub.Insert(
            pb.InsertRequest(
                model="m", token_ids=tokens, session_id=sid, slot_indices=m.allocated_slots
            )
        )
        again = stub.Alloc(pb.AllocRequest(model="m", num_slots=4, session_id=sid))
        reply = stub.Step(
            pb.StepRequest(
                model="m",
                session_id=sid,
                finishes=[
                    pb.StepFinish(
                        token_ids=tokens,
                        slot_indices=again.slot_indices,
                        keep_tail=True,
                        keep_duplicates=keep,
                    )
                ],
            )
        )
        freed = slots(reply.finishes[0].finish.freed_slots)
        held = stub.Stats(pb.StatsRequest(model="m")).models[0]
        assert (freed, held.session_slots) == (([], 4) if keep else (slots(again.slot_indices), 0))
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    server.check_integrity()
