"""`prefixcache stats --sessions`: the top holders of a real `prefixcache serve`, printed
by the real console script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from harness import pb, serve_process, stub_for, toks

CONFIG = """\
server:
  shm_dir: "off"
models:
  - name: m
    page_size: 1
    pool: {size: 256, layers: 1, k_heads: 1, k_head_dim: 4}
"""


def _stats(address: str, *args: str) -> subprocess.CompletedProcess[str]:
    script = shutil.which("prefixcache", path=sysconfig.get_path("scripts"))
    if script is None:
        pytest.fail("no `prefixcache` script: install the project first (pip install -e .)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXCACHE_")}
    return subprocess.run(
        [script, "stats", "--target", address, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_stats_sessions_lists_the_top_holders(tmp_path: Path) -> None:
    with serve_process(tmp_path, CONFIG) as (_, address):
        channel, stub = stub_for(address)
        with channel:
            ids = {}
            for name, n in (("small", 2), ("big", 40), ("idle", 0)):
                ids[name] = stub.OpenSession(
                    pb.OpenSessionRequest(client_name=name, ttl_seconds=60)
                ).session_id
                if n:
                    stub.Alloc(pb.AllocRequest(model="m", num_slots=n, session_id=ids[name]))
            prompt = toks(range(1, 9))
            m = stub.Match(
                pb.MatchRequest(model="m", token_ids=prompt, allocate=True, session_id=ids["small"])
            )
            stub.Insert(
                pb.InsertRequest(
                    model="m",
                    token_ids=prompt,
                    lock=True,
                    slot_indices=m.allocated_slots,
                    session_id=ids["small"],
                )
            )

            result = _stats(address, "--sessions", "2")
            assert result.returncode == 0, result.stderr
            out = result.stdout
            assert "top 2 sessions by holdings:" in out
            table = out.split("top 2 sessions by holdings:")[1].strip().splitlines()
            assert table[0].split()[:3] == ["session", "client", "slots"]
            big, small = (line.split() for line in table[1:])
            assert big[:3] == [ids["big"][:8], "big", "40"]
            # small: 2 slots, 0 state slots, 1 lock on 8 tokens, 0 streams, leased.
            assert small[:8] == [ids["small"][:8], "small", "2", "0", "1", "8", "0", "leased"]
            assert ids["big"] not in out  # only the first 8 characters of a secret

            # Without --sessions, no list; with --json, the list as JSON.
            assert "sessions by holdings" not in _stats(address).stdout
            data = json.loads(_stats(address, "--sessions", "--json").stdout)
            names = [h["clientName"] for h in data["topSessions"]]
            assert names == ["big", "small", "idle"]
