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
    return subprocess.run(
        [*CLI, *args], env=env, input=stdin, capture_output=True, text=True, timeout=60
    )


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
            assert (
                lines[0] == "model p: 17 tokens, page size 4; hits 16, stops at token "
                "16: below_page"
            )
            assert lines[2].split()[:4] == ["hit", "0", "16", "16"]
            assert lines[3].split()[:4] == ["below_page", "16", "17", "1"]

            stub.Evict(pb.EvictRequest(model="p", num_tokens=64))
            out = _cli(
                "explain",
                *target,
                "--tokens-file",
                "-",
                "--extra-key",
                NS,
                "--json",
                stdin=json.dumps(A),
            )
            assert out.returncode == 0, out.stderr
            reply = json.loads(out.stdout)
            assert reply["stop"] == "LOOKUP_OUTCOME_MISS_EVICTED"
            assert reply["ranges"] == [
                {"outcome": "LOOKUP_OUTCOME_MISS_EVICTED", "start": "0", "end": "16"}
            ]

            last = None
            for i in range(0, 16, 4):
                last = hash_token_ids(A[i : i + 4], last)
            out = _cli("explain", *target, "--prompt-hash", last, "--extra-key", NS)
            assert out.returncode == 0, out.stderr
            assert "stops at token 0: miss_evicted" in out.stdout

            out = _cli("explain", *target, "--tokens-file", str(tmp_path / "missing.json"))
            assert out.returncode == 1 and "missing.json" in out.stderr
            (tmp_path / "bad.txt").write_text("1 2 x")
            out = _cli("explain", *target, "--tokens-file", str(tmp_path / "bad.txt"))
            assert out.returncode == 1 and "not a list of token ids" in out.stderr
            out = _cli(
                "explain", "--target", srv.address, "--model", "nope", "--tokens-file", str(tokens)
            )
            assert out.returncode == 1 and "NOT_FOUND" in out.stderr

            out = _cli("stats", "--target", srv.address)
            assert out.returncode == 0, out.stderr
            table = out.stdout[out.stdout.index("looked-up tokens by outcome") :].splitlines()
            assert table[1].split() == [
                "model",
                "hit",
                "miss_cold",
                "miss_evicted",
                "miss_namespace",
                "below_page",
                "load_failed",
                "lease_expired",
                "capacity",
                "ceiling",
            ]
            # The first Match of A (cold) and the one from the default namespace.
            assert table[2].split() == ["p", "0", "16", "0", "16", "0", "0", "0", "0", "0.000"]


