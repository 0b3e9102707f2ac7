"""Capacity: hit ratios with a pool far smaller than the working set, and what retention
hints add for agents.

``python bench/capacity.py --json FILE [--quick] [--server] [--disk-dir DIR]
[--trace NAME]`` replays

(a) the Mooncake conversation trace (bench/traces/mooncake_conversation_trace.jsonl, one
    hour of Kimi chat; a hash id is one 512-token block), and
(b) an agentic trace synthesised here (agentic_trace.py; its parameters below),

each with a pool of ``--pool-share`` (5 %) of the trace's working set (its distinct
blocks), and writes one row per trace and ``config``, each with ``hit_ratio`` (hit tokens
over prompt tokens, every request counted) and ``runner``:

* ``infinite``: a pool that holds the whole working set (the ceiling);
* ``pool``: the pool under the model's LRU;
* ``pool+retention`` (agentic): the same pool; every agent turn carries a retention hint
  (``--retain-seconds`` 600, priority high) and an agent chain that ends (a session, a
  subagent, a compaction) is released (seconds 0); one-off prompts carry none; one
  tenant, with the whole pool as its share (the service's default without
  ``server.tenants``) and with half (its default with one tenant configured);
* ``pool+disk`` and ``pool+disk+retention`` (agentic): the same pool over the local disk
  tier, ``--disk-dir`` with ``--disk-bytes`` (default: 1.5 times the working set's pages,
  4 KiB each; each row's folder is removed after it) and ``--disk-timeout`` (the disk
  reads' deadline, ``server.disk.timeout``); each such row has the server's
  ``prefixcache_disk_lookups_total`` by result at its end (``disk_lookups``: ``disk``,
  ``miss``, ``timeout``, ...).

Runners: ``library`` rows replay in this process through ``RadixCache`` (the cache
library the service runs), one trace block per cache token (page size 1), on the
trace's clock (the retention clock is the request times). ``server`` rows (``--server``,
and every disk row) replay over gRPC against ``prefixcache serve`` subprocesses, with the
trace's time compressed ``--time-scale`` times (retention seconds too) and requests
paced to it. The disk rows need the disk tier (``server.disk``): where the server
refuses that section, each disk row says so in ``skipped``.

Agentic trace (agentic_trace.AgentParams; sources as collected in the project's
research notes on tiers, section 3.1):

* sessions: 160 (quick: 20), starting at uniform times over 1 h (quick: 7.5 min); the
  scale is chosen here.
* turns per session: lognormal, median 38, sigma 0.5. Sources: median 33 (Inferact's
  Codex traces), 43 (vLLM's AgentX blog).
* a system prompt shared by the sessions of one of 4 kinds of agent: 12 K tokens.
  Source: "Don't Break the Cache" (10 K-token system prompts).
* the first user prompt: 1-4 K tokens (chosen here).
* new tokens per turn (tool output and the model's answer): lognormal, median 1.5 K,
  sigma 0.9, clipped to 200-8 K. Source: "a few hundred to a few thousand" a turn, about
  80 K tokens by turn 30 (Inferact).
* contexts capped at 180 K tokens; past it a session compacts to its system prompt and
  a 4 K summary, a new chain. Sources: 80-180 K contexts (Inferact, AgentX); compaction
  breaks the chain (AgentX v0.2).
* gaps between turns: a tool's, exponential with mean 6 s; a person's, at 12 % of
  turns, lognormal with median 3 min, 30 s to 30 min. Sources: tool gaps of seconds and
  human gaps of minutes; about 8 tool steps per human request (TraceLab).
* subagents: 44 % of sessions fork 1-3 once, on the parent's prefix, of about 8 turns
  each with tool gaps; the parent waits for them. Source: 44 % (vLLM's AgentX blog).
* one-off prompts: 30 % of requests, lognormal with median 8 K tokens, no reuse and no
  hint: a chat or batch neighbour of the agents (chosen here).

Each block is 64 tokens; a turn's new tokens are rounded to whole blocks, which
overstates hits by under a block a turn (about 2 % of a turn's new tokens). With an
infinite pool the trace's hit ratio is about 0.91 (agent turns alone about 0.97,
where the published traces report over 0.95).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from array import array
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Run as `python bench/capacity.py`, sys.path[0] is bench/, where trace.py would
# shadow the stdlib `trace` module; import our modules as `bench.*` instead.
_REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == _REPO / "bench":
    sys.path[0] = str(_REPO)
sys.path += [p for p in map(str, (_REPO, _REPO / "server", _REPO / "client")) if p not in sys.path]

from bench.agentic_trace import (  # noqa: E402
    BLOCK,
    RELEASE,
    TURN,
    AgentParams,
    Request,
    agentic_trace,
)
from bench.trace import BLOCK_TOKENS, DEFAULT_TRACE, load_trace  # noqa: E402

# Shares of the pool one tenant may retain (server.retention.tenant_share): all of it
# (the default without server.tenants) and half (its default with one tenant set).
TENANT_SHARES = (1.0, 0.5)
HIGH = 75
# A server row's page: one trace block, 4 KiB of KV (one layer and head of 1,024 fp16
# values for K and for V), a whole direct-I/O block, as a disk tier stores it.
PAGE_BYTES = 4096


@dataclass(frozen=True, slots=True)
class Event:
    """A request of either trace in cache tokens (one per trace block): its prompt
    (``blocks``), its prompt's length in real tokens, and whether it carries a hint."""

    t: float
    kind: str
    blocks: array
    tokens: int


