"""The client side of `grpc_replay.py`: one worker process replaying its share of the
trace against the service or the floor (the service's calls) or the echo (raw bytes of
the same sizes), timing each call, between two barriers the parent reads CPU time at."""

from __future__ import annotations

import asyncio
import mmap
import time
import traceback
from array import array
from dataclasses import dataclass, field
from typing import Any

import grpc

from bench import echo_server
from bench.grpc_servers import MODEL

MAX_MESSAGE = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
]
WARMUP_CALLS = 20
BARRIER_TIMEOUT_S = 600.0


@dataclass
class WorkerSpec:
    kind: str  # "service", "floor" (the service's loop, no cache) or "echo"
    mode: str  # "unary" or "stream"
    target: str
    tokens_path: str
    spans: list[tuple[int, int]]  # byte ranges of this worker's requests in tokens_path
    index: int


@dataclass
class WorkerResult:
    index: int
    requests: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    match_ns: array = field(default_factory=lambda: array("q"))
    insert_ns: array = field(default_factory=lambda: array("q"))
    t_start: float = 0.0
    t_end: float = 0.0
    cpu_s: float = 0.0
    failure: str = ""


def worker(spec: WorkerSpec, barriers: tuple[Any, Any], out: Any) -> None:
    """Process entry: replay this worker's requests, put a WorkerResult on ``out``."""
    result = WorkerResult(spec.index)
    try:
        with (
            open(spec.tokens_path, "rb") as fh,
            mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm,
        ):
            keys = [bytes(mm[a:b]) for a, b in spec.spans]
        replay = _replay_echo if spec.kind == "echo" else _replay_service
        asyncio.run(replay(spec, keys, barriers, result))
    except BaseException:  # reported to the parent, which fails the run
        result.failure = traceback.format_exc()
        for b in barriers:
            b.abort()
    out.put(result)


def _count(result: WorkerResult, what: str) -> None:
    result.errors[what] = result.errors.get(what, 0) + 1


