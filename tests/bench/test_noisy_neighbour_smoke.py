"""Smoke test of the noisy-neighbour bench: the real script, two short attacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]


def test_noisy_neighbour_prints_a_row_per_attack(tmp_path: Path) -> None:
    out = tmp_path / "noisy.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            str(_REPO / "bench" / "noisy_neighbour.py"),
            "--duration",
            "0.3",
            "--warmup",
            "0.1",
            "--attacks",
            "pool grab,KeepAlive storm",
            "--json",
            str(out),
        ],
        cwd=_REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows[1:]] == [
        "quiet (baseline)",
        "pool grab",
        "KeepAlive storm",
    ]
    data = json.loads(out.read_text())
    assert data["server"]["max_session_slots"] == data["pool"] // 4
    for row in data["rows"]:
        assert row["prefills"] > 0 and row["p50_ms"] > 0 and row["lease_held"], row
    assert data["rows"][1]["attacker"]["RESOURCE_EXHAUSTED"] > 0  # the quota refused it
