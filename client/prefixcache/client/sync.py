"""PrefixCacheClient: the blocking client (its leased sessions are in ``session``)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import grpc

from prefixcache.v1 import prefix_cache_pb2_grpc as pb_grpc

from . import kv
from ._core import (
    DEFAULT_TARGET,
    FAIL_OPEN_ERRORS,
    ClientBase,
    Op,
    SessionLike,
    session_id_of,
)
from .attach import AttachedPool, attach
from .errors import PrefixCacheError, Unavailable
from .results import (
    AllocReply,
    CloseReply,
    EvictReply,
    InsertReply,
    LockReply,
    MatchReply,
    ModelList,
    PoolInfo,
    ResetReply,
    SessionInfo,
    StatsReply,
    UnlockReply,
)
from .session import ClientSession


class PrefixCacheClient(ClientBase):
    """A blocking client for one prefix-cache service.

    Every call has a deadline (``timeout`` seconds, overridable per call) that also
    bounds its retries. Calls that are safe to repeat (reads, and locking calls made
    idempotent by a request id, which the client generates) are retried on UNAVAILABLE
    after ``backoff``, ``2*backoff``, ... seconds, at most ``retries`` times. Failures
    raise the typed errors of :mod:`prefixcache.client.errors`.

    With ``fail_open=True`` (here, per session, or per call), ``match``, ``insert``,
    ``lock`` and ``unlock`` do not raise when the service is down, draining or slower
    than the deadline: match answers an empty hit and the others do nothing, each with
    ``skipped=True``, and ``fail_open_count`` goes up. Anything that must hand out real
    slots cannot fail open and raises: ``alloc``, and ``match(allocate=True)``.

    Args:
        target: ``unix:/path`` or ``/path`` for a unix socket, or ``host:port``.
        timeout: default deadline of every call, in seconds.
        token: bearer token, sent as ``authorization: Bearer <token>`` metadata.
        tls: use TLS (default: when any certificate argument is given).
        root_certificates: PEM bytes, or a path, of the CA to trust (None: system roots).
        private_key, certificate_chain: PEM bytes, or paths, for mutual TLS.
        server_name: TLS name to check instead of the target's host.
        max_message_bytes: send and receive limit (match the server's).
        retries, backoff: see above.
        fail_open: see above.
        client_name: sent with OpenSession, for the service's logs.
        options: extra gRPC channel options.
    """

    def __init__(self, target: str | Path = DEFAULT_TARGET, **kwargs: Any) -> None:
        super().__init__(target, **kwargs)
        if self._credentials is not None:
            self._channel = grpc.secure_channel(self.target, self._credentials, self._options)
        else:
            self._channel = grpc.insecure_channel(self.target, self._options)
        self._stub = pb_grpc.PrefixCacheStub(self._channel)
        self._closed = False

    # ------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Close the sessions opened through ``session()`` and the channel."""
        if self._closed:
            return
        self._closed = True
        for session in list(self._sessions):
            with contextlib.suppress(PrefixCacheError):
                session.close()
        self._channel.close()

    def __enter__(self) -> PrefixCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- machinery

    def _invoke(self, op: Op, timeout: float | None) -> Any:
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        call = getattr(self._stub, op.method)
        attempt = 0
        while True:
            try:
                return call(op.request, timeout=max(deadline - time.monotonic(), 0.001),
                            metadata=self._metadata)
            except grpc.RpcError as exc:
                err = self._error(exc)
                delay = self._delay(attempt)
                if not (op.retry and isinstance(err, Unavailable) and attempt < self.retries
                        and deadline - time.monotonic() > delay):
                    raise err from exc
            time.sleep(delay)
            attempt += 1

    def _run(self, op: Op, timeout: float | None = None, fail_open: bool | None = None) -> Any:
        try:
            reply = self._invoke(op, timeout)
        except FAIL_OPEN_ERRORS as err:
            return self._failed_open(op, err, fail_open)
        return self._parse(op, reply)

    # ----------------------------------------------------------------- reads

    def list_models(self, *, timeout: float | None = None) -> ModelList:
        """The hosted models (``reply["name"]`` picks one) and the service's epoch."""
        return self._run(self._op_list_models(), timeout)

    def describe_pool(self, model: str, *, timeout: float | None = None) -> PoolInfo:
        """The memory layout of ``model``'s pools."""
        return self._run(self._op_describe_pool(model), timeout)

    def stats(self, model: str = "", *, timeout: float | None = None) -> StatsReply:
        """Counters of ``model``, or of every model when it is empty."""
        return self._run(self._op_stats(model), timeout)

    # ------------------------------------------------------------- KV data

    def attach_pool(self, model: str, *, timeout: float | None = None) -> AttachedPool:
        """Map ``model``'s pool into this process (same host only): K/V tensors per
        layer, and Mamba state, that alias the service's buffers. Imports torch."""
        return attach(self.describe_pool(model, timeout=timeout))

    def _pool_info(self, model: str, timeout: float | None) -> PoolInfo:
        return self._pools.get(model) or self.describe_pool(model, timeout=timeout)

    def read_kv(self, model: str, slots: Any = (), *, layers: Any = None,
                state_slots: Any = (), chunk_bytes: int | None = None,
                server_epoch: int | None = None, timeout: float | None = None) -> kv.KVData:
        """Copies of the K/V rows of ``slots`` (every layer, or ``layers``) and the
        Mamba state of ``state_slots``, streamed in chunks. ``server_epoch``: the epoch
        the slots come from (default: the newest seen). Imports torch."""
        reader = kv.Reader(self._pool_info(model, timeout), slots, layers, state_slots,
                           kv.chunk_limit(chunk_bytes, self.max_message_bytes))
        reader.request.server_epoch = self._fence(None, server_epoch)
        try:
            for chunk in self._stub.ReadKV(reader.request, timeout=timeout or self.timeout,
                                           metadata=self._metadata):
                reader.add(chunk)
        except grpc.RpcError as exc:
            raise self._error(exc) from exc
        return reader.result()

    def write_kv(self, model: str, slots: Any = (), k: Any = None, v: Any = None, *,
                 session: SessionLike, layers: Any = None, state_slots: Any = (),
                 conv: Any = None, temporal: Any = None, chunk_bytes: int | None = None,
                 server_epoch: int | None = None,
                 timeout: float | None = None) -> kv.WriteKVReply:
        """Write K/V rows into slots ``session`` holds: ``k[i]``/``v[i]`` is
        ``[len(slots), heads, dim]`` for the i-th layer (all, or ``layers``); one
        stacked ``[layers, n, heads, dim]`` tensor works too. ``conv``/``temporal``
        likewise per Mamba layer for ``state_slots``. Imports torch."""
        chunks = kv.write_chunks(self._pool_info(model, timeout), session_id_of(session),
                                 slots, k, v, layers, state_slots, conv, temporal,
                                 kv.chunk_limit(chunk_bytes, self.max_message_bytes),
                                 self._fence(session, server_epoch))
        try:
            reply = self._stub.WriteKV(chunks, timeout=timeout or self.timeout,
                                       metadata=self._metadata)
        except grpc.RpcError as exc:
            raise self._error(exc) from exc
        return kv.WriteKVReply(reply.bytes_written, reply.buffers_written)

    # --------------------------------------------------------------- sessions

    def open_session(self, ttl: float | None = None, name: str | None = None, *,
                     timeout: float | None = None) -> SessionInfo:
        """Open a leased session (``ttl`` None or 0: the service's default lease).

        Nobody renews it: call ``keep_alive`` within the lease, or use ``session()``.
        """
        return self._run(self._op_open_session(ttl, name), timeout)

    def keep_alive(self, session: SessionLike, *, timeout: float | None = None) -> float:
        """Renew a lease; returns its length in seconds."""
        return self._run(self._op_keep_alive(session), timeout)

    def close_session(self, session: SessionLike, *,
                      timeout: float | None = None) -> CloseReply:
        """End a session, releasing its locks and freeing its slots."""
        return self._run(self._op_close_session(session), timeout)

    def session(self, ttl: float | None = None, *, name: str | None = None,
                renew: bool = True, fail_open: bool | None = None,
                timeout: float | None = None) -> ClientSession:
        """Open a session whose lease a background thread renews every ``ttl / 3``.

        Use it as a context manager: leaving the block closes the session, which
        releases every lock and slot it still holds. Its methods (``match``,
        ``insert``, ``lock``, ...) pass the session for you.
        """
        info = self.open_session(ttl, name, timeout=timeout)
        session = ClientSession(self, info, renew=renew, fail_open=fail_open, name=name)
        self._sessions.add(session)
        return session

    # ------------------------------------------------------------ cache calls

    def match(self, model: str, tokens: Any, *, extra_key: str | None = None,
              token_width: int | None = None, session: SessionLike = None,
              lock: bool = False, allocate: bool = False, request_id: int | None = None,
              fail_open: bool | None = None, timeout: float | None = None) -> MatchReply:
        """The longest cached prefix of ``tokens``, optionally locked, and slots for the
        rest with ``allocate`` (both need a ``session``).

        ``tokens``: ints (or equal-width tuples), an ``array``, a numpy array, a torch
        tensor, a ``RadixKey`` (which brings its ``extra_key``), or packed bytes.
        """
        op = self._op_match(model, tokens, extra_key, token_width, session, lock, allocate,
                            request_id)
        return self._run(op, timeout, fail_open)

    def insert(self, model: str, tokens: Any, slots: Any, *, extra_key: str | None = None,
               token_width: int | None = None, session: SessionLike = None,
               lock: bool = False, release_lock_id: int = 0, state_slot: int | None = None,
               slot_version: int = 0, request_id: int | None = None,
               server_epoch: int | None = None, fail_open: bool | None = None,
               timeout: float | None = None) -> InsertReply:
        """Cache ``tokens`` with ``slots`` (one per token: the tree's own from a match,
        or slots the session holds). The service frees the session's slots the tree did
        not need and reports them in ``freed``; the unaligned tail stays the session's.
        ``lock`` locks the new node; ``release_lock_id`` then releases an older lock.
        ``server_epoch``: the epoch the slots and lock come from (default: the
        session's, else the newest seen); the service refuses a stale one."""
        op = self._op_insert(model, tokens, slots, extra_key, token_width, session, lock,
                             release_lock_id, state_slot, slot_version, request_id,
                             server_epoch)
        return self._run(op, timeout, fail_open)

    def evict(self, model: str, num_tokens: int = 0, *, swa_num_tokens: int = 0,
              mamba_num: int = 0, timeout: float | None = None) -> EvictReply:
        """Free at least ``num_tokens`` unlocked cached tokens (whole leaves)."""
        return self._run(self._op_evict(model, num_tokens, swa_num_tokens, mamba_num),
                         timeout)

    def lock(self, model: str, node_id: int, *, session: SessionLike = None,
             request_id: int | None = None, server_epoch: int | None = None,
             fail_open: bool | None = None, timeout: float | None = None) -> LockReply:
        """Protect ``node_id`` and its ancestors from eviction for ``session``."""
        return self._run(self._op_lock(model, node_id, session, request_id, server_epoch),
                         timeout, fail_open)

    def unlock(self, lock_id: int, *, session: SessionLike = None,
               request_id: int | None = None, server_epoch: int | None = None,
               fail_open: bool | None = None, timeout: float | None = None) -> UnlockReply:
        """Release a lock taken by ``lock``, ``match`` or ``insert``."""
        return self._run(self._op_unlock(lock_id, session, request_id, server_epoch),
                         timeout, fail_open)

    def alloc(self, model: str, num_slots: int, *, num_state_slots: int = 0,
              session: SessionLike = None, timeout: float | None = None) -> AllocReply:
        """Allocate slots to ``session``, evicting if needed. Never fails open."""
        return self._run(self._op_alloc(model, num_slots, num_state_slots, session), timeout)

    def free(self, model: str, slots: Any = (), *, state_slots: Any = (),
             session: SessionLike = None, server_epoch: int | None = None,
             fail_open: bool | None = None, timeout: float | None = None) -> None:
        """Return slots (and Mamba state slots) ``session`` holds to the pool."""
        self._run(self._op_free(model, slots, state_slots, session, server_epoch), timeout,
                  fail_open)

    def reset(self, model: str, *, timeout: float | None = None) -> ResetReply:
        """Drop every entry, lock and allocation of ``model`` (needs the admin token)."""
        return self._run(self._op_reset(model), timeout)
