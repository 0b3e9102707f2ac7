"""Real processes for the e2e tests: a `prefixcache serve` sidecar and vLLM engines.

Nothing here imports vLLM or transformers: the engines run in their own processes
(``engine_proc.py``), so the main venv can collect tests/e2e and skip it.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from e2e import tiny_llama

from prefixcache.client import PrefixCacheClient, PrefixCacheError

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# Greedy tokens must match exactly; logprobs agree to ~1e-6 in fp32 where the KV is
# right (another hit length changes the computed suffix, hence not exactly 0), and a
# wrong block moves them by 1e-2 or more.
TOL = 2e-5
ENGINE_START_TIMEOUT = 300.0
CALL_TIMEOUT = 300.0
HYBRID_LAYERS = 4  # tiny_llama.build_gemma3's

# The sidecar's models: the tiny Llama's KV geometry, pages of 16 and of 32; ``swa``
# holds its sliding-window twin's KV (the same geometry, another model's KV); ``hybrid``
# the Gemma-3-style model's (``tiny_llama.build_gemma3``: four layers).
CONFIG = """\
server:
  listen: unix:@SOCKET@
  metrics_port: -1
  change_log_capacity: 65536  # the connector's shadow index follows it (fast misses)
models:
  - name: p16
    page_size: 16
    pool: @POOL@
  - name: p32
    page_size: 32
    pool: @POOL@
  - name: swa
    page_size: 16
    pool: @POOL@
  - name: hybrid
    page_size: 16
    pool: @POOL4@
