"""The ceilings `kv_bandwidth.py` compares against, measured in the same run: a plain
torch copy of the same bytes between the same two buffers, and a raw socket transfer of
the same bytes (unix socket, or TCP on 127.0.0.1: what ReadKV / WriteKV ride on)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

# Bytes per send/recv call of the raw transfer: gRPC's chunks are 1 MiB too.
_CHUNK = 1 << 20


def best_seconds(fn: Callable[[], Any], repeat: int) -> float:
    """The fastest of ``repeat`` runs of ``fn`` after one warm-up (the machine is
    shared: the best run is the one least disturbed by others)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def paired_seconds(
    fn: Callable[[], Any], ceiling: Callable[[], Any], repeat: int
) -> tuple[float, float]:
    """The fastest run of ``fn`` and of ``ceiling``, run in turn (so that both see the
    same load from others on the machine), after one warm-up each."""
    fn()
    ceiling()
    best = [float("inf"), float("inf")]
    for _ in range(repeat):
        for i, f in enumerate((fn, ceiling)):
            start = time.perf_counter()
            f()
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1]


def flat_copy(pairs: list[tuple[Any, Any]]) -> Callable[[], None]:
    """One ``copy_`` per (destination, source) pair of flat byte views: the plain copy
    of the same bytes between the same buffers."""

    def run() -> None:
        for dst, src in pairs:
            dst.copy_(src)

    return run


def byte_prefix(tensor: Any, nbytes: int) -> Any:
    """The first ``nbytes`` bytes of a contiguous tensor, as a flat uint8 view."""
    import torch

    flat = tensor.view(torch.uint8).reshape(-1) if tensor.is_contiguous() else None
    if flat is None or flat.numel() < nbytes:
        raise ValueError(f"a contiguous tensor of at least {nbytes} bytes is needed")
    return flat[:nbytes]


class RawSocket:
    """A connected pair of sockets (unix, or TCP on 127.0.0.1) with a sender thread:
    ``transfer(n)`` moves ``n`` bytes from one end into a buffer at the other."""

    def __init__(self, family: str) -> None:
        if family == "unix":
            self.a, self.b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            with socket.socket() as listener:
                listener.bind(("127.0.0.1", 0))
                listener.listen(1)
                self.a = socket.create_connection(listener.getsockname())
                self.b, _ = listener.accept()
            for s in (self.a, self.b):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._payload = memoryview(bytearray(_CHUNK))

    def transfer(self, nbytes: int) -> Callable[[], None]:
        sink = memoryview(bytearray(nbytes))

        def send() -> None:
            left = nbytes
            while left:
                n = min(left, _CHUNK)
                self.a.sendall(self._payload[:n])
                left -= n

        def run() -> None:
            sender = threading.Thread(target=send)
            sender.start()
            got = 0
            while got < nbytes:
                n = self.b.recv_into(sink[got:], min(nbytes - got, _CHUNK))
                if not n:
                    raise OSError("raw socket closed early")
                got += n
            sender.join()

        return run

    def close(self) -> None:
        self.a.close()
        self.b.close()
