"""How the servicer is registered: request parsers that never raise.

grpc answers UNKNOWN (or INTERNAL) when its own deserializer raises, so a client that
sends bytes that are not a message would get an undocumented code. These parsers hand
a ``Malformed`` marker to the handler instead, which answers INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from prefixcache.cache import InvalidInputError
from prefixcache.v1 import prefix_cache_pb2 as pb


class Malformed:
    """A request whose bytes do not parse as its message: INVALID_ARGUMENT, not the
    UNKNOWN (or INTERNAL) that grpc answers when its own deserializer raises."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _lenient(cls: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except DecodeError as exc:
            return Malformed(f"malformed request bytes: {exc}")
    return parse


def parsed(request: Any) -> Any:
    """``request``, or INVALID_ARGUMENT if its bytes did not parse."""
    if isinstance(request, Malformed):
        raise InvalidInputError(request.error)
    return request


def add_to_server(servicer: Any, server: Any) -> None:
    """Register ``servicer`` like the generated ``add_PrefixCacheServicer_to_server``,
    but with request parsers that hand a ``Malformed`` marker to the handler instead of
    raising, so that bytes that are not a message get INVALID_ARGUMENT."""
    service = pb.DESCRIPTOR.services_by_name["PrefixCache"]
    kinds = {(False, False): grpc.unary_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}
    handlers = {}
    for method in service.methods:
        kind = kinds[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = kind(
            getattr(servicer, method.name),
            request_deserializer=_lenient(getattr(pb, method.input_type.name)),
            response_serializer=getattr(pb, method.output_type.name).SerializeToString)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),))
