"""Smoke test of the capacity bench (``capacity.py --quick``): every in-process row is
there, the rows are consistent (a bigger pool never hits less than a smaller one), the
infinite row of the Mooncake trace is the trace's own ceiling, and retaining the agents' contexts
beats plain LRU on the agentic trace at the same pool size; a disk row runs over the
disk tier."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:  # bench/ is a script folder, not an installed package
    sys.path.insert(0, str(_REPO))

from bench import capacity  # noqa: E402


def test_quick_rows(tmp_path: Path) -> None:
    out = tmp_path / "capacity.json"
    printed: list[str] = []
    assert capacity.main(["--json", str(out), "--quick"], emit=printed.append) == 0
    rows = json.loads(out.read_text())["rows"]
    by = {(r["trace"], r["config"], r["tenant_share"]): r for r in rows}
    assert set(by) == {
        ("mooncake_conversation", "infinite", None),
        ("mooncake_conversation", "pool", None),
        ("agentic", "infinite", None),
        ("agentic", "pool", None),
        ("agentic", "pool+retention", 0.5),
        ("agentic", "pool+retention", 1.0),
    }
    assert all(r["runner"] == "library" and r["skipped"] is None for r in rows)
    for trace in ("mooncake_conversation", "agentic"):
        infinite, pool = by[(trace, "infinite", None)], by[(trace, "pool", None)]
        assert pool["pool_tokens"] < pool["working_set_tokens"] / 10
        assert 0 < pool["hit_ratio"] < infinite["hit_ratio"] <= 1
        assert infinite["refused"] == 0
    # An infinite pool hits every block seen before (hash ids chain their prefixes),
    # counted here without the cache.
    seen: set[int] = set()
    hit = total = 0
    for req in capacity.load_trace(capacity.DEFAULT_TRACE, 2000):
        k = 0
        while k < len(req.hash_ids) and req.hash_ids[k] in seen:
            k += 1
        hit += min(k * capacity.BLOCK_TOKENS, req.input_length)
        total += req.input_length
        seen.update(req.hash_ids)
    assert by[("mooncake_conversation", "infinite", None)]["hit_ratio"] == hit / total
    lru = by[("agentic", "pool", None)]
    kept = by[("agentic", "pool+retention", 1.0)]
    assert kept["agent_hit_ratio"] > lru["agent_hit_ratio"]
    assert kept["hit_ratio"] > lru["hit_ratio"]
    assert "| agentic | pool+retention | library |" in printed[0]


@pytest.mark.slow
def test_a_disk_row_runs_over_the_disk_tier(tmp_path: Path) -> None:
    """A ``pool+disk`` row: a real ``prefixcache serve`` with the disk tier, whose pages
    read back from disk lift the hit ratio above the same pool's alone; its folder (the
    preallocated slots) is gone after the row."""
    out = tmp_path / "capacity.json"
    disk = tmp_path / "disk"
    argv = ["--json", str(out), "--quick", "--trace", "mooncake_conversation"]
    assert capacity.main([*argv, "--disk-dir", str(disk)], emit=lambda _: None) == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    row = rows["pool+disk"]
    assert row["runner"] == "server" and row["skipped"] is None
    assert row["pool_tokens"] == rows["pool"]["pool_tokens"]
    assert row["hit_ratio"] > rows["pool"]["hit_ratio"]
    assert row["disk_lookups"]["disk"] > 0
    assert list(disk.iterdir()) == []
