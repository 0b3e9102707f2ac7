"""How the servicer is registered: request parsers that never raise.

grpc answers UNKNOWN (or INTERNAL) when its own deserializer raises, so a client that
sends bytes that are not a message would get an undocumented code. These parsers hand
a ``Refused`` marker to the handler instead, which answers INVALID_ARGUMENT. They also
check the size limits of string fields (``limits.check_fields``), so an oversized
``extra_key``, ``client_name`` or ``session_id`` is refused as it is decoded, before
any handler looks at it; and, before that, the request's byte count against its type's
cap (request_caps.py), so an oversized request is refused without being parsed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from prefixcache.cache import InvalidInputError
from prefixcache.v1 import prefix_cache_pb2 as pb

from ..access.limits import Limits, check_fields
from ..config import ModelConfig
from ..errors import LimitError, TooLargeError
from . import request_caps
from .kv_wire import parse_data_chunk


class Refused:
    """A request refused as it was decoded: bytes that do not parse as its message, or
    a field over its size limit. The handler raises ``error``; ``seq`` is the Session
    stream request's, so that its error reply still pairs with it."""

    __slots__ = ("error", "seq")

    def __init__(self, error: Exception, seq: int = 0) -> None:
        self.error = error
        self.seq = seq


def _lenient(
    cls: Any, limits: Limits | None, caps: dict[str, int] | None = None
) -> Callable[[bytes], Any]:
    session = cls.DESCRIPTOR.name == "SessionRequest"
    chunk = cls is pb.KVChunk
    cap = None if caps is None else caps.get(cls.DESCRIPTOR.name)

    def parse(data: bytes) -> Any:
        # Sized before parsing: parsing is what an oversized request costs the loop.
        if caps is not None and limits is not None:
            size_cap, seq = request_caps.session_op_cap(caps, data) if session else (cap, 0)
            try:
                request_caps.check(cls, data, size_cap, limits)
            except LimitError as exc:
                return Refused(exc, seq)
        if chunk:  # WriteKV's data chunks: their bytes stay a view of the message
            raw = parse_data_chunk(data)
            if raw is not None:
                return raw
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


def _chunks(reply: Any) -> bytes:
    """ReadKV's replies: serialized already (kv_transfer.encode_chunk: the rows copied
    once, into the message), or a KVChunk."""
    return reply if isinstance(reply, bytes) else reply.SerializeToString()


def parsed(request: Any) -> Any:
    """``request``, or its refusal raised (INVALID_ARGUMENT for bytes that did not parse,
    TooLargeError for a field over its limit)."""
    if isinstance(request, Refused):
        raise request.error
    return request


def add_to_server(
    servicer: Any, server: Any, limits: Limits | None = None, models: Sequence[ModelConfig] = ()
) -> None:
    """Register ``servicer`` like the generated ``add_PrefixCacheServicer_to_server``,
    but with request parsers that hand a ``Refused`` marker to the handler instead of
    raising, so that bytes that are not a message get INVALID_ARGUMENT, and that refuse
    requests over their byte cap (derived from ``limits`` and the hosted ``models``)
    and string fields over ``limits`` (None: unchecked)."""
    caps = None if limits is None else request_caps.derive(limits, models)
    service = pb.DESCRIPTOR.services_by_name["PrefixCache"]
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    handlers = {}
    for method in service.methods:
        kind = kinds[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = kind(
            getattr(servicer, method.name),
            request_deserializer=_lenient(getattr(pb, method.input_type.name), limits, caps),
            response_serializer=_chunks
            if method.name == "ReadKV"
            else getattr(pb, method.output_type.name).SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