@dataclass
class Trace:
    name: str
    block_tokens: int
    events: list[Event]

    @property
    def working_set(self) -> int:
        """Distinct blocks the trace's prompts hold (the pool an infinite row needs)."""
        seen: set[int] = set()
        for e in self.events:
            if e.kind != RELEASE:
                seen.update(e.blocks)
        return len(seen)

    @property
    def largest(self) -> int:
        return max((len(e.blocks) for e in self.events), default=0)


@dataclass
class Row:
    trace: str
    config: str
    runner: str
    pool_tokens: int
    working_set_tokens: int
    requests: int
    hit_ratio: float
    agent_hit_ratio: float | None = None
    tenant_share: float | None = None
    retained_evicted_tokens: int | None = None
    refused: int = 0
    seconds: float = 0.0
    skipped: str | None = None
    # Disk rows: the server's prefixcache_disk_lookups_total by result at the end.
    disk_lookups: dict[str, int] | None = None


def mooncake_trace(limit: int | None) -> Trace:
    reqs = load_trace(DEFAULT_TRACE, limit)
    with open(DEFAULT_TRACE, encoding="utf-8") as fh:  # load_trace keeps no times
        times = [json.loads(line)["timestamp"] / 1000 for line in fh if line.strip()]
    events = [
        Event(t, TURN, array("I", r.hash_ids), r.input_length)
        for t, r in zip(times[: len(reqs)], reqs, strict=True)
    ]
    return Trace("mooncake_conversation", BLOCK_TOKENS, events)


def agent_trace(params: AgentParams) -> Trace:
    def event(r: Request) -> Event:
        blocks = r.blocks()
        return Event(r.t, r.kind, blocks, len(blocks) * BLOCK)

    return Trace("agentic", BLOCK, [event(r) for r in agentic_trace(params)])


# ------------------------------------------------------------------ in process


