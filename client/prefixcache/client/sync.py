"""PrefixCacheClient: the blocking client (its leased sessions are in ``session``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from prefixcache.v1 import prefix_cache_pb2 as pb
from prefixcache.v1 import prefix_cache_pb2_grpc as pb_grpc

from . import pages, results
from ._core import DEFAULT_TARGET, FAIL_OPEN_ERRORS, ClientBase, log
from ._flow import run_blocking
from ._requests import Op, R, SessionLike
from ._session_state import SessionState
from .errors import PrefixCacheError
from .sessions.session import ClientSession
from .shadow.shadow_follow import NamespaceLike, ShadowFollower, subscribe_request
from .step import Admit, Finish, Free, StepItems, StepReply
from .transfer import kv
from .transfer.attach import AttachedPool, attach


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
        # ReadKV's chunks read without protobuf: their data stays a view of the message.
        self._read_kv = self._channel.unary_stream(
            kv.READ_KV_METHOD,
            request_serializer=pb.ReadKVRequest.SerializeToString,
            response_deserializer=kv.parse_chunk,
        )
        # WriteKV's data chunks go out serialized already (kv.encode_chunk).
        self._write_kv = self._channel.stream_unary(
            kv.WRITE_KV_METHOD,
            request_serializer=kv.serialize_chunk,
            response_deserializer=pb.WriteKVResponse.FromString,
        )
        self._closed = False
        self._followers: list[ShadowFollower] = []  # shadow(): closed with the client

    # ------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Close the sessions opened through ``session()`` and the channel."""
        if self._closed:
            return
        self._closed = True
        for session in list(self._sessions):
            with contextlib.suppress(PrefixCacheError):
                session.close()
        for follower in self._followers:
            follower.close()
        self._channel.close()

    def __enter__(self) -> PrefixCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- machinery

    def _run(self, op: Op[R], timeout: float | None = None, fail_open: bool | None = None) -> R:
        return run_blocking(self._run_flow(op, timeout, fail_open))

    # ----------------------------------------------------------------- reads

    def list_models(self, *, timeout: float | None = None) -> results.ModelList:
        """The hosted models (``reply["name"]`` picks one) and the service's epoch."""
        return self._run(self._op_list_models(), timeout)

    def describe_pool(self, model: str, *, timeout: float | None = None) -> results.PoolInfo:
        """The memory layout of ``model``'s pools."""
        return self._run(self._op_describe_pool(model), timeout)

    def stats(self, model: str = "", *, timeout: float | None = None) -> results.StatsReply:
        """Counters of ``model``, or of every model when it is empty."""
        return self._run(self._op_stats(model), timeout)

    # ------------------------------------------------------------- KV data

    def attach_pool(self, model: str, *, timeout: float | None = None) -> AttachedPool:
        """Map ``model``'s pool into this process (same host only): K/V tensors per
        layer, and Mamba state, that alias the service's buffers. Imports torch."""
        return attach(self.describe_pool(model, timeout=timeout))

    def read_kv(
        self,
        model: str,
        slots: Any = (),
        *,
        session: SessionLike = None,
        layers: Any = None,
        state_slots: Any = (),
        chunk_bytes: int | None = None,
        server_epoch: int | None = None,
        timeout: float | None = None,
        out: kv.KVData | None = None,
    ) -> kv.KVData:
        """Copies of the K/V rows of ``slots`` (every layer, or ``layers``) and the
        Mamba state of ``state_slots``, streamed in chunks. Each slot must be held by
        ``session`` or lie under one of its locks (no session: only on a model with
        ``open_reads``). ``server_epoch``: the epoch the slots come from (default: the
        session's, else the newest seen). ``out``: the result of an earlier read of
        as many slots and the same layers, filled in place and returned (staging
        buffers reused: no new memory to fault in). Imports torch."""
        reader = run_blocking(
            self._read_kv_flow(
                model, slots, session, layers, state_slots, chunk_bytes, server_epoch, timeout, out
            )
        )
        try:
            for chunk in self._read_kv(
                reader.request, timeout=timeout or self.timeout, metadata=self._metadata
            ):
                reader.add(chunk)
        except grpc.RpcError as exc:
            raise self._error(exc) from exc
        return reader.result()

    def write_kv(
        self,
        model: str,
        slots: Any = (),
        k: Any = None,
        v: Any = None,
        *,
        session: SessionLike,
        layers: Any = None,
        state_slots: Any = (),
        conv: Any = None,
        temporal: Any = None,
        chunk_bytes: int | None = None,
        server_epoch: int | None = None,
        timeout: float | None = None,
    ) -> kv.WriteKVReply:
        """Write K/V rows into slots ``session`` holds: ``k[i]``/``v[i]`` is
        ``[len(slots), heads, dim]`` for the i-th layer (all, or ``layers``); one
        stacked ``[layers, n, heads, dim]`` tensor works too. ``conv``/``temporal``
        likewise per Mamba layer for ``state_slots``. Imports torch."""
        return run_blocking(
            self._write_kv_flow(
                model,
                slots,
                k,
                v,
                session,
                layers,
                state_slots,
                conv,
                temporal,
                chunk_bytes,
                server_epoch,
                timeout,
            )
        )

    # ------------------------------------------------------------ Subscribe

    def shadow(
        self,
        model: str,
        *,
        namespaces: Iterable[NamespaceLike] | None = None,
        max_pages_per_event: int = 0,
    ) -> ShadowFollower:
        """A shadow index of ``model``'s cached pages, kept current by a daemon thread
        from the Subscribe stream: ``shadow.match(RequestHashes(...))`` answers a ranking
        match locally. ``namespaces``: extra_keys or ``(extra_key, token_width)`` pairs
        to follow (None: all). Closed with the client, or by ``close()``."""
        follower = ShadowFollower(
            self, model, namespaces=namespaces, max_pages_per_event=max_pages_per_event
        )
        self._followers.append(follower)
        return follower

    def subscribe(
        self,
        model: str,
        *,
        after_seq: int | None = None,
        server_epoch: int = 0,
        namespaces: Iterable[NamespaceLike] | None = None,
        max_pages_per_event: int = 0,
    ) -> Iterator[pb.SubscribeEvent]:
        """The raw Subscribe stream of ``model`` (events as the proto defines them),
        until the caller stops iterating; failures raise the typed errors."""
        request = subscribe_request(model, after_seq, server_epoch, namespaces, max_pages_per_event)
        call = self._stub.Subscribe(request, metadata=self._metadata)
        try:
            yield from call
        except grpc.RpcError as exc:
            raise self._error(exc) from exc
        finally:
            call.cancel()

    # --------------------------------------------------------------- sessions

    def open_session(
        self,
        ttl: float | None = None,
        name: str | None = None,
        *,
        timeout: float | None = None,
        retain: Any = None,
    ) -> results.SessionInfo:
        """Open a leased session (``ttl`` None or 0: the service's default lease).

        Nobody renews it: call ``keep_alive`` within the lease, or use ``session()``.
        ``retain``: the retention hint of every call of the session that carries none
        (an agent's conversation), as ``match`` takes it.
        """
        return self._run(self._op_open_session(ttl, name, retain), timeout)

    def keep_alive(self, session: SessionLike, *, timeout: float | None = None) -> float:
        """Renew a lease; returns its length in seconds."""
        return self._run(self._op_keep_alive(session), timeout)

    def close_session(
        self, session: SessionLike, *, timeout: float | None = None
    ) -> results.CloseReply:
        """End a session, releasing its locks and freeing its slots."""
        return self._run(self._op_close_session(session), timeout)

    def session(
        self,
        ttl: float | None = None,
        *,
        name: str | None = None,
        renew: bool = True,
        fail_open: bool | None = None,
        timeout: float | None = None,
        retain: Any = None,
    ) -> ClientSession:
        """Open a session whose lease a background thread renews every ``ttl / 3``.

        Use it as a context manager: leaving the block closes the session, which
        releases every lock and slot it still holds. Its methods (``match``,
        ``insert``, ``lock``, ...) pass the session for you.

        Failing open, a service that cannot be reached does not raise: the session
        starts unopened, its calls answer as misses, and its first ``match`` or
        ``alloc`` that reaches the service opens it.
        """
        try:
            opened: results.SessionInfo | SessionState = self.open_session(
                ttl, name, timeout=timeout, retain=retain
            )
        except FAIL_OPEN_ERRORS as err:
            # Raises unless failing open; then the first match or alloc opens it.
            self._stand_in("open_session", lambda: None, err, fail_open)
            log.warning("session not opened (%s): failing open until the service answers", err)
            opened = SessionState.unopened(ttl, err)
        session = ClientSession(
            self, opened, renew=renew, fail_open=fail_open, name=name, retain=retain
        )
        self._sessions.add(session)
        return session

    # ------------------------------------------------------------ cache calls

    def match(
        self,
        model: str,
        tokens: Any,
        *,
        extra_key: str | None = None,
        token_width: int | None = None,
        session: SessionLike = None,
        lock: bool = False,
        allocate: bool = False,
        request_id: int | None = None,
        fail_open: bool | None = None,
        timeout: float | None = None,
        as_pages: bool = False,
        retain: Any = None,
    ) -> results.MatchReply:
        """The longest cached prefix of ``tokens``, optionally locked, and slots for the
        rest with ``allocate`` (both need a ``session``). ``as_pages``: answer in page
        ids (``page_ids``, ``allocated_page_ids``) instead of slots.

        ``tokens``: ints (or equal-width tuples), an ``array``, a numpy array, a torch
        tensor, a ``RadixKey`` (which brings its ``extra_key``), or packed bytes.
        ``retain``: a retention hint for the matched prefix (``Retention``, seconds, or
        ``{"retain_seconds": s, "priority": p}``); ``reply.retained`` says what it did.
        """
        op = self._op_match(
            model,
            tokens,
            extra_key,
            token_width,
            session,
            lock,
            allocate,
            request_id,
            as_pages,
            retain,
        )
        return self._run(op, timeout, fail_open)

    def insert(
        self,
        model: str,
        tokens: Any,
        slots: Any,
        *,
        extra_key: str | None = None,
        token_width: int | None = None,
        session: SessionLike = None,
        lock: bool = False,
        release_lock_id: int = 0,
        state_slot: int | None = None,
        slot_version: int = 0,
        request_id: int | None = None,
        server_epoch: int | None = None,
        fail_open: bool | None = None,
        timeout: float | None = None,
        retain: Any = None,
    ) -> results.InsertReply:
        """Cache ``tokens`` with ``slots`` (one per token: the tree's own from a match,
        or slots the session holds). The service frees the session's slots the tree did
        not need and reports them in ``freed``; the unaligned tail stays the session's.
        ``lock`` locks the new node; ``release_lock_id`` then releases an older lock.
        ``server_epoch``: the epoch the slots and lock come from (default: the
        session's, else the newest seen); the service refuses a stale one.
        ``retain``: a retention hint for the cached sequence, as ``match`` takes it."""
        op = self._op_insert(
            model,
            tokens,
            slots,
            extra_key,
            token_width,
            session,
            lock,
            release_lock_id,
            state_slot,
            slot_version,
            request_id,
            server_epoch,
            retain,
        )
        return self._run(op, timeout, fail_open)

    def retain(
        self,
        model: str,
        tokens: Any,
        retain: Any,
        *,
        extra_key: str | None = None,
        token_width: int | None = None,
        fail_open: bool | None = None,
        timeout: float | None = None,
    ) -> results.RetainReply:
        """Set, change or end (seconds 0) the retention of the cached prefix of
        ``tokens``, without a lookup: the prefix is neither touched nor counted as hit.
        ``retain`` as ``match`` takes it; None ends the caller's retention."""
        return self._run(
            self._op_retain(model, tokens, retain, extra_key, token_width), timeout, fail_open
        )

    def evict(
        self,
        model: str,
        num_tokens: int = 0,
        *,
        swa_num_tokens: int = 0,
        mamba_num: int = 0,
        session: SessionLike = None,
        timeout: float | None = None,
    ) -> results.EvictReply:
        """Free at least ``num_tokens`` unlocked cached tokens (whole leaves);
        ``session`` names who asks, in the service's log."""
        return self._run(
            self._op_evict(model, num_tokens, swa_num_tokens, mamba_num, session), timeout
        )

    def lock(
        self,
        model: str,
        node_id: int,
        *,
        session: SessionLike = None,
        request_id: int | None = None,
        server_epoch: int | None = None,
        fail_open: bool | None = None,
        timeout: float | None = None,
    ) -> results.LockReply:
        """Protect ``node_id`` and its ancestors from eviction for ``session``."""
        return self._run(
            self._op_lock(model, node_id, session, request_id, server_epoch), timeout, fail_open
        )

    def unlock(
        self,
        lock_id: int,
        *,
        session: SessionLike = None,
        request_id: int | None = None,
        server_epoch: int | None = None,
        fail_open: bool | None = None,
        timeout: float | None = None,
        unused: str | None = None,
    ) -> results.UnlockReply:
        """Release a lock taken by ``lock``, ``match`` or ``insert``. ``unused``: the
        lock's hit went unused, and why ("load_failed", "lease_expired"), for the
        service's lookup outcomes."""
        return self._run(
            self._op_unlock(lock_id, session, request_id, server_epoch, unused), timeout, fail_open
        )

    def alloc(
        self,
        model: str,
        num_slots: int,
        *,
        num_state_slots: int = 0,
        session: SessionLike = None,
        timeout: float | None = None,
        as_pages: bool = False,
    ) -> results.AllocReply:
        """Allocate slots to ``session``, evicting if needed. Never fails open.
        ``as_pages``: answer in whole pages (``page_ids``) instead of slots."""
        return self._run(
            self._op_alloc(model, num_slots, num_state_slots, session, as_pages), timeout
        )

    def free(
        self,
        model: str,
        slots: Any = (),
        *,
        state_slots: Any = (),
        session: SessionLike = None,
        server_epoch: int | None = None,
        fail_open: bool | None = None,
        timeout: float | None = None,
    ) -> None:
        """Return slots (and Mamba state slots) ``session`` holds to the pool."""
        self._run(
            self._op_free(model, slots, state_slots, session, server_epoch), timeout, fail_open
        )

    def reset(self, model: str, *, timeout: float | None = None) -> results.ResetReply:
        """Drop every entry, lock and allocation of ``model`` (needs the admin token)."""
        return self._run(self._op_reset(model), timeout)

    # ---------------------------------------------- pages by hash (pages.py)

    def exists_pages(
        self,
        model: str,
        page_hashes: pages.PageHashes,
        *,
        extra_key: str | None = None,
        token_width: int = 1,
        before_set: bool = False,
        session: SessionLike = None,
        timeout: float | None = None,
    ) -> pages.ExistsPagesReply:
        """Which pages of a chain of page hashes ``model`` holds (leading run, and each);
        ``before_set``: a check before storing them, not counted as a lookup.
        ``session``: required where the service has tenants or quotas configured."""
        return self._run(
            pages.op_exists(model, page_hashes, extra_key, token_width, before_set, session),
            timeout,
        )

    def get_pages(
        self,
        model: str,
        page_hashes: pages.PageHashes,
        *,
        extra_key: str | None = None,
        token_width: int = 1,
        session: SessionLike = None,
        request_id: int | None = None,
        timeout: float | None = None,
    ) -> pages.GetPagesReply:
        """Lock the leading run of held pages for ``session``; answers their slots and
        the locks to ``unlock`` once the pages are read."""
        return self._run(
            pages.op_get(self, model, page_hashes, extra_key, token_width, session, request_id),
            timeout,
        )

    def set_pages(
        self,
        model: str,
        page_hashes: pages.PageHashes,
        slots: Any,
        *,
        extra_key: str | None = None,
        token_width: int = 1,
        prior_hash: str | bytes | None = None,
        session: SessionLike = None,
        request_id: int | None = None,
        server_epoch: int | None = None,
        timeout: float | None = None,
    ) -> pages.SetPagesReply:
        """Store pages by hash: ``slots`` (``page_size`` per page; zeros for a page not
        sent) are slots ``session`` holds with the pages' KV written in."""
        return self._run(
            pages.op_set(
                self,
                model,
                page_hashes,
                slots,
                extra_key,
                token_width,
                prior_hash,
                session,
                request_id,
                server_epoch,
            ),
            timeout,
        )

    def step(
        self,
        model: str,
        *,
        finishes: Sequence[Finish] = (),
        unlocks: Sequence[int] = (),
        frees: Sequence[Free | Any] = (),
        decodes: Sequence[int] | int = (),
        admits: Sequence[Admit | Any] = (),
        session: SessionLike = None,
        request_id: int | None = None,
        server_epoch: int | None = None,
        fail_open: bool | None = None,
        timeout: float | None = None,
    ) -> StepReply:
        """One scheduling step's cache work for ``model`` in one call (see
        :mod:`prefixcache.client.step`): ``finishes`` (insert, release the admission's
        lock, free the unaligned tail), ``unlocks``, ``frees``, ``decodes`` (a slot
        count per running request, or one total), then ``admits`` (match, lock,
        allocate; plain tokens are admissions). Each item gets its own result, a reply
        or the typed error; the reply's ``counters`` are the model's after the step.

        Retried after UNAVAILABLE under a request id, so a retry is answered from the
        service's replay window. Failing open (``fail_open``) answers a ``skipped``
        reply: finishes, unlocks, frees and lock-only admissions hold their stand-ins,
        decodes and allocating admissions the error (they need real slots).
        """
        items = StepItems.of(finishes, unlocks, frees, decodes, admits)
        return self._run(
            self._op_step(model, items, session, request_id, server_epoch), timeout, fail_open
        )
