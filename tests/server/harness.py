"""A real server for tests: PrefixCacheServer on its own event loop in a thread."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from prefixcache.client import PrefixCacheClient
from prefixcache.server.app import PrefixCacheServer
from prefixcache.server.config import Config, MambaConfig, ModelConfig, PoolConfig, ServerConfig
from prefixcache.v1 import prefix_cache_pb2 as pb
from prefixcache.v1 import prefix_cache_pb2_grpc as pb_grpc

SMALL_POOL = PoolConfig(size=256, layers=1, k_heads=1, k_head_dim=4)
# One small model of every kind (two radix page sizes), for tests that cover them all.
EVERY_KIND = (
    ModelConfig(name="m", page_size=1, vocab_size=1000, pool=SMALL_POOL),
    ModelConfig(name="p", page_size=4, pool=PoolConfig(size=64, k_heads=1, k_head_dim=4)),
    ModelConfig(name="w", kind="swa", page_size=1, sliding_window_size=4, pool=SMALL_POOL),
    ModelConfig(name="c", kind="chunk", page_size=1, pool=SMALL_POOL),
    ModelConfig(
        name="h",
        kind="mamba",
        page_size=2,
        pool=SMALL_POOL,
        mamba=MambaConfig(
            state_slots=4,
            working_slots=2,
            layers=2,
            conv_state_shape=(3, 2),
            temporal_state_shape=(2, 2, 2),
        ),
    ),
    ModelConfig(
        name="s", kind="slot", max_seq_len=16, pool=PoolConfig(size=4, k_heads=1, k_head_dim=2)
    ),
)


class ServerThread:
    """Runs a server until ``stop``; ``call`` runs a coroutine on its loop."""

    def __init__(self, config: Config, check_integrity: bool = True) -> None:
        self.loop = asyncio.new_event_loop()
        self.server = PrefixCacheServer(config, check_integrity=check_integrity)
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.call(self.server.start())

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def run(self, fn: Any, *args: Any) -> Any:
        """Run a plain function on the server's loop (so it sees a quiet cache)."""

        async def wrapper() -> Any:
            return fn(*args)

        return self.call(wrapper())

    @property
    def service(self) -> Any:
        return self.server.service

    @property
    def address(self) -> str:
        return self.server.address

    def check_integrity(self) -> None:
        self.run(self.service.check_integrity)

    def stop(self, grace: float = 1.0) -> None:
        self.call(self.server.stop(grace))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def make_config(tmp: Path, models: Sequence[ModelConfig] | None = None, **server: Any) -> Config:
    server.setdefault("listen", f"unix:{tmp / 'pc.sock'}")
    server.setdefault("metrics_port", -1)
    # Tests get the opt-in change log (Subscribe, page RPCs) unless they say otherwise.
    server.setdefault("change_log_capacity", 65536)
    models = models or (ModelConfig(name="m", page_size=1, pool=SMALL_POOL),)
    return Config(ServerConfig(**server), tuple(models))


@contextmanager
def running(
    tmp: Path, models: Sequence[ModelConfig] | None = None, **server: Any
) -> Iterator[ServerThread]:
    thread = ServerThread(make_config(tmp, models, **server))
    try:
        yield thread
    finally:
        thread.stop()


# Generators for pytest fixtures (``yield from serve_module(...)``), so that each test file
# keeps its fixtures explicit while sharing their set-up and tear-down.


def serve_module(
    factory: Any, name: str, models: Sequence[ModelConfig] | None = None, **server: Any
) -> Iterator[ServerThread]:
    """A server in a fresh tmp dir named ``name`` (``factory`` is tmp_path_factory)."""
    with running(factory.mktemp(name), models, **server) as srv:
        yield srv


def stub_of(server: ServerThread) -> Iterator[pb_grpc.PrefixCacheStub]:
    """A stub on a channel to ``server``, closed afterwards."""
    channel, stub = stub_for(server.address)
    try:
        yield stub
    finally:
        channel.close()


def session_of(stub: pb_grpc.PrefixCacheStub, ttl: float = 60) -> Iterator[str]:
    """A session id, closed afterwards unless the test already closed it."""
    sid = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=ttl)).session_id
    yield sid
    with contextlib.suppress(grpc.RpcError):
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


def client_of(server: ServerThread, timeout: float = 5.0) -> Iterator[PrefixCacheClient]:
    """A PrefixCacheClient of ``server``, closed afterwards."""
    with PrefixCacheClient(server.address, timeout=timeout) as client:
        yield client


REPO = Path(__file__).resolve().parents[2]
# What a child process needs on its path: both source roots, then the caller's own
# PYTHONPATH (packages installed with --target, as on the GPU machine).
SOURCE_PATH = os.pathsep.join(
    [str(REPO / "server"), str(REPO / "client"), *filter(None, [os.environ.get("PYTHONPATH")])]
)


@contextmanager
def serve_process(tmp: Path, config_yaml: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`prefixcache serve` in a child process on a unix socket under ``tmp``; yields the
    process and its address once it answers, and stops it with SIGTERM (exit code 0)."""
    (tmp / "pc.yaml").write_text(config_yaml)
    sock = tmp / "pc.sock"
    env = {**os.environ, "PYTHONPATH": SOURCE_PATH, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prefixcache.server.cli",
            "serve",
            "--config",
            str(tmp / "pc.yaml"),
            "--listen",
            f"unix:{sock}",
            "--metrics-port",
            "-1",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_serving(proc, f"unix:{sock}")
        yield proc, f"unix:{sock}"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        if proc.wait(30) != 0:
            raise RuntimeError(f"prefixcache serve exited with {proc.returncode}")


def wait_serving(proc: subprocess.Popen[Any], address: str, timeout: float = 30.0) -> None:
    """Return once the server process at ``address`` answers a call; raise if it exits
    first (with its stderr, when that is a pipe) or does not answer within ``timeout``."""
    deadline = time.monotonic() + timeout
    channel, stub = stub_for(address)
    with channel:
        while True:
            try:
                stub.ListModels(pb.ListModelsRequest(), timeout=1)
                return
            except grpc.RpcError:
                if proc.poll() is not None:
                    err = proc.stderr.read() if proc.stderr and not proc.stderr.closed else ""
                    err = err.decode() if isinstance(err, bytes) else err
                    raise RuntimeError(f"serve exited {proc.returncode}:\n{err}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError("prefixcache serve did not start") from None
                time.sleep(0.1)


def toks(ids: Sequence[int] | np.ndarray) -> bytes:
    return np.asarray(ids, dtype="<u4").tobytes()


def slots(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype="<i8").tolist()


def pack_slots(ids: Sequence[int] | np.ndarray) -> bytes:
    return np.asarray(ids, dtype="<i8").tobytes()


def stub_for(address: str, **kwargs: Any) -> tuple[grpc.Channel, pb_grpc.PrefixCacheStub]:
    channel = grpc.insecure_channel(address, **kwargs)
    return channel, pb_grpc.PrefixCacheStub(channel)


__all__ = [
    "EVERY_KIND",
    "SMALL_POOL",
    "ServerThread",
    "client_of",
    "make_config",
    "pack_slots",
    "pb",
    "pb_grpc",
    "running",
    "serve_module",
    "serve_process",
    "session_of",
    "slots",
    "stub_for",
    "stub_of",
    "toks",
    "wait_serving",
]
