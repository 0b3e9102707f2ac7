"""What the sync and the asyncio client share: settings, channel setup and, for every
operation, the request it sends, how its reply is read, whether it may be retried and
what it answers when it fails open.

An operation is an :class:`Op`; each client only knows how to run one (blocking or
awaiting), so the two cannot drift apart.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from itertools import count
from pathlib import Path
from typing import Any

import grpc

from . import results
from ._flow import Flow, Pause
from ._requests import Op, R, Requests, SessionLike, session_id_of
from .errors import (
    DeadlineExceeded,
    InvalidArgument,
    PrefixCacheError,
    SessionLost,
    StaleEpoch,
    Unavailable,
    from_rpc_error,
)
from .transfer import kv

log = logging.getLogger("prefixcache.client")

DEFAULT_TARGET = "unix:/tmp/prefixcache.sock"
DEFAULT_TIMEOUT = 5.0
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# What fails open: the service is down, draining or too slow, or the call names handles
# from before a restart (or of a lost session), which are gone either way.
FAIL_OPEN_ERRORS = (Unavailable, DeadlineExceeded, StaleEpoch, SessionLost)


def normalize_target(target: str | Path) -> str:
    """``/path`` and ``unix:/path`` are unix sockets; anything else goes to gRPC as is."""
    target = str(target)
    if target.startswith("/"):
        return f"unix:{target}"
    return target


def _read(value: bytes | str | Path | None) -> bytes | None:
    """PEM material given as bytes, or as a path to a file."""
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()


class ClientBase(Requests):
    """Settings and request building for :class:`PrefixCacheClient` and
    :class:`AsyncPrefixCacheClient` (see their docstring for the arguments)."""

    _stub: Any  # each client's stub: blocking or grpc.aio
    _write_kv: Any  # its WriteKV call, which sends chunks serialized already

    def __init__(
        self,
        target: str | Path = DEFAULT_TARGET,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        token: str | None = None,
        tls: bool | None = None,
        root_certificates: bytes | str | Path | None = None,
        private_key: bytes | str | Path | None = None,
        certificate_chain: bytes | str | Path | None = None,
        server_name: str | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        retries: int = 2,
        backoff: float = 0.05,
        fail_open: bool = False,
        client_name: str = "",
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        if timeout <= 0:
            raise InvalidArgument(f"timeout must be > 0, got {timeout}")
        if retries < 0 or backoff < 0:
            raise InvalidArgument("retries and backoff must be >= 0")
        self.target = normalize_target(target)
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.fail_open = bool(fail_open)
        self.client_name = client_name
        # The newest epoch any reply carried, and how often it changed (restarts seen).
        self.server_epoch = 0
        self.restarts = 0
        self._restart_hooks: list[Callable[[int, int], None]] = []
        # Sessions opened through this client, told when the service restarts.
        self._sessions: weakref.WeakSet[Any] = weakref.WeakSet()
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        if tls is None:
            tls = any(x is not None for x in (root_certificates, private_key, certificate_chain))
        if (private_key is None) != (certificate_chain is None):
            raise InvalidArgument(
                "a client certificate needs both private_key and certificate_chain"
            )
        self._credentials = (
            grpc.ssl_channel_credentials(
                root_certificates=_read(root_certificates),
                private_key=_read(private_key),
                certificate_chain=_read(certificate_chain),
            )
            if tls
            else None
        )
        opts: list[tuple[str, Any]] = [
            ("grpc.max_send_message_length", int(max_message_bytes)),
            ("grpc.max_receive_message_length", int(max_message_bytes)),
            # A sidecar restarts in about a second: reconnect within one, not after
            # gRPC's default backoff, which grows to two minutes while it is down.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        if server_name:
            opts.append(("grpc.ssl_target_name_override", server_name))
        self._options = [*opts, *options]
        self.max_message_bytes = int(max_message_bytes)
        # Pool layouts by model, for read_kv / write_kv (fixed while the service runs).
        self._pools: dict[str, results.PoolInfo] = {}
        # Request ids only need to be unique within a session; a random start keeps two
        # clients sharing a session id apart too.
        self._request_ids = count(secrets.randbits(48) + 1)
        self._fail_open_lock = threading.Lock()
        self._fail_open_count = 0
        # Each model's counters as the latest Step reply carried them, so that a
        # scheduler reads its budget without a Stats call.
        self.counters: dict[str, results.ModelStats] = {}

    @property
    def fail_open_count(self) -> int:
        """How many calls failed open (answered a stand-in instead of raising)."""
        return self._fail_open_count

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.target!r}, fail_open={self.fail_open})"

    # ------------------------------------------------------------- machinery

    def _failed_open(self, op: Op[R], err: PrefixCacheError, fail_open: bool | None) -> R:
        """The fail-open answer to ``op`` for ``err``; raises ``err`` when it may not."""
        fallback = op.fallback
        if op.fallback_for is not None:
            fallback = partial(op.fallback_for, err)
        return self._stand_in(op.method, fallback, err, fail_open)

    def _stand_in(
        self,
        what: str,
        fallback: Callable[[], R] | None,
        err: PrefixCacheError,
        fail_open: bool | None,
    ) -> R:
        allowed = self.fail_open if fail_open is None else fail_open
        if not allowed or fallback is None or not isinstance(err, FAIL_OPEN_ERRORS):
            raise err
        with self._fail_open_lock:
            self._fail_open_count += 1
        log.debug("%s failed open: %s", what, err)
        return fallback()

    def _delay(self, attempt: int) -> float:
        return self.backoff * 2.0**attempt

    def on_restart(self, hook: Callable[[int, int], None]) -> Callable[[int, int], None]:
        """Call ``hook(old_epoch, new_epoch)`` whenever a reply shows the service has
        restarted: every handle from before is gone, and in-flight requests whose KV
        lived in the old pool must be recomputed. Usable as a decorator."""
        self._restart_hooks.append(hook)
        return hook

    def _seen_epoch(self, epoch: int) -> None:
        old = self.server_epoch
        if not epoch or epoch == old:
            return
        self.server_epoch = epoch
        if not old:
            return
        self.restarts += 1
        log.warning(
            "the prefix-cache service restarted (epoch %d -> %d): node handles, "
            "locks, slots and sessions from before are gone",
            old,
            epoch,
        )
        self._pools.clear()  # a restarted service may have other pool shapes
        for session in list(self._sessions):
            if (state := getattr(session, "_state", None)) is not None:
                state.service_restarted(epoch)
        for hook in list(self._restart_hooks):
            try:
                hook(old, epoch)
            except Exception:  # a hook must not break the call that noticed the restart
                log.exception("on_restart hook %r failed", hook)

    def _error(self, exc: grpc.RpcError) -> PrefixCacheError:
        """The typed error for a failed call; a stale-epoch refusal also tells the
        client the current epoch."""
        err = from_rpc_error(exc)
        if isinstance(err, StaleEpoch):
            self._seen_epoch(err.server_epoch)
        return err

    def _run_flow(self, op: Op[R], timeout: float | None, fail_open: bool | None) -> Flow[R]:
        """``op`` sent (retried as :meth:`_send_flow` decides), its reply parsed; its
        fail-open answer when it fails open. Each client drives it (``_flow``)."""
        try:
            reply = yield from self._send_flow(op, timeout)
        except FAIL_OPEN_ERRORS as err:
            return self._failed_open(op, err, fail_open)
        return self._parse(op, reply)

    def _send_flow(self, op: Op[R], timeout: float | None) -> Flow[Any]:
        """``op``'s reply, its tries bounded by one deadline: a call that may be retried
        is tried again after UNAVAILABLE, after a growing pause, at most ``retries``
        times and only while the pause ends before the deadline."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        call = getattr(self._stub, op.method)
        for attempt in count():
            try:
                return (
                    yield partial(
                        call,
                        op.request,
                        metadata=self._metadata,
                        timeout=max(deadline - time.monotonic(), 0.001),
                    )
                )
            except grpc.RpcError as exc:
                err = self._error(exc)
                delay = self._delay(attempt)
                if not (
                    op.retry
                    and isinstance(err, Unavailable)
                    and attempt < self.retries
                    and deadline - time.monotonic() > delay
                ):
                    raise err from exc
            yield Pause(delay)
        raise AssertionError("unreachable")

    # ------------------------------------------------ KV transfers (kv.py)

    def _pool_flow(self, model: str, timeout: float | None) -> Flow[results.PoolInfo]:
        """``model``'s pool layout: known already (fixed while the service runs), or
        asked for (DescribePool)."""
        known = self._pools.get(model)
        if known is not None:
            return known
        return (yield from self._run_flow(self._op_describe_pool(model), timeout, None))

    def _read_kv_flow(
        self,
        model: str,
        slots: Any,
        session: SessionLike,
        layers: Any,
        state_slots: Any,
        chunk_bytes: int | None,
        server_epoch: int | None,
        timeout: float | None,
        out: kv.KVData | None,
    ) -> Flow[kv.Reader]:
        """The reader of a ReadKV: its request, and where the chunks go."""
        info = yield from self._pool_flow(model, timeout)
        reader = kv.Reader(
            info,
            slots,
            layers,
            state_slots,
            kv.chunk_limit(chunk_bytes, self.max_message_bytes),
            out,
        )
        reader.request.session_id = session_id_of(session)
        reader.request.server_epoch = self._fence(session, server_epoch)
        return reader

    def _write_kv_flow(
        self,
        model: str,
        slots: Any,
        k: Any,
        v: Any,
        session: SessionLike,
        layers: Any,
        state_slots: Any,
        conv: Any,
        temporal: Any,
        chunk_bytes: int | None,
        server_epoch: int | None,
        timeout: float | None,
    ) -> Flow[kv.WriteKVReply]:
        """A WriteKV: its chunks built (every shape checked first), then streamed."""
        info = yield from self._pool_flow(model, timeout)
        chunks = kv.write_chunks(
            info,
            session_id_of(session),
            slots,
            k,
            v,
            layers,
            state_slots,
            conv,
            temporal,
            kv.chunk_limit(chunk_bytes, self.max_message_bytes),
            self._fence(session, server_epoch),
        )
        try:
            reply = yield partial(
                self._write_kv, chunks, timeout=timeout or self.timeout, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise self._error(exc) from exc
        return kv.WriteKVReply(reply.bytes_written, reply.buffers_written)

    def _parse(self, op: Op[R], reply: Any) -> R:
        """``op``'s answer from ``reply``, noting the epoch the reply carries (if any)."""
        epoch = getattr(reply, "server_epoch", 0)
        if epoch != self.server_epoch:
            self._seen_epoch(epoch)
        return op.parse(reply)
