"""The gRPC floor under ReadKV: a grpc.aio server streaming pre-built byte messages
(no protobuf, no pool, no checks) to a sync client, as fast as Python gRPC allows.
`kv_bandwidth.py --grpc-floor` reports it beside ReadKV (what bounds ReadKV).

    python bench/grpc_stream_floor.py unix:/tmp/floor.sock   # serve
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

import grpc

METHOD = "/floor.Floor/Stream"


async def _serve(target: str) -> None:
    async def stream(request: bytes, context: object) -> AsyncIterator[bytes]:
        total, chunk = (int(x) for x in request.decode().split(","))
        payload = bytes(chunk)
        sent = 0
        while sent < total:
            n = min(chunk, total - sent)
            yield payload if n == chunk else payload[:n]
            sent += n

    limit = 64 * 1024 * 1024
    server = grpc.aio.server(
        options=[
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
        ]
    )
    handler = grpc.method_handlers_generic_handler(
        "floor.Floor", {"Stream": grpc.unary_stream_rpc_method_handler(stream)}
    )
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(target)
    await server.start()
    await server.wait_for_termination()


def reader(target: str) -> tuple[grpc.Channel, object]:
    """A channel and a callable: ``call(total, chunk)`` reads ``total`` bytes in messages
    of ``chunk`` into one reused buffer."""
    limit = 64 * 1024 * 1024
    channel = grpc.insecure_channel(
        target,
        options=[
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
        ],
    )
    stream = channel.unary_stream(METHOD)
    sink: dict[int, memoryview] = {}

    def call(total: int, chunk: int) -> None:
        buf = sink.get(total)
        if buf is None:
            buf = sink[total] = memoryview(bytearray(total))
        got = 0
        for message in stream(f"{total},{chunk}".encode()):
            buf[got : got + len(message)] = message
            got += len(message)
        if got != total:
            raise RuntimeError(f"floor stream ended at {got} of {total} bytes")

    return channel, call


if __name__ == "__main__":
    asyncio.run(_serve(sys.argv[1]))
