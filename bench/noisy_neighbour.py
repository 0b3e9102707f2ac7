"""Noisy neighbour: does one hostile client hurt another?

A fresh ``prefixcache serve`` (unix socket, one small radix model, 64 MiB of KV, and a
1M-token model of tiny rows for requests as large as a 1M-token prompt, the
limits and per-session quotas of ``SERVER`` below, KV events with a replay socket, one
tenant) serves a *victim*: a client with a
1 s lease that it renews every quarter second, running prefills back to back (Match
with lock and allocate of a prompt that shares a system prompt with the others and
has its own suffix, then Insert handing the lock over). First alone (the quiet
baseline), then while an *attacker* process runs each attack of ``noisy_attacks.py``
in turn: pool grab, lock everything, huge extra_key, huge client names, max-size
Match, ReadKV amplification, tiny chunks, KeepAlive storm, half-sent WriteKV and
session flood; then those of noisy_surfaces.py: KV-event replay requests,
Subscribe churn (and subscribers that never read), the page RPCs, and a tenant's
token probing for other tenants' nodes; then floods of 1M-token Explains, of 1M-hash
ExistsPages, and Subscribes hung up at once. Per row: the victim's prefills, their p50
and p99 latency, its errors, whether its lease held through the attack, the
attacker's calls by status code, and the server's RSS at the end of the attack.

    python bench/noisy_neighbour.py --duration 5 --json bench/out/noisy.json
    python bench/noisy_neighbour.py --duration 1 --attacks "pool grab,KeepAlive storm"

Exit status 1 when the victim lost its lease, a victim call failed, or an attack
could not run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == _REPO / "bench":
    sys.path[0] = str(_REPO)  # bench/trace.py would shadow the stdlib `trace`
sys.path += [p for p in map(str, (_REPO, _REPO / "server", _REPO / "client")) if p not in sys.path]

import grpc  # noqa: E402

from bench import noisy_auth  # noqa: E402
from bench.grpc_servers import _SERVE, ServerProcess  # noqa: E402
from bench.noisy_attacks import (  # noqa: E402
    ATTACKS,
    BIG,
    BIG_TOKENS,
    MODEL,
    attacker,
    toks,
    victim_prompt,
)
from prefixcache.v1 import prefix_cache_pb2 as pb  # noqa: E402
from prefixcache.v1 import prefix_cache_pb2_grpc as pb_grpc  # noqa: E402

POOL = 32768  # tokens; 4 layers x (K + V) x 2 heads x 64 x fp16: 64 MiB
SERVER = {
    "shm_dir": "off",
    "log_level": "warning",
    "session_ttl_min": 0.5,
    "max_sessions": 256,
    "max_session_slots": POOL // 4,
    "max_session_locked_tokens": POOL // 4,
    "max_session_streams": 8,
    "max_inflight_write_bytes": 16 << 20,
    "max_inflight_write_bytes_total": 64 << 20,
    # The newer surfaces (noisy_surfaces.py): a change log (Subscribe, page RPCs), an
    # evict cap, and a tenant; KV events with a replay socket are added per run.
    "change_log_capacity": 65536,
    "max_evict_tokens": 4096,
    "tenants": [{"name": "t1", "token": "noisy-tenant-token", "namespaces": ["t1/"]}],
    "token": "noisy-token",  # with a tenant, every call needs a token (noisy_auth.py)
}
TENANT_TOKEN = "noisy-tenant-token"
TOKEN = "noisy-token"
SHARED, UNIQUE, SUFFIX = 256, 192, 64  # victim prompt: system prompt, own part, per call
VICTIM_TTL = 1.0


def kv_events(tmp: Path) -> dict[str, Any]:
    """KV events on ipc sockets under ``tmp``, with a replay socket; tenants' namespaces
    hashed (the bench server has a tenant)."""
    return {
        "enable_kv_cache_events": True,
        "endpoint": f"ipc://{tmp}/kv-events",
        "replay_endpoint": f"ipc://{tmp}/kv-replay",
        "tenants": "hashed",
    }


def start_server(tmp: Path) -> ServerProcess:
    settings = {**SERVER, "kv_events": kv_events(tmp)}
    server = "".join(f"  {k}: {json.dumps(v)}\n" for k, v in settings.items())
    (tmp / "noisy.yaml").write_text(
        f"server:\n{server}models:\n  - name: {MODEL}\n    kind: radix\n    page_size: 1\n"
        f"    pool: {{size: {POOL}, layers: 4, k_heads: 2, k_head_dim: 64, "
        "dtype: float16}\n"
        f"  - name: {BIG}\n    kind: radix\n    page_size: 1\n"
        f"    pool: {{size: {BIG_TOKENS}, layers: 1, k_heads: 1, k_head_dim: 1, "
        "dtype: float16}\n"
    )
    argv = [
        sys.executable,
        "-c",
        _SERVE,
        "serve",
        "--config",
        str(tmp / "noisy.yaml"),
        "--listen",
        f"unix:{tmp / 'pc.sock'}",
        "--metrics-port",
        "-1",
    ]
    return ServerProcess("prefixcache serve", argv, tmp / "pc.sock", tmp / "server.log")


class Victim:
    """An innocent client: a leased session kept alive by a thread, and prefills."""

    def __init__(self, target: str) -> None:
        self.channel = noisy_auth.channel(target, TOKEN)
        self.stub = pb_grpc.PrefixCacheStub(self.channel)
        self.sid = self.stub.OpenSession(
            pb.OpenSessionRequest(ttl_seconds=VICTIM_TTL, client_name="victim"), timeout=10
        ).session_id
        self.lease_lost: list[str] = []
        self.errors: list[str] = []
        self.calls = 0
        self._stop = threading.Event()
        self._keeper = threading.Thread(target=self._keep_alive, daemon=True)
        self._keeper.start()

    def _keep_alive(self) -> None:
        while not self._stop.wait(VICTIM_TTL / 4):
            try:
                self.stub.KeepAlive(pb.KeepAliveRequest(session_id=self.sid), timeout=10)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    self.lease_lost.append(exc.details())
                    return
                self.errors.append(f"KeepAlive: {exc.code().name}")

    def prefill(self) -> None:
        self.calls += 1
        tokens = toks(
            victim_prompt(self.calls % 32, SHARED, UNIQUE)
            + [900_000 + self.calls * SUFFIX + j for j in range(SUFFIX)]
        )
        m = self.stub.Match(
            pb.MatchRequest(
                model=MODEL, token_ids=tokens, lock=True, allocate=True, session_id=self.sid
            ),
            timeout=30,
        )
        self.stub.Insert(
            pb.InsertRequest(
                model=MODEL,
                token_ids=tokens,
                slot_indices=m.slot_indices + m.allocated_slots,
                release_lock_id=m.lock_id,
                session_id=self.sid,
            ),
            timeout=30,
        )

    def run(self, seconds: float) -> list[float]:
        """Prefills back to back for ``seconds``; their latencies in ms."""
        out = []
        end = time.monotonic() + seconds
        while time.monotonic() < end and not self.lease_lost:
            start = time.perf_counter()
            try:
                self.prefill()
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    self.lease_lost.append(exc.details())
                else:
                    self.errors.append(f"prefill: {exc.code().name}: {exc.details()[:80]}")
                continue
            out.append((time.perf_counter() - start) * 1000)
        return out

    def close(self) -> None:
        self._stop.set()
        self._keeper.join()
        with contextlib.suppress(grpc.RpcError):
            self.stub.CloseSession(pb.CloseSessionRequest(session_id=self.sid), timeout=10)
        self.channel.close()


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


class Attacker:
    """The attacker's process (spawned once, so its imports are paid once), running one
    attack of noisy_attacks.py at a time."""

    def __init__(self, target: str, huge: int, extras: dict[str, Any]) -> None:
        ctx = mp.get_context("spawn")
        self.commands, self.out = ctx.Queue(), ctx.Queue()
        self.stop, self.armed = ctx.Event(), ctx.Event()
        self.proc = ctx.Process(
            target=attacker,
            daemon=True,
            args=(target, POOL, huge, self.commands, self.stop, self.armed, self.out, extras),
        )
        self.proc.start()

    def start(self, name: str) -> bool:
        """Start attack ``name``; whether it armed within a minute."""
        self.stop.clear()
        self.armed.clear()
        self.commands.put(name)
        return self.armed.wait(60)

    def finish(self) -> dict[str, Any]:
        """Stop the running attack; its counters once it has cleaned up."""
        self.stop.set()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                return self.out.get(timeout=1)
            except queue.Empty:
                if not self.proc.is_alive():
                    break
        return {"codes": {}, "error": "the attacker process died or hung"}

    def close(self) -> None:
        if self.proc.is_alive():
            self.commands.put(None)
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def run_one(
    name: str | None,
    server: ServerProcess,
    victim: Victim,
    attacker: Attacker | None,
    duration: float,
    warmup: float,
) -> dict[str, Any]:
    """The victim alone (``name`` None) or under one attack: one row of the table."""
    lost, errors = len(victim.lease_lost), len(victim.errors)
    row: dict[str, Any] = {"attack": name or "quiet (baseline)", "attacker": {}, "error": ""}
    if name is not None and attacker is not None:
        if not attacker.start(name):
            row["error"] = "never armed"
        victim.run(warmup)
    latencies = victim.run(duration)
    row["rss_mib"] = round(_rss_mib(server.proc.pid), 1)
    if name is not None and attacker is not None:
        result = attacker.finish()
        row["attacker"] = result["codes"]
        row["error"] = row["error"] or result["error"]
        victim.run(0.2)  # the lease must hold through the attacker's cleanup too
    row.update(
        prefills=len(latencies),
        p50_ms=round(_pct(latencies, 50), 2),
        p99_ms=round(_pct(latencies, 99), 2),
        victim_errors=victim.errors[errors:],
        lease_held=len(victim.lease_lost) == lost,
    )
    return row


def run(
    attacks: list[str], duration: float, warmup: float = 0.5, huge: int = 50 << 20
) -> list[dict[str, Any]]:
    """Start a server, then the baseline and every attack in ``attacks``; the rows.
    ``huge``: the size of the huge extra_key."""
    with tempfile.TemporaryDirectory(prefix="noisy-") as tmp:
        server = start_server(Path(tmp))
        attacker = None
        try:
            victim = Victim(server.target)
            try:
                rows = [run_one(None, server, victim, None, duration, warmup)]
                if attacks:
                    extras = {
                        "replay": kv_events(Path(tmp))["replay_endpoint"],
                        "tenant_token": TENANT_TOKEN,
                        "token": TOKEN,
                    }
                    attacker = Attacker(server.target, huge, extras)
                for name in attacks:
                    rows.append(run_one(name, server, victim, attacker, duration, warmup))
            finally:
                if attacker is not None:
                    attacker.close()
                victim.close()
        finally:
            code = server.stop()
        if code != 0:
            raise RuntimeError(f"the server exited {code}: {server.log_tail()}")
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| attack | prefills | p50 ms | p99 ms | victim errors | lease held | "
        "attacker calls | server RSS MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        calls = ", ".join(
            f"{k} {v}" for k, v in sorted(r["attacker"].items(), key=lambda kv: -kv[1])
        )
        if r["error"]:
            calls = f"{calls} (attack failed: {r['error']})"
        lines.append(
            f"| {r['attack']} | {r['prefills']} | {r['p50_ms']} | {r['p99_ms']} | "
            f"{len(r['victim_errors'])} | {'yes' if r['lease_held'] else 'NO'} | "
            f"{calls or '-'} | {r['rss_mib']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--duration",
        type=float,
        default=5.0,
        help="seconds the victim is measured per row (default 5)",
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=0.5,
        help="seconds of each attack before measuring (default 0.5)",
    )
    parser.add_argument(
        "--attacks", default=",".join(ATTACKS), help="comma-separated attack names (default: all)"
    )
    parser.add_argument(
        "--huge-mib",
        type=int,
        default=50,
        help="size of the huge extra_key, MiB (default 50, the issue's)",
    )
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    attacks = [a.strip() for a in args.attacks.split(",") if a.strip()]
    unknown = [a for a in attacks if a not in ATTACKS]
    if unknown:
        parser.error(f"unknown attacks {unknown}; known: {', '.join(ATTACKS)}")
    rows = run(attacks, args.duration, args.warmup, args.huge_mib << 20)
    print(table(rows))
    for r in rows:
        for err in r["victim_errors"][:3]:
            print(f"{r['attack']}: victim error: {err}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"server": SERVER, "pool": POOL, "rows": rows}, indent=2))
    bad = [r for r in rows if not r["lease_held"] or r["victim_errors"] or r["error"]]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
