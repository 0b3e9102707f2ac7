"""A bare gRPC echo server, the baseline that `grpc_replay.py` compares the service with.

It is the same kind of server as the service (one ``grpc.aio`` server, one event loop,
the same message-size options, a unix socket) with nothing behind it: a generic handler
whose messages are raw bytes (identity serializers), so no protobuf work either.

A request is a 4-byte little-endian length ``k`` followed by any payload; the reply is
``k`` zero bytes. That lets one echo call have the request and response sizes of one
service call (a Match sends 4 bytes per token and gets 8 back; an Insert sends 12 and
gets almost nothing back), so the comparison is per RPC of the same shape.

    python bench/echo_server.py unix:/tmp/echo.sock
"""

from __future__ import annotations

import asyncio
import signal
import struct
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

SERVICE = "bench.Echo"
UNARY = f"/{SERVICE}/Unary"
STREAM = f"/{SERVICE}/Stream"
MAX_MESSAGE = 64 * 1024 * 1024  # as the service's default max_message_bytes
_HEADER = struct.Struct("<I")


def request(reply_bytes: int, payload_bytes: int) -> bytes:
    """An echo request of ``4 + payload_bytes`` bytes asking for ``reply_bytes`` back."""
    return _HEADER.pack(reply_bytes) + bytes(payload_bytes)


class _Replies:
    """Reply bytes by length; a reply is a slice of one zero buffer."""

    def __init__(self) -> None:
        self._zeros = bytes(1 << 20)

    def __call__(self, req: bytes) -> bytes:
        (k,) = _HEADER.unpack_from(req)
        if k > len(self._zeros):
            self._zeros = bytes(max(k, 2 * len(self._zeros)))
        return self._zeros[:k]


async def serve(address: str) -> None:
    reply = _Replies()

    async def unary(req: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return reply(req)

    async def stream(
        requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        async for req in requests:
            yield reply(req)

    await serve_until_stopped(
        address,
        lambda server: server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    SERVICE,
                    {
                        "Unary": grpc.unary_unary_rpc_method_handler(unary),
                        "Stream": grpc.stream_stream_rpc_method_handler(stream),
                    },
                ),
            )
        ),
    )


async def serve_until_stopped(address: str, register: Callable[[Any], None]) -> None:
    """A ``grpc.aio`` server with the service's message-size options on ``address``,
    its handlers added by ``register``, until SIGTERM or SIGINT (the bench's servers
    share this, so they differ only in their handlers)."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.so_reuseport", 0),
        ]
    )
    register(server)
    server.add_insecure_port(address)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)


def run(serve_at: Callable[[str], Any], argv: list[str] | None, name: str) -> int:
    """The command line of a bench server: one ADDRESS argument."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(f"usage: {name} ADDRESS (unix:PATH or HOST:PORT)", file=sys.stderr)
        return 2
    asyncio.run(serve_at(args[0]))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(serve, argv, "echo_server.py")


if __name__ == "__main__":
    sys.exit(main())
