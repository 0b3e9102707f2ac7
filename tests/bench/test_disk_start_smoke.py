"""Smoke test of bench/disk_start.py: a small disk tier filled through the real store,
and `prefixcache serve` started and timed in each case (none, empty, full, killed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]


def test_disk_start_times_every_case(tmp_path: Path) -> None:
    out = tmp_path / "start.json"
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
            str(_REPO / "bench" / "disk_start.py"),
            "--tokens",
            "16000",
            "--repeat",
            "0",
            "--dir",
            str(tmp_path),
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
    (row,) = json.loads(out.read_text())
    assert row["pages"] == 1000
    for case in ("none", "empty", "full", "killed"):
        assert 0 < row[f"{case}_s"] < 60, row
