"""Scheduler loops against in-process and remote cache backends, in one run.

Backends, each on the same request stream (Mooncake conversation prompts; output lengths
the trace's, scaled by ``--output-scale``), with a fresh cache each:

* ``inprocess``: ``LocalSGLangCache`` (the in-process ``RadixCache`` with SGLang's API)
  driven by ``sglang_sched.Scheduler``;
* ``client``: the raw client, one ``Step`` per step (``raw_sched.RawScheduler``);
* ``remote_radix_cache``: ``RemoteRadixCache`` driven by the same ``Scheduler`` as the
  in-process backend;
* ``max_inprocess`` and ``remote_radix_trie``: Modular MAX's manager loop
  (``max_sched.MaxScheduler``) over the in-process ``RadixTrie`` and over
  ``RemoteRadixTrie``;
* ``mamba_inprocess`` and ``remote_mamba``: the ``MambaRadixCache`` API's loop
  (``mamba_sched.MambaScheduler``) over the in-process ``MambaRadixCache`` and over
  ``RemoteMambaRadixCache`` (a mamba model with ``--states`` state slots).

The service backends start ``prefixcache serve`` as a subprocess on a unix socket, with
a pool of ``--pool`` tokens and tiny KV rows (so the bytes stay small). Per step it
measures the step's wall time (all of it is cache and scheduling work: there is no
model), this process's CPU time (the shadow follower's thread included), the server's
CPU time (``/proc/<pid>/stat``), the RPCs made, the token hit ratio of admissions, and
the shadow index's lag. It prints a markdown table; ``--json OUT`` writes one object per
backend.

    python bench/scheduler_loop.py --waiting 128 --batch 128 --steps 300 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == _REPO / "bench":
    sys.path[0] = str(_REPO)  # bench/trace.py would shadow the stdlib module
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import torch  # noqa: E402

from bench.grpc_servers import ServerProcess  # noqa: E402
from bench.mamba_sched import MambaScheduler  # noqa: E402
from bench.max_sched import MaxScheduler  # noqa: E402
from bench.raw_sched import RawScheduler  # noqa: E402
from bench.sglang_sched import Req, Scheduler, StepResult  # noqa: E402
from bench.trace import DEFAULT_TRACE, expand, load_trace  # noqa: E402
from prefixcache.cache import (  # noqa: E402
    MambaPool,
    MambaRadixCache,
    RadixTrie,
    TokenToKVPoolAllocator,
)
from prefixcache.client import (  # noqa: E402
    PrefixCacheClient,
    RemoteMambaRadixCache,
    RemoteRadixCache,
    RemoteRadixTrie,
)
from prefixcache.client.worker.sglang_local import LocalSGLangCache  # noqa: E402

MODEL = "bench"
BACKENDS = (
    "inprocess",
    "client",
    "remote_radix_cache",
    "max_inprocess",
    "remote_radix_trie",
    "mamba_inprocess",
    "remote_mamba",
)
_SERVE = "import sys; from prefixcache.server.cli import main; sys.exit(main())"
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


class CountingClient(PrefixCacheClient):
    """A client that counts its unary calls (the Subscribe stream is not one)."""

    rpcs = 0

    def _send_flow(self, op: Any, timeout: float | None) -> Any:
        self.rpcs += 1  # every unary call goes through here (sync and shared flows)
        return (yield from super()._send_flow(op, timeout))


@dataclass
class Requests:
    prompts: list[Any]
    outputs: list[int]

    def make(self, i: int) -> Req:
        return Req(i, self.prompts[i], self.outputs[i])


def load_requests(
    path: Path, page_size: int, limit: int, scale: float, max_output: int
) -> Requests:
    """The first ``limit`` requests: prompts as in ``trace.expand``, output lengths the
    trace's times ``scale``, at least 1 and at most ``max_output``."""
    traces = load_trace(path, limit)
    with open(path, encoding="utf-8") as fh:
        outputs = [
            max(1, min(round(int(json.loads(line)["output_length"]) * scale), max_output))
            for line, _ in zip(fh, range(limit), strict=False)
            if line.strip()
        ]
    return Requests(expand(traces, page_size), outputs[: len(traces)])


