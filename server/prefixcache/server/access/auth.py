"""Bearer-token authentication for the gRPC server.

Clients send ``authorization: Bearer <token>`` metadata. With a token configured, a
call without it (or with a wrong one) is UNAUTHENTICATED; admin methods need the admin
token and answer PERMISSION_DENIED to anyone else. Health checks stay open so that
Kubernetes probes, which cannot send tokens, keep working. Tokens are compared in
constant time. Tenants' tokens (tenants.py) pass like the token; with tenants set, a
token is required even when ``token`` itself is not set.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

ADMIN_METHODS = frozenset({"/prefixcache.v1.PrefixCache/Reset"})
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


def _matches(presented: str, secret: str | None) -> bool:
    return secret is not None and hmac.compare_digest(presented.encode(), secret.encode())


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks the bearer token of every call before its handler runs.

    Args:
        token: Required for every call (except health); None lets any caller in.
        admin_token: Required for admin methods; the admin token also passes as a
            plain token. None disables admin methods while ``token`` is set.
        tenant_tokens: More tokens that pass as plain tokens (bound to namespaces
            by the servicer, not here).
    """

    def __init__(
        self, token: str | None, admin_token: str | None, tenant_tokens: tuple[str, ...] = ()
    ) -> None:
        self.token = token
        self.admin_token = admin_token
        self.tenant_tokens = tenant_tokens
        self._required = token is not None or bool(tenant_tokens)

    def _plain(self, presented: str) -> bool:
        # Every token compared, so the time taken does not tell which one matched.
        hits = [_matches(presented, t) for t in (self.token, *self.tenant_tokens)]
        return any(hits)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        method = details.method
        if method.startswith(OPEN_PREFIXES):
            return await continuation(details)
        presented = ""
        for key, value in details.invocation_metadata or ():
            if key == "authorization" and isinstance(value, str) and value[:7].lower() == "bearer ":
                presented = value[7:].strip()
        is_admin = _matches(presented, self.admin_token)
        if method in ADMIN_METHODS:
            if not is_admin:
                if self._required and not self._plain(presented):
                    return await self._deny(
                        continuation,
                        details,
                        grpc.StatusCode.UNAUTHENTICATED,
                        "missing or wrong bearer token",
                    )
                return await self._deny(
                    continuation,
                    details,
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"{method} needs the admin token",
                )
        elif self._required and not is_admin and not self._plain(presented):
            return await self._deny(
                continuation,
                details,
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong bearer token",
            )
        return await continuation(details)

    @staticmethod
    async def _deny(
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
        code: grpc.StatusCode,
        message: str,
    ) -> Any:
        handler = await continuation(details)
        if handler is None:  # unknown method: let gRPC answer UNIMPLEMENTED
            return None

        async def deny_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(code, message)

        async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(code, message)
            yield  # pragma: no cover - makes this an async generator

        streaming = handler.response_streaming
        factory = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(handler.request_streaming, streaming)]
        return factory(
            deny_stream if streaming else deny_unary,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
