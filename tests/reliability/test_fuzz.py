"""Adversarial requests against a real server: no crash, only documented codes, no harm.

A server with one model of every cache kind runs in-process on a unix socket, with a
session that holds real state (cached prefixes, locks, slots, state slots). Hypothesis
builds malformed and adversarial versions of every request message, mixing the live ids
of that state with garbage (odd-length token bytes, tokens out of the vocabulary, width
mismatches, huge and negative numbers, unknown models, nodes, locks and sessions,
unbalanced unlocks, double frees, oversized messages), and also sends raw random bytes to
every method (Step, the page RPCs and Subscribe included). For each case:

* the answer is OK or a status code the proto documents for client mistakes (never
  INTERNAL or UNKNOWN, and the server stays up);
* a refused call leaves every model's Stats exactly as they were, and the integrity
  check holds after every case (the server also runs it after every mutating call).

The default run of messages is a few hundred cases, outside the fast subset (about
20 s on a loaded 2-core machine); the long run (>= 10,000 cases) is marked slow too and
needs PREFIXCACHE_SLOW=1 (PREFIXCACHE_FUZZ_CASES sets its size):

    PREFIXCACHE_SLOW=1 python -m pytest -m slow -s tests/reliability/test_fuzz.py

The world and its checks are in tests/server/fuzz_world.py, the request strategies in
tests/server/fuzz_requests.py; the cases and the tests are here.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from fuzz_requests import (
    INDEX,
    RAW,
    STREAM_OPS,
    U64,
    UNARY_BUILDERS,
    _pick,
    read_request,
    subscribe_request,
    write_chunks,
)
from fuzz_world import ALLOWED_VALUES, CODE, MAX_MESSAGE, MODELS, SERVICE, TIMEOUT, UNARY, World
from harness import pb, running, toks
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

LONG = pytest.mark.skipif(
    not os.environ.get("PREFIXCACHE_SLOW"), reason="set PREFIXCACHE_SLOW=1 for the long fuzz run"
)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with running(
        tmp_path_factory.mktemp("fuzz"),
        MODELS,
        max_message_bytes=MAX_MESSAGE,
        session_ttl=600,
        session_ttl_min=300,
        session_ttl_max=3600,
    ) as server:
        w = World(server)
        yield w
        w.channel.close()


# ---------------------------------------------------------------------- cases


def _code(fn: Any) -> tuple[grpc.StatusCode, str, Any]:
    try:
        return CODE.OK, "", fn()
    except grpc.RpcError as err:
        return err.code(), err.details() or "", None


def unary_case(draw: Any, world: World) -> None:
    method = draw(st.sampled_from(sorted(UNARY_BUILDERS)))
    request = UNARY_BUILDERS[method](draw, world)
    call = getattr(world.stub, method)
    code, detail, reply = _code(lambda: call(request, timeout=TIMEOUT))
    if code == CODE.OK:
        world.learn(method, request, reply)
    world.settle(f"{method}({request})"[:2000], code, detail)


def read_case(draw: Any, world: World) -> None:
    request = read_request(draw, world)
    code, detail, _ = _code(lambda: list(world.stub.ReadKV(request, timeout=TIMEOUT)))
    world.settle(f"ReadKV({request})", code, detail)


def write_case(draw: Any, world: World) -> None:
    chunks = write_chunks(draw, world)
    code, detail, _ = _code(lambda: world.stub.WriteKV(iter(chunks), timeout=TIMEOUT))
    world.settle(f"WriteKV({chunks})", code, detail)


def stream_case(draw: Any, world: World) -> None:
    """A Session stream, one op at a time: each refused op changes nothing."""
    # Everything is drawn first: hypothesis may abandon an example at any draw, and
    # that must not leave a stream open behind the next case's back.
    ops = []
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from([*STREAM_OPS, None]))
        req = pb.SessionRequest(seq=draw(U64))
        if op is not None:
            getattr(req, op).CopyFrom(STREAM_OPS[op](draw, world))
        ops.append((op, req))
    requests: queue.Queue[pb.SessionRequest | None] = queue.Queue()
    replies = world.stub.Session(iter(requests.get, None), timeout=TIMEOUT)
    try:
        # Once a first reply is back, the stream's session is open: that is the baseline.
        requests.put(pb.SessionRequest(seq=0, stats=pb.StatsRequest()))
        assert next(replies).WhichOneof("result") == "stats"
        world.baseline = world.stats()
        for op, req in ops:
            requests.put(req)
            try:
                reply = next(replies)
            except grpc.RpcError as err:
                # gRPC itself ends the stream on a message over the size limit.
                assert err.code() == CODE.RESOURCE_EXHAUSTED, (err.code(), err.details())
                world.settle("Session close (oversized message)", CODE.OK)
                return
            assert reply.seq == req.seq
            result = reply.WhichOneof("result")
            if result == "error":
                assert reply.error.code in ALLOWED_VALUES, f"Session/{op}: {reply.error}"
                code = CODE.INVALID_ARGUMENT  # any refusal: Stats must not move
            else:
                assert result == op
                code = CODE.OK
                world.learn(op.capitalize(), getattr(req, op), getattr(reply, result))
            world.settle(f"Session/{op}({req})", code, reply.error.message)
    finally:
        requests.put(None)
    code, detail, _ = _code(lambda: list(replies))
    assert code == CODE.OK, (code, detail)
    # Closing the stream released what it held; that is a change, not a refusal.
    world.settle("Session close", CODE.OK)


def _first_events(call: Any) -> list[Any]:
    """A Subscribe's events up to its snapshot's end (at most 50), read within a second;
    a stream that would wait for changes is cancelled (an OK outcome)."""
    timer = threading.Timer(1.0, call.cancel)
    timer.start()
    events: list[Any] = []
    try:
        for event in call:
            events.append(event)
            if len(events) >= 50 or (
                isinstance(event, pb.SubscribeEvent) and event.HasField("snapshot_end")
            ):
                break
    except grpc.RpcError as err:
        if err.code() != CODE.CANCELLED:
            raise
    finally:
        timer.cancel()
        call.cancel()
    return events


def subscribe_case(draw: Any, world: World) -> None:
    request = subscribe_request(draw, world)
    if request.server_epoch == 1:  # the live epoch, so that after_seq is judged
        request.server_epoch = world.stats().server_epoch
    code, detail, _ = _code(lambda: _first_events(world.stub.Subscribe(request, timeout=TIMEOUT)))
    world.settle(f"Subscribe({request})"[:2000], code, detail)


def raw_case(draw: Any, world: World) -> None:
    method = draw(st.sampled_from([*UNARY, "ReadKV", "WriteKV", "Session", "Subscribe"]))
    path = SERVICE + method
    if method == "Subscribe":
        data = draw(RAW)
        code, detail, _ = _code(
            lambda: _first_events(world.channel.unary_stream(path)(data, timeout=TIMEOUT))
        )
    elif method in UNARY:
        data = draw(RAW)
        code, detail, reply = _code(lambda: world.channel.unary_unary(path)(data, timeout=TIMEOUT))
        if code == CODE.OK and method == "OpenSession":
            world.sessions.append(pb.OpenSessionResponse.FromString(reply).session_id)
    elif method == "ReadKV":
        data = draw(RAW)
        code, detail, _ = _code(
            lambda: list(world.channel.unary_stream(path)(data, timeout=TIMEOUT))
        )
    elif method == "WriteKV":
        msgs = draw(st.lists(RAW, max_size=4))
        code, detail, _ = _code(
            lambda: world.channel.stream_unary(path)(iter(msgs), timeout=TIMEOUT)
        )
    else:
        msgs = draw(st.lists(RAW, max_size=4))
        code, detail, answers = _code(
            lambda: list(world.channel.stream_stream(path)(iter(msgs), timeout=TIMEOUT))
        )
        for raw in answers or []:
            reply = pb.SessionResponse.FromString(raw)
            if reply.WhichOneof("result") == "error":
                assert reply.error.code in ALLOWED_VALUES, reply.error
        code = CODE.OK  # the stream's ops are re-baselined: they may have done things
    world.settle(f"raw {method}", code, detail)


def workflow_case(draw: Any, world: World) -> None:
    """A well-formed request as examples/worker.py makes it, each step settled: a locking,
    allocating match, an insert handing the lock over, and a free or an unlock.

    On the slot model the match often finds its prefix in a slot whose owner freed it
    (the worker frees its slot at the end), and reuses it in place; on the Mamba model
    every new prefix needs a state slot, so snapshots are evicted under state pressure.
    Sometimes the insert first names the session's lock on another model as
    ``release_lock_id``: refused with FAILED_PRECONDITION, changing nothing.
    """
    # Everything is drawn first, and never depends on the world (see INDEX).
    model = draw(st.sampled_from(["s", "s", "h", "h", "m", "p", "w"]))
    sid = _pick(draw, world.sessions, st.just(""))
    base = _pick(draw, world.seqs[model], st.just([1, 2, 3]))
    cut, tail = draw(INDEX), draw(st.lists(st.integers(0, 60), max_size=6))
    tokens = (base[: cut % (len(base) + 1)] + tail)[:16]  # the slot model's max_seq_len
    if model == "h":  # a Mamba state is the state after whole pages (of 2)
        tokens = tokens[: len(tokens) - len(tokens) % 2]
    other = draw(st.sampled_from([n for n in ("m", "p", "w", "h", "s") if n != model]))
    cross, free_slot = draw(st.integers(0, 2)) == 0, draw(st.integers(0, 3)) > 0
    keep, unlock = draw(st.booleans()), draw(st.booleans())
    if not tokens:
        return
    if not sid:  # the fuzzer closed every session: a worker opens a new one
        sid = world.open_session()
        world.settle("workflow: OpenSession", CODE.OK)

    refusals: list[str] = []

    def step(what: str, method: str, request: Any) -> Any:
        code, detail, reply = _code(lambda: getattr(world.stub, method)(request, timeout=TIMEOUT))
        if code == CODE.OK:
            world.learn(method, request, reply)
        else:
            refusals.append(f"{what}: {code.name} {detail} ({request})")
        world.settle(f"workflow {what}: {method}({request})"[:2000], code, detail)
        return reply

    before = {s.model: s for s in (world.baseline or world.stats()).models}[model]
    m = step(
        "prefill",
        "Match",
        pb.MatchRequest(
            model=model, token_ids=toks(tokens), session_id=sid, lock=True, allocate=True
        ),
    )
    if m is None:
        event("workflow: prefill refused")  # no room: every slot or state is held
        return
    if model == "s" and m.prefix_len and m.allocated_slots == m.slot_indices:
        event("workflow: a freed slot reused in place")
    if model == "h" and not before.free_state_slots:
        event("workflow: a state evicted for a new one")
    named = m.allocated_slots if model == "s" else m.slot_indices + m.allocated_slots
    insert = pb.InsertRequest(
        model=model,
        token_ids=toks(tokens),
        session_id=sid,
        slot_indices=named,
        lock=keep,
        release_lock_id=m.lock_id,
    )
    if model == "s":
        insert.slot_version = m.allocated_slot_version
    if m.HasField("allocated_state_slot"):
        insert.state_slot = m.allocated_state_slot
    if cross:
        theirs = step(
            "a lock on another model",
            "Match",
            pb.MatchRequest(
                model=other, token_ids=toks(world.seqs[other][0]), session_id=sid, lock=True
            ),
        )
        if theirs is not None and theirs.lock_id:
            wrong = pb.InsertRequest()
            wrong.CopyFrom(insert)
            wrong.release_lock_id = theirs.lock_id
            code, detail, _ = _code(lambda: world.stub.Insert(wrong, timeout=TIMEOUT))
            assert code == CODE.FAILED_PRECONDITION, (code, detail, wrong)
            event("workflow: release_lock_id of another model refused")
            world.settle(f"workflow insert naming {other}'s lock: {wrong}", code, detail)
    ins = step("insert", "Insert", insert)
    assert ins is not None, f"an insert right after its match was refused: {refusals}"
    if model == "s" and free_slot:
        step(
            "finish",
            "Free",
            pb.FreeRequest(model="s", slot_indices=m.allocated_slots, session_id=sid),
        )
    if ins.lock_id and unlock:
        step("unlock", "Unlock", pb.UnlockRequest(lock_id=ins.lock_id, session_id=sid))
    if len(tokens) > 1 and tokens not in world.seqs[model]:
        world.seqs[model] = [*world.seqs[model][-15:], tokens]


CASES = {
    "unary": unary_case,
    "read": read_case,
    "write": write_case,
    "stream": stream_case,
    "workflow": workflow_case,
    "subscribe": subscribe_case,
}


def run_case(data: Any, world: World, raw: bool) -> None:
    world.maybe_rebuild()
    draw = data.draw
    if raw:
        raw_case(draw, world)
    else:
        kind = draw(
            st.sampled_from(
                ["unary"] * 6 + ["read", "write", "stream", "subscribe"] + ["workflow"] * 2
            )
        )
        CASES[kind](draw, world)


def _settings(examples: int) -> settings:
    # No shrinking: a case's outcome depends on the server's state, which a replay
    # does not reproduce; the failure message names the request instead.
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.function_scoped_fixture,
            HealthCheck.data_too_large,
        ],
    )


@pytest.mark.slow
@settings(_settings(400))
@given(data=st.data())
def test_fuzz_messages(world: World, data: Any) -> None:
    run_case(data, world, raw=False)


@settings(_settings(150))
@given(data=st.data())
def test_fuzz_raw_bytes(world: World, data: Any) -> None:
    run_case(data, world, raw=True)


SLOW_CASES = int(os.environ.get("PREFIXCACHE_FUZZ_CASES", "10000"))


@pytest.mark.slow
@LONG
def test_fuzz_long(world: World) -> None:
    """>= PREFIXCACHE_FUZZ_CASES cases (default 10,000): four fifths messages, the
    rest raw bytes; prints the count and the time."""
    start, first = time.perf_counter(), world.cases

    @settings(_settings(SLOW_CASES * 4 // 5))
    @given(data=st.data())
    def messages(data: Any) -> None:
        run_case(data, world, raw=False)

    @settings(_settings(SLOW_CASES - SLOW_CASES * 4 // 5))
    @given(data=st.data())
    def raw(data: Any) -> None:
        run_case(data, world, raw=True)

    messages()
    raw()
    cases = world.cases - first
    print(f"\nfuzz: {cases} cases in {time.perf_counter() - start:.1f} s")
    assert cases >= SLOW_CASES
