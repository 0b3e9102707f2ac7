"""Smoke test of bench/tier.py: a tiny synthetic run prints the three hit ratios and the
three fetch throughputs, and two nodes with the tier hit what one sidecar hits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:  # bench/ is a script folder, not an installed package
    sys.path.insert(0, str(_REPO))

from tier_harness import needs_mooncake  # noqa: E402

from bench.tier import main  # noqa: E402


@pytest.mark.slow  # seven server processes and two masters start: about 30 s
def test_tier_bench_runs_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    needs_mooncake()
    out = main(["--synthetic", "--limit", "6", "--page-size", "16", "--fetch-requests", "3",
                "--fetch-page-size", "16", "--fetch-heads", "1", "--fetch-head-dim", "16",
                "--rounds", "1", "--json", str(tmp_path / "tier.json")])
    printed = capsys.readouterr().out
    assert "| two nodes, tier |" in printed and "Mooncake batch_get_into" in printed
    # Nothing is evicted, so the two nodes sharing through the tier hit what one does,
    # and more than the two without it.
    assert out["two_nodes_tier_hit_ratio"] == pytest.approx(out["single_hit_ratio"])
    assert out["two_nodes_no_tier_hit_ratio"] < out["single_hit_ratio"]
    assert out["fetch_gbps"] > 0 and out["mooncake_get_gbps"] > 0 and out["memcpy_gbps"] > 0
    assert (tmp_path / "tier.json").exists()
