"""ClientSession: the blocking client's leased session, renewed by a thread, that
outlives its service-side session."""

from __future__ import annotations

import threading
import weakref
from types import TracebackType
from typing import Any

from .. import results, step
from .._flow import run_blocking
from .._session_state import SessionState
from ..transfer import kv
from . import _session_flow as flows
from ._client_protocol import BlockingClient


class ClientSession:
    """A leased session, renewed in a background thread while it is open.

    It outlives its service-side session: when the service restarts or the lease
    lapses, the next ``match`` or ``alloc`` opens a new one, and calls naming handles
    of the old one (its lock ids, or a ``server_epoch`` that is not the session's) are
    refused without being sent (``SessionLost`` / ``StaleEpoch``; skipped when failing
    open). Pass ``server_epoch=reply.server_epoch`` with the slots of a reply so that
    slots from before a restart are refused too.

    Attributes:
        session_id, ttl, server_epoch: of the current service-side session.
        lost: why the current service-side session is gone, else None.
        reopened: how many times a new service-side session replaced a lost one.
        dropped: calls refused because they named stale handles.
        renewals: successful keep-alives so far.
    """

    def __init__(
        self,
        client: BlockingClient,
        info: results.SessionInfo | SessionState,
        *,
        renew: bool = True,
        fail_open: bool | None = None,
        name: str | None = None,
        retain: Any = None,
    ) -> None:
        self.client = client
        self.retain = retain  # its default retention hint, also for a reopened session
        self._state = info if isinstance(info, SessionState) else SessionState(info)
        self.info = results.SessionInfo(
            self._state.session_id, self._state.ttl, self._state.server_epoch
        )
        self.name = name
        self.fail_open = fail_open
        self.closed = False
        self.renewals = 0
        self._renew = renew
        self._reopen_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_renewal()

    session_id = property(lambda self: self._state.session_id)
    ttl = property(lambda self: self._state.ttl)
    server_epoch = property(lambda self: self._state.server_epoch)
    lost = property(lambda self: self._state.lost)
    reopened = property(lambda self: self._state.reopened)
    dropped = property(lambda self: self._state.dropped)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "lost" if self.lost else "open"
        return f"ClientSession({self.session_id[:8]}..., ttl={self.ttl}, {state})"

    def _start_renewal(self) -> None:
        if self._renew and self.ttl > 0 and self.session_id:
            self._stop = threading.Event()
            flow = flows.renewal_flow(
                weakref.ref(self),
                self.client,
                self.session_id,
                self.server_epoch,
                self.ttl,
                self._stop.wait,
            )
            self._thread = threading.Thread(
                target=run_blocking,
                args=(flow,),
                daemon=True,
                name=f"prefixcache-lease-{self.session_id[:8]}",
            )
            self._thread.start()

    def _stop_renewal(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def _reopen(self) -> None:
        """Replace the lost service-side session with a new one."""
        with self._reopen_lock:
            run_blocking(flows.reopen_flow(self, None))

    def close(self) -> results.CloseReply | None:
        """Stop renewing and close the session (releasing its locks and slots).

        Returns what the service released; an empty reply when the service had already
        forgotten the session; None when it failed open (service unreachable). Closing
        twice is a no-op (None).
        """
        if self.closed:
            return None
        self.closed = True
        self._stop_renewal()
        return run_blocking(flows.close_flow(self))

    def __enter__(self) -> ClientSession:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        run_blocking(flows.exit_flow(self, kind is not None))

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """``client.<name>`` in this session, across a lost service-side session."""
        return run_blocking(flows.call_flow(self, self._state, name, args, kwargs))

    # ------------------------------------------ the client's calls, in this session

    def keep_alive(self, *, timeout: float | None = None) -> float:
        return self.client.keep_alive(self, timeout=timeout)

    def match(self, model: str, tokens: Any, **kwargs: Any) -> results.MatchReply:
        """``PrefixCacheClient.match`` in this session."""
        reply: results.MatchReply = self._call("match", model, tokens, **kwargs)
        return reply

    def insert(self, model: str, tokens: Any, slots: Any, **kwargs: Any) -> results.InsertReply:
        """``PrefixCacheClient.insert`` in this session."""
        reply: results.InsertReply = self._call("insert", model, tokens, slots, **kwargs)
        return reply

    def lock(self, model: str, node_id: int, **kwargs: Any) -> results.LockReply:
        """``PrefixCacheClient.lock`` in this session."""
        reply: results.LockReply = self._call("lock", model, node_id, **kwargs)
        return reply

    def unlock(self, lock_id: int, **kwargs: Any) -> results.UnlockReply:
        """``PrefixCacheClient.unlock`` in this session."""
        reply: results.UnlockReply = self._call("unlock", lock_id, **kwargs)
        return reply

    def alloc(self, model: str, num_slots: int, **kwargs: Any) -> results.AllocReply:
        """``PrefixCacheClient.alloc`` in this session (never fails open)."""
        reply: results.AllocReply = self._call("alloc", model, num_slots, **kwargs)
        return reply

    def free(self, model: str, slots: Any = (), **kwargs: Any) -> None:
        """``PrefixCacheClient.free`` in this session."""
        self._call("free", model, slots, **kwargs)

    def step(
        self,
        model: str,
        *,
        request_id: int | None = None,
        server_epoch: int | None = None,
        fail_open: bool | None = None,
        timeout: float | None = None,
        **lists: Any,
    ) -> step.StepReply:
        """``PrefixCacheClient.step`` in this session. After the service-side session
        was lost, the items that name its handles (finishes, unlocks, frees, and lock ids
        of an earlier session) are answered ``SessionLost`` without being sent; the
        admissions and decodes go out in a new session."""
        return run_blocking(
            flows.step_flow(
                self, self._state, model, request_id, server_epoch, fail_open, timeout, lists
            )
        )

    def write_kv(
        self, model: str, slots: Any = (), k: Any = None, v: Any = None, **kwargs: Any
    ) -> kv.WriteKVReply:
        """``PrefixCacheClient.write_kv`` in this session."""
        if (refused := self._state.refusal("write_kv", (), kwargs)) is not None:
            raise refused
        return self.client.write_kv(model, slots, k, v, session=self, **kwargs)

    def read_kv(self, model: str, slots: Any = (), **kwargs: Any) -> kv.KVData:
        """``PrefixCacheClient.read_kv`` of slots this session holds or has locked."""
        if (refused := self._state.refusal("read_kv", (), kwargs)) is not None:
            raise refused
        return self.client.read_kv(model, slots, session=self, **kwargs)

    def evict(self, model: str, num_tokens: int = 0, **kwargs: Any) -> results.EvictReply:
        """``PrefixCacheClient.evict``, attributed to this session."""
        return self.client.evict(model, num_tokens, session=self, **kwargs)
