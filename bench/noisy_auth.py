"""Bearer tokens on every call of the noisy-neighbour bench's channels.

The bench server has a tenant (to attack tenants' side channels), and a server with
tokens wants one on every call; the victim and the attacks send the server token,
the tenant attack its own (a call that names ``authorization`` itself keeps it).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import grpc


def _with_token(metadata: Any, token: str) -> list[tuple[str, Any]]:
    pairs = list(metadata or ())
    if not any(key == "authorization" for key, _ in pairs):
        pairs.append(("authorization", f"Bearer {token}"))
    return pairs


class _Details(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any


class _Token(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, token: str) -> None:
        self.token = token

    def _details(self, d: Any) -> Any:
        return _Details(
            d.method,
            d.timeout,
            _with_token(d.metadata, self.token),
            d.credentials,
            getattr(d, "wait_for_ready", None),
            getattr(d, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


def channel(target: str, token: str | None, options: Any = None) -> grpc.Channel:
    """An insecure channel whose calls carry ``token`` (None: none)."""
    plain = grpc.insecure_channel(target, options=options)
    return plain if token is None else grpc.intercept_channel(plain, _Token(token))


def _aio_details(d: Any, token: str) -> Any:
    return grpc.aio.ClientCallDetails(
        d.method,
        d.timeout,
        grpc.aio.Metadata(*_with_token(d.metadata, token)),
        d.credentials,
        d.wait_for_ready,
    )


class _AioUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_aio_details(details, self.token), request)


class _AioStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(_aio_details(details, self.token), requests)


def aio_channel(target: str, token: str | None, options: Any = None) -> Any:
    """As ``channel``, for grpc.aio (unary-unary and stream-unary calls carry it)."""
    interceptors = None if token is None else [_AioUnaryUnary(token), _AioStreamUnary(token)]
    return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
