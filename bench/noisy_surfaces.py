"""The attacks on the event and page surfaces, for the noisy-neighbour bench: KV-event
replay requests, Subscribe churn, the page RPCs, and a tenant's token.

Each is an attack of noisy_attacks.py (see there: a ``Ctx``, armed, pressing until
stopped, then handing back what it holds). The bench server (noisy_neighbour.py) runs
with KV events (a replay socket), a change log, a tenant and an evict cap, so that
each surface is there to attack.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import grpc

from bench import noisy_auth
from prefixcache.v1 import prefix_cache_pb2 as pb

MODEL = "m"
# A client that reads only what it asks for (no flow-control window growth), so that a
# subscriber that stops reading stalls the server's writes after ~100 KiB.
STINGY = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 65536)]
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def replay_requests(ctx: Any, peers: int = 24, lazy: int = 8) -> None:
    """KV-event replay requests from many peers (ZMQ DEALERs), each for seq 0 (older
    than the buffer: a snapshot), asked again as soon as answered or refused; ``lazy``
    more peers ask once and never read; a malformed request every poll."""
    import zmq

    endpoint = ctx.extras.get("replay")
    if not endpoint:
        raise RuntimeError("the bench server has no kv_events.replay_endpoint")
    zctx = zmq.Context()
    socks = []
    try:
        for i in range(peers + lazy):
            sock = zctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if i >= peers:
                sock.setsockopt(zmq.RCVHWM, 1)
            sock.connect(endpoint)
            socks.append(sock)
        start = (0).to_bytes(8, "big")
        for sock in socks:
            sock.send_multipart([b"", start])
        poller = zmq.Poller()
        for sock in socks[:peers]:
            poller.register(sock, zmq.POLLIN)
        ctx.armed.set()
        last_malformed = 0.0
        while ctx.running():
            for sock, _ in poller.poll(50):
                frames = sock.recv_multipart()
                if len(frames) >= 3 and frames[1] == END_SEQ:
                    ctx.count("busy" if frames[2] == b"busy" else "replayed")
                    sock.send_multipart([b"", start])
            if time.monotonic() - last_malformed > 0.01:  # 100 a second
                socks[0].send_multipart([b"not a seq"])
                ctx.count("malformed sent")
                last_malformed = time.monotonic()
    finally:
        for sock in socks:
            sock.close(0)
        zctx.term()


def subscribe_churn(ctx: Any, readers: int = 6, idle: int = 10) -> None:
    """Subscribe, read the snapshot, hang up, again, on ``readers`` threads; and ``idle``
    subscribers (of the attacker's session: more than max_session_subscribes) that
    never read, opened again as the server refuses or drops them."""
    sid = ctx.session()
    channel = noisy_auth.channel(ctx.target, ctx.extras.get("token"), options=STINGY)
    stub_idle = _stub(channel)
    held: list[Any] = []

    def churn() -> None:
        call = ctx.stub.Subscribe(pb.SubscribeRequest(model=MODEL), timeout=30)
        try:
            for event in call:
                if event.HasField("snapshot_end"):
                    break
            ctx.count("OK")
        except grpc.RpcError as exc:
            ctx.count(exc.code().name)
            ctx.stop.wait(0.01)
        finally:
            call.cancel()

    def never_read() -> None:
        while ctx.running():
            for call in held:
                if not call.is_active():  # refused (over the session's cap) or dropped
                    ctx.count(call.code().name)
            held[:] = [c for c in held if c.is_active()]
            while len(held) < idle:
                held.append(
                    stub_idle.Subscribe(
                        pb.SubscribeRequest(model=MODEL, session_id=sid), timeout=600
                    )
                )
                ctx.count("idle stream")
            ctx.stop.wait(0.05)

    keeper = threading.Thread(target=never_read, daemon=True)
    keeper.start()
    try:
        _threads(ctx, readers, churn)
    finally:
        keeper.join()
        for call in held:
            if not call.is_active():
                ctx.count(call.code().name)
            call.cancel()
        channel.close()


def page_rpcs(ctx: Any) -> None:
    """ExistsPages of as many page hashes as a call may name, with the attacker's session
    and without one (refused where quotas are on), and GetPages of random chains."""
    sid = ctx.session()
    count = min(ctx.pool_size, 1 << 20)  # page size 1: one page per token
    hashes = os.urandom(32 * count)
    exists = pb.ExistsPagesRequest(model=MODEL, page_hashes=hashes, session_id=sid)
    anonymous = pb.ExistsPagesRequest(model=MODEL, page_hashes=hashes[: 32 * 1024])
    get = pb.GetPagesRequest(model=MODEL, page_hashes=hashes, session_id=sid)

    def body() -> None:
        ctx.call("ExistsPages", exists)
        ctx.call("ExistsPages", anonymous)
        reply = ctx.call("GetPages", get)
        for lock_id in reply.lock_ids if reply is not None else ():
            ctx.call("Unlock", pb.UnlockRequest(lock_id=lock_id, session_id=sid))

    _threads(ctx, 4, body)


def tenant_probes(ctx: Any) -> None:
    """A tenant's token: Lock probes of guessed node ids, Matches outside its namespace
    (the victim's), small Evicts as fast as answered, and Stats."""
    token = ctx.extras.get("tenant_token")
    if not token:
        raise RuntimeError("the bench server has no tenant")
    metadata = (("authorization", f"Bearer {token}"),)
    reply = ctx.stub.OpenSession(
        pb.OpenSessionRequest(ttl_seconds=60, client_name="tenant"), metadata=metadata, timeout=30
    )
    ctx.sessions.append(reply.session_id)
    sid = reply.session_id
    counter = iter(range(1 << 62))

    def call(method: str, request: Any) -> None:
        try:
            getattr(ctx.stub, method)(request, metadata=metadata, timeout=30)
            ctx.count("OK")
        except grpc.RpcError as exc:
            ctx.count(exc.code().name)

    def body() -> None:
        n = next(counter)
        call("Lock", pb.LockRequest(model=MODEL, node_id=n % 4096 + 1, session_id=sid))
        call("Match", pb.MatchRequest(model=MODEL, token_ids=_toks(range(1, 257))))
        call(
            "Match",
            pb.MatchRequest(
                model=MODEL,
                token_ids=_toks(range(n, n + 64)),
                extra_key="t1/own",
                lock=True,
                allocate=True,
                session_id=sid,
            ),
        )
        call("Evict", pb.EvictRequest(model=MODEL, num_tokens=64, session_id=sid))
        call("Stats", pb.StatsRequest(model=MODEL))

    _threads(ctx, 4, body)


def _threads(ctx: Any, n: int, body: Any) -> None:
    from bench.noisy_attacks import _threads as run  # noisy_attacks imports this module

    run(ctx, n, body)


def _stub(channel: grpc.Channel) -> Any:
    from prefixcache.v1 import prefix_cache_pb2_grpc as pb_grpc

    return pb_grpc.PrefixCacheStub(channel)


def _toks(ids: Any) -> bytes:
    import numpy as np

    return np.asarray(list(ids), dtype="<u4").tobytes()


SURFACES = {
    "replay requests": replay_requests,
    "Subscribe churn": subscribe_churn,
    "page RPCs": page_rpcs,
    "tenant probes": tenant_probes,
}
