"""Smoke test of the KV bandwidth bench: tiny sizes, every path, real servers. The bench
checks once that the bytes arrived byte-identical (vLLM save and load, SGLang set then
get, WriteKV then ReadKV) and exits non-zero if they did not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[2]
BENCH = _REPO / "bench" / "kv_bandwidth.py"
PATHS = {"vllm_load", "vllm_save", "sglang_get", "sglang_set", "readkv", "writekv"}
DISK_PATHS = {"disk_promote", "disk_demote"}


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
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
    return subprocess.run(
        [sys.executable, str(BENCH), *args],
        cwd=_REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_kv_bandwidth_rows_and_bytes(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "kv.json"
    proc = run_bench(
        "--layers",
        "2",
        "--tokens",
        "64",
        "--pages",
        "16",
        "--repeat",
        "1",
        "--disk-pages",
        "1,4",
        "--disk-layers",
        "2",
        "--disk-dir",
        str(tmp_path),
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    assert {r["path"] for r in rows} == PATHS | DISK_PATHS
    disk = [r for r in rows if r["path"] in DISK_PATHS]
    rows = [r for r in rows if r["path"] in PATHS]
    # Pages of 16 tokens x 2 layers x (K + V) x 8 heads x 128 dims x 2 bytes.
    assert sorted((r["path"], r["pages"], r["bytes"]) for r in disk) == sorted(
        (p, n, n * 16 * 2 * 2 * 8 * 128 * 2) for p in DISK_PATHS for n in (1, 4)
    )
    assert all(r["gb_per_s"] > 0 and r["ceiling_gb_per_s"] > 0 for r in disk)
    # 64 tokens x 2 layers x (K + V) x 8 heads x 128 dims x 2 bytes (bfloat16).
    want = 64 * 2 * 2 * 8 * 128 * 2
    for r in rows:
        assert set(r) >= {"path", "bytes", "gb_per_s", "ceiling_gb_per_s", "ratio"}, r
        assert r["bytes"] == want, r
        assert r["gb_per_s"] > 0 and r["ceiling_gb_per_s"] > 0, r
        assert r["ratio"] == pytest.approx(
            r["gb_per_s"] / r["ceiling_gb_per_s"], rel=0.01, abs=0.002
        ), r
    # vLLM: both layouts; ReadKV / WriteKV: unix socket and TCP.
    assert {r["layout"] for r in rows if r["path"] == "vllm_load"} == {"bhn2d", "cpu_vec"}
    assert {r["transport"] for r in rows if r["path"] == "readkv"} == {"unix", "tcp"}
    assert "| vllm_load | bhn2d |" in proc.stdout


@pytest.mark.gpu
def test_kv_bandwidth_on_a_gpu(tmp_path: Path) -> None:
    """``--device cuda``: vllm_load whole and layer-wise, byte-checked against each other
    by the bench (kv_layerwise.py), with the overlap numbers on the layer-wise row, and
    vllm_save."""
    out = tmp_path / "kv.json"
    proc = run_bench(
        "--device",
        "cuda",
        "--layers",
        "2",
        "--tokens",
        "64",
        "--pages",
        "16",
        "--repeat",
        "1",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    assert [(r["path"], r["mode"]) for r in rows] == [
        ("vllm_load", "whole"),
        ("vllm_load", "layerwise"),
        ("vllm_save", "whole"),
    ]
    assert all(r["bytes"] == 64 * 2 * 2 * 8 * 128 * 2 and r["gb_per_s"] > 0 for r in rows)
    assert {"serial_s", "layerwise_s", "hidden", "issue_host_s"} <= set(rows[1])
