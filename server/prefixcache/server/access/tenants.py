"""Tenants: bearer tokens bound to ``extra_key`` namespaces, and who a call comes from.

``extra_key`` splits the cache into namespaces (the tree keeps one subtree per value,
and a Match never crosses them), but on its own anyone may name any namespace. With
``server.tenants`` set, each tenant's token may name only the ``extra_key`` values
that start with one of its prefixes:

- Match and Insert naming another namespace (or none, unless a prefix is "") are
  PERMISSION_DENIED before the cache is looked at, so the refusal reveals nothing
  about what is cached there, and counts no lookup.
- Lock of a node of another namespace is PERMISSION_DENIED.
- ReadKV by a tenant's token reads only slots under its session's locks
  (kv_access.py), and those locks came from Matches, Inserts and Locks in its own
  namespaces; WriteKV writes only slots the session holds.

The server token and the admin token are bound to no namespace. Tenant tokens are
accepted by the token check (auth.py) like the server token, so with tenants set a
call without a known token is UNAUTHENTICATED. Refusals count in
``prefixcache_refusals_total{limit="tenant_namespaces"}``.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import ipaddress
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from ..config import TenantConfig
from ..errors import DeniedError
from .loopback_peers import loopback_uid
from .unix_peers import credentials

LIMIT = "tenant_namespaces"


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a call comes from, as far as the service tells callers apart.

    Attributes:
        admin: The call carries the admin token.
        tenant: The tenant's name (for messages), when its token is a tenant's.
        namespaces: The extra_key prefixes the caller may use; None for any.
    """

    admin: bool = False
    tenant: str | None = None
    namespaces: tuple[str, ...] | None = None

    @property
    def bound(self) -> bool:
        return self.namespaces is not None

    def may_use(self, extra_key: str | None) -> bool:
        if self.namespaces is None:
            return True
        key = extra_key or ""
        return any(key.startswith(prefix) for prefix in self.namespaces)


ANYONE = Caller()
ADMIN = Caller(admin=True)

# Who the call being handled comes from, and its gRPC peer: each RPC runs in its own
# task, and an entry point (servicer.py) sets these before any handler runs, so
# handlers need no extra argument.
CALLER: contextvars.ContextVar[Caller] = contextvars.ContextVar("caller", default=ANYONE)
PEER: contextvars.ContextVar[str] = contextvars.ContextVar("peer", default="")


def peer_address(peer: str) -> tuple[str, int] | None:
    """The address and port of a gRPC TCP peer (``ipv4:10.0.0.7:51234`` -> ``("10.0.0.7",
    51234)``); None for a unix socket or an unknown form."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6") or not rest:
        return None
    host, _, port = unquote(rest).rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        return None
    return host, int(port)


def client_identity(caller: Caller, peer: str, name: str) -> str:
    """Who a session belongs to, for ``max_sessions_per_client``, the Subscribe caps and
    the Evict budget: what the peer cannot choose.

    A tenant is its token (``tenant:acme``, however many peers it calls from), the admin
    token is ``admin``. Any other caller on the unix socket is its process as the kernel
    tells it (``unix:uid=1000,pid=4242``; ``unix:uid=1000`` from another pid namespace,
    where its pid is 0; unix_peers.py). On TCP it is its peer's address
    (``host:10.0.0.7``; the port is left out, since each connection has its own), but a
    loopback peer, which may bind any 127.x address, is the uid owning its socket
    (``local:uid=1000``, loopback_peers.py). The client_name is self-asserted, so it
    tells clients apart only where nothing else can (``local:`` plus it): a unix socket
    served without the relay (``server.peer_credentials: false``).
    """
    if caller.tenant is not None:
        return f"tenant:{caller.tenant}"
    if caller.admin:
        return "admin"
    creds = credentials(peer)
    if creds is not None:
        uid, pid = creds
        return f"unix:uid={uid},pid={pid}" if pid else f"unix:uid={uid}"
    address = peer_address(peer)
    if address is None:
        return f"local:{name}"
    host, port = address
    try:
        ip = ipaddress.ip_address(host)
        local = (getattr(ip, "ipv4_mapped", None) or ip).is_loopback
    except ValueError:
        local = False
    if local:
        owner = loopback_uid(host, port)
        if owner is not None:
            return f"local:uid={owner}"
    return f"host:{host}"


def bearer(metadata: Iterable[tuple[str, Any]] | None) -> str:
    """The bearer token of a call's metadata ("" when there is none)."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value[:7].lower() == "bearer ":
            return value[7:].strip()
    return ""


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Callers:
    """Tells callers apart by their bearer token.

    Tenant tokens are looked up by their SHA-256, so the lookup takes the same time
    whichever token matches (or none does).
    """

    def __init__(
        self, admin_token: str | None = None, tenants: tuple[TenantConfig, ...] = ()
    ) -> None:
        self._admin = admin_token
        self._tenants = {
            _digest(t.token): Caller(tenant=t.name, namespaces=t.namespaces)
            for t in tenants
            if t.token
        }
        self.tokens = tuple(t.token for t in tenants if t.token)

    @property
    def has_tenants(self) -> bool:
        return bool(self._tenants)

    def of(self, metadata: Iterable[tuple[str, Any]] | None) -> Caller:
        """The caller of a call with this metadata."""
        if not self._admin and not self._tenants:
            return ANYONE
        presented = bearer(metadata)
        if not presented:
            return ANYONE
        if self._admin and hmac.compare_digest(presented.encode(), self._admin.encode()):
            return ADMIN
        return self._tenants.get(_digest(presented), ANYONE)


def check_request(caller: Caller, request: Any, service: Any) -> None:
    """Refuse a request that names a namespace ``caller`` may not use.

    Raises:
        DeniedError: PERMISSION_DENIED, naming the tenant but not the namespace.
    """
    if caller.namespaces is None:
        return
    for extra_key in _extra_keys(request):
        if not caller.may_use(extra_key):
            raise DeniedError(
                f"extra_key is outside the namespaces of this token (tenant {caller.tenant!r})",
                LIMIT,
            )
    if request.DESCRIPTOR.name == "LockRequest" and request.node_id:
        node = _node(service, request.model, request.node_id)
        if node is not None and not caller.may_use(_namespace_of(node)):
            raise DeniedError(
                f"node {request.node_id} is outside the namespaces of this "
                f"token (tenant {caller.tenant!r})",
                LIMIT,
            )


def _extra_keys(message: Any) -> Iterator[str | None]:
    """Every ``extra_key`` a message names, nested messages (a Step's items) included;
    None where a message with the field leaves it unset (the default namespace)."""
    descriptor = message.DESCRIPTOR
    if "extra_key" in descriptor.fields_by_name:
        yield message.extra_key if message.HasField("extra_key") else None
    for field, value in message.ListFields():
        if field.message_type is None or field.message_type.GetOptions().map_entry:
            continue
        if hasattr(value, "DESCRIPTOR"):
            yield from _extra_keys(value)
        else:  # a repeated field of messages
            for item in value:
                yield from _extra_keys(item)


def _node(service: Any, model: str, node_id: int) -> Any:
    engine = service.engines.get(model)
    if engine is None:
        return None  # the handler answers NOT_FOUND for the model
    return engine._nodes.get(node_id)


def _namespace_of(node: Any) -> str | None:
    namespace = getattr(node, "namespace", None)
    return None if namespace is None else namespace.extra_key