class Tally:
    """Hit and prompt tokens, all requests and agent turns apart."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.hit = self.total = self.agent_hit = self.agent_total = 0
        self.requests = self.refused = 0
        self.agents = False

    def add(self, e: Event, hit_blocks: int) -> None:
        hit = min(hit_blocks * self.block_tokens, e.tokens)
        self.requests += 1
        self.hit += hit
        self.total += e.tokens
        if e.kind == TURN:
            self.agent_hit += hit
            self.agent_total += e.tokens
        else:
            self.agents = True  # the trace has other requests: agent turns apart

    def ratio(self) -> float:
        return self.hit / self.total if self.total else 0.0

    def agent_ratio(self) -> float | None:
        if not self.agents or not self.agent_total:
            return None
        return self.agent_hit / self.agent_total


def replay_library(
    trace: Trace, pool_blocks: int, retain_seconds: float | None, share: float = TENANT_SHARES[0]
) -> Row:
    """The trace through a RadixCache of ``pool_blocks`` tokens, as a worker drives it
    (match and lock, evict for room, allocate, insert), on the trace's clock."""
    import torch

    from prefixcache.cache import RadixCache, RadixKey, TokenToKVPoolAllocator

    now = [0.0]
    alloc = TokenToKVPoolAllocator(pool_blocks, "cpu", 1)
    cache = RadixCache(1, None, alloc, clock=lambda: now[0])
    limit = int(share * pool_blocks)
    tally = Tally(trace.block_tokens)
    t0 = time.perf_counter()
    for e in trace.events:
        now[0] = e.t
        key = RadixKey(e.blocks)
        if e.kind == RELEASE:
            if retain_seconds is not None:
                node, cached = cache.peek_node(key)
                if cached:
                    cache.retain(node, 0, HIGH, None, limit)
            continue
        m = cache.match_prefix(key)
        tally.add(e, m.prefix_len)
        need = len(e.blocks) - m.prefix_len
        if need == 0:
            continue
        node = m.last_node if m.prefix_len else None
        cache.inc_lock_ref(node)
        short = need - alloc.available_size()
        if short > 0:
            cache.evict(short)
        slots = alloc.alloc(need)
        if slots is None:  # the locked prefix and the rest do not fit: not cached
            tally.refused += 1
            cache.dec_lock_ref(node)
            continue
        result = cache.insert(key, torch.cat([m.indices, slots]))
        if result.prefix_len > m.prefix_len:  # cannot happen sequentially; kept sound
            alloc.free(slots[: result.prefix_len - m.prefix_len])
        cache.dec_lock_ref(node)
        if retain_seconds is not None and e.kind == TURN:
            cache.retain(result.last_node, retain_seconds, HIGH, None, limit)
    cache.check_integrity()
    book = cache.retention
    config = "pool" if pool_blocks < trace.working_set + trace.largest else "infinite"
    if retain_seconds is not None:
        config += "+retention"
    return Row(
        trace.name,
        config,
        "library",
        pool_blocks * trace.block_tokens,
        trace.working_set * trace.block_tokens,
        tally.requests,
        tally.ratio(),
        tally.agent_ratio(),
        share if retain_seconds is not None else None,
        book.evicted * trace.block_tokens if book is not None and retain_seconds else None,
        tally.refused,
        time.perf_counter() - t0,
    )


# ----------------------------------------------------------------- over gRPC


