"""`prefixcache serve` and `prefixcache stats` as real subprocesses.

One server per module answers the read-only checks (health, metrics, stats,
reflection); the shutdown test starts its own, since it ends it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from server.harness import pb, stub_for, toks

ROOT = Path(__file__).resolve().parents[2]
# `python -m prefixcache.server.cli` would not call main(); this runs the console
# script's entry point whether or not the project is installed.
CLI = [sys.executable, "-c", "from prefixcache.server.cli import main; raise SystemExit(main())"]
SERVICE = "prefixcache.v1.PrefixCache"
START_TIMEOUT = 30.0
GRACE = 2.0


def _env() -> dict[str, str]:
    # Settings from the caller's environment would leak into the server's config.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXCACHE_")}
    paths = [str(ROOT / "server"), str(ROOT / "client")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _cli(*args: str | Path, cwd: Path, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *map(str, args)],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _health(address: str, service: str = "") -> int:
    """The health status of ``service``; raises grpc.RpcError while nothing answers."""
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=2.0
        )
    return reply.status


class Served:
    """A `prefixcache serve` subprocess with its stderr in a file."""

    def __init__(self, tmp: Path, *extra: str) -> None:
        self.tmp = tmp
        self.socket = tmp / "s.sock"
        self.address = f"unix:{self.socket}"
        self.stderr_path = tmp / "serve.stderr"
        self._stderr: IO[str] = open(self.stderr_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [
                *CLI,
                "serve",
                "--listen",
                self.address,
                "--metrics-port",
                "0",
                "--grace-period",
                str(GRACE),
                *extra,
            ],
            cwd=tmp,
            env=_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
            text=True,
        )

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def wait_serving(self) -> None:
        """Poll the overall health status until SERVING (the process must stay up)."""
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"serve exited with {self.proc.returncode}:\n{self.stderr}")
            try:
                if _health(self.address) == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"serve not SERVING after {START_TIMEOUT} s:\n{self.stderr}")
            time.sleep(0.2)

    def log_line(self, event: str) -> str:
        """The first stderr line that logs ``event`` (waits for it a little)."""
        deadline = time.monotonic() + 10.0
        while True:
            for line in self.stderr.splitlines():
                if re.search(rf"\b{re.escape(event)}\b", line):
                    return line
            if time.monotonic() > deadline:
                pytest.fail(f"no {event!r} line on stderr:\n{self.stderr}")
            time.sleep(0.1)

    def terminate(self, timeout: float) -> int:
        """SIGTERM, then the exit code (killing it if it outlives ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"serve still running {timeout} s after SIGTERM:\n{self.stderr}")
        finally:
            self._stderr.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    server = Served(tmp_path_factory.mktemp("serve"))
    try:
        server.wait_serving()
        yield server
    finally:
        server.terminate(GRACE + 10)


# ------------------------------------------------------------------ the server


def test_serve_reports_serving_overall_and_per_model(served: Served) -> None:
    serving = health_pb2.HealthCheckResponse.SERVING
    assert _health(served.address) == serving
    assert _health(served.address, SERVICE) == serving
    assert _health(served.address, f"{SERVICE}/default") == serving


def test_serve_unknown_model_health_is_not_found(served: Served) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _health(served.address, f"{SERVICE}/nope")
    assert info.value.code() is grpc.StatusCode.NOT_FOUND


def test_serve_hosts_the_embedded_default_model(served: Served) -> None:
    channel, stub = stub_for(served.address)
    with channel:
        reply = stub.ListModels(pb.ListModelsRequest(), timeout=10)
    assert [(m.name, m.page_size, m.cache_kind) for m in reply.models] == [
        ("default", 16, pb.CACHE_KIND_RADIX)
    ]


def test_serve_socket_is_owner_only(served: Served) -> None:
    assert served.socket.is_socket()
    assert os.stat(served.socket).st_mode & 0o777 == 0o600


def test_serve_text_log_names_listen_and_metrics_port(served: Served) -> None:
    line = served.log_line("serving")
    assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z info +serving ", line), line
    assert f"listen={served.address}" in line
    assert "models=default" in line
    assert re.search(r"\bmetrics_port=\d+\b", line), line


