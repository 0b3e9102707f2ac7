"""Smoke test of the gRPC replay bench: a real server, the protobuf floor and an echo
server, both modes, the requests in rounds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[2]
BENCH = _REPO / "bench" / "grpc_replay.py"
TRACE = _REPO / "bench" / "traces" / "mooncake_conversation_trace.jsonl"
CONFIGS = [(mode, workers) for mode in ("unary", "stream") for workers in (1, 2)]


def test_grpc_replay_runs_every_config(tmp_path: Path) -> None:
    pytest.importorskip("grpc")
    pytest.importorskip("torch")
    out = tmp_path / "grpc.json"
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(
            [
                str(_REPO / "server"),
                str(_REPO / "client"),
                *filter(None, [os.environ.get("PYTHONPATH")]),
            ]
        ),
    )
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--trace",
            str(TRACE),
            "--limit",
            "20",
            "--workers",
            "1",
            "--workers",
            "2",
            "--modes",
            "unary,stream",
            "--budget",
            "200000",
            "--json",
            str(out),
        ],
        cwd=_REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr

    # The first table: one row per configuration, req/s in the fourth column.
    rows: dict[tuple[str, int], list[str]] = {}
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 14 and cells[0] in ("unary", "stream") and cells[1].isdigit():
            rows[(cells[0], int(cells[1]))] = cells
    assert sorted(rows) == sorted(CONFIGS), proc.stdout
    for cells in rows.values():
        assert cells[2].startswith("20 (0)"), cells  # every request, no errors
        assert float(cells[3].replace(",", "")) > 0  # service req/s
        assert float(cells[4].replace(",", "")) > 0  # echo req/s

    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == len(CONFIGS)
    for run in runs:
        svc = run["service"]
        assert svc["requests"] == run["floor"]["requests"] == run["echo"]["requests"] == 20
        # 20 requests may take under one 10 ms tick of server CPU: present, not > 0.
        assert run["floor"]["server_cpu_us_per_req"] >= 0
        assert svc["match"]["p50_us"] > 0 and svc["insert"]["p50_us"] > 0
        # Every session was closed: nothing stays locked or held.
        assert svc["stats"]["locks"] == 0 and svc["stats"]["session_slots"] == 0
        assert svc["stats"]["match_tokens"] > 0
