"""The client side of `load.py`: one worker process with a ``PrefixCacheClient`` session
replaying its slice of the trace in a loop until the duration is up, timing each call
and counting errors (see load.py's docstring for the per-request sequence)."""

from __future__ import annotations

import mmap
import time
import traceback
from array import array
from dataclasses import dataclass, field
from typing import Any

from bench.grpc_servers import MODEL
from bench.load_mixed import KINDS, SideRequests

OPS = ("match", "insert", "alloc", "free", "unlock", "reopen", *KINDS)
START_TIMEOUT_S = 300.0
SESSION_TTL_S = 30.0
CALL_TIMEOUT_S = 30.0  # generous: on a 2-core box with 8 workers the tail is long


@dataclass
class WorkerSpec:
    target: str
    tokens_path: str
    spans: list[tuple[int, int]]
    index: int
    duration: float
    reopen_every: int
    decode_tokens: int
    side_every: int


@dataclass
class WorkerResult:
    index: int
    requests: int = 0
    reopens: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    first_errors: list[str] = field(default_factory=list)
    ns: dict[str, array] = field(default_factory=lambda: {op: array("q") for op in OPS})
    hit_tokens: int = 0
    query_tokens: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # expected outcomes, not errors
    t_start: float = 0.0
    t_end: float = 0.0
    failure: str = ""


def worker(spec: WorkerSpec, barrier: Any, out: Any) -> None:
    """Process entry: replay in a loop until the time is up; put a WorkerResult."""
    result = WorkerResult(spec.index)
    try:
        _replay(spec, barrier, result)
    except BaseException:  # reported to the parent, which fails the run
        result.failure = traceback.format_exc()
        barrier.abort()
    out.put(result)


def _error(result: WorkerResult, op: str, err: BaseException) -> None:
    key = f"{op} {type(err).__name__}"
    result.errors[key] = result.errors.get(key, 0) + 1
    if len(result.first_errors) < 5:
        result.first_errors.append(f"{key}: {err}")


def _replay(spec: WorkerSpec, barrier: Any, result: WorkerResult) -> None:
    from prefixcache.client import PrefixCacheClient, PrefixCacheError

    perf = time.perf_counter_ns
    ns = result.ns
    client = PrefixCacheClient(
        spec.target, timeout=CALL_TIMEOUT_S, fail_open=False, client_name=f"load-{spec.index}"
    )
    with (
        open(spec.tokens_path, "rb") as fh,
        mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm,
        client,
    ):
        session = client.session(ttl=SESSION_TTL_S, name=f"load-{spec.index}")
        client.stats(MODEL)  # connected
        side = (
            SideRequests(spec.index, lambda op, err: _error(result, op, err), result.counts)
            if spec.side_every
            else None
        )
        barrier.wait(START_TIMEOUT_S)
        result.t_start = time.monotonic()
        end = result.t_start + spec.duration
        i = 0
        while time.monotonic() < end:
            a, b = spec.spans[i % len(spec.spans)]
            key = bytes(mm[a:b])
            i += 1
            if i % spec.reopen_every == 0:
                t0 = perf()
                try:
                    # Leave a lock and slots behind: closing must release them.
                    session.match(MODEL, key, lock=True, allocate=True)
                    session.close()
                    session = client.session(ttl=SESSION_TTL_S, name=f"load-{spec.index}")
                except PrefixCacheError as err:
                    _error(result, "reopen", err)
                    if session.closed:
                        session = client.session(ttl=SESSION_TTL_S, name=f"load-{spec.index}")
                    continue
                ns["reopen"].append(perf() - t0)
                result.reopens += 1
                continue
            _request(
                session,
                key,
                spec.decode_tokens + i % 7,
                result,
                side if side is not None and i % spec.side_every == 0 else None,
            )
        result.t_end = time.monotonic()
        session.close()


def _request(
    session: Any, key: bytes, decode: int, result: WorkerResult, side: SideRequests | None = None
) -> None:
    """One prefill (and a side request while it is locked) and two decode steps; errors
    are counted and undone best effort."""
    from prefixcache.client import PrefixCacheError

    perf = time.perf_counter_ns
    ns = result.ns
    held: list[int] = []  # lock ids to release on error
    owned: list[Any] = []  # session-owned slot arrays to free on error
    op = "match"
    try:
        t0 = perf()
        m = session.match(MODEL, key, lock=True, allocate=True)
        ns["match"].append(perf() - t0)
        held.append(m.lock_id)
        owned.append(m.allocated)
        result.query_tokens += len(key) // 4
        result.hit_tokens += m.prefix_len
        op = "insert"
        t0 = perf()
        ins = session.insert(MODEL, key, m.all_slots(), release_lock_id=m.lock_id, lock=True)
        ns["insert"].append(perf() - t0)
        held[:] = [ins.lock_id]
        owned.clear()
        if side is not None:  # counts its own errors
            t0 = perf()
            kind = side.run(session, ins.lock_id)
            ns[kind].append(perf() - t0)
        op = "alloc"
        for _ in range(2):
            t0 = perf()
            owned.append(session.alloc(MODEL, decode).slots)
            ns["alloc"].append(perf() - t0)
        op = "free"
        t0 = perf()
        session.free(MODEL, owned[0] + owned[1])
        ns["free"].append(perf() - t0)
        owned.clear()
        op = "unlock"
        t0 = perf()
        session.unlock(ins.lock_id)
        ns["unlock"].append(perf() - t0)
        held.clear()
        result.requests += 1
    except PrefixCacheError as err:
        _error(result, op, err)
        try:
            for slots in owned:
                if len(slots):
                    session.free(MODEL, slots)
            for lock_id in held:
                if lock_id:
                    session.unlock(lock_id)
        except PrefixCacheError as undo:
            _error(result, "undo", undo)
