"""Smoke test of the scheduler-loop benchmark: a tiny shape, every backend, one run
(four server subprocesses)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:  # bench/ is a script folder, not an installed package
    sys.path.insert(0, str(_REPO))

from bench import scheduler_loop  # noqa: E402

KEYS = {
    "backend",
    "rpcs_per_step",
    "cache_wall_ms_per_step",
    "worker_cpu_ms_per_step",
    "server_cpu_ms_per_step",
    "hit_ratio",
}


def test_every_backend_reports_its_step_costs(tmp_path: Path) -> None:
    out = tmp_path / "sched.json"
    assert (
        scheduler_loop.main(
            [
                "--waiting",
                "4",
                "--batch",
                "4",
                "--steps",
                "20",
                "--pool",
                "262144",
                "--output-scale",
                "0.01",
                "--requests",
                "80",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    runs = {r["backend"]: r for r in json.loads(out.read_text())}
    assert set(runs) == set(scheduler_loop.BACKENDS)
    for run in runs.values():
        assert set(run) >= KEYS, run
        assert run["admitted"] > 4 and run["finished"] > 0  # requests came and went
    for name in ("client", "remote_radix_cache"):
        assert 0 < runs[name]["rpcs_per_step"] <= 3, runs[name]
        assert runs[name]["server_cpu_ms_per_step"] >= 0
    for local in ("inprocess", "max_inprocess", "mamba_inprocess"):
        assert runs[local]["rpcs_per_step"] == 0
    for local, remote in (
        ("max_inprocess", "remote_radix_trie"),
        ("mamba_inprocess", "remote_mamba"),
    ):
        assert runs[remote]["rpcs_per_step"] > 0 and runs[remote]["queued_errors"] == 0
        for key in ("hit_ratio", "admitted", "finished"):  # the same loop, the same story
            assert runs[remote][key] == runs[local][key], (key, runs[remote], runs[local])
    assert runs["remote_radix_cache"]["queued_errors"] == 0
