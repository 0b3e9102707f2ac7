"""Smoke test of the restart bench: the real script at 50 k cached tokens and an empty
pool's start (a few server starts), every row filled in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]


def test_restart_bench_restores_what_it_cached(tmp_path: Path) -> None:
    out = tmp_path / "restart.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            str(_REPO / "bench" / "restart.py"),
            "--tokens",
            "5e4",
            "--pool-gib",
            "0",
            "--rounds",
            "1",
            "--json",
            str(out),
        ],
        cwd=_REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    (run,) = data["restarts"]
    assert run["cached_tokens"] >= 5e4
    assert run["warm_outcome"] == "restored" and run["restored_tokens"] == run["cached_tokens"]
    assert run["after_kill_outcome"] == "restored_from_checkpoint"
    assert run["after_kill_tokens"] == run["cached_tokens"]
    assert [(r["gib"], r["shared"]) for r in data["pool_starts"]] == [(0, False), (0, True)]
    assert all(r["start_s"] > 0 for r in data["pool_starts"])
    assert "| cached tokens |" in proc.stdout and "| 0 GiB |" in proc.stdout