@dataclass
class Run:
    backend: str
    steps: int
    warmup: int
    samples: dict[str, list[float]] = field(default_factory=dict)
    prompt_tokens: int = 0
    hit_tokens: int = 0
    admitted: int = 0
    finished: int = 0
    lag_events: list[int] = field(default_factory=list)
    lag_ms: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def add(self, name: str, value: float) -> None:
        self.samples.setdefault(name, []).append(value)

    def summary(self) -> dict[str, Any]:
        def mean(name: str) -> float:
            xs = self.samples.get(name, [])[self.warmup :]
            return sum(xs) / len(xs) if xs else 0.0

        def peak(name: str) -> float:
            xs = self.samples.get(name, [])[self.warmup :]
            return max(xs) if xs else 0.0

        return {
            "backend": self.backend,
            "steps": self.steps,
            "warmup_steps": self.warmup,
            "rpcs_per_step": mean("rpcs"),
            "rpcs_per_step_max": peak("rpcs"),
            "cache_wall_ms_per_step": mean("wall_ms"),
            "cache_wall_ms_per_step_max": peak("wall_ms"),
            "worker_cpu_ms_per_step": mean("worker_cpu_ms"),
            "server_cpu_ms_per_step": mean("server_cpu_ms"),
            "hit_ratio": self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "admitted": self.admitted,
            "finished": self.finished,
            "first_step_wall_ms": self.samples.get("wall_ms", [0.0])[0],
            "first_step_rpcs": self.samples.get("rpcs", [0.0])[0],
            "shadow_lag_events_p50": _pct(self.lag_events, 50),
            "shadow_lag_events_p99": _pct(self.lag_events, 99),
            "shadow_lag_ms_p50": _pct(self.lag_ms, 50),
            "shadow_lag_ms_p99": _pct(self.lag_ms, 99),
            **self.extra,
        }


