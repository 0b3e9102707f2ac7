"""Smoke test of the capacity bench (``capacity.py --quick``): every in-process row is
there, the rows are consistent (a bigger pool never hits less than a smaller one), the
infinite row of the Mooncake trace is the trace's own ceiling, and retaining the agents' contexts
beats plain LRU on the agentic trace at the same pool size."""

from __future__ import annotations

import json
import sys
from pathlib import Path

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
