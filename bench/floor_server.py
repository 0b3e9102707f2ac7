"""The protobuf floor: the service's own gRPC interface with handlers that do no cache work.

`grpc_replay.py` runs the service's client loop against it, so the only difference from
``prefixcache serve`` is the cache: the same ``grpc.aio`` server options, the generated
protobuf messages and stubs, the same request and reply sizes (a Match reply carries
8 bytes of slots per token, an Insert reply a few fields), the same unary calls and the
same ``Session`` stream with one ``SessionResponse`` per request. What the floor costs
above ``echo_server.py`` (raw bytes, no protobuf) is what gRPC's typed handlers and
protobuf cost; what the service costs above the floor is the cache and its checks.

    python bench/floor_server.py unix:/tmp/floor.sock
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == _REPO / "bench":
    sys.path[0] = str(_REPO)  # bench/trace.py would shadow the stdlib `trace` module
sys.path += [p for p in map(str, (_REPO, _REPO / "server", _REPO / "client")) if p not in sys.path]

from bench.echo_server import run, serve_until_stopped  # noqa: E402
from prefixcache.v1 import prefix_cache_pb2 as pb  # noqa: E402
from prefixcache.v1 import prefix_cache_pb2_grpc as pb_grpc  # noqa: E402

_SLOT_BYTES = 8
_TOKEN_BYTES = 4


class FloorServicer(pb_grpc.PrefixCacheServicer):
    """Answers the calls of grpc_replay's service loop with replies of the service's
    sizes: every Match misses and gets a slot per token, every Insert caches it all."""

    def __init__(self) -> None:
        self._zeros = bytes(1 << 20)
        self._ops = {
            "match": self._match,
            "insert": self._insert,
            "stats": self._stats,
            "free": self._empty(pb.FreeResponse),
            "unlock": self._empty(pb.UnlockResponse),
        }

    def _slots(self, tokens: int) -> bytes:
        size = tokens * _SLOT_BYTES
        if size > len(self._zeros):
            self._zeros = bytes(max(size, 2 * len(self._zeros)))
        return self._zeros[:size]

    def _match(self, req: pb.MatchRequest) -> pb.MatchResponse:
        tokens = len(req.token_ids) // _TOKEN_BYTES
        return pb.MatchResponse(
            lock_id=1, node_id=1, allocated_slots=self._slots(tokens), server_epoch=1
        )

    def _insert(self, req: pb.InsertRequest) -> pb.InsertResponse:
        tokens = len(req.token_ids) // _TOKEN_BYTES
        return pb.InsertResponse(cached_len=tokens, node_id=1, server_epoch=1)

    def _stats(self, req: pb.StatsRequest) -> pb.StatsResponse:
        return pb.StatsResponse(server_epoch=1)

    @staticmethod
    def _empty(cls: Any) -> Any:
        return lambda req: cls()

    async def OpenSession(self, request: Any, context: Any) -> pb.OpenSessionResponse:
        return pb.OpenSessionResponse(session_id="floor", ttl_seconds=600.0, server_epoch=1)

    async def CloseSession(self, request: Any, context: Any) -> pb.CloseSessionResponse:
        return pb.CloseSessionResponse()

    async def Stats(self, request: Any, context: Any) -> pb.StatsResponse:
        return self._stats(request)

    async def Match(self, request: Any, context: Any) -> pb.MatchResponse:
        return self._match(request)

    async def Insert(self, request: Any, context: Any) -> pb.InsertResponse:
        return self._insert(request)

    async def Free(self, request: Any, context: Any) -> pb.FreeResponse:
        return pb.FreeResponse()

    async def Unlock(self, request: Any, context: Any) -> pb.UnlockResponse:
        return pb.UnlockResponse()

    async def Session(
        self, request_iterator: AsyncIterator[pb.SessionRequest], context: Any
    ) -> AsyncIterator[pb.SessionResponse]:
        async for request in request_iterator:
            op = request.WhichOneof("op")
            response = pb.SessionResponse(seq=request.seq)
            getattr(response, op).CopyFrom(self._ops[op](getattr(request, op)))
            yield response


async def serve(address: str) -> None:
    await serve_until_stopped(
        address, lambda server: pb_grpc.add_PrefixCacheServicer_to_server(FloorServicer(), server)
    )


def main(argv: list[str] | None = None) -> int:
    return run(serve, argv, "floor_server.py")


if __name__ == "__main__":
    sys.exit(main())
