"""`prefixcache explain` and the outcome table of `prefixcache stats`, run as real
subprocesses against a real server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from harness import pb, running, stub_for, toks
from test_lookup_outcomes import MODEL, NS, A, _cache

from prefixcache.cache.hashing import hash_token_ids

CLI = [sys.executable, "-c", "from prefixcache.server.cli import main; raise SystemExit(main())"]


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXCACHE_")}
    return subprocess.run([*CLI, *args], env=env, input=stdin, capture_output=True,
                          text=True, timeout=60)


def test_explain_and_stats_from_the_command_line(tmp_path: Path) -> None:
    with running(tmp_path, [MODEL]) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
            _cache(stub, sid, A, NS)
            stub.Match(pb.MatchRequest(model="p", token_ids=toks(A)))  # miss_namespace 16
            target = ("--target", srv.address, "--model", "p")
            tokens = tmp_path / "prompt.json"
            tokens.write_text(json.dumps(A))

            out = _cli("explain", *target, "--tokens-file", str(tokens))
            assert out.returncode == 0, out.stderr
            assert "hits 0, stops at token 0: miss_namespace" in out.stdout
            assert "cached under namespace 'tenant-a'" in out.stdout

            text = tmp_path / "prompt.txt"  # plain integers, with an unaligned tail
            text.write_text(" ".join(map(str, [*A, 5])) + "\n")
            out = _cli("explain", *target, "--tokens-file", str(text), "--extra-key", NS)
            assert out.returncode == 0, out.stderr
            lines = out.stdout.splitlines()
            assert lines[0] == "model p: 17 tokens, page size 4; hits 16, stops at token " \
                               "16: below_page"
            assert lines[2].split()[:4] == ["hit", "0", "16", "16"]
            assert lines[3].split()[:4] == ["below_page", "16", "17", "1"]

            stub.Evict(pb.EvictRequest(model="p", num_tokens=64))
            out = _cli("explain", *target, "--tokens-file", "-", "--extra-key", NS, "--json",
                       stdin=json.dumps(A))
            assert out.returncode == 0, out.stderr
            reply = json.loads(out.stdout)
            assert reply["stop"] == "LOOKUP_OUTCOME_MISS_EVICTED"
            assert reply["ranges"] == [{"outcome": "LOOKUP_OUTCOME_MISS_EVICTED",
                                        "start": "0", "end": "16"}]

            last = None
            for i in range(0, 16, 4):
                last = hash_token_ids(A[i:i + 4], last)
            out = _cli("explain", *target, "--prompt-hash", last, "--extra-key", NS)
            assert out.returncode == 0, out.stderr
            assert "stops at token 0: miss_evicted" in out.stdout

            out = _cli("explain", *target, "--tokens-file", str(tmp_path / "missing.json"))
            assert out.returncode == 1 and "missing.json" in out.stderr
            (tmp_path / "bad.txt").write_text("1 2 x")
            out = _cli("explain", *target, "--tokens-file", str(tmp_path / "bad.txt"))
            assert out.returncode == 1 and "not a list of token ids" in out.stderr
            out = _cli("explain", "--target", srv.address, "--model", "nope",
                       "--tokens-file", str(tokens))
            assert out.returncode == 1 and "NOT_FOUND" in out.stderr

            out = _cli("stats", "--target", srv.address)
            assert out.returncode == 0, out.stderr
            table = out.stdout[out.stdout.index("looked-up tokens by outcome"):].splitlines()
            assert table[1].split() == ["model", "hit", "miss_cold", "miss_evicted",
                                        "miss_namespace", "below_page", "load_failed",
                                        "lease_expired", "capacity", "ceiling"]
            # The first Match of A (cold) and the one from the default namespace.
            assert table[2].split() == ["p", "0", "16", "0", "16", "0", "0", "0", "0",
                                        "0.000"]


def test_outcomes_of_a_served_process(tmp_path: Path) -> None:
    """`prefixcache serve` as a process: every outcome at 0 from the start, then a
    namespace miss, an eviction, an unaligned tail counted on /metrics and explained."""
    import signal
    import socket

    from harness import wait_serving
    from test_metrics import scrape, value

    (tmp_path / "pc.yaml").write_text(
        'server:\n  shm_dir: "off"\nmodels:\n  - name: p\n    page_size: 4\n'
        '    pool: {size: 64, layers: 1, k_heads: 1, k_head_dim: 4}\n')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"unix:{tmp_path / 'pc.sock'}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXCACHE_")}
    proc = subprocess.Popen([*CLI, "serve", "--config", str(tmp_path / "pc.yaml"),
                             "--listen", address, "--metrics-host", "127.0.0.1",
                             "--metrics-port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_serving(proc, address)
        names = ("hit", "miss_cold", "miss_evicted", "miss_namespace", "below_page",
                 "load_failed", "lease_expired", "capacity")

        def outcomes() -> dict[str, float]:
            s = scrape(port)
            return {o: value(s, "prefixcache_lookup_tokens_total", model="p", outcome=o)
                    for o in names}

        assert outcomes() == dict.fromkeys(names, 0)
        channel, stub = stub_for(address)
        with channel:
            sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
            _cache(stub, sid, A, NS)                                          # cold 16
            stub.Match(pb.MatchRequest(model="p", token_ids=toks(A)))         # namespace 16
            stub.Evict(pb.EvictRequest(model="p", num_tokens=64))
            stub.Match(pb.MatchRequest(model="p", token_ids=toks([*A, 1, 2]),
                                       extra_key=NS))                         # evicted, tail
        assert outcomes() == {**dict.fromkeys(names, 0), "miss_cold": 16,
                              "miss_namespace": 16, "miss_evicted": 16, "below_page": 2}
        tokens = tmp_path / "a.json"
        tokens.write_text(json.dumps(A))
        out = _cli("explain", "--target", address, "--model", "p", "--tokens-file",
                   str(tokens), "--extra-key", NS)
        assert out.returncode == 0 and "stops at token 0: miss_evicted" in out.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
