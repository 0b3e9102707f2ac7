"""The unix socket's relay (unix_peers.py): gRPC's callers named by the kernel.

Against real servers: the relay process is there while the server serves, tells gRPC
each connection's uid and pid, survives the signals that stop the service (which drains
through it), is started again when it dies, ends with the service (a clean stop, and a
SIGKILL of the service too), and leaves no socket, directory or process behind.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
from harness import SMALL_POOL, pack_slots, pb, running, serve_process, slots, stub_for

from prefixcache.server.access.unix_peers import credentials
from prefixcache.server.config import ModelConfig

MODELS = (ModelConfig(name="m", page_size=1, pool=SMALL_POOL),)


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started, from any of its threads."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as fh:
            out += [int(p) for p in fh.read().split()]
    return out


def _relay_pid(pid: int) -> int:
    relays = [c for c in _children(pid) if "unix_peers.py" in _cmdline(c)]
    assert len(relays) == 1, relays
    return relays[0]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not os.path.exists(f"/proc/{pid}") or _state(pid) == "Z":
            return True
        time.sleep(0.05)
    return False


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "X"


def _who(stub) -> str:
    """The client this process is, as a refusal at the cap names it."""
    sid = stub.OpenSession(pb.OpenSessionRequest(), timeout=10).session_id
    try:
        stub.OpenSession(pb.OpenSessionRequest(), timeout=10)
    except grpc.RpcError as exc:
        return exc.details()
    finally:
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)
    raise AssertionError("the second session was not refused")


def test_the_relay_names_callers_and_carries_their_bytes(tmp_path) -> None:
    with running(tmp_path, MODELS, max_sessions_per_client=1) as srv:
        relay = srv.server._relay
        folder = Path(relay.directory)
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert stat.S_IMODE(os.stat(tmp_path / "pc.sock").st_mode) == 0o600
        channel, stub = stub_for(srv.address)
        with channel:
            assert f"uid={os.geteuid()},pid={os.getpid()}" in _who(stub)
            # KV bytes through it, whole: a row per slot written, then read back.
            sid = stub.OpenSession(pb.OpenSessionRequest(), timeout=10).session_id
            held = slots(
                stub.Alloc(pb.AllocRequest(model="m", num_slots=128, session_id=sid)).slot_indices
            )
            d = stub.DescribePool(pb.DescribePoolRequest(model="m"))
            row = d.k_head_num * d.k_head_dim * 2
            data = {
                role: os.urandom(row * len(held)) for role in (pb.BUFFER_ROLE_K, pb.BUFFER_ROLE_V)
            }
            header = pb.KVChunk(
                header=pb.WriteKVHeader(
                    model="m", slot_indices=pack_slots(held), layers=[0], session_id=sid
                )
            )
            stub.WriteKV(
                iter(
                    [
                        header,
                        *(
                            pb.KVChunk(role=role, layer=0, offset_bytes=0, data=part)
                            for role, part in data.items()
                        ),
                    ]
                )
            )
            read: dict[int, bytes] = {}
            for chunk in stub.ReadKV(
                pb.ReadKVRequest(
                    model="m", session_id=sid, layers=[0], slot_indices=pack_slots(held)
                )
            ):
                read[chunk.role] = read.get(chunk.role, b"") + chunk.data
            assert read == data
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        # No name of a relay's is left in its directory, only gRPC's socket.
        assert [p.name for p in folder.iterdir()] == ["grpc.sock"]
    assert not folder.exists() and not (tmp_path / "pc.sock").exists()
    assert credentials(f"unix:{folder}/0.1.2") is None  # forgotten with its relay


def test_the_relay_outlives_stop_signals_and_comes_back_when_killed(tmp_path) -> None:
    with running(tmp_path, MODELS) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            stub.ListModels(pb.ListModelsRequest(), timeout=10)  # the relay is up
            first = _relay_pid(os.getpid())
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                os.kill(first, signum)
            stub.ListModels(pb.ListModelsRequest(), timeout=10)
            assert _relay_pid(os.getpid()) == first
            os.kill(first, signal.SIGKILL)
            assert _gone(first)
            deadline = time.monotonic() + 10
            while srv.server._relay.restarts == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert srv.server._relay.restarts == 1
            # The channel reconnects through the new relay.
            stub.ListModels(pb.ListModelsRequest(), timeout=10, wait_for_ready=True)
            second = _relay_pid(os.getpid())
            assert second != first
    assert _gone(second)
    assert [c for c in _children(os.getpid()) if "unix_peers.py" in _cmdline(c)] == []


def test_the_relay_ends_when_the_service_is_killed(tmp_path) -> None:
    yaml = "models:\n  - name: m\n    pool: {size: 64, layers: 1, k_heads: 1, k_head_dim: 4}\n"
    with serve_process(tmp_path, yaml) as (proc, _):
        relay = _relay_pid(proc.pid)
        folder = _cmdline(relay).split()[-1]  # its private directory
        proc.kill()
        proc.wait(10)
        assert _gone(relay), "the relay outlived its service"
        assert not os.path.exists(folder)  # its private directory went with it
        # Its socket stays (a stale one, which the next start removes).
        restart = subprocess.run(
            [
                sys.executable,
                "-c",
                "import socket, sys; s = socket.socket(socket.AF_UNIX);s.connect(sys.argv[1])",
                str(tmp_path / "pc.sock"),
            ],
            capture_output=True,
        )
        assert restart.returncode != 0  # nobody accepts on it any more
        proc.returncode = 0  # serve_process expects a clean exit; this one was killed
