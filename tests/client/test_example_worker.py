"""examples/worker.py runs the whole protocol against a real `prefixcache serve`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from harness import REPO, serve_process

from prefixcache.client import PrefixCacheClient

CONFIG = """
models:
  - name: default
    page_size: 16
    pool: {size: 65536, layers: 2, k_heads: 1, k_head_dim: 8}
"""


def test_worker_runs_against_a_real_server(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with serve_process(tmp_path, CONFIG) as (_, address):
        for mode in ("attach", "transfer"):
            out = subprocess.run(
                [
                    sys.executable,
                    str(REPO / "examples" / "worker.py"),
                    "--target",
                    address,
                    "--limit",
                    "6",
                    "--kv",
                    mode,
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
                check=True,
            ).stdout
            assert "requests/s" in out and "hit ratio" in out and mode in out, out
        with PrefixCacheClient(address) as client:
            stats = client.stats("default")["default"]
            # Everything was released; the second pass hit what the first one cached.
            assert (stats.locks, stats.session_slots) == (0, 0)
            assert stats.hit_tokens_total > 0 and stats.cached_tokens > 0


def test_worker_runs_without_the_trace_files(tmp_path: Path) -> None:
    """A trace file that is not there: the example replays a synthetic trace."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with serve_process(tmp_path, CONFIG) as (_, address):
        done = subprocess.run(
            [
                sys.executable,
                str(REPO / "examples" / "worker.py"),
                "--target",
                address,
                "--limit",
                "20",
                "--trace",
                str(tmp_path / "missing.jsonl"),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        assert "synthetic" in done.stderr, done.stderr
        assert "20 requests" in done.stdout, done.stdout
        ratio = float(done.stdout.split("hit ratio ")[1].split()[0])
        assert ratio > 0.3, done.stdout  # its turns repeat earlier turns' blocks
