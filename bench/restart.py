"""Restarts at scale: how long a served model with a large cache is away across a clean
stop, a warm start, a SIGKILL and the start after it, against the same config's cold
start; and how a start grows with the pool.

For each size (``--tokens``, default 1, 10 and 50 M) a fresh ``prefixcache serve``
hosts one radix model with tiny rows (one layer, one head of dimension 1, fp16: 4 bytes
of KV a token, so tens of millions of slots fit) and ``warm_restart`` on, its pool in
a directory of its own under /dev/shm. In order: the cold start (empty directory), a
fill over gRPC from the Mooncake conversation trace (Match with allocation, Insert,
as a worker does, until the tree holds the size), the clean stop (SIGTERM to exit),
the warm start, a SIGKILL once its first checkpoint is written, and the start after
it. A start is timed from the spawn to the first answered call; the restore's own
seconds and tokens come from its log line. Every time is also given as a ratio to the
cold start of the same run.

Then the pool start (``--pool-gib``, default 0, 4 and 8): an empty server with rows of
32 KiB (8 layers, 8 heads of 128, fp16), private and in shared memory, timed the same
way (the fastest of ``--rounds``, interleaved), as a ratio to the 0 GiB start. A
shared pool is reserved after the start: the seconds that took are reported beside
it. Sizes the machine has no room for now (free memory, /dev/shm) are skipped, and
said so.

    python bench/restart.py --tokens 1e6,10e6,50e6 --pool-gib 0,4,8 --json bench/out/restart.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == _REPO / "bench":
    sys.path[0] = str(_REPO)  # bench/trace.py would shadow the stdlib `trace`
sys.path += [p for p in map(str, (_REPO, _REPO / "server", _REPO / "client")) if p not in sys.path]

import grpc  # noqa: E402

from bench.trace import DEFAULT_TRACE, expand, load_trace  # noqa: E402
from prefixcache.v1 import prefix_cache_pb2 as pb  # noqa: E402
from prefixcache.v1 import prefix_cache_pb2_grpc as pb_grpc  # noqa: E402

_ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(str(_REPO / p) for p in ("server", "client")),
    "OMP_NUM_THREADS": "1",
    "PREFIXCACHE_LOG_FORMAT": "json",
}
PAGE = 16
_ROW_32K = "layers: 8, k_heads: 8, k_head_dim: 128"
_TINY = "layers: 1, k_heads: 1, k_head_dim: 1"


class Serve:
    """One ``prefixcache serve``; ``seconds``: from the spawn to the first answer."""

    def __init__(self, tmp: Path, config: str, name: str) -> None:
        (tmp / f"{name}.yaml").write_text(config)
        self.address = f"unix:{tmp / 'pc.sock'}"
        self.log = tmp / f"{name}.log"
        started = time.perf_counter()
        with self.log.open("wb") as err:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "prefixcache.server.cli",
                    "serve",
                    "--config",
                    str(tmp / f"{name}.yaml"),
                    "--listen",
                    self.address,
                    "--metrics-port",
                    "0",
                ],
                env=_ENV,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        # Reconnect at once: gRPC's default backoff (1 s, then more) would round every
        # start up to whole seconds.
        self.channel = grpc.insecure_channel(
            self.address,
            options=[
                ("grpc.initial_reconnect_backoff_ms", 10),
                ("grpc.min_reconnect_backoff_ms", 10),
                ("grpc.max_reconnect_backoff_ms", 20),
            ],
        )
        self.stub = pb_grpc.PrefixCacheStub(self.channel)
        while True:
            try:
                self.stub.ListModels(pb.ListModelsRequest(), timeout=1)
                break
            except grpc.RpcError:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"serve exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}"
                    ) from None
                time.sleep(0.005)
        self.seconds = time.perf_counter() - started

    def records(self, event: str) -> list[dict[str, Any]]:
        out = []
        for line in self.log.read_text().splitlines():
            if line.startswith("{"):
                rec = json.loads(line)
                if rec.get("event") == event:
                    out.append(rec)
        return out

    def metric(self, pattern: str) -> float:
        port = self.records("serving")[0]["metrics_port"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            found = re.search(pattern, r.read().decode(), re.M)
        return float(found[1]) if found else 0.0

    def stop(self) -> float:
        """SIGTERM; seconds until the process exited."""
        self.channel.close()
        started = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(600)
        return time.perf_counter() - started

    def kill(self) -> None:
        self.channel.close()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(60)


def _config(shm: Path, pool: int, rows: str, warm: bool = True) -> str:
    return (
        f'server:\n  shm_dir: "{shm}"\n  warm_restart: {str(warm).lower()}\n'
        f"models:\n  - name: m\n    page_size: {PAGE}\n"
        f"    pool: {{size: {pool}, {rows}}}\n"
    )


def _fill(stub: Any, keys: list[Any], target: int) -> int:
    """Cache trace prompts until the tree holds ``target`` tokens; returns them."""
    session = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=3600)).session_id
    cached = 0
    for key in keys:
        packed = key.tobytes()
        m = stub.Match(
            pb.MatchRequest(model="m", token_ids=packed, session_id=session, allocate=True),
            timeout=600,
        )
        stub.Insert(
            pb.InsertRequest(
                model="m",
                token_ids=packed,
                session_id=session,
                slot_indices=m.slot_indices + m.allocated_slots,
            ),
            timeout=600,
        )
        cached += len(key) - m.prefix_len
        if cached >= target:
            break
    stub.CloseSession(pb.CloseSessionRequest(session_id=session))
    return cached


def _room(nbytes: int, shared: bool) -> bool:
    with open("/proc/meminfo") as f:
        avail = int(re.search(r"MemAvailable:\s+(\d+)", f.read())[1]) * 1024
    free = shutil.disk_usage("/dev/shm").free
    margin = 4 << 30
    return avail > nbytes + margin and (not shared or free > nbytes + margin)


def restarts(keys: list[Any], target: int, workdir: Path) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="restart-", dir=workdir))
    shm = Path(tempfile.mkdtemp(prefix="pc-bench-restart-", dir="/dev/shm"))
    pool = int(target * 1.1) + 1_000_000
    cfg = _config(shm, pool, _TINY)
    out: dict[str, Any] = {"tokens_target": target, "pool": pool}
    servers: list[Serve] = []
    try:
        cold = Serve(tmp, cfg, "cold")
        servers.append(cold)
        out["cold_s"] = cold.seconds
        started = time.perf_counter()
        out["cached_tokens"] = _fill(cold.stub, keys, target)
        out["fill_s"] = time.perf_counter() - started
        out["stop_s"] = cold.stop()
        written = cold.records("warm restart: snapshot written")
        out["snapshot_bytes"] = written[0]["bytes"] if written else 0
        warm = Serve(tmp, cfg, "warm")
        servers.append(warm)
        out["warm_s"] = warm.seconds
        restored = warm.records("warm restart: cache restored")
        out["warm_outcome"] = restored[0]["outcome"] if restored else "cold"
        out["restored_tokens"] = restored[0]["tokens"] if restored else 0
        out["restore_s"] = restored[0]["seconds"] if restored else 0.0
        deadline = time.monotonic() + 600
        written_now = r'^prefixcache_warm_checkpoints_total\{outcome="written"\} (\S+)$'
        while warm.metric(written_now) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        warm.kill()
        killed = Serve(tmp, cfg, "after_kill")
        servers.append(killed)
        out["after_kill_s"] = killed.seconds
        restored = killed.records("warm restart: cache restored")
        out["after_kill_outcome"] = restored[0]["outcome"] if restored else "cold"
        out["after_kill_tokens"] = restored[0]["tokens"] if restored else 0
        out["after_kill_stop_s"] = killed.stop()
    finally:
        for s in servers:
            if s.proc.poll() is None:
                s.kill()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    cold_s = out["cold_s"]
    out["warm_over_cold"] = out["warm_s"] / cold_s
    out["after_kill_over_cold"] = out["after_kill_s"] / cold_s
    out["restore_tokens_per_s"] = out["restored_tokens"] / max(out["restore_s"], 1e-9)
    return out


def pool_starts(gibs: list[float], workdir: Path, rounds: int) -> list[dict[str, Any]]:
    """Each (size, private or shared) start ``rounds`` times, interleaved so drift on a
    shared machine hits them alike; the fastest of each."""
    rows: dict[tuple[float, bool], dict[str, Any]] = {}
    for _ in range(rounds):
        for shared in (False, True):
            for gib in gibs:
                row = rows.setdefault((gib, shared), {"gib": gib, "shared": shared})
                nbytes = int(gib * (1 << 30))
                if "skipped" in row or (nbytes and not _room(nbytes, shared)):
                    row["skipped"] = "no room now"
                    continue
                tmp = Path(tempfile.mkdtemp(prefix="poolstart-", dir=workdir))
                shm = Path(tempfile.mkdtemp(prefix="pc-bench-pool-", dir="/dev/shm"))
                cfg = _config(shm, max(64, nbytes // 32768), _ROW_32K, warm=False)
                if not shared:
                    cfg = cfg.replace(f'shm_dir: "{shm}"', 'shm_dir: "off"')
                try:
                    s = Serve(tmp, cfg, "pool")
                    row["start_s"] = min(row.get("start_s", 1e9), s.seconds)
                    if shared and nbytes:
                        deadline = time.monotonic() + 120
                        while not s.records("pool memory reserved") and time.monotonic() < deadline:
                            time.sleep(0.05)
                        got = s.records("pool memory reserved")
                        took = got[0]["seconds"] if got else float("nan")
                        row["reserve_s"] = min(row.get("reserve_s", 1e9), took)
                    s.stop()
                finally:
                    shutil.rmtree(shm, ignore_errors=True)
                    shutil.rmtree(tmp, ignore_errors=True)
    out = list(rows.values())
    base = {r["shared"]: r["start_s"] for r in out if r["gib"] == 0 and "start_s" in r}
    for r in out:
        if "start_s" in r and r["shared"] in base:
            r["over_empty"] = r["start_s"] / base[r["shared"]]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--tokens", default="1e6,10e6,50e6", help="cache sizes, comma-separated")
    ap.add_argument("--pool-gib", default="0,4,8", help="pool sizes for the start, GiB")
    ap.add_argument("--rounds", type=int, default=3, help="starts of each pool size")
    ap.add_argument("--json", type=Path, help="write the results as JSON")
    args = ap.parse_args()
    targets = [int(float(x)) for x in args.tokens.split(",") if x]
    gibs = [float(x) for x in args.pool_gib.split(",") if x]
    keys = expand(load_trace(args.trace), PAGE) if targets else []
    workdir = Path(tempfile.mkdtemp(prefix="pc-bench-"))
    results: dict[str, Any] = {"restarts": [], "pool_starts": []}
    try:
        for target in targets:
            if not _room(target * 80, shared=True):  # server bookkeeping, ~80 B a token
                results["restarts"].append({"tokens_target": target, "skipped": "no room now"})
                continue
            results["restarts"].append(restarts(keys, target, workdir))
            print(json.dumps(results["restarts"][-1]), flush=True)
        results["pool_starts"] = pool_starts(gibs, workdir, args.rounds)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(
        "| cached tokens | cold s | stop s | warm s (xcold) | after SIGKILL s (xcold) "
        "| restored | restore tok/s |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results["restarts"]:
        if "skipped" in r:
            print(f"| {r['tokens_target'] / 1e6:.0f} M | skipped: {r['skipped']} |||||")
            continue
        print(
            f"| {r['cached_tokens'] / 1e6:.1f} M | {r['cold_s']:.2f} | {r['stop_s']:.2f} | "
            f"{r['warm_s']:.2f} ({r['warm_over_cold']:.2f}x) | {r['after_kill_s']:.2f} "
            f"({r['after_kill_over_cold']:.2f}x) | {r['restored_tokens'] / 1e6:.1f} M / "
            f"{r['after_kill_tokens'] / 1e6:.1f} M | {r['restore_tokens_per_s'] / 1e6:.1f} M |"
        )
    print()
    print("| pool | private start s (xempty) | shared start s (xempty) | shared reserved after |")
    print("|---|---|---|---|")
    by = {(r["gib"], r["shared"]): r for r in results["pool_starts"]}
    for gib in gibs:
        cells = []
        for shared in (False, True):
            r = by.get((gib, shared), {})
            cells.append(
                f"{r['start_s']:.2f} ({r.get('over_empty', 1):.2f}x)"
                if "start_s" in r
                else r.get("skipped", "-")
            )
        reserve = by.get((gib, True), {}).get("reserve_s", 0.0)
        print(f"| {gib:g} GiB | {cells[0]} | {cells[1]} | {reserve:.2f} s |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