async def _replay_service(
    spec: WorkerSpec, keys: list[bytes], barriers: tuple[Any, Any], result: WorkerResult
) -> None:
    from prefixcache.v1 import prefix_cache_pb2 as pb
    from prefixcache.v1 import prefix_cache_pb2_grpc as pb_grpc

    perf = time.perf_counter_ns
    async with grpc.aio.insecure_channel(spec.target, options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.PrefixCacheStub(channel)
        if spec.mode == "unary":
            sid = (
                await stub.OpenSession(
                    pb.OpenSessionRequest(ttl_seconds=600, client_name=f"bench-{spec.index}")
                )
            ).session_id
            for _ in range(WARMUP_CALLS):
                await stub.Stats(pb.StatsRequest(model=MODEL))
            _start(result, barriers[0])
            for key in keys:
                match = pb.MatchRequest(
                    model=MODEL, token_ids=key, session_id=sid, lock=True, allocate=True
                )
                t0 = perf()
                try:
                    m = await stub.Match(match)
                except grpc.aio.AioRpcError as exc:
                    _count(result, f"Match {exc.code().name}")
                    continue
                t1 = perf()
                insert = pb.InsertRequest(
                    model=MODEL,
                    token_ids=key,
                    slot_indices=m.slot_indices + m.allocated_slots,
                    session_id=sid,
                    release_lock_id=m.lock_id,
                )
                t1b = perf()
                try:
                    await stub.Insert(insert)
                except grpc.aio.AioRpcError as exc:
                    _count(result, f"Insert {exc.code().name}")
                    await _undo_unary(stub, pb, sid, m)
                    continue
                t2 = perf()
                result.match_ns.append(t1 - t0)
                result.insert_ns.append(t2 - t1b)
                result.requests += 1
            _stop(result, barriers[1])
            await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
            return

        call = stub.Session()
        seq = 0

        def request(**kw: Any) -> Any:
            nonlocal seq
            seq += 1
            return pb.SessionRequest(seq=seq, **kw)

        async def op(req: Any) -> Any:
            await call.write(req)
            reply = await call.read()
            if reply is grpc.aio.EOF or reply.seq != req.seq:
                raise RuntimeError(f"Session stream: expected the reply to {req.seq}, got {reply}")
            return reply

        for _ in range(WARMUP_CALLS):
            await op(request(stats=pb.StatsRequest(model=MODEL)))
        _start(result, barriers[0])
        for key in keys:
            match = request(
                match=pb.MatchRequest(model=MODEL, token_ids=key, lock=True, allocate=True)
            )
            t0 = perf()
            r = await op(match)
            t1 = perf()
            if r.HasField("error"):
                _count(result, f"Match {_code_name(r.error.code)}")
                continue
            m = r.match
            insert = request(
                insert=pb.InsertRequest(
                    model=MODEL,
                    token_ids=key,
                    slot_indices=m.slot_indices + m.allocated_slots,
                    release_lock_id=m.lock_id,
                )
            )
            t1b = perf()
            r = await op(insert)
            t2 = perf()
            if r.HasField("error"):
                _count(result, f"Insert {_code_name(r.error.code)}")
                await op(request(free=pb.FreeRequest(model=MODEL, slot_indices=m.allocated_slots)))
                await op(request(unlock=pb.UnlockRequest(lock_id=m.lock_id)))
                continue
            result.match_ns.append(t1 - t0)
            result.insert_ns.append(t2 - t1b)
            result.requests += 1
        _stop(result, barriers[1])
        await call.done_writing()
        while await call.read() is not grpc.aio.EOF:
            pass


def _code_name(value: int) -> str:
    return next((c.name for c in grpc.StatusCode if c.value[0] == value), str(value))


async def _undo_unary(stub: Any, pb: Any, sid: str, m: Any) -> None:
    """After a failed Insert, hand back the match's slots and lock (best effort)."""
    try:
        if m.allocated_slots:
            await stub.Free(
                pb.FreeRequest(model=MODEL, slot_indices=m.allocated_slots, session_id=sid)
            )
        if m.lock_id:
            await stub.Unlock(pb.UnlockRequest(lock_id=m.lock_id, session_id=sid))
    except grpc.aio.AioRpcError:
        pass


async def _replay_echo(
    spec: WorkerSpec, keys: list[bytes], barriers: tuple[Any, Any], result: WorkerResult
) -> None:
    perf = time.perf_counter_ns
    # Same sizes as the service's messages: Match sends 4 B/token and gets 8 B/token of
    # slots back; Insert sends 4 + 8 B/token and gets a few bytes back.
    shapes = [
        (echo_server.request(2 * len(k), len(k)), echo_server.request(8, 3 * len(k))) for k in keys
    ]
    async with grpc.aio.insecure_channel(spec.target, options=CHANNEL_OPTIONS) as channel:
        small = echo_server.request(16, 16)
        if spec.mode == "unary":
            call = channel.unary_unary(echo_server.UNARY)
            for _ in range(WARMUP_CALLS):
                await call(small)
            _start(result, barriers[0])
            for match_req, insert_req in shapes:
                t0 = perf()
                await call(match_req)
                t1 = perf()
                await call(insert_req)
                t2 = perf()
                result.match_ns.append(t1 - t0)
                result.insert_ns.append(t2 - t1)
                result.requests += 1
            _stop(result, barriers[1])
            return

        stream = channel.stream_stream(echo_server.STREAM)()
        for _ in range(WARMUP_CALLS):
            await stream.write(small)
            await stream.read()
        _start(result, barriers[0])
        for match_req, insert_req in shapes:
            t0 = perf()
            await stream.write(match_req)
            await stream.read()
            t1 = perf()
            await stream.write(insert_req)
            await stream.read()
            t2 = perf()
            result.match_ns.append(t1 - t0)
            result.insert_ns.append(t2 - t1)
            result.requests += 1
        _stop(result, barriers[1])
        await stream.done_writing()
        while await stream.read() is not grpc.aio.EOF:
            pass


def _start(result: WorkerResult, barrier: Any) -> None:
    barrier.wait(BARRIER_TIMEOUT_S)  # every worker and the parent are ready
    result.cpu_s = time.process_time()
    result.t_start = time.monotonic()


def _stop(result: WorkerResult, barrier: Any) -> None:
    result.t_end = time.monotonic()
    result.cpu_s = time.process_time() - result.cpu_s
    barrier.wait(BARRIER_TIMEOUT_S)  # the parent reads the server's CPU time here
