"""How a leased session's calls get through a lost service-side session, written once
for ``ClientSession`` and ``AsyncClientSession`` as flows (see ``_flow``): each session
drives them, one blocking and one awaiting.

A call naming stale handles is refused without being sent; a call naming none but the
session first opens a new service-side session; a first try that the service refuses
as stale (it restarted under us), or that fails open while the session is lost, runs
once more in a new session.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from .. import step
from .._core import FAIL_OPEN_ERRORS, log
from .._flow import Flow
from .._session_state import SessionState, stand_in, take_fail_open
from ..errors import NotFound, PrefixCacheError, StaleEpoch
from ..results import CloseReply, SessionInfo
from ._client_protocol import ClientCalls


class LeasedSession(Protocol):
    """What the flows use of a session. Its methods are blocking, or coroutine
    functions, as its client's calls are."""

    client: Any  # a BlockingClient or an AsyncClient (_client_protocol)
    fail_open: bool | None
    name: str | None
    retain: Any  # the session's default retention hint

    @property
    def info(self) -> SessionInfo | None: ...

    @info.setter
    def info(self, value: SessionInfo) -> None: ...

    @property
    def _state(self) -> SessionState | None: ...

    @property
    def session_id(self) -> str: ...

    @property
    def ttl(self) -> float: ...

    @property
    def lost(self) -> PrefixCacheError | None: ...

    def _reopen(self) -> Any: ...

    def _stop_renewal(self) -> Any: ...

    def _start_renewal(self) -> None: ...

    def close(self) -> Any: ...


def call_flow(
    session: LeasedSession,
    state: SessionState,
    name: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Flow[Any]:
    """``session.client.<name>(*args, session=session, **kwargs)``, across a lost
    service-side session."""
    client = session.client
    fail_open = take_fail_open(name, kwargs, session.fail_open)
    for attempt in range(2):
        if (refused := state.refusal(name, args, kwargs)) is not None:
            return client._stand_in(name, stand_in(name), refused, fail_open)
        if state.needs_reopen(name):
            try:
                yield session._reopen
            except FAIL_OPEN_ERRORS as err:  # a match without allocate may fail open
                fallback = None if kwargs.get("allocate") else stand_in(name)
                return client._stand_in(name, fallback, err, fail_open)
        try:
            reply = yield partial(getattr(client, name), *args, session=session, **kwargs)
        except StaleEpoch as err:
            if state.again(name, attempt, err=err):
                continue  # the service restarted under us
            raise
        if state.again(name, attempt, reply):
            continue
        state.record(name, args, kwargs, reply)
        return reply
    raise AssertionError("unreachable")


def step_flow(
    session: LeasedSession,
    state: SessionState,
    model: str,
    request_id: int | None,
    server_epoch: int | None,
    fail_open: bool | None,
    timeout: float | None,
    lists: dict[str, Any],
) -> Flow[step.StepReply]:
    """``client.step`` in ``session``: after the service-side session was lost, the
    items naming its handles are answered ``SessionLost`` without being sent; the
    admissions and decodes go out in a new session."""
    client: ClientCalls = session.client
    fail_open = session.fail_open if fail_open is None else fail_open
    items = step.StepItems.of(**lists)
    for attempt in range(2):
        if (refused := step.stale_fence(state, server_epoch)) is not None:
            return client._stand_in(
                "step", partial(step.failed_open, items, refused), refused, fail_open
            )
        todo = step.plan(state, items)
        if todo.fresh and state.needs_reopen("match"):
            try:
                yield session._reopen
            except FAIL_OPEN_ERRORS as err:
                return client._stand_in("step", partial(todo.failed_open, err), err, fail_open)
        if not len(todo.send):
            return todo.merge(step.StepReply(server_epoch=state.server_epoch))
        op = client._op_step(model, todo.send, session, request_id, server_epoch)
        try:
            reply = yield from client._run_flow(op, timeout, fail_open)
        except StaleEpoch:
            if attempt == 0:
                continue  # the service restarted under us: stale items stay here
            raise
        if reply.skipped and state.lost is not None and attempt == 0:
            continue
        step.record(state, todo.send, reply)
        return todo.merge(reply)
    raise AssertionError("unreachable")


def reopen_flow(session: LeasedSession, timeout: float | None) -> Flow[None]:
    """Replace the lost service-side session with a new one (a no-op when another
    caller already did, under the session's reopen lock)."""
    state = session._state
    if state is None or state.lost is None:
        return
    yield session._stop_renewal
    info: SessionInfo = yield partial(
        session.client.open_session,
        session.ttl,
        session.name,
        timeout=timeout,
        retain=session.retain,
    )
    session.info = info
    state.replaced_by(info)
    if state.reopened:
        log.warning("session reopened as %s... after losing the last one", state.session_id[:8])
    else:
        log.info("session %s... opened: the service is reachable again", state.session_id[:8])
    session._start_renewal()


def close_flow(session: LeasedSession) -> Flow[CloseReply | None]:
    """Close the service-side session (renewal already stopped): what the service
    released; an empty reply when it had already forgotten the session; None when it
    failed open."""
    if session.lost is not None:
        return CloseReply()
    try:
        closed: CloseReply = yield partial(session.client.close_session, session)
        return closed
    except (NotFound, StaleEpoch):
        return CloseReply()
    except FAIL_OPEN_ERRORS:
        allowed = session.client.fail_open if session.fail_open is None else session.fail_open
        if allowed:
            return None
        raise


def exit_flow(session: LeasedSession, leaving_on_error: bool) -> Flow[None]:
    """Close the session at the end of its ``with`` block; never hide the error that
    is leaving the block (a failed close is logged instead)."""
    try:
        yield session.close
    except PrefixCacheError as err:
        if not leaving_on_error:
            raise
        log.warning("closing session %s... failed: %s", session.session_id[:8], err)


def renewal_flow(
    ref: weakref.ref[Any],
    client: ClientCalls,
    session_id: str,
    epoch: int,
    ttl: float,
    wait: Callable[[float], Any],
) -> Flow[None]:
    """Keep a session's lease alive every ``ttl / 3`` until it is closed or lost; ``wait``
    (a blocking or awaitable wait) answers true when the renewal is to stop.

    The renewal holds the session only weakly: a session dropped without ``close`` stops
    being renewed, and its lease lapses, releasing what it held.
    """
    interval = ttl / 3
    timeout = max(min(client.timeout, interval), 0.05)
    while not (yield partial(wait, interval)):
        if ref() is None:
            return
        try:
            yield from client._run_flow(client._op_keep_alive(session_id, epoch), timeout, None)
        except (NotFound, StaleEpoch) as err:
            _lost(ref, session_id, err)
            log.warning("session %s... is gone: %s", session_id[:8], err.details)
            return
        except PrefixCacheError as err:  # unreachable for now: try again next tick
            log.debug("keep-alive of session %s... failed: %s", session_id[:8], err)
        except ValueError:  # the channel was closed under us
            return
        else:
            _renewed(ref)


# Apart from the renewal, so that it keeps no strong reference to its session.


def _lost(ref: weakref.ref[Any], session_id: str, err: PrefixCacheError) -> None:
    session = ref()
    if session is not None and session._state is not None and session.session_id == session_id:
        session._state.mark_lost(err)


def _renewed(ref: weakref.ref[Any]) -> None:
    if (session := ref()) is not None:
        session.renewals += 1