def replay_server(
    trace: Trace,
    pool_blocks: int,
    retain_seconds: float | None,
    disk: dict[str, Any] | None,
    time_scale: float,
    tmp: Path,
    share: float = TENANT_SHARES[0],
) -> Row:
    """The trace over gRPC against a ``prefixcache serve`` with a pool of
    ``pool_blocks`` tokens (and ``server.disk`` = ``disk`` when given), the trace's
    time compressed ``time_scale`` times and requests paced to it."""
    from prefixcache.client import Retention

    model = {
        "name": "m",
        "kind": "radix",
        "page_size": 1,
        "pool": {"size": pool_blocks, "layers": 1, "k_heads": 1, "k_head_dim": PAGE_BYTES // 4},
    }
    server: dict[str, Any] = {}
    if retain_seconds is not None:
        server["retention"] = {"tenant_share": share, "max_seconds": 86400.0}
    if disk is not None:
        server["disk"] = disk
    config = (
        "pool"
        + ("+disk" if disk is not None else "")
        + ("+retention" if retain_seconds is not None else "")
    )
    node = _Server(tmp, model, server)
    tally = Tally(trace.block_tokens)
    hint = None if retain_seconds is None else Retention(retain_seconds / time_scale, HIGH)
    t0 = time.perf_counter()
    try:
        try:
            client = node.connect()
        except RuntimeError as exc:
            return Row(
                trace.name,
                config,
                "server",
                pool_blocks * trace.block_tokens,
                trace.working_set * trace.block_tokens,
                0,
                0.0,
                skipped=f"the server refused the config: {exc}",
            )
        start = time.monotonic()
        with client.session(60.0) as s:
            for e in trace.events:
                wait = start + e.t / time_scale - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if e.kind == RELEASE:
                    if hint is not None:
                        client.retain("m", e.blocks, 0)
                    continue
                turn_hint = hint if e.kind == TURN else None
                try:
                    m = s.match("m", e.blocks, lock=True, allocate=True)
                except Exception:  # larger than the pool can free: a miss, not cached
                    tally.add(e, s.match("m", e.blocks).prefix_len)
                    tally.refused += 1
                    continue
                tally.add(e, m.prefix_len)
                s.insert("m", e.blocks, m.all_slots(), release_lock_id=m.lock_id, retain=turn_hint)
        lookups = node.results("prefixcache_disk_lookups_total") if disk is not None else None
    finally:
        node.stop()
    return Row(
        trace.name,
        config,
        "server",
        pool_blocks * trace.block_tokens,
        trace.working_set * trace.block_tokens,
        tally.requests,
        tally.ratio(),
        tally.agent_ratio(),
        share if retain_seconds is not None else None,
        None,
        tally.refused,
        time.perf_counter() - t0,
        disk_lookups=lookups,
    )


def _is_record(line: str) -> bool:
    return line.startswith("{")


class _Server:
    """One ``prefixcache serve`` subprocess with this config, on a unix socket."""

    def __init__(self, tmp: Path, model: dict[str, Any], server: dict[str, Any]) -> None:
        import subprocess

        import yaml

        from bench.tier_nodes import child_env

        (tmp / "pc.yaml").write_text(
            yaml.safe_dump(
                {
                    "server": {"shm_dir": "off", "metrics_port": 0, "log_format": "json", **server},
                    "models": [model],
                }
            )
        )
        self.address = f"unix:{tmp / 'pc.sock'}"
        self.log = tmp / "stderr"
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "from prefixcache.server.cli import main; raise SystemExit(main())",
                    "serve",
                    "--config",
                    str(tmp / "pc.yaml"),
                    "--listen",
                    self.address,
                ],
                env=child_env(),
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        self.client: Any = None

    def connect(self) -> Any:
        """A client once the server answers; RuntimeError naming its last log line if
        it exits first (a config it refuses)."""
        from prefixcache.client import PrefixCacheClient

        self.client = PrefixCacheClient(self.address, timeout=60)
        deadline = time.monotonic() + 60
        while True:
            try:
                self.client.list_models(timeout=2)
                return self.client
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    lines = self.log.read_text().strip().splitlines()
                    raise RuntimeError(lines[-1] if lines else "no output") from None
                time.sleep(0.1)

    def results(self, metric: str) -> dict[str, int]:
        """``metric``'s values by their ``result`` label, from the server's /metrics."""
        import re
        import urllib.request

        port = next(
            rec["metrics_port"]
            for rec in map(json.loads, filter(_is_record, self.log.read_text().splitlines()))
            if rec.get("event") == "serving"
        )
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            text = r.read().decode()
        pattern = rf'^{metric}\{{[^}}]*result="([^"]+)"[^}}]*\}} (\S+)$'
        return {m[1]: int(float(m[2])) for m in re.finditer(pattern, text, re.M)}

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except Exception:
                self.proc.kill()
                self.proc.wait()


# ---------------------------------------------------------------------- main


def rows(args: argparse.Namespace) -> list[Row]:
    quick = args.quick
    params = AgentParams(sessions=20, arrival_s=450.0) if quick else AgentParams()
    wanted = args.trace or ["mooncake_conversation", "agentic"]
    traces = []
    if "mooncake_conversation" in wanted:
        traces.append(mooncake_trace(2000 if quick else None))
    if "agentic" in wanted:
        traces.append(agent_trace(params))
    out: list[Row] = []
    for trace in traces:
        agentic = trace.name == "agentic"
        out.append(replay_library(trace, trace.working_set + trace.largest + 1, None))
        for pool_share in args.pool_share or [0.05]:
            pool = max(trace.largest + 1, int(pool_share * trace.working_set))
            out.append(replay_library(trace, pool, None))
            if agentic:
                out += [
                    replay_library(trace, pool, args.retain_seconds, share)
                    for share in TENANT_SHARES
                ]
            out += server_rows(args, trace, pool, len(out))
        print(table([r for r in out if r.trace == trace.name]), file=sys.stderr)
    return out


