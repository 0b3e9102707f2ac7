"""Helpers of the vLLM connector tests: the models, a test clock, core factories."""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from array import array
from collections.abc import Sequence
from typing import Any

from prefixcache.integrations.vllm.attn_backends import BackendInfo
from prefixcache.integrations.vllm.backend import RpcBackend
from prefixcache.integrations.vllm.config import ConnectorConfig
from prefixcache.integrations.vllm.scheduler import SchedulerCore
from prefixcache.integrations.vllm.worker import WorkerCore
from prefixcache.server.config import ModelConfig, PoolConfig

BLOCK = 4  # vLLM's block size in these tests
LAYERS, HEADS, DIM = 2, 2, 8
LATENT = 12  # MLA's latent size per token (576 in DeepSeek)
MODELS = (
    # page_size 2 divides the block: hits and saves are whole blocks anyway.
    ModelConfig(
        name="v",
        page_size=2,
        pool=PoolConfig(size=256, layers=LAYERS, k_heads=HEADS, k_head_dim=DIM),
    ),
    ModelConfig(
        name="b",
        page_size=4,
        pool=PoolConfig(size=128, layers=LAYERS, k_heads=HEADS, k_head_dim=DIM, dtype="bfloat16"),
    ),
    ModelConfig(
        name="f8",
        page_size=4,
        pool=PoolConfig(
            size=128, layers=LAYERS, k_heads=HEADS, k_head_dim=DIM, dtype="float8_e4m3fn"
        ),
    ),
    ModelConfig(
        name="mla",
        page_size=2,
        pool=PoolConfig(
            size=128, layers=LAYERS, k_heads=1, k_head_dim=LATENT, dtype="bfloat16", mla=True
        ),
    ),
    # The layout tests' model: pages of 8 under blocks of 16 and 32 (the CPU backend's
    # AMX layout needs blocks and dims in multiples of 16).
    ModelConfig(
        name="c",
        page_size=8,
        pool=PoolConfig(size=256, layers=LAYERS, k_heads=HEADS, k_head_dim=16, dtype="bfloat16"),
    ),
    # vLLM's CPU backend through its own cache-write op (test_layouts_vllm.py).
    ModelConfig(
        name="cpu",
        page_size=16,
        pool=PoolConfig(size=512, layers=LAYERS, k_heads=HEADS, k_head_dim=32, dtype="bfloat16"),
    ),
    ModelConfig(
        name="mla8",
        page_size=4,
        pool=PoolConfig(
            size=128, layers=LAYERS, k_heads=1, k_head_dim=LATENT, dtype="float8_e4m3fn", mla=True
        ),
    ),
)


class Clock:
    """A clock the test moves (leases)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(
    address: str,
    model: str = "v",
    clock: Clock | None = None,
    *,
    block: int = BLOCK,
    wait_shadow: bool = True,
    during_run_saves: bool = False,
    **settings: object,
) -> SchedulerCore:
    """A scheduler core; with ``fast_miss`` (the default) it waits for its shadow
    index's first snapshot (``wait_shadow``), so that a test starts where an engine
    runs: the shadow current, a miss answered at the first probe. ``during_run_saves``:
    as for a sliding-window engine."""
    config = ConnectorConfig(model=model, target=address, **settings)  # type: ignore[arg-type]
    backend = RpcBackend(config)
    if wait_shadow and backend.shadow is not None and not backend.wait_fast_miss(10.0):
        raise TimeoutError(
            "the connector's shadow index got no snapshot, or ListModels did not answer"
        )
    return SchedulerCore(
        backend, config, block, clock or Clock(), during_run_saves=during_run_saves
    )


def shadow_holds(core: SchedulerCore, tokens: Sequence[int], key: str | None = None) -> None:
    """Wait until the core's shadow index holds ``tokens`` (the Subscribe stream
    delivered their insert), as an engine probing a moment after another's save
    would find it; at once without a shadow (``fast_miss`` off)."""
    backend: Any = core.backend
    if backend.shadow is None:
        return
    deadline = time.monotonic() + 10
    while (backend.shadow_hit(array("q", tokens), key) or 0) < len(tokens):
        if time.monotonic() > deadline:
            raise TimeoutError("the shadow index never saw the insert")
        time.sleep(0.005)


def settle(core: SchedulerCore) -> None:
    """Let the backend's calls land (vLLM would simply ask again next step)."""
    if not core.backend.wait_idle(10.0):  # type: ignore[attr-defined]
        raise TimeoutError("backend calls did not finish")


