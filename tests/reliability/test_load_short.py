"""A short run of bench/load.py: a real server in invariant mode, with a model of every
kind, under concurrent sessions, locks, allocation and eviction for ~10 s must answer
every call and leave nothing held. Besides the radix trace replay this covers a slot
model's locking, allocating matches that reuse freed slots in place, inserts naming
another model's lock as release_lock_id (refused), and Mamba states evicted under
state pressure; a pool of 20,000 tokens keeps the per-call integrity check cheap.

The full run (8 workers, 10 minutes, RSS flat within 5 % after warm-up) is in
bench/README.md, "Load". Here RSS is only checked loosely (< 25 % growth after a
5-second warm-up): in ten seconds glibc's arenas, gRPC's buffers and the tree's node
pool are still settling, so a tight bound would flake without telling us about leaks;
a leak is a slope over minutes, which only the long run can see.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "bench" / "traces" / "mooncake_conversation_trace.jsonl"
DURATION = 10
WORKERS = 3


@pytest.mark.slow
def test_short_load_has_no_errors_and_leaves_nothing_held(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXCACHE_")}
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(
            [str(ROOT / "server"), str(ROOT / "client"), *filter(None, [env.get("PYTHONPATH")])]
        ),
    )
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "load.py"),
            "--duration",
            str(DURATION),
            "--workers",
            str(WORKERS),
            "--limit",
            "300",
            "--reopen-every",
            "25",
            "--warmup",
            "5",
            "--budget",
            "20000",
            "--check-integrity",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=DURATION + 120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rep = json.loads(out.read_text())
    assert rep["errors"] == {}, rep["first_errors"]
    assert rep["requests"] > 0 and rep["req_per_s"] > 0
    assert rep["reopens"] > 0  # sessions were closed while holding a lock and slots
    for op in (
        "match",
        "insert",
        "alloc",
        "free",
        "unlock",
        "reopen",
        "swa",
        "mamba",
        "slot",
        "chunk",
    ):
        assert rep["latency"][op]["count"] > 0, op
    counts = rep["counts"]
    assert counts["cross-model release_lock_id refused"] > 0, counts
    assert counts["slot reused in place"] > 0, counts
    stats = rep["stats"]
    assert stats["evicted_tokens"] > 0  # the pool was under pressure
    models = stats["models"]
    assert set(models) == {"bench", "swa", "mamba", "slot", "chunk"}
    assert models["mamba"]["evicted_tokens"] > 0  # states (and their leaves) under pressure
    assert models["slot"]["evicted_tokens"] > 0
    assert stats["sessions"] == 0
    for name, m in models.items():
        assert (
            m["locks"],
            m["session_slots"],
            m["session_state_slots"],
            m["protected_tokens"],
        ) == (0, 0, 0, 0), (name, m)
    assert models["slot"]["free_slots"] == models["slot"]["pool_size"]
    # every slot is either free or cached: nothing leaked out of the pool
    assert stats["free_slots"] + stats["cached_tokens"] == stats["pool_size"], stats
    assert rep["server_exit"] == 0
    assert rep["rss_warm_kib"] > 0
    assert rep["rss_growth_pct"] < 25, rep["rss_timeline"]
    assert "| requests | req/s |" in result.stdout
