"""The servers `grpc_replay.py` measures, each a subprocess on a unix socket: ``prefixcache
serve``, the raw-bytes echo (``echo_server.py``) and the protobuf floor
(``floor_server.py``); and what it reads from the service afterwards (Stats, /metrics)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc

_REPO = Path(__file__).resolve().parents[1]
MODEL = "bench"
# `python -m prefixcache.server.cli` does not run main(): the module has no __main__ guard.
_SERVE = "import sys; from prefixcache.server.cli import main; sys.exit(main())"
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
_SERVER_PATHS = [str(_REPO / "server"), str(_REPO / "client")]


class ServerProcess:
    """A server subprocess on a unix socket; ``cpu_s`` reads its user+system time."""

    def __init__(self, name: str, argv: list[str], socket_path: Path, log_path: Path) -> None:
        self.name = name
        self.target = f"unix:{socket_path}"
        self.log_path = log_path
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            PYTHONPATH=os.pathsep.join(
                [*_SERVER_PATHS, *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        )
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv, env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=_REPO
        )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.target) as channel:
            ready = grpc.channel_ready_future(channel)
            while True:
                try:
                    ready.result(timeout=0.25)
                    return
                except grpc.FutureTimeoutError:
                    pass
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    ready.cancel()
                    self.stop()
                    raise RuntimeError(
                        f"{self.name} did not start (exit {self.proc.returncode})"
                        f"; its log:\n{self.log_tail()}"
                    )

    def cpu_s(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat", encoding="ascii") as fh:
            fields = fh.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_service(
    tmp: Path, budget: int, page_size: int, tag: str, change_log_capacity: int | None = None
) -> tuple[ServerProcess, int]:
    config = tmp / "bench.yaml"
    server = (
        ""
        if change_log_capacity is None
        else f"server:\n  change_log_capacity: {change_log_capacity}\n"
    )
    config.write_text(
        f"{server}models:\n  - name: {MODEL}\n    kind: radix\n    page_size: {page_size}\n"
        f"    pool: {{size: {budget}, layers: 1, k_heads: 1, k_head_dim: 8, "
        "dtype: float16}\n"
    )
    port = _free_port()
    argv = [
        sys.executable,
        "-c",
        _SERVE,
        "serve",
        "--config",
        str(config),
        "--listen",
        f"unix:{tmp / 'pc.sock'}",
        "--metrics-host",
        "127.0.0.1",
        "--metrics-port",
        str(port),
        "--grace-period",
        "1",
        "--log-level",
        "warning",
    ]
    log = tmp / f"server-{tag}.log"
    return ServerProcess("prefixcache serve", argv, tmp / "pc.sock", log), port


def start_echo(tmp: Path) -> ServerProcess:
    argv = [sys.executable, str(_REPO / "bench" / "echo_server.py"), f"unix:{tmp / 'echo.sock'}"]
    return ServerProcess("echo server", argv, tmp / "echo.sock", tmp / "echo.log")


def start_floor(tmp: Path) -> ServerProcess:
    argv = [sys.executable, str(_REPO / "bench" / "floor_server.py"), f"unix:{tmp / 'floor.sock'}"]
    return ServerProcess("floor server", argv, tmp / "floor.sock", tmp / "floor.log")


def service_stats(target: str) -> dict[str, Any]:
    from prefixcache.v1 import prefix_cache_pb2 as pb
    from prefixcache.v1 import prefix_cache_pb2_grpc as pb_grpc

    with grpc.insecure_channel(target) as channel:
        reply = pb_grpc.PrefixCacheStub(channel).Stats(pb.StatsRequest(model=MODEL), timeout=30)
    m = reply.models[0]
    return {
        "match_tokens": m.match_tokens_total,
        "hit_tokens": m.hit_tokens_total,
        "hit_ratio": m.hit_tokens_total / m.match_tokens_total if m.match_tokens_total else 0.0,
        "evicted_tokens": m.evicted_tokens_total,
        "cached_tokens": m.evictable_tokens + m.protected_tokens,
        "locks": m.locks,
        "session_slots": m.session_slots,
        "sessions": reply.sessions,
    }


_METRIC = re.compile(r"^prefixcache_rpc_duration_seconds_(sum|count)\{([^}]*)\} (\S+)$")


def handler_times(port: int) -> dict[str, float]:
    """Mean server-side handler µs per method (OK calls) from the service's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    acc: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if not (m := _METRIC.match(line)):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if labels.get("code") != "OK":
            continue
        acc.setdefault(labels["method"], {})[m.group(1)] = float(m.group(3))
    return {method: v["sum"] / v["count"] * 1e6 for method, v in acc.items() if v.get("count")}
