"""Start-up failures: each bad config or busy resource makes
`prefixcache serve`, a real subprocess, exit 2 with one line naming the field, and leave
no socket and no shared-memory file behind. None allocates a large pool: the oversize
ones are refused before anything is allocated.

The cases run a few subprocesses at a time from one module fixture (each one fails
within its start, mostly importing torch), and each case is its own test.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # 15 serve subprocesses, torch imported in each: 95 s at load 10

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-c", "from prefixcache.server.cli import main; raise SystemExit(main())"]
AT_ONCE = min(4, os.cpu_count() or 1)
SMALL = "models:\n  - name: m\n    pool: {size: 64, k_heads: 1, k_head_dim: 4}\n"
# A device this torch lacks: cuda:0 on a CPU build, one past the last GPU otherwise.
MISSING_CUDA = f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"


@dataclass(frozen=True)
class Case:
    yaml: str
    field: str
    args: tuple[str, ...] = ()
    # gRPC's C core logs a failed bind itself, and TCP without TLS is warned about.
    one_line: bool = True
    says: str = ""  # what the line must also name (a path to fix)


# {port} is replaced by a port that the fixture holds busy.
CASES = {
    "private-pool-over-memory": Case(
        "server: {shm_dir: 'off'}\nmodels:\n  - name: a\n    pool: {size: 1000000000000}\n",
        "models[0].pool.size",
    ),
    "shared-pool-over-memory": Case(
        "models:\n  - name: a\n    pool: {size: 64}\n"
        "  - name: b\n    pool: {size: 1000000000000, layers: 4}\n",
        "models[1].pool.size",
    ),
    "slot-max-seq-len-1e8": Case(
        "models:\n  - name: s\n    kind: slot\n    max_seq_len: 100000000\n"
        "    pool: {size: 64, layers: 32}\n",
        "models[0].max_seq_len",
    ),
    "huge-mamba-state": Case(
        "models:\n  - name: h\n    kind: mamba\n"
        "    mamba: {layers: 64, temporal_state_shape: [1024, 1024, 1024]}\n",
        "models[0].mamba",
    ),
    "missing-cuda-device": Case(
        f"models:\n  - name: g\n    pool: {{size: 64, device: '{MISSING_CUDA}'}}\n",
        "models[0].pool.device",
    ),
    "metrics-port-in-use": Case(SMALL, "server.metrics_port", ("--metrics-port", "{port}")),
    "listen-port-in-use": Case(
        SMALL, "server.listen", ("--listen", "127.0.0.1:{port}", "--insecure"), False
    ),
    "max-message-bytes-3GiB": Case(
        "server: {max_message_bytes: 3221225472}\n" + SMALL, "server.max_message_bytes"
    ),
    "shm-dir-proc": Case("server: {shm_dir: /proc}\n" + SMALL, "server.shm_dir"),
    "grace-period-nan": Case("server: {grace_period: .nan}\n", "server.grace_period"),
    "grace-period-1e12": Case("server: {grace_period: 1e12}\n", "server.grace_period"),
    "socket-mode-0": Case("server: {socket_mode: 0}\n", "server.socket_mode"),
    "session-ttl-max-inf": Case("server: {session_ttl_max: .inf}\n", "server.session_ttl_max"),
    "socket-directory-missing": Case(
        SMALL,
        "server.listen",
        ("--listen", "unix:/nonexistent-pc-dir/s.sock"),
        says="/nonexistent-pc-dir does not exist",
    ),
    "token-file-missing": Case(
        SMALL,
        "server.token_file",
        ("--token-file", "/nonexistent-pc-dir/token"),
        says="/nonexistent-pc-dir/token",
    ),
}


@dataclass
class Outcome:
    returncode: int
    stderr: str
    left: list[str]  # files left in the case's directories


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXCACHE_")}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "server"), str(ROOT / "client"), *filter(None, [env.get("PYTHONPATH")])]
    )
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Outcome]]:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = str(busy.getsockname()[1])
    shm_root = Path(tempfile.mkdtemp(prefix="pc-startup-", dir="/dev/shm"))
    results: dict[str, Outcome] = {}
    try:
        pending = list(CASES.items())
        running: list[tuple[str, Path, Path, subprocess.Popen[str]]] = []
        while pending or running:
            while pending and len(running) < AT_ONCE:
                name, case = pending.pop(0)
                tmp = tmp_path_factory.mktemp(name)
                shm = shm_root / name
                shm.mkdir()
                (tmp / "c.yaml").write_text(case.yaml)
                args = [
                    "serve",
                    "--config",
                    str(tmp / "c.yaml"),
                    "--listen",
                    f"unix:{tmp / 's.sock'}",
                    "--metrics-port",
                    "-1",
                    "--shm-dir",
                    str(shm),
                    *(a.replace("{port}", port) for a in case.args),
                ]
                if "shm_dir" in case.yaml:  # the YAML's own shm_dir is the one under test
                    args.remove("--shm-dir")
                    args.remove(str(shm))
                proc = subprocess.Popen(
                    [*CLI, *args],
                    cwd=tmp,
                    env=_env(),
                    text=True,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )
                running.append((name, tmp, shm, proc))
            name, tmp, shm, proc = running.pop(0)
            try:
                _, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:  # it started after all: stop it, report it
                proc.kill()
                _, err = proc.communicate()
            left = [p.name for p in tmp.iterdir() if p.name != "c.yaml"]
            left += [p.name for p in shm.iterdir()]
            results[name] = Outcome(proc.returncode, err, left)
        yield results
    finally:
        busy.close()
        shutil.rmtree(shm_root, ignore_errors=True)


@pytest.mark.parametrize("name", CASES)
def test_start_failure_exits_2_with_one_line_and_leaves_nothing(
    outcomes: dict[str, Outcome], name: str
) -> None:
    out = outcomes[name]
    assert out.returncode == 2, (out.returncode, out.stderr)
    lines = out.stderr.splitlines()
    assert len(lines) == 1 or not CASES[name].one_line, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert lines[-1].startswith(f"prefixcache: config error: {CASES[name].field}: "), lines[-1]
    assert CASES[name].says in lines[-1], lines[-1]
    assert out.left == [], f"left behind: {out.left}"
