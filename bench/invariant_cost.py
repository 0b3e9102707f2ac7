"""What invariant mode (`server.check_integrity`) costs: prefills with and without it.

Starts the service in-process (its own event loop in a thread, on a unix socket) once
per mode and times ``--requests`` two-call prefills (Match with lock and allocate, then
Insert with the lock handed over) of ``--tokens`` tokens each over gRPC. Each prompt
shares a system prefix with the others and has its own tail, so the tree grows and,
once the pool is full, eviction runs; every mutating call then pays one integrity check
of every model.

    PYTHONPATH=server:client python bench/invariant_cost.py --requests 500 --tokens 2048
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np

from prefixcache.server.app import PrefixCacheServer
from prefixcache.server.config import Config, ModelConfig, PoolConfig, ServerConfig
from prefixcache.v1 import prefix_cache_pb2 as pb
from prefixcache.v1 import prefix_cache_pb2_grpc as pb_grpc


def run(check: bool, requests: int, tokens: int, pool: int, page: int) -> float:
    """Seconds for ``requests`` prefills against a fresh server."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Config(
            ServerConfig(
                listen=f"unix:{Path(tmp) / 'pc.sock'}",
                metrics_port=-1,
                shm_dir="",
                check_integrity=check,
            ),
            (
                ModelConfig(
                    name="m", page_size=page, pool=PoolConfig(size=pool, k_heads=1, k_head_dim=4)
                ),
            ),
        )
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        server = PrefixCacheServer(config)
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
        rng = np.random.default_rng(0)
        prefix = rng.integers(0, 50000, tokens // 2)
        prompts = [
            np.concatenate([prefix, rng.integers(0, 50000, tokens - len(prefix))])
            .astype("<u4")
            .tobytes()
            for _ in range(requests)
        ]
        try:
            with grpc.insecure_channel(server.address) as channel:
                stub = pb_grpc.PrefixCacheStub(channel)
                sid = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=600)).session_id
                start = time.perf_counter()
                for ids in prompts:
                    m = stub.Match(
                        pb.MatchRequest(
                            model="m", token_ids=ids, session_id=sid, lock=True, allocate=True
                        )
                    )
                    stub.Insert(
                        pb.InsertRequest(
                            model="m",
                            token_ids=ids,
                            session_id=sid,
                            slot_indices=m.slot_indices + m.allocated_slots,
                            release_lock_id=m.lock_id,
                        )
                    )
                elapsed = time.perf_counter() - start
                stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        finally:
            asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()
        return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--pool", type=int, default=262144, help="KV pool slots")
    parser.add_argument("--page", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=2, help="runs per mode (best kept)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    times = {}
    for check in (False, True):
        times[check] = min(
            run(check, args.requests, args.tokens, args.pool, args.page) for _ in range(args.repeat)
        )
    off, on = times[False], times[True]
    result = {
        "requests": args.requests,
        "tokens": args.tokens,
        "pool": args.pool,
        "off_ms_per_prefill": 1000 * off / args.requests,
        "on_ms_per_prefill": 1000 * on / args.requests,
        "ratio": on / off,
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.requests} prefills of {args.tokens} tokens, pool {args.pool}:")
    print(f"  off: {result['off_ms_per_prefill']:.2f} ms a prefill")
    print(f"  on:  {result['on_ms_per_prefill']:.2f} ms a prefill  ({result['ratio']:.2f}x)")


if __name__ == "__main__":
    main()