def _pct(xs: list[Any], q: int) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return float(s[min(len(s) - 1, len(s) * q // 100)])


def drive(
    name: str,
    sched: Any,
    reqs: Requests,
    args: argparse.Namespace,
    rpcs: Any = lambda: 0,
    server: ServerProcess | None = None,
) -> Run:
    """Run ``args.steps`` steps, keeping ``args.waiting`` requests waiting."""
    run = Run(name, args.steps, args.warmup)
    nxt = 0
    gc.collect()
    for _ in range(args.steps):
        while len(sched.waiting) < args.waiting and nxt < len(reqs.prompts):
            sched.waiting.append(reqs.make(nxt))
            nxt += 1
        r0, s0 = rpcs(), server.cpu_s() if server else 0.0
        c0, t0 = time.process_time(), time.perf_counter()
        out: StepResult = sched.step()
        t1, c1 = time.perf_counter(), time.process_time()
        s1 = server.cpu_s() if server else 0.0
        run.add("wall_ms", (t1 - t0) * 1e3)
        run.add("worker_cpu_ms", (c1 - c0) * 1e3)
        run.add("server_cpu_ms", (s1 - s0) * 1e3)
        run.add("rpcs", rpcs() - r0)
        run.prompt_tokens += out.prompt_tokens
        run.hit_tokens += out.hit_tokens
        run.admitted += out.admitted
        run.finished += out.finished
    return run


def _lags(run: Run, follower: Any) -> None:
    samples = follower.index.lag_samples()
    run.lag_events = [s.events for s in samples]
    run.lag_ms = [s.ms for s in samples]


def start_server(tmp: Path, args: argparse.Namespace, tag: str) -> ServerProcess:
    config = tmp / f"{tag}.yaml"
    mamba = tag.endswith("mamba")
    config.write_text(
        "server:\n  change_log_capacity: 65536\n"  # Subscribe, for the shadow index
        f"models:\n  - name: {MODEL}\n    kind: {'mamba' if mamba else 'radix'}\n"
        f"    page_size: {args.page_size}\n"
        f"    pool: {{size: {args.pool}, layers: 1, k_heads: 1, k_head_dim: 4, "
        "dtype: float16}\n"
        + (
            f"    mamba: {{state_slots: {args.states}, layers: 1, conv_state_shape: [4, 3], "
            "temporal_state_shape: [1, 4, 4]}\n"
            if mamba
            else ""
        )
    )
    sock = tmp / f"{tag}.sock"
    argv = [
        sys.executable,
        "-c",
        _SERVE,
        "serve",
        "--config",
        str(config),
        "--listen",
        f"unix:{sock}",
        "--metrics-port",
        "0",
        "--grace-period",
        "1",
        "--log-level",
        "warning",
    ]
    return ServerProcess(f"prefixcache serve ({tag})", argv, sock, tmp / f"{tag}.log")


def run_backend(name: str, reqs: Requests, args: argparse.Namespace, tmp: Path) -> Run:
    pages = args.pool // args.page_size
    if name == "inprocess":
        cache = LocalSGLangCache(args.pool, args.page_size)
        return drive(name, Scheduler(cache, batch=args.batch, chunk=args.chunk), reqs, args)
    if name == "max_inprocess":
        sched = MaxScheduler(RadixTrie(args.page_size), args.page_size, pages, args.batch)
        return drive(name, sched, reqs, args)
    if name == "mamba_inprocess":
        allocator = TokenToKVPoolAllocator(args.pool, "cpu", args.page_size)
        states = MambaPool(
            max_reqs=1,
            max_track_slots=args.states,
            num_layers=1,
            conv_state_shape=(4, 3),
            temporal_state_shape=(1, 4, 4),
        )
        return drive(
            name,
            MambaScheduler(
                MambaRadixCache(args.page_size, allocator, states), args.page_size, args.batch
            ),
            reqs,
            args,
        )
    server = start_server(tmp, args, name)
    try:
        client = CountingClient(server.target, timeout=60.0)
        if name == "remote_radix_trie":
            trie = RemoteRadixTrie(client, MODEL, ttl=60.0, shadow_wait=10.0)
            sched = MaxScheduler(trie, args.page_size, pages, args.batch, own_pool=False)
            run = drive(name, sched, reqs, args, lambda: client.rpcs, server)
            _lags(run, trie._shadow)
            run.extra = {"queued_errors": len(trie.errors)}
            trie.close()
        elif name == "remote_mamba":
            mcache = RemoteMambaRadixCache(client, MODEL, ttl=60.0)
            run = drive(
                name,
                MambaScheduler(mcache, args.page_size, args.batch),
                reqs,
                args,
                lambda: client.rpcs,
                server,
            )
            run.extra = {"queued_errors": len(mcache.errors)}
            mcache.close()
        elif name == "client":
            sched = RawScheduler(client, MODEL, page_size=args.page_size, batch=args.batch)
            run = drive(name, sched, reqs, args, lambda: client.rpcs, server)
            _lags(run, sched.shadow)
            run.extra = {
                "stale_hints": sched.stale_hints,
                "failed_admissions": sched.failed_admissions,
            }
            sched.close()
        else:
            cache = RemoteRadixCache(client, MODEL, ttl=60.0, shadow_wait=10.0)
            w = cache.window  # follow the shadow before the clock starts
            sched = Scheduler(cache, batch=args.batch, chunk=args.chunk)
            run = drive(name, sched, reqs, args, lambda: client.rpcs, server)
            _lags(run, w.shadow)
            run.extra = {
                "speculated": w.speculated,
                "used": w.used,
                "released": w.released,
                "shortfalls": w.shortfalls,
                "on_demand_calls": w.on_demand_calls,
                "queued_errors": len(cache.errors),
                "stopped_by": sched.stopped_by,
            }
            cache.close()
        client.close()
        return run
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = ap.add_argument
    add("--trace", type=Path, default=DEFAULT_TRACE)
    add("--waiting", type=int, default=128, help="requests kept waiting (default 128)")
    add("--batch", type=int, default=128, help="most requests running (default 128)")
    add("--steps", type=int, default=300, help="scheduling steps per backend (default 300)")
    add(
        "--warmup",
        type=int,
        default=1,
        help="first steps left out of the per-step means (default 1: the initial fill)",
    )
    add("--chunk", type=int, default=None, help="chunked prefill budget per step (tokens)")
    add("--page-size", type=int, default=16)
    add("--pool", type=int, default=4 * 1024 * 1024, help="KV pool in tokens (default 4M)")
    add(
        "--states",
        type=int,
        default=4096,
        help="Mamba state slots of the mamba backends (default 4096)",
    )
    add(
        "--output-scale",
        type=float,
        default=0.25,
        help="output lengths are the trace's times this (default 0.25: mean ~90 tokens, "
        "so requests finish at every step, not all at once)",
    )
    add("--max-output", type=int, default=1024, help="and at most this (default 1024)")
    add(
        "--requests",
        type=int,
        default=None,
        help="trace requests to load (default: enough for the run)",
    )
    add("--backends", default=",".join(BACKENDS))
    add("--json", type=Path, metavar="OUT")
    args = ap.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    if bad := [b for b in backends if b not in BACKENDS]:
        ap.error(f"unknown backends {bad}; choose from {', '.join(BACKENDS)}")
    torch.set_num_threads(1)  # small tensor ops: the thread pool only costs here
    limit = args.requests or args.waiting + args.batch + args.steps * 4
    reqs = load_requests(args.trace, args.page_size, limit, args.output_scale, args.max_output)
    results = []
    with tempfile.TemporaryDirectory(prefix="sched-bench-") as tmp:
        for name in backends:
            results.append(run_backend(name, reqs, args, Path(tmp)).summary())
    print(
        f"{args.waiting} waiting, batch {args.batch}, {args.steps} steps "
        f"(means over steps {args.warmup + 1}..), page {args.page_size}, "
        f"pool {args.pool}, chunk {args.chunk}\n"
    )
    print(
        "| backend | RPCs/step (max) | cache wall ms/step | worker CPU ms | server CPU ms "
        "| hit ratio | shadow lag events p50/p99 | lag ms p50/p99 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['backend']} | {r['rpcs_per_step']:.2f} ({r['rpcs_per_step_max']:.0f}) "
            f"| {r['cache_wall_ms_per_step']:.2f} | {r['worker_cpu_ms_per_step']:.2f} "
            f"| {r['server_cpu_ms_per_step']:.2f} | {r['hit_ratio']:.4f} "
            f"| {r['shadow_lag_events_p50']:.0f}/{r['shadow_lag_events_p99']:.0f} "
            f"| {r['shadow_lag_ms_p50']:.2f}/{r['shadow_lag_ms_p99']:.2f} |"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