def make_worker(
    address: str,
    model: str = "v",
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    block: int = BLOCK,
    **settings: object,
) -> WorkerCore:
    """A worker core; ``kv_layout`` defaults to ``kv_first`` (``make_caches``' usual
    layout) for tests that register caches without a backend."""
    settings.setdefault("kv_layout", "kv_first")
    config = ConnectorConfig(model=model, target=address, **settings)  # type: ignore[arg-type]
    return WorkerCore(config, block, tp_rank=tp_rank, tp_size=tp_size)


# The backend (vLLM 0.32 class) whose layout each test layout is.
_V1 = "vllm.v1.attention.backends."
BACKEND_OF = {
    "kv_first": _V1 + "flash_attn.FlashAttentionBackend",  # 5-D, before 0.32
    "blocks_first": _V1 + "flashinfer.FlashInferBackend",  # 5-D, before 0.32
    "bhn2d": _V1 + "flash_attn.FlashAttentionBackend",  # 0.32's 4-D view
    "cpu_vec": _V1 + "cpu_attn.CPUAttentionBackend",
    "cpu_amx": _V1 + "cpu_attn.CPUAttentionBackend",
    "mla": _V1 + "mla.triton_mla.TritonMLABackend",
}


def backend_for(layout: str, head_size: int = DIM) -> BackendInfo:
    """What vLLM would report for a layer in ``layout``."""
    isa = {"cpu_vec": "vec", "cpu_amx": "amx"}.get(layout)
    return BackendInfo(BACKEND_OF[layout], LATENT if layout == "mla" else head_size, isa)


def make_caches(
    layout: str,
    num_blocks: int = 16,
    *,
    heads: int = HEADS,
    kernel_block: int = BLOCK,
    dtype: str = "float16",
) -> dict[str, Any]:
    """Random KV tensors in one of vLLM's layouts, one per layer (random bytes: every
    comparison is of bytes)."""
    import torch

    n = num_blocks * (BLOCK // kernel_block)
    shape = {
        "kv_first": (2, n, kernel_block, heads, DIM),
        "blocks_first": (n, 2, kernel_block, heads, DIM),
        "bhn2d": (n, heads, kernel_block, 2 * DIM),
        "cpu_vec": (n, heads, kernel_block, 2 * DIM),
        "mla": (n, kernel_block, LATENT),
    }[layout]
    torch_dtype = getattr(torch, dtype)
    size = torch.empty((), dtype=torch_dtype).element_size()
    out = {}
    for layer in range(LAYERS):
        raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8)
        out[f"model.layers.{layer}.self_attn.attn"] = raw.view(torch_dtype)
    return out


def token_rows(view: Any, block_ids: list[int], num_tokens: int) -> Any:
    """K and V bytes of a request's first ``num_tokens`` tokens, ``[2, n, heads, dim]``
    (MLA: the latent's, ``[1, n, 1, dim]``)."""
    import torch

    from prefixcache.integrations.vllm.layout import block_positions, gather_blocks

    blocks, offsets = block_positions(
        array("q", block_ids), 0, num_tokens, BLOCK, view.kernel_block_size
    )
    parts = (view.k,) if view.v is None else (view.k, view.v)
    rows = torch.stack([gather_blocks(part, blocks, offsets) for part in parts])
    return rows.contiguous().view(torch.uint8)  # bytes: random bits hold NaNs


class JsonLines:
    """A child process's stdout, one JSON line at a time within a deadline (raw reads: a
    buffered reader may hold a line that select no longer sees)."""

    def __init__(self, proc: subprocess.Popen[bytes], who: str) -> None:
        self.proc = proc
        self.who = who
        self._buf = b""

    def read(self, timeout: float = 60.0) -> dict:
        if self.proc.stdout is None:
            raise AssertionError(f"{self.who} has no stdout pipe")
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise AssertionError(f"{self.who} said nothing for {timeout} s")
            data = os.read(fd, 65536)
            if not data:
                self.proc.wait(10)
                raise AssertionError(f"{self.who} exited with {self.proc.returncode}")
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)
