"""SIGTERM during load: `prefixcache serve --grace-period 2` in a subprocess, hammered by
unary callers and Session streams, must exit 0 within the grace period (plus a little
for teardown), remove its socket, and never leave a call hanging or failing oddly.

What each kind of call may see (anything else fails the test):

- **unary** calls: OK (finished before or during the drain) or UNAVAILABLE (arrived
  while draining, or after the socket was gone). Every call has a 5 s deadline, far
  above the grace period, so DEADLINE_EXCEEDED can only mean a hang.
- **Session stream ops**: in-band OK or in-band UNAVAILABLE (the server answers ops
  with an `error` while draining; the stream itself stays open).
- **Session stream ends**: a client that closes its side when it sees UNAVAILABLE gets
  a clean OK end. A client that keeps its stream open past the grace period (one that
  keeps sending, and one that sits idle) has it cut by the server when the grace period
  expires: CANCELLED or UNAVAILABLE. That is what a grace period means, and the client
  learns at once; what it must never see is its deadline (a hang), INTERNAL or UNKNOWN.
  A stream opened after the drain began is refused with UNAVAILABLE.

A unary call already received but not yet dispatched when SIGTERM arrives would be
cancelled by gRPC core (CANCELLED) if gRPC stopped at once. The server keeps the loop
running a moment (`_DISPATCH_WINDOW` in app.py) after it starts draining and before it
stops gRPC, so such calls reach a handler and get UNAVAILABLE. A call that only arrives
once gRPC itself is stopping (after that window) is cancelled by gRPC core: it was never
in flight, and the client maps CANCELLED to Unavailable (retryable, fail-open). So
CANCELLED is allowed for unary calls started after the window, and for none started
before it.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from harness import wait_serving

from prefixcache.v1 import prefix_cache_pb2 as pb
from prefixcache.v1 import prefix_cache_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-c", "from prefixcache.server.cli import main; raise SystemExit(main())"]
GRACE = 2.0
# How long a stopping server may take to exit: a bound on the wait, no claim of speed
# (teardown at load 10 took over 3 s after "stopped"). Whether the drain kept to its
# grace period is told by what it did: the codes of the calls and streams it cut (a
# stream held past it would end DEADLINE_EXCEEDED, at STREAM_DEADLINE) and its log.
EXIT_WAIT = 30.0
CALL_DEADLINE = 5.0
STREAM_DEADLINE = 20.0
LOAD_BEFORE_SIGTERM = 1.5
MODEL = "m"
CONFIG = (
    f"models:\n  - name: {MODEL}\n    kind: radix\n    page_size: 16\n"
    "    pool: {size: 8192, layers: 1, k_heads: 1, k_head_dim: 8}\n"
)

OK = grpc.StatusCode.OK
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
CANCELLED = grpc.StatusCode.CANCELLED
DISPATCH_WINDOW = 0.2  # app.py's _DISPATCH_WINDOW: draining before gRPC's own stop


@dataclass(frozen=True)
class Outcome:
    who: str  # "unary", "stream-op", "stream-end:<behaviour>"
    what: str  # RPC or stream op
    code: grpc.StatusCode
    at: float  # monotonic start


def _code_of(value: int) -> grpc.StatusCode:
    return next(c for c in grpc.StatusCode if c.value[0] == value)


def _tokens(i: int) -> bytes:
    # 24 conversations of 4..12 pages sharing a 2-page system prompt: hits, splits,
    # and (8192-slot pool) eviction all happen.
    conv, turn = i % 24, i // 24 % 5
    base = list(range(32)) + [1000 + conv * 500 + t for t in range(32 + 32 * turn)]
    return array("I", base[: len(base) - len(base) % 16]).tobytes()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXCACHE_")}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "server"), str(ROOT / "client"), *filter(None, [env.get("PYTHONPATH")])]
    )
    env["OMP_NUM_THREADS"] = "1"
    return env


class Load:
    """Client threads against ``address`` recording every call's outcome until stopped."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.outcomes: list[Outcome] = []
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.crashes: list[str] = []

    def record(self, who: str, what: str, code: grpc.StatusCode, t0: float) -> None:
        self.outcomes.append(Outcome(who, what, code, t0))

    def start(self, unary: int = 3) -> None:
        targets: list[tuple[Any, tuple[Any, ...]]] = [(self._unary, (i,)) for i in range(unary)]
        targets += [
            (self._stream, ("polite",)),
            (self._stream, ("stubborn",)),
            (self._stream, ("idle",)),
        ]
        for fn, args in targets:
            t = threading.Thread(target=self._guard, args=(fn, *args), daemon=True)
            t.start()
            self.threads.append(t)

    def _guard(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # a bug in the test's client code, reported by the test
            self.crashes.append(f"{fn.__name__}{args}: {exc!r}")

    def _call(self, stub_method: Any, request: Any, what: str) -> Any:
        t0 = time.monotonic()
        try:
            reply = stub_method(request, timeout=CALL_DEADLINE)
        except grpc.RpcError as exc:
            self.record("unary", what, exc.code(), t0)
            return None
        self.record("unary", what, OK, t0)
        return reply

    def _unary(self, index: int) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = pb_grpc.PrefixCacheStub(channel)
            sid = stub.OpenSession(
                pb.OpenSessionRequest(ttl_seconds=30), timeout=CALL_DEADLINE
            ).session_id
            i = index * 1000
            while not self.stop.is_set():
                i += 1
                key = _tokens(i)
                m = self._call(
                    stub.Match,
                    pb.MatchRequest(
                        model=MODEL, token_ids=key, session_id=sid, lock=True, allocate=True
                    ),
                    "Match",
                )
                if m is None:
                    time.sleep(0.01)
                    continue
                ins = self._call(
                    stub.Insert,
                    pb.InsertRequest(
                        model=MODEL,
                        token_ids=key,
                        slot_indices=m.slot_indices + m.allocated_slots,
                        session_id=sid,
                        release_lock_id=m.lock_id,
                    ),
                    "Insert",
                )
                if ins is None:
                    time.sleep(0.01)
                    continue
                if i % 3 == 0:
                    a = self._call(
                        stub.Alloc,
                        pb.AllocRequest(model=MODEL, num_slots=16, session_id=sid),
                        "Alloc",
                    )
                    if a is not None:
                        self._call(
                            stub.Free,
                            pb.FreeRequest(
                                model=MODEL, slot_indices=a.slot_indices, session_id=sid
                            ),
                            "Free",
                        )
                if i % 5 == 0:
                    self._call(stub.Stats, pb.StatsRequest(model=MODEL), "Stats")

    def _stream(self, behaviour: str) -> None:
        """``polite`` closes its side on the first UNAVAILABLE; ``stubborn`` keeps sending
        until the stream is cut; ``idle`` does one op and then waits. After a stream
        ends, polite and stubborn open another (it is refused once draining)."""
        with grpc.insecure_channel(self.address) as channel:
            stub = pb_grpc.PrefixCacheStub(channel)
            while not self.stop.is_set():
                self._one_stream(stub, behaviour)
                if behaviour == "idle":
                    return
                time.sleep(0.01)

    def _one_stream(self, stub: Any, behaviour: str) -> None:
        requests: queue.Queue[Any] = queue.Queue()

        def feed() -> Iterator[Any]:
            while (r := requests.get()) is not None:
                yield r

        opened = time.monotonic()
        call = stub.Session(feed(), timeout=STREAM_DEADLINE)
        who = f"stream-end:{behaviour}"
        seq = 0
        try:
            while not self.stop.is_set():
                seq += 1
                if seq % 2:
                    req = pb.SessionRequest(
                        seq=seq,
                        match=pb.MatchRequest(
                            model=MODEL, token_ids=_tokens(seq), lock=True, allocate=True
                        ),
                    )
                else:
                    req = pb.SessionRequest(seq=seq, stats=pb.StatsRequest(model=MODEL))
                t0 = time.monotonic()
                requests.put(req)
                reply = next(call)
                assert reply.seq == seq, (reply.seq, seq)
                code = _code_of(reply.error.code) if reply.HasField("error") else OK
                self.record("stream-op", req.WhichOneof("op"), code, t0)
                if behaviour == "idle":
                    break
                if code is not OK and behaviour == "polite":
                    break
                if req.HasField("match") and code is OK and reply.match.lock_id:
                    seq += 1
                    requests.put(
                        pb.SessionRequest(
                            seq=seq, unlock=pb.UnlockRequest(lock_id=reply.match.lock_id)
                        )
                    )
                    t1 = time.monotonic()
                    r = next(call)
                    self.record(
                        "stream-op",
                        "unlock",
                        _code_of(r.error.code) if r.HasField("error") else OK,
                        t1,
                    )
                    requests.put(
                        pb.SessionRequest(
                            seq=seq + 1,
                            free=pb.FreeRequest(
                                model=MODEL, slot_indices=reply.match.allocated_slots
                            ),
                        )
                    )
                    seq += 1
                    t1 = time.monotonic()
                    r = next(call)
                    self.record(
                        "stream-op",
                        "free",
                        _code_of(r.error.code) if r.HasField("error") else OK,
                        t1,
                    )
            if behaviour != "stubborn":
                if behaviour == "polite":
                    requests.put(None)  # done writing
                for _ in call:  # idle: blocks until the server ends the stream
                    pass
            self.record(who, "end", call.code() or OK, opened)
        except grpc.RpcError as exc:
            self.record(who, "end", exc.code(), opened)
        except StopIteration:
            self.record(who, "end", call.code() or OK, opened)
        finally:
            requests.put(None)
            call.cancel()


@pytest.mark.slow
def test_sigterm_under_load_drains_cleanly(tmp_path: Path) -> None:
    (tmp_path / "pc.yaml").write_text(CONFIG)
    sock = tmp_path / "pc.sock"
    address = f"unix:{sock}"
    stderr_path = tmp_path / "serve.stderr"
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(
            [
                *CLI,
                "serve",
                "--config",
                str(tmp_path / "pc.yaml"),
                "--listen",
                address,
                "--metrics-port",
                "-1",
                "--grace-period",
                str(GRACE),
            ],
            cwd=tmp_path,
            env=_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    load = Load(address)
    try:
        _wait_serving(proc, address, stderr_path)
        load.start()
        time.sleep(LOAD_BEFORE_SIGTERM)
        before = len(load.outcomes)
        sigterm_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(EXIT_WAIT)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"serve still running {EXIT_WAIT} s after SIGTERM:\n{stderr_path.read_text()}"
            )
        exited_after = time.monotonic() - sigterm_at  # for the report
        time.sleep(0.3)  # calls against the gone server: UNAVAILABLE at once
    finally:
        load.stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for t in load.threads:
            t.join(STREAM_DEADLINE + 5)
    log = stderr_path.read_text()
    assert code == 0, log
    assert not sock.exists(), "serve left its socket file behind"
    assert "Traceback" not in log and "internal error" not in log, log
    assert not [t for t in load.threads if t.is_alive()], "a client thread hung"
    assert not load.crashes, load.crashes

    outcomes = list(load.outcomes)
    print(f"serve exited {exited_after:.2f} s after SIGTERM; outcomes:\n{_summary(outcomes)}")
    assert before > 0, "no call completed before SIGTERM"
    allowed = {
        "unary": {OK, UNAVAILABLE},
        "stream-op": {OK, UNAVAILABLE},
        "stream-end:polite": {OK, UNAVAILABLE},
        "stream-end:stubborn": {CANCELLED, UNAVAILABLE},
        "stream-end:idle": {CANCELLED, UNAVAILABLE},
    }
    stopping = sigterm_at + DISPATCH_WINDOW - 0.05  # gRPC stops taking calls after this
    # A call or stream opened once gRPC stops taking calls may be cancelled by gRPC
    # itself before the server sees it.
    bad = [
        o
        for o in outcomes
        if o.code not in allowed[o.who]
        and not (
            o.who in ("unary", "stream-end:polite") and o.code is CANCELLED and o.at >= stopping
        )
    ]
    assert not bad, (
        _summary(bad)
        + "\n"
        + "\n".join(f"{o}: started {o.at - sigterm_at:+.3f} s after SIGTERM" for o in bad[:10])
    )
    seen = {(o.who, o.code) for o in outcomes}
    assert ("unary", OK) in seen and ("unary", UNAVAILABLE) in seen, _summary(outcomes)
    assert ("stream-op", UNAVAILABLE) in seen, "no stream op was refused while draining"
    assert {o.who for o in outcomes} >= set(allowed), _summary(outcomes)


def _summary(outcomes: list[Outcome]) -> str:
    counts: dict[tuple[str, str, str], int] = {}
    for o in outcomes:
        key = (o.who, o.what, o.code.name)
        counts[key] = counts.get(key, 0) + 1
    return "\n".join(f"{k}: {v}" for k, v in sorted(counts.items()))


def _wait_serving(proc: subprocess.Popen[Any], address: str, stderr_path: Path) -> None:
    try:
        wait_serving(proc, address)
    except (RuntimeError, TimeoutError) as exc:
        pytest.fail(f"{exc}\n{stderr_path.read_text()}")


# ------------------------------------------------------------ other signals, start-up

SIGNAL_GRACE = 1.0


def _start(tmp: Path, *extra: str) -> tuple[subprocess.Popen[Any], Path, Path, Path]:
    """`prefixcache serve` with its pools in ``tmp/shm``; (process, socket, shm, stderr)."""
    (tmp / "pc.yaml").write_text(CONFIG)
    sock, shm, stderr_path = tmp / "pc.sock", tmp / "shm", tmp / "serve.stderr"
    shm.mkdir()
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(
            [
                *CLI,
                "serve",
                "--config",
                str(tmp / "pc.yaml"),
                "--listen",
                f"unix:{sock}",
                "--metrics-port",
                "-1",
                "--grace-period",
                str(SIGNAL_GRACE),
                "--shm-dir",
                str(shm),
                *extra,
            ],
            cwd=tmp,
            env=_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    return proc, sock, shm, stderr_path


def _exit_code(proc: subprocess.Popen[Any], stderr_path: Path, timeout: float) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"serve still running {timeout} s after the signal:\n{stderr_path.read_text()}")


def _assert_clean_exit(code: int, sock: Path, shm: Path, stderr_path: Path) -> str:
    log = stderr_path.read_text()
    assert code == 0, f"exit {code}:\n{log}"
    assert not sock.exists(), "serve left its socket file behind"
    assert not list(shm.iterdir()), f"serve left shared memory behind: {list(shm.iterdir())}"
    assert "Traceback" not in log, log
    return log


def test_sighup_drains_like_sigterm(tmp_path: Path) -> None:
    """SIGHUP is no reload and no crash: the server drains (a stream open during the
    grace period keeps it up that long, then is cut), removes its files and exits 0."""
    proc, sock, shm, stderr_path = _start(tmp_path)
    address = f"unix:{sock}"
    try:
        _wait_serving(proc, address, stderr_path)
        with grpc.insecure_channel(address) as channel:
            requests: queue.Queue[Any] = queue.Queue()
            stream = pb_grpc.PrefixCacheStub(channel).Session(
                iter(requests.get, None), timeout=STREAM_DEADLINE
            )
            requests.put(pb.SessionRequest(seq=1, stats=pb.StatsRequest(model=MODEL)))
            assert next(stream).seq == 1
            hup_at = time.monotonic()
            proc.send_signal(signal.SIGHUP)
            with pytest.raises(grpc.RpcError) as cut:
                next(stream)  # the server ends the idle stream when the grace period is up
            requests.put(None)
        code = _exit_code(proc, stderr_path, EXIT_WAIT)
        took = time.monotonic() - hup_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = _assert_clean_exit(code, sock, shm, stderr_path)
    assert cut.value.code() in (CANCELLED, UNAVAILABLE), cut.value
    assert took >= SIGNAL_GRACE * 0.9, f"exited {took:.2f} s after SIGHUP: no drain"
    assert "signal=SIGHUP" in log and "draining" in log, log


def test_every_stop_signal_cleans_up(tmp_path: Path) -> None:
    """SIGQUIT and SIGUSR1 (like the rest of signals.STOP_SIGNALS) used to kill the
    server with its socket and shared-memory files left behind. Two servers at once."""
    from prefixcache.server.signals import STOP_SIGNALS

    named = {
        signal.SIGTERM,
        signal.SIGINT,
        signal.SIGHUP,
        signal.SIGQUIT,
        signal.SIGUSR1,
        signal.SIGUSR2,
    }
    assert named <= set(STOP_SIGNALS)
    sigs = (signal.SIGQUIT, signal.SIGUSR1)
    runs = []
    try:
        for sig in sigs:
            (tmp_path / sig.name).mkdir()
            runs.append(_start(tmp_path / sig.name))
        for proc, sock, _shm, stderr_path in runs:
            _wait_serving(proc, f"unix:{sock}", stderr_path)
        for sig, (proc, *_rest) in zip(sigs, runs, strict=True):
            proc.send_signal(sig)
        for sig, (proc, sock, shm, stderr_path) in zip(sigs, runs, strict=True):
            code = _exit_code(proc, stderr_path, EXIT_WAIT)
            log = _assert_clean_exit(code, sock, shm, stderr_path)
            assert f"signal={sig.name}" in log and "stopped" in log, log
    finally:
        for proc, *_rest in runs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _catches(pid: int, sig: signal.Signals) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    (mask,) = [line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")]
    return bool(int(mask, 16) >> (sig - 1) & 1)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("phase", ["imports", "pools"])
def test_sigterm_during_start_up_exits_0_leaving_nothing(tmp_path: Path, phase: str) -> None:
    """SIGTERM while start-up imports torch, or while it makes the pools, used to kill
    the server (exit -15), leaving the pools' files. Now it stops once the pools are made,
    frees them, never binds, and exits 0."""
    proc, sock, shm, stderr_path = _start(tmp_path)
    try:
        deadline = time.monotonic() + 30
        # "imports": the moment `serve` catches SIGTERM, before it imports torch;
        # "pools": the moment the first pool's shared-memory file appears.
        while not (
            _catches(proc.pid, signal.SIGTERM) if phase == "imports" else any(shm.iterdir())
        ):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"serve exited {proc.returncode} or never got to {phase}:\n"
                    f"{stderr_path.read_text()}"
                )
            time.sleep(0.001)
        proc.send_signal(signal.SIGTERM)
        code = _exit_code(proc, stderr_path, EXIT_WAIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = _assert_clean_exit(code, sock, shm, stderr_path)
    if phase == "imports":
        assert "stopped before start" in log and "serving" not in log, log


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
def test_a_second_stop_signal_cuts_the_drain_short(tmp_path: Path, second: signal.Signals) -> None:
    """With a 60 s grace period and a stream that keeps it busy, the second signal ends
    the drain at once: the stream is cut, the files go, exit 0. It is not ignored as a
    repeat of the stop the first signal set: the server does not wait out the grace."""
    proc, sock, shm, stderr_path = _start(tmp_path, "--grace-period", "60")
    address = f"unix:{sock}"
    try:
        _wait_serving(proc, address, stderr_path)
        with grpc.insecure_channel(address) as channel:
            requests: queue.Queue[Any] = queue.Queue()
            stream = pb_grpc.PrefixCacheStub(channel).Session(
                iter(requests.get, None), timeout=STREAM_DEADLINE
            )
            requests.put(pb.SessionRequest(seq=1, stats=pb.StatsRequest(model=MODEL)))
            assert next(stream).seq == 1
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while "draining" not in stderr_path.read_text():
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.02)
            time.sleep(0.5)  # well into the drain
            proc.send_signal(second)
            with pytest.raises(grpc.RpcError) as cut:
                next(stream)
            requests.put(None)
        # Cut short: the stream ended by the server (not by its 20 s deadline, far short
        # of the 60 s grace the first signal began), and the log says why.
        code = _exit_code(proc, stderr_path, EXIT_WAIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = _assert_clean_exit(code, sock, shm, stderr_path)
    assert cut.value.code() in (CANCELLED, UNAVAILABLE), cut.value
    assert "cutting the drain short" in log, log
