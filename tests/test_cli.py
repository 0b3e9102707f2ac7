"""The installed `prefixcache` console script, run as a real subprocess."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


def _prefixcache_script() -> str:
    # The script installed next to this interpreter, not whatever is first on PATH.
    script = shutil.which("prefixcache", path=sysconfig.get_path("scripts"))
    if script is None:
        pytest.fail("no `prefixcache` script: install the project first (pip install -e .)")
    return script


def _run(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_prefixcache_script(), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def _env(**settings: str) -> dict[str, str]:
    """This environment less its PREFIXCACHE_* variables, plus ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXCACHE_")}
    return {**env, "OMP_NUM_THREADS": "1", **settings}


def test_help_lists_commands(tmp_path: Path) -> None:
    """`prefixcache --help` exits 0 and names the demo command."""
    result = _run("--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "demo" in result.stdout


def test_no_command_is_a_usage_error(tmp_path: Path) -> None:
    """A bare `prefixcache` prints usage and exits 2, as argparse does."""
    result = _run(cwd=tmp_path)
    assert result.returncode == 2
    assert "usage: prefixcache" in result.stderr


def test_demo_reports_shared_prefix_hit(tmp_path: Path) -> None:
    """The demo's query shares 10 leading tokens with a cached prompt, and hits all 10."""
    result = _run("demo", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^match query: hit 10 of 12 tokens$", result.stdout, re.MULTILINE), (
        result.stdout
    )


# ------------------------------------------- serve, health and stats against one server


@dataclass
class Server:
    proc: subprocess.Popen[str]
    address: str
    socket: Path
    stderr: Path
    tmp: Path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`prefixcache serve`, set up through the environment the way the manifests do it:
    the socket mode written as operators write it (0660), and one misspelt setting."""
    tmp = tmp_path_factory.mktemp("serve")
    sock = tmp / "pc.sock"
    env = _env(
        PREFIXCACHE_LISTEN=f"unix:{sock}",
        PREFIXCACHE_SOCKET_MODE="0660",
        PREFIXCACHE_METRICS_PORT="-1",
        PREFIXCACHE_SHM_DIR="off",
        PREFIXCACHE_GRACE_PERIOD="1",
        PREFIXCACHE_GRACE_PERIODS="5",
    )
    stderr = tmp / "stderr"
    with open(stderr, "w") as err:
        proc = subprocess.Popen(
            [_prefixcache_script(), "serve"],
            cwd=tmp,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            text=True,
        )
    running = Server(proc, f"unix:{sock}", sock, stderr, tmp)
    try:
        deadline = time.monotonic() + 60
        # What a startup probe does: `prefixcache health` until it passes.
        while _run("health", "--target", running.address, cwd=tmp, env=_env()).returncode:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"serve exited {proc.returncode} or never served:\n{stderr.read_text()}"
                )
            time.sleep(0.2)
        yield running
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    assert code == 0, stderr.read_text()


def test_serve_reads_an_octal_socket_mode_written_0660(server: Server) -> None:
    """PREFIXCACHE_SOCKET_MODE=0660 is read as octal, not refused as no integer."""
    assert server.socket.stat().st_mode & 0o777 == 0o660


def test_serve_warns_once_of_an_unknown_variable(server: Server) -> None:
    """A misspelt PREFIXCACHE_* variable is named once, not ignored in silence."""
    lines = [
        line
        for line in server.stderr.read_text().splitlines()
        if "PREFIXCACHE_GRACE_PERIODS" in line
    ]
    assert len(lines) == 1, server.stderr.read_text()
    assert "warning" in lines[0] and "did you mean PREFIXCACHE_GRACE_PERIOD?" in lines[0]


@pytest.mark.parametrize(
    "service", ["", "prefixcache.v1.PrefixCache", "prefixcache.v1.PrefixCache/default"]
)
def test_health_exits_0_when_serving(server: Server, service: str) -> None:
    # The address from PREFIXCACHE_LISTEN, as in the server's own container.
    result = _run(
        "health", "--service", service, cwd=server.tmp, env=_env(PREFIXCACHE_LISTEN=server.address)
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(server.address) and result.stdout.endswith(": SERVING\n")


def test_health_fails_for_an_unknown_service(server: Server) -> None:
    result = _run(
        "health", "--target", server.address, "--service", "nope", cwd=server.tmp, env=_env()
    )
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert "'nope'" in line and "NOT_FOUND" in line, line


def test_health_fails_fast_without_a_server(tmp_path: Path) -> None:
    result = _run("health", "--target", f"unix:{tmp_path / 'none.sock'}", cwd=tmp_path, env=_env())
    assert result.returncode == 1
    # UNAVAILABLE, not DEADLINE_EXCEEDED: the missing socket failed the call at once,
    # rather than the call waiting for a server until its 3 s deadline ran out.
    (line,) = result.stderr.splitlines()
    assert "UNAVAILABLE" in line and "none.sock" in line, line


@pytest.mark.parametrize("command", ["stats", "health"])
def test_client_commands_connect_to_prefixcache_target(server: Server, command: str) -> None:
    """`prefixcache stats` used to ignore PREFIXCACHE_TARGET (what workers are given) and
    ask PREFIXCACHE_LISTEN (which the image sets to the container's own socket)."""
    env = _env(
        PREFIXCACHE_TARGET=server.address,
        PREFIXCACHE_LISTEN=f"unix:{server.tmp / 'elsewhere.sock'}",
    )
    result = _run(command, cwd=server.tmp, env=env)
    assert result.returncode == 0, result.stderr
    if command == "stats":
        assert re.search(r"^default\s", result.stdout, re.MULTILINE), result.stdout


@pytest.mark.parametrize("command", ["health", "stats"])
def test_client_side_commands_load_no_torch(tmp_path: Path, command: str) -> None:
    """`prefixcache health` is a probe run every few seconds: it must not load torch (2+ s
    of CPU). It did once the config became a package whose facade imported the cache."""
    check = (
        "import sys\n"
        "from prefixcache.server.cli import main\n"
        f"code = main([{command!r}, '--target', 'unix:{tmp_path}/none.sock'])\n"
        "assert code == 1, code\n"
        "assert 'torch' not in sys.modules, 'torch loaded'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
