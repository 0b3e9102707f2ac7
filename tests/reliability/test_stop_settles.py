"""A stop whose grace period cuts open calls must not end like a crash.

grpc's stop returns once its core has cancelled the calls still open, before each
call's own task has run that cancellation (it learns of it through grpc's poller
thread, later under load). `serve` ends its event loop soon after the stop, and
asyncio then cancelled those tasks a second time, inside grpc's code, which printed
"Exception not handled by _handle_exceptions" with a CancelledError traceback per
call: a CI run's SIGTERM test failed on it. The stop now lets them finish first: when
it returns, no task it did not start is left for the loop's end to cancel.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from pathlib import Path
from typing import Any

import grpc
from harness import make_config

from prefixcache.server.app import PrefixCacheServer
from prefixcache.v1 import prefix_cache_pb2 as pb
from prefixcache.v1 import prefix_cache_pb2_grpc as pb_grpc

STREAMS = 4


def _hold_stream(address: str, opened: threading.Semaphore, ended: list[Any]) -> None:
    """One Session stream that sends one op and then stays open until the server cuts it
    (a client of its own, off the server's loop, as in production)."""
    requests: queue.Queue[Any] = queue.Queue()
    with grpc.insecure_channel(address) as channel:
        stream = pb_grpc.PrefixCacheStub(channel).Session(iter(requests.get, None), timeout=30)
        requests.put(pb.SessionRequest(seq=1, stats=pb.StatsRequest(model="m")))
        next(stream)
        opened.release()
        try:
            next(stream)
        except grpc.RpcError as exc:
            ended.append(exc.code())
        finally:
            requests.put(None)


async def _stop_with_open_streams(tmp: Path) -> tuple[list[asyncio.Task[Any]], list[Any]]:
    server = PrefixCacheServer(make_config(tmp))
    await server.start()
    opened, ended = threading.Semaphore(0), []
    clients = [
        threading.Thread(target=_hold_stream, args=(server.address, opened, ended))
        for _ in range(STREAMS)
    ]
    for client in clients:
        client.start()
    for _ in clients:
        while not opened.acquire(blocking=False):
            await asyncio.sleep(0.01)
    await server.stop(grace=0.05)  # shorter than any stream: the stop cuts them all
    left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for client in clients:
        await asyncio.to_thread(client.join, 10)
    return left, ended


def test_a_stop_leaves_no_call_for_the_loop_to_cancel(tmp_path: Path) -> None:
    left, ended = asyncio.run(_stop_with_open_streams(tmp_path))
    assert not left, f"still running when stop returned: {left}"
    assert len(ended) == STREAMS and set(ended) <= {
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNAVAILABLE,
    }, ended