def server_rows(args: argparse.Namespace, trace: Trace, pool: int, n: int) -> list[Row]:
    """The rows over gRPC: with ``--server`` the pool's, with ``--disk-dir`` the disk
    tier's (each disk row in a fresh folder under it)."""
    agentic = trace.name == "agentic"
    runs: list[tuple[float | None, bool]] = []
    if args.server:
        runs += [(None, False)] + ([(args.retain_seconds, False)] if agentic else [])
    if args.disk_dir:
        runs += [(None, True)] + ([(args.retain_seconds, True)] if agentic else [])
    out = []
    for seconds, on_disk in runs:
        disk = None
        if on_disk:
            path = Path(args.disk_dir) / f"{trace.name}-{n + len(out)}"
            path.mkdir(parents=True, exist_ok=True)
            # The working set's pages and half as much again, or what --disk-bytes says.
            disk = {
                "path": str(path),
                "bytes": args.disk_bytes or 3 * PAGE_BYTES * trace.working_set // 2,
            }
            if args.disk_timeout:
                disk["timeout"] = args.disk_timeout
        try:
            with tempfile.TemporaryDirectory(prefix="capacity-") as tmp:
                out.append(
                    replay_server(
                        trace,
                        pool,
                        seconds,
                        disk,
                        args.time_scale,
                        Path(tmp),
                        share=TENANT_SHARES[0],
                    )
                )
        finally:
            if disk is not None:  # its preallocated slots: gigabytes a row
                shutil.rmtree(disk["path"], ignore_errors=True)
    return out


def table(rows: Iterable[Row]) -> str:
    lines = [
        "| trace | config | runner | pool / working set (tokens) | tenant share "
        "| hit ratio | agent turns |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        agent = "" if r.agent_hit_ratio is None else f"{r.agent_hit_ratio:.3f}"
        hit = f"skipped: {r.skipped[:60]}..." if r.skipped else f"{r.hit_ratio:.3f}"
        share = "" if r.tenant_share is None else f"{r.tenant_share:g}"
        lines.append(
            f"| {r.trace} | {r.config} | {r.runner} | {r.pool_tokens / 1e6:.1f} M / "
            f"{r.working_set_tokens / 1e6:.1f} M | {share} | {hit} | {agent} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None, emit: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="write the rows here")
    parser.add_argument(
        "--quick", action="store_true", help="2,000 Mooncake requests and 20 agent sessions"
    )
    parser.add_argument(
        "--pool-share",
        type=float,
        action="append",
        help="the pool as a share of each trace's working set; repeatable (default 0.05)",
    )
    parser.add_argument("--retain-seconds", type=float, default=600.0)
    parser.add_argument(
        "--server",
        action="store_true",
        help="also the pool rows over gRPC against prefixcache serve",
    )
    parser.add_argument("--disk-dir", help="the disk tier's rows, with their files here")
    parser.add_argument(
        "--disk-bytes",
        type=int,
        default=0,
        help="server.disk.bytes (0: 1.5 times the working set's pages)",
    )
    parser.add_argument(
        "--disk-timeout",
        type=float,
        default=0.0,
        help="server.disk.timeout (0: its default, 0.5 s)",
    )
    parser.add_argument(
        "--trace",
        choices=("mooncake_conversation", "agentic"),
        action="append",
        help="replay only this trace; repeatable (default: both)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=100.0,
        help="trace seconds per second of a server replay",
    )
    args = parser.parse_args(argv)
    out = rows(args)
    doc = {
        "host": platform.node(),
        "python": platform.python_version(),
        "args": vars(args),
        "rows": [asdict(r) for r in out],
    }
    Path(args.json).write_text(json.dumps(doc, indent=2))
    emit(table(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
