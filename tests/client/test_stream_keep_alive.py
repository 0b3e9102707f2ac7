"""The async Session stream keeps itself alive while idle.

The service ends a stream that sends nothing for ``stream_ttl``. An idle worker's
stream used to lapse, losing its locks and slots; the stream session now sends
``keep_alive`` when it opens (learning the TTL) and whenever it has been silent for a
third of the TTL.
"""

from __future__ import annotations

import asyncio

import pytest
from harness import SMALL_POOL, pb, running, stub_for

from prefixcache.client import AsyncPrefixCacheClient, Unavailable
from prefixcache.server.config import ModelConfig

MODELS = (ModelConfig(name="m", page_size=1, pool=SMALL_POOL),)
TTL = 1.0


@pytest.fixture(scope="module")
def short_ttl_server(tmp_path_factory: pytest.TempPathFactory):
    with running(tmp_path_factory.mktemp("stream-ttl"), MODELS, stream_ttl=TTL) as srv:
        yield srv


async def _idle(address: str, keep_alive: bool, seconds: float) -> tuple[float | None, int]:
    """Open a stream, take 3 slots, stay silent ``seconds``, then ask for Stats; the
    TTL it learnt and the session slots the model counts at the end."""
    async with (
        AsyncPrefixCacheClient(address, timeout=5.0) as client,
        client.stream_session(keep_alive=keep_alive) as stream,
    ):
        await stream.alloc("m", 3)
        await asyncio.sleep(seconds)
        try:
            stats = await stream.stats("m")
        except Unavailable:
            return stream.stream_ttl, -1
        return stream.stream_ttl, stats.models[0].session_slots


def test_an_idle_stream_survives_several_ttls(short_ttl_server) -> None:
    ttl, held = asyncio.run(_idle(short_ttl_server.address, True, 3.5 * TTL))
    assert ttl == TTL  # told by the service in its first reply
    assert held == 3
    short_ttl_server.check_integrity()


def test_without_keep_alive_the_idle_stream_lapses(short_ttl_server) -> None:
    """The control: the same idle stream, keep_alive off, is ended by the service."""
    ttl, held = asyncio.run(_idle(short_ttl_server.address, False, 2.5 * TTL))
    assert (ttl, held) == (None, -1)


def test_the_keep_alive_op_answers_the_stream_ttl(short_ttl_server) -> None:
    channel, stub = stub_for(short_ttl_server.address)
    with channel:
        replies = stub.Session(
            iter(
                [
                    pb.SessionRequest(
                        seq=7,
                        keep_alive=pb.KeepAliveRequest(server_epoch=short_ttl_server.service.epoch),
                    )
                ]
            ),
            timeout=10,
        )
        (reply,) = list(replies)
        assert reply.seq == 7 and reply.keep_alive.ttl_seconds == TTL