def test_serve_metrics_endpoint(served: Served) -> None:
    channel, stub = stub_for(served.address)
    with channel:
        stub.Stats(pb.StatsRequest(), timeout=10)
        stub.Match(pb.MatchRequest(model="default", token_ids=toks(range(32))), timeout=10)
    port = int(re.search(r"\bmetrics_port=(\d+)", served.log_line("serving"))[1])
    assert port > 0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    assert "prefixcache_rpc_requests_total" in text
    assert re.search(
        r'^prefixcache_rpc_requests_total\{[^}]*method="Stats"[^}]*\} [1-9]', text, re.MULTILINE
    ), text
    assert re.search(
        r'^prefixcache_query_tokens_total\{[^}]*model="default"[^}]*\} '
        r"(\d+)",
        text,
        re.MULTILINE,
    ), text


def test_serve_reflection_lists_the_service(served: Served) -> None:
    with grpc.insecure_channel(served.address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = database.get_services()
        assert SERVICE in services
        assert "grpc.health.v1.Health" in services
        descriptor = DescriptorPool(database).FindServiceByName(SERVICE)
        assert {"Match", "Insert", "Reset", "Session"} <= set(descriptor.methods_by_name)


# ----------------------------------------------------------------------- stats


def test_stats_prints_the_model(served: Served, tmp_path: Path) -> None:
    result = _cli("stats", "--target", served.address, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^default\s", result.stdout, re.MULTILINE), result.stdout
    assert "hit ratio" in result.stdout


def test_stats_json(served: Served, tmp_path: Path) -> None:
    result = _cli("stats", "--target", served.address, "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert isinstance(data["models"], list)
    assert [m["model"] for m in data["models"]] == ["default"]
    assert int(data["models"][0]["poolSize"]) == 16384


def test_stats_unreachable_target_exits_1(tmp_path: Path) -> None:
    result = _cli(
        "stats", "--target", f"unix:{tmp_path / 'none.sock'}", "--timeout", "2", cwd=tmp_path
    )
    assert result.returncode == 1
    assert "UNAVAILABLE" in result.stderr


# -------------------------------------------------------------------- shutdown


def test_sigterm_drains_and_exits_0_with_json_logs(tmp_path: Path) -> None:
    server = Served(tmp_path, "--log-format", "json")
    try:
        server.wait_serving()
        channel, stub = stub_for(server.address)
        with channel:
            assert stub.ListModels(pb.ListModelsRequest(), timeout=10).models
    finally:
        code = server.terminate(GRACE + 5)  # fails the test if serve outlives that
    assert code == 0, server.stderr
    assert not server.socket.exists(), "serve left its socket file behind"
    lines = server.stderr.splitlines()
    assert lines
    events = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            pytest.fail(f"stderr line is not JSON: {line!r}")
        assert {"ts", "level", "event"} <= set(record), line
        events.append(record["event"])
    assert events[0] == "serving"
    assert {"draining", "stopped"} <= set(events), events
    serving = json.loads(lines[0])
    assert serving["listen"] == server.address
    assert isinstance(serving["metrics_port"], int) and serving["metrics_port"] > 0


# ---------------------------------------------------------------- config errors


def _config_error(tmp: Path, *args: str | Path) -> str:
    """Run serve with ``args``; it must exit 2 with a one-line config error."""
    result = _cli(
        "serve", "--listen", f"unix:{tmp / 'never.sock'}", "--metrics-port", "-1", *args, cwd=tmp
    )
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    assert "config error" in result.stderr, result.stderr
    assert not (tmp / "never.sock").exists()
    return result.stderr


@pytest.mark.parametrize(
    ("yaml_text", "names"),
    [
        ("models:\n  - name: a\n    page_size: 0\n", "models[0].page_size"),
        ("models:\n  - name: a\n    page_sise: 16\n", "models[0].page_sise"),
        ("server:\n  lisen: unix:/tmp/x.sock\n", "server.lisen"),
    ],
    ids=["page-size-0", "unknown-model-key", "unknown-server-key"],
)
def test_invalid_config_exits_2_naming_the_field(
    tmp_path: Path, yaml_text: str, names: str
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(yaml_text)
    assert names in _config_error(tmp_path, "--config", config)


def test_missing_config_file_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    assert str(missing) in _config_error(tmp_path, "--config", missing)


def test_tcp_without_tls_or_insecure_exits_2(tmp_path: Path) -> None:
    """Found at bind time, not while loading the config: still exit 2, no traceback."""
    stderr = _config_error(tmp_path, "--listen", "127.0.0.1:0")
    assert "insecure" in stderr


# ------------------------------------------------------------------------ help


def test_serve_help(tmp_path: Path) -> None:
    result = _cli("serve", "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for flag in ("--listen", "--metrics-port", "--config", "--tls-cert", "--token-file"):
        assert flag in result.stdout, flag
