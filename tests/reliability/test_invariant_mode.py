"""Invariant mode: `server.check_integrity` (env PREFIXCACHE_CHECK_INTEGRITY, CLI
`--check-integrity`) runs the integrity check after every call that can change a cache
or a pool, so corruption surfaces as INTERNAL at the call that caused it."""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from harness import SOURCE_PATH, ServerThread, make_config, pb, stub_for, toks, wait_serving

from prefixcache.server.cli import build_parser
from prefixcache.server.config import ModelConfig, PoolConfig, load_config

MODELS = (ModelConfig(name="m", page_size=1, pool=PoolConfig(size=64, k_heads=1, k_head_dim=4)),)
CODE = grpc.StatusCode


def test_off_by_default_and_set_by_yaml_env_and_cli(tmp_path: Path) -> None:
    assert load_config(env={}).server.check_integrity is False
    (tmp_path / "pc.yaml").write_text("server:\n  check_integrity: true\n")
    assert load_config(tmp_path / "pc.yaml", env={}).server.check_integrity is True
    env = {"PREFIXCACHE_CHECK_INTEGRITY": "1"}
    assert load_config(env=env).server.check_integrity is True
    args = build_parser().parse_args(["serve", "--check-integrity"])
    assert args.check_integrity is True
    assert build_parser().parse_args(["serve"]).check_integrity is None
    assert load_config(env={}, overrides={"check_integrity": True}).server.check_integrity


def _corrupt(srv: ServerThread) -> None:
    engine = srv.service.engines["m"]
    srv.run(setattr, engine, "session_slots", engine.session_slots + 1)


def test_a_corrupted_counter_fails_the_next_mutating_call(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="prefixcache.server")
    # The flag comes from the config here, not from the test harness.
    srv = ServerThread(make_config(tmp_path, MODELS, check_integrity=True), check_integrity=False)
    try:
        assert srv.server.servicer.check_integrity
        assert "invariant mode is on" in caplog.text
        channel, stub = stub_for(srv.address)
        sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
        stub.Alloc(pb.AllocRequest(model="m", num_slots=2, session_id=sid))
        _corrupt(srv)
        # Calls that change nothing are not checked...
        stub.Stats(pb.StatsRequest())
        stub.Match(pb.MatchRequest(model="m", token_ids=toks([1, 2])))
        stub.KeepAlive(pb.KeepAliveRequest(session_id=sid))
        # ...the next one that may change the cache is, and answers INTERNAL.
        with pytest.raises(grpc.RpcError) as err:
            stub.Alloc(pb.AllocRequest(model="m", num_slots=1, session_id=sid))
        assert err.value.code() == CODE.INTERNAL
        assert "slots owned by sessions" in err.value.details()
        assert "internal error in Alloc" in caplog.text
        # A Session stream op answers the same, in its reply.
        requests: queue.Queue[pb.SessionRequest | None] = queue.Queue()
        replies = stub.Session(iter(requests.get, None), timeout=10)
        requests.put(pb.SessionRequest(seq=1, evict=pb.EvictRequest(model="m", num_tokens=1)))
        reply = next(replies)
        assert reply.error.code == CODE.INTERNAL.value[0]
        requests.put(None)
        list(replies)
        assert "internal error in Session/evict" in caplog.text
        channel.close()
    finally:
        srv.stop()


def test_off_a_corrupted_counter_goes_unnoticed(tmp_path: Path) -> None:
    srv = ServerThread(make_config(tmp_path, MODELS), check_integrity=False)
    try:
        assert not srv.server.servicer.check_integrity
        channel, stub = stub_for(srv.address)
        sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
        _corrupt(srv)
        stub.Alloc(pb.AllocRequest(model="m", num_slots=1, session_id=sid))
        channel.close()
        _corrupt_back = srv.service.engines["m"]
        srv.run(setattr, _corrupt_back, "session_slots", _corrupt_back.session_slots - 1)
    finally:
        srv.stop()


@pytest.mark.slow
def test_cli_flag_starts_the_server_in_invariant_mode(tmp_path: Path) -> None:
    sock = tmp_path / "pc.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXCACHE_")}
    env.update(PYTHONPATH=SOURCE_PATH, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prefixcache.server.cli",
            "serve",
            "--listen",
            f"unix:{sock}",
            "--metrics-port",
            "-1",
            "--shm-dir",
            "off",
            "--check-integrity",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_serving(proc, f"unix:{sock}")
        channel, stub = stub_for(f"unix:{sock}")
        sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
        tokens = toks(list(range(32)))
        m = stub.Match(
            pb.MatchRequest(
                model="default", token_ids=tokens, session_id=sid, lock=True, allocate=True
            )
        )
        stub.Insert(
            pb.InsertRequest(
                model="default",
                token_ids=tokens,
                session_id=sid,
                slot_indices=m.allocated_slots,
                release_lock_id=m.lock_id,
            )
        )
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        channel.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "invariant mode is on" in err
