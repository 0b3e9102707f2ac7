"""Smoke tests of bench/tier.py. The default run: the fetch measurement alone (a master,
two sidecars, Mooncake's own reader) and the seals' cost (checks, puts, saves), about
25 s. The whole bench on a tiny synthetic trace (the three hit ratios too: seven
sidecars, two masters, 30 to 100 s here) runs only with PREFIXCACHE_SLOW=1, as CI runs every test:

    PREFIXCACHE_SLOW=1 python -m pytest tests/bench/test_tier_bench_smoke.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:  # bench/ is a script folder, not an installed package
    sys.path.insert(0, str(_REPO))

from tier_harness import needs_mooncake  # noqa: E402

from bench.tier import main  # noqa: E402

LONG = pytest.mark.skipif(
    not os.environ.get("PREFIXCACHE_SLOW"), reason="set PREFIXCACHE_SLOW=1 for the whole tier bench"
)
TINY_FETCH = ["--fetch-page-size", "16", "--fetch-heads", "1", "--fetch-head-dim", "16"]


def test_tier_bench_fetch_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    needs_mooncake()
    out = main(
        [
            "--synthetic",
            "--limit",
            "2",
            "--fetch-only",
            "--no-split",
            "--fetch-requests",
            "2",
            *TINY_FETCH,
            "--rounds",
            "2",
            "--json",
            str(tmp_path / "tier.json"),
        ]
    )
    printed = capsys.readouterr().out
    assert "Mooncake batch_get_into, same pages and batches" in printed
    assert "| one sidecar" not in printed  # no hit-ratio runs
    # Both sides read the same pages: ours fetched them all, in the batches Mooncake read.
    assert out["fetch_bytes"] > 0 and out["fetch_pages_per_lookup"] > 0
    assert out["fetch_gbps"] > 0 and out["mooncake_get_gbps"] > 0 and out["memcpy_gbps"] > 0
    assert len(out["fetch_vs_mooncake_rounds"]) == 2
    assert out["fetch_vs_mooncake"] == pytest.approx(out["fetch_gbps"] / out["mooncake_get_gbps"])
    assert json.loads((tmp_path / "tier.json").read_text())["fetch_bytes"] == out["fetch_bytes"]
    # The seal checks: the same fetch with and without them, digest and MAC, in one run.
    assert "checked / unchecked" in printed
    for kind in ("digest", "mac"):
        assert out[f"fetch_gbps_{kind}_checked"] > 0 and out[f"seal_check_gbps_{kind}"] > 0
        assert len(out[f"fetch_checked_cost_{kind}_rounds"]) == 2
        # And the put of the same pages, sealed against unsealed.
        assert out[f"put_gbps_{kind}_sealed"] > 0 and out[f"put_gbps_{kind}_unsealed"] > 0
        assert len(out[f"put_sealed_cost_{kind}_rounds"]) == 2
    assert "sealed / unsealed" in printed
    # The save path on sidecars with the tier sealing each way and without it.
    for kind in ("none", "digest", "mac"):
        assert out[f"saves_per_s_{kind}"] > 0
    assert len(out["save_cost_mac_rounds"]) == 2


@LONG
@pytest.mark.slow  # seven server processes and two masters start
def test_tier_bench_runs_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    needs_mooncake()
    out = main(
        [
            "--synthetic",
            "--limit",
            "6",
            "--page-size",
            "16",
            "--fetch-requests",
            "3",
            *TINY_FETCH,
            "--rounds",
            "1",
            "--json",
            str(tmp_path / "tier.json"),
        ]
    )
    printed = capsys.readouterr().out
    assert "| two nodes, tier |" in printed and "Mooncake batch_get_into" in printed
    # Nothing is evicted, so the two nodes sharing through the tier hit what one does,
    # and more than the two without it.
    assert out["two_nodes_tier_hit_ratio"] == pytest.approx(out["single_hit_ratio"])
    assert out["two_nodes_no_tier_hit_ratio"] < out["single_hit_ratio"]
    assert out["fetch_gbps"] > 0 and out["mooncake_get_gbps"] > 0 and out["memcpy_gbps"] > 0
    assert out["mooncake_get_gbps_object_per_buffer"] > 0
    assert out["mooncake_get_gbps_object_per_page"] > 0
    assert len(out["object_per_buffer_vs_page_rounds"]) == 1
    assert "per buffer / per page" in printed and "exists probe" in printed
    assert out["exists_ms_object_per_buffer"] > 0
    assert (tmp_path / "tier.json").exists()