"""


def engine_env(**extra: str) -> dict[str, str]:
    """The environment of every vLLM process: offline, one engine core reserved."""
    env = {
        key: value for key, value in os.environ.items() if key != "PREFIXCACHE_E2E"
    }  # not a sidecar setting: it would warn
    env = {
        **env,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO / "server"), str(REPO / "client")]),
    }
    # Any kv_transfer_config makes vLLM's CPU build reserve an extra core; with two
    # cores that leaves the engine none unless it reserves only one.
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    env.update(extra)
    return env


class Sidecar:
    """`prefixcache serve` in its own process (so that it can be SIGKILLed)."""

    def __init__(
        self,
        tmp: Path,
        *,
        layers: int = tiny_llama.LAYERS,
        kv_heads: int = tiny_llama.KV_HEADS,
        head_dim: int = tiny_llama.HEAD_DIM,
        size: int = 16384,
        disk: Path | None = None,
        tier: dict[str, Any] | None = None,
    ) -> None:
        self.tmp = tmp
        self.socket = tmp / "pc.sock"
        self.target = f"unix:{self.socket}"
        self.config = tmp / "pc.yaml"

        def pool(n: int) -> str:
            return (
                f"{{size: {size}, layers: {n}, k_heads: {kv_heads}, "
                f"k_head_dim: {head_dim}, dtype: float32}}"
            )

        config = (
            CONFIG.replace("@SOCKET@", str(self.socket))
            .replace("@POOL@", pool(layers))
            .replace("@POOL4@", pool(HYBRID_LAYERS))
        )
        self.metrics_port = 0
        if disk is not None or tier is not None:  # /metrics on, for ``metric``
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                self.metrics_port = probe.getsockname()[1]
            config = config.replace(
                "metrics_port: -1", f"metrics_port: {self.metrics_port}\n  metrics_host: 127.0.0.1"
            )
        if disk is not None:  # the disk tier below the pool (docs/disk-tier.md)
            config = config.replace(
                "server:\n",
                f"server:\n  disk: {{path: '{disk}', bytes: 268435456, timeout: 30}}\n",
                1,
            )
        if tier is not None:  # ``server.tier``: the Mooncake tier (docs/across-nodes.md)
            config = config.replace("server:\n", f"server:\n  tier: {json.dumps(tier)}\n", 1)
        self.config.write_text(config)
        self.log = tmp / "pc.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()
        self.client = PrefixCacheClient(self.target, timeout=10.0)

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "prefixcache.server.cli",
                    "serve",
                    "--config",
                    str(self.config),
                ],
                env=engine_env(OMP_NUM_THREADS="1"),
                stdout=log,
                stderr=log,
            )
        probe = PrefixCacheClient(self.target, timeout=1.0, retries=0)
        deadline = time.monotonic() + 60
        try:
            while True:
                try:
                    probe.list_models()
                    return
                except PrefixCacheError:
                    if self.proc.poll() is not None:
                        raise RuntimeError(
                            f"serve exited {self.proc.returncode}:\n{self.log.read_text()[-4000:]}"
                        ) from None
                    if time.monotonic() > deadline:
                        raise TimeoutError("prefixcache serve did not start") from None
                    time.sleep(0.1)
        finally:
            probe.close()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)
        self.client.close()

    def metric(self, name: str, labels: str = "") -> float:
        """The sum of the samples of metric ``name`` whose line holds ``labels`` (needs
        ``disk`` or ``tier``: /metrics is on)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
        return sum(
            float(line.rpartition(" ")[2])
            for line in text.splitlines()
            if line.startswith((name + " ", name + "{")) and labels in line
        )

    def cached_len(self, model: str, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` the sidecar holds (a Match without lock)."""
        return self.client.match(model, list(tokens)).prefix_len

    def wait_cached(
        self, model: str, prompts: Sequence[Sequence[int]], unit: int, timeout: float = 60.0
    ) -> None:
        """Wait until the saves of ``prompts`` have landed (a save lands a few tenths of a
        second after the reply): each prompt's whole ``unit``-token blocks but the one
        holding its last token, at least."""
        deadline = time.monotonic() + timeout
        for p in prompts:
            want = (len(p) - 1) // unit * unit
            while (got := self.cached_len(model, p)) < want:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the sidecar holds {got} of a {len(p)}-token "
                        f"prompt's {want} saved tokens after {timeout} s"
                    )
                time.sleep(0.05)


class Engine:
    """A ``vllm.LLM`` in ``engine_proc.py``; one process for all a module's checks.
    ``kv_role``: vLLM's, for the connector (prefill/decode)."""

    def __init__(
        self,
        tmp: Path,
        name: str,
        model_dir: Path,
        block_size: int,
        sidecar: Sidecar | None,
        pc_model: str | None,
        *,
        kv_role: str = "kv_both",
        python: str = sys.executable,
        **opts: Any,
    ) -> None:
        """``python``: another venv's interpreter (a peer's connector, given as
        ``kv_transfer_config`` in ``opts``)."""
        self.name = name
        self.block_size = block_size
        self.log = tmp / f"engine-{name}.log"
        options = {
            "model_dir": str(model_dir),
            "block_size": block_size,
            "pc_model": pc_model,
            "target": sidecar.target if sidecar else None,
            "kv_role": kv_role,
            **opts,
        }
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [python, str(HERE / "engine_proc.py"), json.dumps(options)],
                # vLLM's default: the engine core in a process of its own, its loop
                # stepping while the connector has saves in flight after the replies.
                env=engine_env(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._pending = 0
        self._reply(ENGINE_START_TIMEOUT)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _reply(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(
                f"engine {self.name}: no answer in {timeout} s; log tail:\n{self.log_tail()}"
            ) from None
        if line is None:
            raise RuntimeError(
                f"engine {self.name} exited ({self.proc.wait()}); log tail:\n{self.log_tail()}"
            )
        return json.loads(line)

    def log_tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        self._pending += 1

    def submit(self, prompts: Sequence[Sequence[int]], max_tokens: int = 6) -> None:
        """Start a batch; ``result()`` waits for it."""
        self.send(
            {"op": "generate", "prompts": [list(p) for p in prompts], "max_tokens": max_tokens}
        )

    def result(self, timeout: float = CALL_TIMEOUT) -> dict[str, Any]:
        self._pending -= 1
        return self._reply(timeout)

    def generate(
        self, prompts: Sequence[Sequence[int]], max_tokens: int = 6
    ) -> list[dict[str, Any]]:
        self.submit(prompts, max_tokens)
        return self.result()["outputs"]

    def metrics(self) -> dict[str, float]:
        self.send({"op": "metrics"})
        return self.result()

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``LLM.reset_prefix_cache()``: whether vLLM reset its prefix cache."""
        self.send({"op": "reset"})
        return bool(self.result()["reset"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"op": "quit"})
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(30)


def prompts(seed: int, lengths: Sequence[int]) -> list[list[int]]:
    """Random prompts of these lengths, ids of ordinary words only."""
    rng = random.Random(seed)
    first = len(tiny_llama.SPECIALS)
    return [[rng.randrange(first, tiny_llama.VOCAB) for _ in range(n)] for n in lengths]


def expected_hit(n: int, block: int) -> int:
    """What the connector loads: whole blocks, leaving the last prompt token."""
    return (n - 1) // block * block


def mismatches(
    got: Sequence[dict[str, Any]], want: Sequence[dict[str, Any]], tol: float
) -> list[str]:
    """Where outputs differ: greedy tokens exactly, logprobs within ``tol``."""
    bad = []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g["tokens"] != w["tokens"]:
            bad.append(f"prompt {i}: tokens {g['tokens']} != {w['tokens']}")
            continue
        diff = max(abs(a - b) for a, b in zip(g["logprobs"], w["logprobs"], strict=True))
        if diff > tol:
            bad.append(
                f"prompt {i}: logprobs differ by {diff:.2e} "
                f"({g['logprobs'][:3]} vs {w['logprobs'][:3]})"
            )
    return bad
