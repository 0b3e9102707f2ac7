"""AsyncPrefixCacheClient: the asyncio client (grpc.aio). Its sessions live in
``aio_session`` (leased) and ``aio_stream`` (the Session stream)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path
from typing import Any

import grpc

from prefixcache.v1 import prefix_cache_pb2 as pb
from prefixcache.v1 import prefix_cache_pb2_grpc as pb_grpc

from . import results
from ._core import DEFAULT_TARGET, ClientBase
from ._flow import run_async
from ._requests import Op, R, SessionLike
from .errors import (
    PrefixCacheError,
    Unavailable,
)
from .sessions.aio_session import AsyncClientSession
from .sessions.aio_stream import AsyncStreamSession
from .shadow.shadow_follow import AsyncShadowFollower, NamespaceLike, subscribe_request
from .step import Admit, Finish, Free, StepItems, StepReply
from .transfer import kv
from .transfer.attach import AttachedPool, attach


class AsyncPrefixCacheClient(ClientBase):
    """The asyncio twin of :class:`~prefixcache.client.PrefixCacheClient`: the same
    arguments, methods and semantics (deadlines, retries, fail-open), awaited.

    The channel is made on first use, inside the running event loop; use the client
    from that one loop. ``async with client.session(ttl) as s`` keeps a lease renewed by
    a task; ``async with client.stream_session() as s`` uses the bidirectional Session
    stream instead (no lease: the session lives as long as the stream).
    """

    def __init__(self, target: str | Path = DEFAULT_TARGET, **kwargs: Any) -> None:
        super().__init__(target, **kwargs)
        self._channel: grpc.aio.Channel | None = None
        self._stub_obj: pb_grpc.PrefixCacheStub | None = None
        self._closed = False
        self._followers: list[AsyncShadowFollower] = []  # shadow(): closed with the client

    @property
    def _stub(self) -> pb_grpc.PrefixCacheStub:
        if self._stub_obj is None:
            if self._closed:
                raise Unavailable("the client is closed")
            if self._credentials is not None:
                self._channel = grpc.aio.secure_channel(
                    self.target, self._credentials, self._options
                )
            else:
                self._channel = grpc.aio.insecure_channel(self.target, self._options)
            self._stub_obj = pb_grpc.PrefixCacheStub(self._channel)
        return self._stub_obj

    async def close(self) -> None:
        """Close the sessions opened through this client, then the channel."""
        if self._closed:
            return
        self._closed = True
        for session in list(self._sessions):
            with contextlib.suppress(PrefixCacheError):
                await session.close()
        for follower in self._followers:
            await follower.close()
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stub_obj = None

    async def __aenter__(self) -> AsyncPrefixCacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -------------------------------------------------------------- machinery

    async def _run(
        self, op: Op[R], timeout: float | None = None, fail_open: bool | None = None
    ) -> R:
        return await run_async(self._run_flow(op, timeout, fail_open))

    # ----------------------------------------------------------------- reads

    async def list_models(self, *, timeout: float | None = None) -> results.ModelList:
        return await self._run(self._op_list_models(), timeout)

    async def describe_pool(self, model: str, *, timeout: float | None = None) -> results.PoolInfo:
        return await self._run(self._op_describe_pool(model), timeout)

    async def stats(self, model: str = "", *, timeout: float | None = None) -> results.StatsReply:
        return await self._run(self._op_stats(model), timeout)

    # ------------------------------------------------------------- KV data

    async def attach_pool(self, model: str, *, timeout: float | None = None) -> AttachedPool:
        """See ``PrefixCacheClient.attach_pool``."""
        return attach(await self.describe_pool(model, timeout=timeout))

    @property
    def _write_kv(self) -> Any:
        self._stub  # noqa: B018 - opens the channel
        if self._channel is None:  # closed since
            raise Unavailable("the client is closed")
        # Data chunks go out serialized already (kv.encode_chunk).
        return self._channel.stream_unary(
            kv.WRITE_KV_METHOD,
            request_serializer=kv.serialize_chunk,
            response_deserializer=pb.WriteKVResponse.FromString,
        )

    async def read_kv(
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
        """See ``PrefixCacheClient.read_kv``."""
        reader = await run_async(
            self._read_kv_flow(
                model, slots, session, layers, state_slots, chunk_bytes, server_epoch, timeout, out
            )
        )
        try:
            call = self._stub.ReadKV(
                reader.request, timeout=timeout or self.timeout, metadata=self._metadata
            )
            async for chunk in call:
                reader.add(chunk)
        except grpc.RpcError as exc:
            raise self._error(exc) from exc
        return reader.result()

    async def write_kv(
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
        """See ``PrefixCacheClient.write_kv``."""
        return await run_async(
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
    ) -> AsyncShadowFollower:
        """See ``PrefixCacheClient.shadow``; the stream is read by a task of the running
        loop (call it from a coroutine; ``await shadow.wait_ready()``)."""
        follower = AsyncShadowFollower(
            self, model, namespaces=namespaces, max_pages_per_event=max_pages_per_event
        )
        self._followers.append(follower)
        return follower

    async def subscribe(
        self,
        model: str,
        *,
        after_seq: int | None = None,
        server_epoch: int = 0,
        namespaces: Iterable[NamespaceLike] | None = None,
        max_pages_per_event: int = 0,
    ) -> AsyncIterator[pb.SubscribeEvent]:
        """See ``PrefixCacheClient.subscribe``."""
        request = subscribe_request(model, after_seq, server_epoch, namespaces, max_pages_per_event)
        call = self._stub.Subscribe(request, metadata=self._metadata)
        try:
            async for event in call:
                yield event
        except grpc.RpcError as exc:
            raise self._error(exc) from exc
        finally:
            call.cancel()

    # --------------------------------------------------------------- sessions

    async def open_session(
        self,
        ttl: float | None = None,
        name: str | None = None,
        *,
        timeout: float | None = None,
        retain: Any = None,
    ) -> results.SessionInfo:
        return await self._run(self._op_open_session(ttl, name, retain), timeout)

    async def keep_alive(self, session: SessionLike, *, timeout: float | None = None) -> float:
        return await self._run(self._op_keep_alive(session), timeout)

    async def close_session(
        self, session: SessionLike, *, timeout: float | None = None
    ) -> results.CloseReply:
        return await self._run(self._op_close_session(session), timeout)

    def session(
        self,
        ttl: float | None = None,
        *,
        name: str | None = None,
        renew: bool = True,
        fail_open: bool | None = None,
        timeout: float | None = None,
        retain: Any = None,
    ) -> AsyncClientSession:
        """A leased session renewed by a task every ``ttl / 3``; opened by
        ``async with`` (which closes it on exit) or by ``await``."""
        return AsyncClientSession(
            self, ttl, name=name, renew=renew, fail_open=fail_open, timeout=timeout, retain=retain
        )

    def stream_session(
        self,
        *,
        fail_open: bool | None = None,
        timeout: float | None = None,
        keep_alive: bool = True,
    ) -> AsyncStreamSession:
        """A session carried by the bidirectional Session stream (``async with``); with
        ``keep_alive`` it keeps itself alive while idle (see ``AsyncStreamSession``)."""
        return AsyncStreamSession(self, fail_open=fail_open, timeout=timeout, keep_alive=keep_alive)

    # ------------------------------------------------------------ cache calls

    async def match(
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
        return await self._run(op, timeout, fail_open)

    async def insert(
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
        return await self._run(op, timeout, fail_open)

    async def retain(
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
        return await self._run(
            self._op_retain(model, tokens, retain, extra_key, token_width), timeout, fail_open
        )

    async def evict(
        self,
        model: str,
        num_tokens: int = 0,
        *,
        swa_num_tokens: int = 0,
        mamba_num: int = 0,
        session: SessionLike = None,
        timeout: float | None = None,
    ) -> results.EvictReply:
        return await self._run(
            self._op_evict(model, num_tokens, swa_num_tokens, mamba_num, session), timeout
        )

    async def lock(
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
        return await self._run(
            self._op_lock(model, node_id, session, request_id, server_epoch), timeout, fail_open
        )

    async def unlock(
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
        return await self._run(
            self._op_unlock(lock_id, session, request_id, server_epoch, unused), timeout, fail_open
        )

    async def alloc(
        self,
        model: str,
        num_slots: int,
        *,
        num_state_slots: int = 0,
        session: SessionLike = None,
        timeout: float | None = None,
        as_pages: bool = False,
    ) -> results.AllocReply:
        return await self._run(
            self._op_alloc(model, num_slots, num_state_slots, session, as_pages), timeout
        )

    async def free(
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
        await self._run(
            self._op_free(model, slots, state_slots, session, server_epoch), timeout, fail_open
        )

    async def reset(self, model: str, *, timeout: float | None = None) -> results.ResetReply:
        return await self._run(self._op_reset(model), timeout)

    async def step(
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
        """See ``PrefixCacheClient.step``."""
        items = StepItems.of(finishes, unlocks, frees, decodes, admits)
        return await self._run(
            self._op_step(model, items, session, request_id, server_epoch), timeout, fail_open
        )
