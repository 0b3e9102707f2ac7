"""A storm of KeepAlives with made-up session ids.

Sessions' own KeepAlives were paced (test_keepalive_pacing.py), but ids that name no
session were answered NOT_FOUND as fast as the loop could go: a storm of them cost a
victim 271 ms at p99. Now every KeepAlive that renews no lease takes a slot of one
shared bucket (keepalive.Unleased), so the storm gets a few hundred answers a second,
and the victim's calls, its own KeepAlives included, go on.

The server and the storm are processes of their own; the victim is this test.
"""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest
from harness import SOURCE_PATH, pb, serve_process, stub_for, toks

from prefixcache.server.sessions import keepalive
from prefixcache.server.sessions.session import Session

CONFIG = """\
models:
  - name: m
    page_size: 1
    pool: {size: 4096, layers: 1, k_heads: 1, k_head_dim: 4}
"""
STORM_SECONDS = 3.0
# Made-up ids from many calls in flight, each loop sending the next as soon as the last
# is answered; prints how many were answered (NOT_FOUND) and any other code seen.
STORM = """\
import asyncio, secrets, sys, time
import grpc
from prefixcache.v1 import prefix_cache_pb2 as pb, prefix_cache_pb2_grpc as pb_grpc

async def main(address, seconds, loops):
    answered, odd = 0, set()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.PrefixCacheStub(channel)
        end = time.monotonic() + seconds
        async def loop():
            nonlocal answered
            while (left := end - time.monotonic()) > 0:
                try:
                    await stub.KeepAlive(pb.KeepAliveRequest(
                        session_id=secrets.token_hex(16)), timeout=max(left, 0.01))
                    odd.add("OK")
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.NOT_FOUND:
                        answered += 1
                    elif exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                        odd.add(exc.code().name)
        await asyncio.gather(*(loop() for _ in range(loops)))
    print(answered, *sorted(odd), flush=True)

asyncio.run(main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3])))
"""


def test_unleased_keepalives_share_one_paced_bucket() -> None:
    bucket = keepalive.Unleased(gap=0.01, burst=2)
    first = [keepalive.wait(None, 50.0, bucket) for _ in range(3)]
    assert first == [0.0, 0.0, 0.0]  # the burst
    assert round(keepalive.wait(None, 50.0, bucket), 6) == 0.01
    assert round(keepalive.wait(None, 50.0, bucket), 6) == 0.02
    keepalive.give_back(None, bucket)
    assert round(keepalive.wait(None, 50.0, bucket), 6) == 0.02
    assert keepalive.wait(None, 60.0, bucket) == 0.0  # a quiet bucket fills up again
    assert keepalive.wait(None, 1.0) == 0.0  # no bucket given: not paced
    # A storm far ahead in the bucket costs a session's own renewal nothing.
    for _ in range(100):
        keepalive.wait(None, 70.0, bucket)
    assert keepalive.wait(None, 70.0, bucket) > 0.5
    session = Session(id="x", tag=1, name="", ttl=5.0, expires_at=0.0)
    assert keepalive.wait(session, 70.0, bucket) == 0.0


@pytest.mark.slow
def test_a_storm_of_unknown_ids_is_paced_and_the_victim_goes_on(tmp_path) -> None:
    with serve_process(tmp_path, CONFIG) as (_proc, address):
        channel, stub = stub_for(address)
        with channel:
            sid = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=5.0)).session_id
            storm = subprocess.Popen(
                [sys.executable, "-c", STORM, address, str(STORM_SECONDS), "32"],
                env={"PYTHONPATH": SOURCE_PATH, "PATH": "/usr/bin:/bin"},
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                time.sleep(0.5)  # the storm is on
                # The victim's calls go on, each answered by its deadline (10 s, never
                # reached: the storm cannot take the loop from them); their times are
                # for the report only.
                took: list[float] = []
                unknown: list[str] = []
                start = time.monotonic()
                i = 0
                while time.monotonic() - start < STORM_SECONDS - 1.0:
                    i += 1
                    tokens = toks([i % 50, 7, 8, i % 13])
                    t0 = time.monotonic()
                    stub.Match(
                        pb.MatchRequest(model="m", token_ids=tokens, session_id=sid), timeout=10
                    )
                    took.append(time.monotonic() - t0)
                    if i % 10 == 0:  # a worker whose session is gone learns it in time
                        try:
                            stub.KeepAlive(pb.KeepAliveRequest(session_id="gone"), timeout=10)
                            unknown.append("OK")
                        except grpc.RpcError as exc:
                            unknown.append(exc.code().name)
                    time.sleep(0.01)
                # The victim's own KeepAlive, in the storm: renews its lease, and takes
                # no turn in the storm's bucket (as the test above shows of keepalive.wait).
                reply = stub.KeepAlive(pb.KeepAliveRequest(session_id=sid), timeout=10)
                out, _ = storm.communicate(timeout=30)
            finally:
                if storm.poll() is None:
                    storm.kill()
                    storm.wait()
            answered, *odd = out.split()
            # Paced: one answer per UNLEASED_GAP after the burst (about 200 a second),
            # with room for the victim's own; unpaced, the storm got thousands.
            bound = (STORM_SECONDS / keepalive.UNLEASED_GAP + keepalive.UNLEASED_BURST) * 1.2
            assert 50 <= int(answered) <= bound, (answered, bound)
            assert odd == [], odd
            took.sort()
            p99 = took[int(len(took) * 0.99) - 1]
            print(f"victim: {len(took)} Matches, worst {took[-1]:.3f} s, p99 {p99:.3f} s")
            assert len(took) > 20
            # NOT_FOUND, each within its deadline (DEADLINE_EXCEEDED otherwise).
            assert unknown and set(unknown) == {"NOT_FOUND"}, unknown
            assert reply.ttl_seconds == 5.0
            # The victim's session held throughout.
            assert stub.KeepAlive(pb.KeepAliveRequest(session_id=sid)).ttl_seconds == 5.0
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
