"""The attacks on a shared service, one function each, for the noisy-neighbour bench
(and, from noisy_surfaces.py, those on the KV-event, Subscribe and page surfaces; and
floods of Explain, ExistsPages and Subscribe, the first two against the bench's
1M-token model ``BIG``).

Each runs in the attacker's own process (so its client-side work does not take the
victim's GIL) against a real server, until ``stop`` is set, and counts its calls by
status code. An attack first does what it needs to be "armed" (grab the pool, take the
locks, open the streams), then sets ``armed``, and keeps pressing until stopped; then
it hands back what it holds (closing its sessions), so the next attack starts clean.

Raw gRPC stubs, not the client library: an attacker does not retry politely.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np

from bench import noisy_auth
from bench.noisy_surfaces import SURFACES
from prefixcache.v1 import prefix_cache_pb2 as pb
from prefixcache.v1 import prefix_cache_pb2_grpc as pb_grpc

MODEL = "m"
BIG = "big"  # 1M-token pool of tiny rows: requests as large as a 1M-token prompt
BIG_TOKENS = 1 << 20
_BIG = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
Codes = Counter


def toks(ids: Any) -> bytes:
    return np.asarray(ids, dtype="<u4").tobytes()


def slots_of(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i8")


def pack(ids: Any) -> bytes:
    return np.asarray(ids, dtype="<i8").tobytes()


def victim_prompt(i: int, shared: int, unique: int) -> list[int]:
    """The victim's i-th prompt: a shared system prompt, then its own tokens (the
    attacker knows them, as a co-tenant of a shared prefix would)."""
    return list(range(1, shared + 1)) + [100_000 + i * unique + j for j in range(unique)]


class Ctx:
    """What an attack gets: the server, the pool shape, a stop flag and its counters."""

    def __init__(
        self,
        target: str,
        pool_size: int,
        stop: Any,
        armed: Any,
        huge: int = 50 << 20,
        extras: dict[str, Any] | None = None,
    ) -> None:
        self.target = target
        # What the newer surfaces' attacks need (noisy_surfaces.py): the replay
        # endpoint, a tenant's token.
        self.extras = extras or {}
        self.pool_size = pool_size
        self.huge = huge  # the "huge extra_key" size (the issue's: 50 MiB)
        self.stop = stop
        self.armed = armed
        self.codes: Codes[str] = Counter()
        self.channel = noisy_auth.channel(target, self.extras.get("token"), options=_BIG)
        self.stub = pb_grpc.PrefixCacheStub(self.channel)
        self.sessions: list[str] = []
        self._lock = threading.Lock()

    def call(self, method: str, request: Any, timeout: float = 30.0) -> Any:
        try:
            reply = getattr(self.stub, method)(request, timeout=timeout)
        except grpc.RpcError as exc:
            self.count(exc.code().name)
            return None
        self.count("OK")
        return reply

    def count(self, code: str) -> None:
        with self._lock:
            self.codes[code] += 1

    def session(self, ttl: float = 60.0, name: str = "attacker") -> str:
        reply = self.call("OpenSession", pb.OpenSessionRequest(ttl_seconds=ttl, client_name=name))
        if reply is None:
            raise RuntimeError("the attacker could not open its session")
        self.sessions.append(reply.session_id)
        return reply.session_id

    def running(self) -> bool:
        return not self.stop.is_set()

    def close(self) -> None:
        for sid in self.sessions:
            with contextlib.suppress(grpc.RpcError):  # lapsed, or never fully opened
                self.stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=30)
        self.channel.close()


def _threads(ctx: Ctx, n: int, body: Callable[[], None]) -> None:
    """``body`` in a loop on ``n`` threads until stopped (armed at once)."""

    def loop() -> None:
        while ctx.running():
            body()

    workers = [threading.Thread(target=loop, daemon=True) for _ in range(n)]
    for w in workers:
        w.start()
    ctx.armed.set()
    for w in workers:
        w.join()


# ------------------------------------------------------------------ take everything


def pool_grab(ctx: Ctx) -> None:
    """Allocate slots until refused, hold them, and keep asking."""
    sid = ctx.session()
    while ctx.running():
        if ctx.call("Alloc", pb.AllocRequest(model=MODEL, num_slots=512, session_id=sid)) is None:
            ctx.armed.set()
            ctx.stop.wait(0.01)


def lock_everything(ctx: Ctx, shared: int = 256, unique: int = 256) -> None:
    """Cache prompts of its own and lock them, and lock the victim's cached prompts,
    until refused; then keep asking for more locks."""
    sid = ctx.session()
    i = 0
    while ctx.running():
        i += 1
        tokens = toks(list(range(7_000_000 + i * 512, 7_000_000 + i * 512 + 512)))
        m = ctx.call(
            "Match",
            pb.MatchRequest(
                model=MODEL, token_ids=tokens, lock=True, allocate=True, session_id=sid
            ),
        )
        if m is not None:
            ctx.call(
                "Insert",
                pb.InsertRequest(
                    model=MODEL,
                    token_ids=tokens,
                    slot_indices=m.allocated_slots,
                    lock=True,
                    session_id=sid,
                ),
            )
        mine = ctx.call(
            "Match",
            pb.MatchRequest(
                model=MODEL,
                token_ids=toks(victim_prompt(i % 32, shared, unique)),
                lock=True,
                session_id=sid,
            ),
        )
        if m is None or mine is None:
            ctx.armed.set()
            ctx.stop.wait(0.01)


def session_flood(ctx: Ctx) -> None:
    """Open sessions until refused (server.max_sessions), and keep trying."""
    while ctx.running():
        reply = ctx.call(
            "OpenSession", pb.OpenSessionRequest(ttl_seconds=60.0, client_name="flood")
        )
        if reply is None:
            ctx.armed.set()
            ctx.stop.wait(0.005)
        else:
            ctx.sessions.append(reply.session_id)


# ------------------------------------------------------------------ grow memory


def huge_extra_key(ctx: Ctx) -> None:
    """Matches whose extra_key is 50 MiB (``ctx.huge``)."""
    request = pb.MatchRequest(model=MODEL, token_ids=toks([1, 2, 3]), extra_key="k" * ctx.huge)
    _threads(ctx, 2, lambda: ctx.call("Match", request))


def huge_client_names(ctx: Ctx) -> None:
    """OpenSession with a 1 MiB client name."""
    request = pb.OpenSessionRequest(ttl_seconds=60.0, client_name="n" * (1 << 20))

    def body() -> None:
        reply = ctx.call("OpenSession", request)
        if reply is not None:
            ctx.sessions.append(reply.session_id)

    _threads(ctx, 2, body)


def half_sent_writekv(ctx: Ctx, streams: int = 16) -> None:
    """WriteKV streams that send a header and most of a row, then stall; more are
    opened as the server refuses or ends them."""
    sid = ctx.session()
    reply = ctx.call("Alloc", pb.AllocRequest(model=MODEL, num_slots=streams, session_id=sid))
    if reply is None:
        raise RuntimeError("the attacker could not allocate its slots")
    held = slots_of(reply.slot_indices)
    row = _row_bytes(ctx)

    async def one(i: int) -> None:
        async with noisy_auth.aio_channel(ctx.target, ctx.extras.get("token"), _BIG) as channel:
            stub = pb_grpc.PrefixCacheStub(channel)
            while ctx.running():
                call = stub.WriteKV()
                try:
                    await call.write(
                        pb.KVChunk(
                            header=pb.WriteKVHeader(
                                model=MODEL,
                                slot_indices=pack([int(held[i])]),
                                layers=[0],
                                session_id=sid,
                            )
                        )
                    )
                    # A refused header is answered at once; the data goes out after.
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(call), 0.05)
                    await call.write(
                        pb.KVChunk(
                            role=pb.BUFFER_ROLE_K, layer=0, offset_bytes=0, data=b"\0" * (row - 1)
                        )
                    )
                    await asyncio.wait_for(asyncio.shield(call), 0.5)
                    ctx.count("OK")
                except TimeoutError:  # the server waits for the rest: stalled
                    ctx.armed.set()
                    await asyncio.to_thread(ctx.stop.wait)
                    call.cancel()
                    return
                except (grpc.RpcError, asyncio.InvalidStateError):
                    # Refused, maybe while a write was still going out (which then
                    # fails on its own): the call's status says why.
                    ctx.count((await call.code()).name)
                    await asyncio.sleep(0.01)

    async def main() -> None:
        await asyncio.gather(*(one(i) for i in range(streams)))

    asyncio.run(main())


# ------------------------------------------------------------------ stall the loop


def max_size_match(ctx: Ctx) -> None:
    """Matches as large as a request may be (the pool size in tokens), never cached."""
    counter = iter(range(1 << 30))

    def body() -> None:
        base = 50_000_000 + next(counter) * ctx.pool_size
        request = pb.MatchRequest(
            model=MODEL, token_ids=toks(np.arange(base, base + ctx.pool_size))
        )
        ctx.call("Match", request)

    _threads(ctx, 2, body)


def readkv_amplification(ctx: Ctx) -> None:
    """ReadKV of one held slot named a million times (8 MB asking for GBs)."""
    sid = ctx.session()
    reply = ctx.call("Alloc", pb.AllocRequest(model=MODEL, num_slots=1, session_id=sid))
    if reply is None:
        raise RuntimeError("the attacker could not allocate its slot")
    request = pb.ReadKVRequest(
        model=MODEL, session_id=sid, slot_indices=reply.slot_indices * 1_000_000
    )
    _threads(ctx, 2, lambda: _drain(ctx, request))


def tiny_chunks(ctx: Ctx) -> None:
    """ReadKV of 256 held slots with max_chunk_bytes=1."""
    sid = ctx.session()
    reply = ctx.call("Alloc", pb.AllocRequest(model=MODEL, num_slots=256, session_id=sid))
    if reply is None:
        raise RuntimeError("the attacker could not allocate its slots")
    request = pb.ReadKVRequest(
        model=MODEL, session_id=sid, max_chunk_bytes=1, slot_indices=reply.slot_indices
    )
    _threads(ctx, 2, lambda: _drain(ctx, request))


def keepalive_storm(ctx: Ctx, concurrency: int = 64) -> None:
    """KeepAlive on one session from many concurrent calls, as fast as answered."""
    sid = ctx.session()

    async def main() -> None:
        async with noisy_auth.aio_channel(ctx.target, ctx.extras.get("token")) as channel:
            stub = pb_grpc.PrefixCacheStub(channel)
            request = pb.KeepAliveRequest(session_id=sid)

            async def loop() -> None:
                while ctx.running():
                    try:
                        await stub.KeepAlive(request, timeout=30)
                        ctx.count("OK")
                    except grpc.RpcError as exc:
                        ctx.count(exc.code().name)

            tasks = [asyncio.create_task(loop()) for _ in range(concurrency)]
            ctx.armed.set()
            await asyncio.to_thread(ctx.stop.wait)
            for task in tasks:  # paced calls may wait long: the attack is over
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


def explain_flood(ctx: Ctx, threads: int = 8) -> None:
    """Explain of a 1M-token prompt, never cached, without a session, on 8 threads."""
    request = pb.ExplainRequest(model=BIG, token_ids=toks(np.arange(1, BIG_TOKENS + 1)))
    _threads(ctx, threads, lambda: ctx.call("Explain", request, timeout=120))


def exists_pages_flood(ctx: Ctx, threads: int = 8) -> None:
    """ExistsPages of 1M random page hashes (32 MiB), 8 in parallel, with a session (the
    bench server wants one)."""
    sid = ctx.session()
    request = pb.ExistsPagesRequest(
        model=BIG, page_hashes=np.random.default_rng(1).bytes(32 * BIG_TOKENS), session_id=sid
    )
    _threads(ctx, threads, lambda: ctx.call("ExistsPages", request, timeout=120))


def resubscribe_storm(ctx: Ctx, threads: int = 8) -> None:
    """Subscribe and hang up at once, again and again, on 8 threads (of the model with a
    cached tree: each Subscribe asks for a snapshot)."""
    request = pb.SubscribeRequest(model=MODEL)

    def body() -> None:
        call = ctx.stub.Subscribe(request, timeout=30)
        try:
            next(call)
            ctx.count("OK")
        except grpc.RpcError as exc:
            ctx.count(exc.code().name)
        finally:
            call.cancel()

    _threads(ctx, threads, body)


def _drain(ctx: Ctx, request: pb.ReadKVRequest) -> None:
    try:
        for _ in ctx.stub.ReadKV(request, timeout=30):
            if not ctx.running():
                break
        ctx.count("OK")
    except grpc.RpcError as exc:
        ctx.count(exc.code().name)


def _row_bytes(ctx: Ctx) -> int:
    """Bytes of one K row of layer 0 of the model."""
    d = ctx.stub.DescribePool(pb.DescribePoolRequest(model=MODEL), timeout=10)
    return d.k_head_num * d.k_head_dim * (2 if d.dtype in ("float16", "bfloat16") else 4)


ATTACKS: dict[str, Callable[[Ctx], None]] = {
    "pool grab": pool_grab,
    "lock everything": lock_everything,
    "huge extra_key": huge_extra_key,
    "huge client names": huge_client_names,
    "max-size Match": max_size_match,
    "ReadKV amplification": readkv_amplification,
    "tiny chunks": tiny_chunks,
    "KeepAlive storm": keepalive_storm,
    "half-sent WriteKV": half_sent_writekv,
    "session flood": session_flood,
    **SURFACES,  # replay requests, Subscribe churn, page RPCs, tenant probes
    "Explain flood": explain_flood,
    "ExistsPages flood": exists_pages_flood,
    "resubscribe storm": resubscribe_storm,
}


def attacker(
    target: str,
    pool_size: int,
    huge: int,
    commands: Any,
    stop: Any,
    armed: Any,
    out: Any,
    extras: dict[str, Any] | None = None,
) -> None:
    """The attacker process: for each attack name on ``commands`` (None: done), run it
    until ``stop``, clean up, and put its counters (or its failure) on ``out``."""
    while (name := commands.get()) is not None:
        ctx = Ctx(target, pool_size, stop, armed, huge, extras)
        error = ""
        try:
            ATTACKS[name](ctx)
        except Exception as exc:  # reported in the table, not a crash of the bench
            error = f"{type(exc).__name__}: {exc}"
            armed.set()
        finally:
            started = time.monotonic()
            ctx.close()
            out.put(
                {"codes": dict(ctx.codes), "error": error, "cleanup_s": time.monotonic() - started}
            )
