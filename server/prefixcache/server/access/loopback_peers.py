"""Who a loopback TCP caller is: the uid that owns its socket, as the kernel tells it.

Loopback peers share an address (and may bind any of 127.0.0.0/8, so the address is
theirs to choose), so the service asks the kernel whose socket it is: one exact
``sock_diag`` lookup (netlink, ``SOCK_DIAG_BY_FAMILY``) of the peer's end of the
connection, by its four addresses and ports, answers its owner's uid. The server's
ports are those ``listening`` registered (a process may run several servers).
"""

from __future__ import annotations

import ipaddress
import socket
import struct

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_ERROR = 2
_HEADER = struct.Struct("=IHHII")  # nlmsghdr
_REQUEST = struct.Struct("=BBBBI")  # inet_diag_req_v2, before its sockid
_NO_COOKIE = 0xFFFFFFFF
_ALL_STATES = 0xFFFFFFFF
# inet_diag_msg: family, state, timer, retrans, then the 48-byte sockid, expires, queues,
# and the uid at this offset.
_UID_AT = 4 + 48 + 12

_PORTS: set[int] = set()


def listening(port: int, on: bool = True) -> None:
    """Register (or forget) a TCP port this process serves on."""
    if on:
        _PORTS.add(port)
    else:
        _PORTS.discard(port)


def _packed(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bytes:
    return address.packed.ljust(16, b"\0")


def _lookup(family: int, src: bytes, sport: int, dst: bytes, dport: int) -> int | None:
    sockid = (
        struct.pack("!HH", sport, dport)
        + src
        + dst
        + struct.pack("=III", 0, _NO_COOKIE, _NO_COOKIE)
    )
    body = _REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, _ALL_STATES) + sockid
    message = (
        _HEADER.pack(_HEADER.size + len(body), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0) + body
    )
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(1.0)
        nl.sendto(message, (0, 0))
        reply = nl.recv(4096)
    if len(reply) < _HEADER.size + _UID_AT + 4:
        return None
    if _HEADER.unpack_from(reply)[1] == _NLMSG_ERROR:
        return None
    return int(struct.unpack_from("=I", reply, _HEADER.size + _UID_AT)[0])


def loopback_uid(host: str, port: int) -> int | None:
    """The uid owning the socket at ``host:port`` that is connected to one of this
    process's ports; None where the kernel does not say (not found, no netlink)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    mapped = getattr(address, "ipv4_mapped", None)
    address = mapped or address
    family = socket.AF_INET if address.version == 4 else socket.AF_INET6
    loopback = ipaddress.ip_address("127.0.0.1" if address.version == 4 else "::1")
    # The address the peer connected to: its own (a client on 127.0.0.1 calling
    # 127.0.0.1), else the loopback one.
    targets = dict.fromkeys((address, loopback))
    for dport in sorted(_PORTS):
        for target in targets:
            try:
                uid = _lookup(family, _packed(address), port, _packed(target), dport)
            except OSError:
                return None
            if uid is not None:
                return uid
    return None