def test_every_outcome_of_a_served_process(tmp_path: Path) -> None:
    """`prefixcache serve` as a process: every outcome at 0 from the start, then each of
    the eight caused on purpose (another namespace, evict then ask again, an unaligned
    tail, a hit, a reservation of the vLLM scheduler core that lapses, a load that
    failed, a refused allocation), counted on /metrics and explained."""
    import signal
    import socket

    import grpc
    import pytest
    from harness import wait_serving
    from integrations.vllm.vllm_support import Clock, make_scheduler, settle
    from test_metrics import scrape, value

    from prefixcache.integrations.vllm.keys import RequestInfo

    (tmp_path / "pc.yaml").write_text(
        'server:\n  shm_dir: "off"\nmodels:\n  - name: p\n    page_size: 4\n'
        "    pool: {size: 64, layers: 1, k_heads: 1, k_head_dim: 4}\n"
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"unix:{tmp_path / 'pc.sock'}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXCACHE_")}
    proc = subprocess.Popen(
        [
            *CLI,
            "serve",
            "--config",
            str(tmp_path / "pc.yaml"),
            "--listen",
            address,
            "--metrics-host",
            "127.0.0.1",
            "--metrics-port",
            str(port),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    names = (
        "hit",
        "miss_cold",
        "miss_evicted",
        "miss_namespace",
        "below_page",
        "load_failed",
        "lease_expired",
        "capacity",
    )
    seen = dict.fromkeys(names, 0.0)

    def grew(**expected: int) -> None:
        """The outcomes on /metrics grew by ``expected`` since the last call, the others
        not at all."""
        s = scrape(port)
        now = {o: value(s, "prefixcache_lookup_tokens_total", model="p", outcome=o) for o in names}
        assert {o: now[o] - seen[o] for o in names} == {**dict.fromkeys(names, 0), **expected}
        seen.update(now)

    def explain(tokens: list[int], extra_key: str | None = None) -> str:
        (tmp_path / "t.json").write_text(json.dumps(tokens))
        ns = ("--extra-key", extra_key) if extra_key is not None else ()
        out = _cli(
            "explain",
            "--target",
            address,
            "--model",
            "p",
            "--tokens-file",
            str(tmp_path / "t.json"),
            *ns,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()[0]

    try:
        wait_serving(proc, address)
        grew()  # every outcome exported, at 0
        channel, stub = stub_for(address)
        with channel:
            sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
            _cache(stub, sid, A, NS)
            grew(miss_cold=16)
            stub.Match(pb.MatchRequest(model="p", token_ids=toks(A)))
            grew(miss_namespace=16)
            assert explain(A).endswith("hits 0, stops at token 0: miss_namespace")
            stub.Match(pb.MatchRequest(model="p", token_ids=toks([*A, 1, 2]), extra_key=NS))
            grew(hit=16, below_page=2)
            assert explain([*A, 1, 2], NS).endswith("hits 16, stops at token 16: below_page")
            stub.Evict(pb.EvictRequest(model="p", num_tokens=64))
            stub.Match(pb.MatchRequest(model="p", token_ids=toks(A), extra_key=NS))
            grew(miss_evicted=16)
            assert explain(A, NS).endswith("hits 0, stops at token 0: miss_evicted")
            _cache(stub, sid, A, NS)
            grew(miss_evicted=16)

            # The vLLM scheduler core reserves the hit; vLLM never comes back for it.
            _cache(stub, sid, A, None)  # the connector's namespace (no LoRA, no salt)
            grew(miss_namespace=16)
            clock = Clock()
            # No change log to follow; no save (its own Match would count a hit too).
            core = make_scheduler(
                address, model="p", clock=clock, lease_ttl=5.0, fast_miss=False, save="off"
            )
            try:
                req = RequestInfo("r", [*A, 1, 2], len(A) + 2)
                if core.probe(req, 0) == (None, False):  # the lookup is in flight
                    core.build_meta()
                    settle(core)
                assert core.probe(req, 0) == (16, False)
                grew(hit=16)
                clock.now += 5.1
                core.build_meta()
                settle(core)
                assert core.stats.leases_expired == 1
                grew(lease_expired=16)
            finally:
                core.close()

            # A connector that could not load its hit says so as it lets go.
            held = stub.Match(
                pb.MatchRequest(
                    model="p", token_ids=toks(A), extra_key=NS, session_id=sid, lock=True
                )
            )
            stub.Unlock(
                pb.UnlockRequest(
                    session_id=sid,
                    lock_id=held.lock_id,
                    unused_outcome=pb.LookupOutcome.Value("LOOKUP_OUTCOME_LOAD_FAILED"),
                )
            )
            grew(hit=16, load_failed=16)

            # A session holds every free slot: a lookup that allocates is refused.
            n = 64
            while n:
                try:
                    stub.Alloc(pb.AllocRequest(model="p", num_slots=n, session_id=sid))
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    n //= 2
            other = stub.OpenSession(pb.OpenSessionRequest()).session_id
            with pytest.raises(grpc.RpcError) as refused:
                stub.Match(
                    pb.MatchRequest(
                        model="p",
                        token_ids=toks(list(range(300, 308))),
                        session_id=other,
                        allocate=True,
                    )
                )
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            grew(capacity=8)
            assert all(seen[o] > 0 for o in names), seen
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
