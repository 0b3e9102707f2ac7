"""Long calls (Explain, ExistsPages) take turns (access/turns.py): one slice at a time,
round the clients, at most PER_CLIENT admitted per client.

First the turns themselves on a real event loop (the order slices run in), then against
a real server: other calls are answered while a long call waits for its turn or runs,
and a client over its admitted calls is refused RESOURCE_EXHAUSTED with nothing counted
or changed. Behaviour, not timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time

import grpc
import pytest
from harness import SOURCE_PATH, pb, running, stub_for, toks

from prefixcache.server.access.turns import PER_CLIENT, Turns
from prefixcache.server.config import ModelConfig, PoolConfig
from prefixcache.server.errors import OverLimitError

CODE = grpc.StatusCode


def _run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


def test_slices_go_round_the_clients() -> None:
    async def main() -> list[str]:
        turns, order = Turns(), []

        async def call(client: str, slices: int) -> None:
            async with turns.admit(client) as turn:
                for i in range(slices):
                    order.append(f"{client}{i} asks")
                    await turn.next()
                    order.append(f"{client}{i}")
                    await asyncio.sleep(0)  # another call's work between two slices

        flood = [asyncio.create_task(call("a", 3)) for _ in range(3)]
        await asyncio.sleep(0)
        small = asyncio.create_task(call("b", 1))
        await asyncio.gather(*flood, small)
        return order

    order = _run(main())
    ran = [o for o in order if not o.endswith("asks")]
    assert len(ran) == 10 and ran.count("a0") == 3
    # b's one slice waits for at most the one of a's that runs when it asks, not for
    # the eight more its flood has waiting.
    between = order[order.index("b0 asks") : order.index("b0")]
    assert len([o for o in between if not o.endswith("asks")]) <= 1, order


def test_a_client_over_its_calls_is_refused_and_cancelled_waiters_let_go() -> None:
    async def main() -> None:
        turns = Turns()
        async with contextlib.AsyncExitStack() as stack:
            held = [await stack.enter_async_context(turns.admit("a")) for _ in range(PER_CLIENT)]
            with pytest.raises(OverLimitError, match="long calls"):
                async with turns.admit("a"):
                    pass
            async with turns.admit("b") as other:  # another client is not refused
                await other.next()
            await held[0].next()  # a holds the turn
            waiter = asyncio.create_task(held[1].next())
            await asyncio.sleep(0.01)
            assert not waiter.done() and turns.waiting() == 1
            waiter.cancel()  # a call gone while it waits for its turn
            with contextlib.suppress(asyncio.CancelledError):
                await waiter
            assert turns.waiting() == 0
        assert turns.admitted == {} and turns.refused == 1
        async with turns.admit("a") as turn:  # nothing left held
            await turn.next()

    _run(main())


# ExistsPages of every page a 1M-token prompt may have, from a process of its own.
EXISTS = """
import os, sys, grpc
from prefixcache.v1 import prefix_cache_pb2 as pb, prefix_cache_pb2_grpc as pb_grpc
options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
stub = pb_grpc.PrefixCacheStub(grpc.insecure_channel(sys.argv[1], options=options))
reply = stub.ExistsPages(pb.ExistsPagesRequest(model="m", page_hashes=os.urandom(
    32 * int(sys.argv[2]))), timeout=120)
print(len(reply.present))
"""
PAGES = 1 << 18


def _me() -> str:
    return f"unix:uid={os.geteuid()},pid={os.getpid()}"


def test_other_calls_are_answered_while_a_long_call_waits_and_runs(tmp_path) -> None:
    models = (
        ModelConfig(
            name="m", page_size=1, pool=PoolConfig(size=4096, layers=1, k_heads=1, k_head_dim=4)
        ),
    )
    with running(tmp_path, models, max_request_tokens=PAGES) as srv:
        turns = srv.server.servicer.turns

        def until(what, why: str) -> None:
            deadline = time.monotonic() + 60
            while not srv.run(what):
                assert time.monotonic() < deadline, why
                time.sleep(0.01)

        # A slice of another client's holds the turn.
        holder = srv.call(_hold(turns, "another"))
        flood = subprocess.Popen(
            [sys.executable, "-c", EXISTS, srv.address, str(PAGES)],
            env={**os.environ, "PYTHONPATH": SOURCE_PATH},
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            until(lambda: turns.waiting() == 1, "the flood's call to wait for its turn")
            channel, stub = stub_for(srv.address)
            with channel:
                for _ in range(3):  # answered while it waits
                    stub.Stats(pb.StatsRequest(model="m"), timeout=10)
                assert srv.run(turns.waiting) == 1
                # The other client's next slice asks while its first still holds the
                # turn; the turn then goes round: one slice of the flood, then the other
                # client's, while the flood's next slice waits. (Asked after the flood
                # ran a few, it could come after the flood's last one.)
                queued = asyncio.run_coroutine_threadsafe(_hold(turns, "another"), srv.loop)
                until(lambda: turns.waiting() == 2, "the other client's next slice to ask")
                granted = srv.run(lambda: turns.granted)
                srv.call(_let_go(holder))
                holder = queued.result(timeout=60)
                assert srv.run(lambda: turns.granted) == granted + 2
                assert srv.run(turns.waiting) == 1  # the flood's next slice
                for _ in range(3):
                    stub.Stats(pb.StatsRequest(model="m"), timeout=10)
                assert flood.poll() is None and srv.run(turns.waiting) == 1
                srv.call(_let_go(holder))
            assert int(flood.communicate(timeout=60)[0]) == PAGES
            assert srv.run(lambda: dict(turns.admitted)) == {}
        finally:
            if flood.poll() is None:
                flood.kill()


def test_a_client_over_its_long_calls_is_refused_and_changes_nothing(tmp_path) -> None:
    with running(tmp_path) as srv:
        turns = srv.server.servicer.turns
        channel, stub = stub_for(srv.address)
        with channel:
            sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
            explain = pb.ExplainRequest(model="m", token_ids=toks(range(1, 65)))
            exists = pb.ExistsPagesRequest(model="m", page_hashes=b"\1" * 64, session_id=sid)
            before = stub.Stats(pb.StatsRequest(model="m")).models[0]
            held = [srv.call(_hold(turns, _me(), take=False)) for _ in range(PER_CLIENT)]
            for method, request in (("Explain", explain), ("ExistsPages", exists)):
                with pytest.raises(grpc.RpcError) as err:
                    getattr(stub, method)(request, timeout=10)
                assert err.value.code() == CODE.RESOURCE_EXHAUSTED
                assert "long calls" in err.value.details()
            after = stub.Stats(pb.StatsRequest(model="m")).models[0]
            assert after == before  # nothing looked up, counted or held
            for h in held:
                srv.call(_let_go(h))
            assert stub.Explain(explain, timeout=10).num_tokens == 64
            assert stub.ExistsPages(exists, timeout=10).present == b"\0\0"
        srv.check_integrity()


async def _hold(turns: Turns, client: str, take: bool = True) -> contextlib.AsyncExitStack:
    """A call of ``client`` admitted (and holding the turn, with ``take``) until
    ``_let_go``."""
    stack = contextlib.AsyncExitStack()
    turn = await stack.enter_async_context(turns.admit(client))
    if take:
        await turn.next()
    return stack


async def _let_go(stack: contextlib.AsyncExitStack) -> None:
    await stack.aclose()
