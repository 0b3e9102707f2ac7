"""How the servicer is registered: request parsers that never raise.

grpc answers UNKNOWN (or INTERNAL) when its own deserializer raises, so a client that
sends bytes that are not a message would get an undocumented code. These parsers hand
a ``Refused`` marker to the handler instead, which answers INVALID_ARGUMENT. They also
check the size limits of string fields (``limits.check_fields``), so an oversized
``extra_key``, ``client_name`` or ``session_id`` is refused as it is decoded, before
any handler looks at it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from prefixcache.cache import InvalidInputError
from prefixcache.v1 import prefix_cache_pb2 as pb

from .errors import TooLargeError
from .limits import Limits, check_fields


class Refused:
    """A request refused as it was decoded: bytes that do not parse as its message, or
    a field over its size limit. The handler raises ``error``; ``seq`` is the Session
    stream request's, so that its error reply still pairs with it."""

    __slots__ = ("error", "seq")

    def __init__(self, error: Exception, seq: int = 0) -> None:
        self.error = error
        self.seq = seq


def _lenient(cls: Any, limits: Limits | None) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            message = cls.FromString(data)
        except DecodeError as exc:
            return Refused(InvalidInputError(f"malformed request bytes: {exc}"))
        if limits is not None:
            try:
                check_fields(message, limits)
            except TooLargeError as exc:
                return Refused(exc, getattr(message, "seq", 0))
        return message
    return parse


def parsed(request: Any) -> Any:
    """``request``, or its refusal raised (INVALID_ARGUMENT for bytes that did not parse,
    TooLargeError for a field over its limit)."""
    if isinstance(request, Refused):
        raise request.error
    return request


def add_to_server(servicer: Any, server: Any, limits: Limits | None = None) -> None:
    """Register ``servicer`` like the generated ``add_PrefixCacheServicer_to_server``,
    but with request parsers that hand a ``Refused`` marker to the handler instead of
    raising, so that bytes that are not a message get INVALID_ARGUMENT, and that refuse
    string fields over ``limits`` (None: unchecked)."""
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
            request_deserializer=_lenient(getattr(pb, method.input_type.name), limits),
            response_serializer=getattr(pb, method.output_type.name).SerializeToString)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),))
