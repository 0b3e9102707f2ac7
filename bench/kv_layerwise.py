"""vLLM loads on a GPU, whole and layer-wise, for
``kv_bandwidth.py --device cuda``.

The vLLM worker core loads a request from the mapped host pool (pinned by the core)
into vLLM's blocks in CUDA tensors (FlashAttention's layout, scattered blocks):

- ``vllm_load`` rows, ``mode`` ``whole`` (every copy issued before the forward, the
  default) and ``layerwise`` (``layerwise_load``: a stream of their own, an event per
  layer), each against the plain copy of the same bytes from the same pinned pool rows
  into the same CUDA tensors (``cudaMemcpyAsync`` of flat bytes, then a sync);
- a ``vllm_save`` row (``whole``): the same blocks back into the same pool rows, against
  the flat copy the other way;
- per ``layerwise`` row, the overlap with a forward pass simulated on the engine's
  stream (``overlap``): per layer, the layer's wait then matmuls about as long as one
  layer's copies; ``serial_s`` (whole load, then the forward), ``layerwise_s`` (issue,
  then the forward waiting layer by layer) and ``hidden`` (the share of the shorter of
  the two that the overlap hides: 1 is perfect, 0 none).

The GPU test (tests/integrations/vllm/test_worker_layerwise_cuda.py) reports
``overlap`` for its own load.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from typing import Any

import torch

from prefixcache.client import PrefixCacheClient
from prefixcache.integrations.vllm.attn_backends import BackendInfo
from prefixcache.integrations.vllm.config import ConnectorConfig
from prefixcache.integrations.vllm.meta import LoadOp, SaveOp, StepMeta
from prefixcache.integrations.vllm.worker import WorkerCore

FLASH = "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"


def cuda_seconds(fn: Callable[[], Any], repeat: int) -> float:
    """The fastest of ``repeat`` runs of ``fn`` until the GPU is done (one warm-up)."""
    best = float("inf")
    for i in range(repeat + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i:
            best = min(best, time.perf_counter() - start)
    return best


def host_seconds(worker: WorkerCore, meta: StepMeta, repeat: int) -> float:
    """How long ``start_step`` keeps the host: what the forward's launch waits for."""
    best = float("inf")
    for i in range(repeat + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        worker.start_step(meta)
        if i:
            best = min(best, time.perf_counter() - start)
        worker.end_step()
    torch.cuda.synchronize()
    return best


def overlap(
    whole: WorkerCore, by_layer: WorkerCore, meta: StepMeta, repeat: int = 5
) -> dict[str, Any]:
    """Times of ``meta``'s loads with a simulated forward (see the module docstring);
    both cores hold the same geometry of caches on one GPU."""
    names = [view.name for view in by_layer.layers]
    a = torch.randn(2048, 2048, device=by_layer.layers[0].device, dtype=torch.bfloat16)
    t_load = cuda_seconds(lambda: whole.start_step(meta), repeat)
    t_matmul = cuda_seconds(lambda: [a @ a for _ in range(20)], repeat) / 20
    reps = max(1, round(t_load / len(names) / max(t_matmul, 1e-7)))

    def forward(worker: WorkerCore | None) -> None:
        for name in names:
            if worker is not None:
                worker.wait_layer(name)
            for _ in range(reps):
                a @ a
        if worker is not None:
            worker.end_step()

    t_compute = cuda_seconds(lambda: forward(None), repeat)
    t_serial = cuda_seconds(lambda: (whole.start_step(meta), forward(None)), repeat)
    t_layerwise = cuda_seconds(lambda: (by_layer.start_step(meta), forward(by_layer)), repeat)
    return {
        "load_s": t_load,
        "compute_s": t_compute,
        "serial_s": t_serial,
        "layerwise_s": t_layerwise,
        "hidden": (t_serial - t_layerwise) / min(t_load, t_compute),
        "issue_host_s": host_seconds(by_layer, meta, repeat),
        "whole_host_s": host_seconds(whole, meta, repeat),
        "matmuls_per_layer": reps,
    }


def bench_vllm_cuda(
    client: PrefixCacheClient,
    target: str,
    model: str,
    page: int,
    n: int,
    layers: int,
    heads: int,
    dim: int,
    repeat: int,
    row: Callable[..., dict],
) -> list[dict]:
    """``vllm_load`` rows, whole and layer-wise, and a whole ``vllm_save`` row, for
    ``n`` tokens in pages of ``page``;
    ``row(path, bytes, seconds, ceiling_seconds, **extra)`` makes each."""
    session = client.session(120, name="kv-layerwise")
    alloc = client.alloc(model, n, session=session)
    slots = array("q", alloc.slots)
    blocks = n // page + 4
    order = (torch.randperm(blocks - 1) + 1)[: n // page].tolist()  # 0: vLLM's null block
    meta = StepMeta(
        [LoadOp("l", array("q", order), 0, n, slots, alloc.server_epoch, session.session_id)]
    )
    nbytes = n * layers * 2 * heads * dim * 2
    cores: dict[str, tuple[WorkerCore, dict[str, Any]]] = {}
    rows = []
    try:
        for mode in ("whole", "layerwise"):
            worker = WorkerCore(
                ConnectorConfig(
                    model=model,
                    target=target,
                    transfer="attach",
                    verify_loads=False,
                    layerwise_load=mode == "layerwise",
                ),
                page,
            )
            caches = {
                f"model.layers.{i}.self_attn.attn": torch.zeros(
                    blocks, heads, page, 2 * dim, dtype=torch.bfloat16, device="cuda"
                )
                for i in range(layers)
            }
            worker.register(caches, BackendInfo(FLASH, dim))
            cores[mode] = (worker, caches)
            worker.start_step(meta)  # maps and pins the pool
            worker.end_step()
            if worker.failed_loads or worker._access is None:
                raise RuntimeError(f"{mode}: the load failed")
        whole, want = cores["whole"]
        by_layer, got = cores["layerwise"]
        torch.cuda.synchronize()
        if not all(torch.equal(want[k].view(torch.int16), got[k].view(torch.int16)) for k in want):
            raise RuntimeError("layer-wise loads differ from whole loads")
        pool = by_layer._access.pool  # type: ignore[union-attr]
        pinned = bool(pool.k_buffer[0].is_pinned())
        ceiling = cuda_seconds(_plain_copy(pool, slots, list(got.values())), repeat)
        extra = {
            "layout": "bhn2d",
            "page_size": page,
            "tokens": n,
            "layers": layers,
            "device": torch.cuda.get_device_name(),
            "pinned": pinned,
        }
        t_whole = cuda_seconds(lambda: whole.start_step(meta), repeat)
        t_layer = cuda_seconds(lambda: (by_layer.start_step(meta), by_layer.end_step()), repeat)
        rows.append(row("vllm_load", nbytes, t_whole, ceiling, mode="whole", **extra))
        rows.append(
            row(
                "vllm_load",
                nbytes,
                t_layer,
                ceiling,
                mode="layerwise",
                **extra,
                **{
                    k: round(v, 6) if isinstance(v, float) else v
                    for k, v in overlap(whole, by_layer, meta, repeat).items()
                },
            )
        )
        # The save: the same blocks back into the same pool rows, against the flat copy
        # the other way.
        save = StepMeta(
            saves=[SaveOp("s", array("q", order), 0, slots, alloc.server_epoch, session.session_id)]
        )
        t_save = cuda_seconds(lambda: whole.start_step(save), repeat)
        if whole.failed_saves:
            raise RuntimeError("the save failed")
        back = cuda_seconds(_plain_copy(pool, slots, list(want.values()), to_pool=True), repeat)
        rows.append(row("vllm_save", nbytes, t_save, back, mode="whole", **extra))
    finally:
        for worker, _ in cores.values():
            worker.close()
        client.free(model, slots, session=session, server_epoch=alloc.server_epoch)
        session.close()
    return rows


def _plain_copy(
    pool: Any, slots: array, caches: list[Any], to_pool: bool = False
) -> Callable[[], None]:
    """The same bytes from the same pool rows into the same CUDA tensors (``to_pool``:
    back), flat: one asynchronous copy per layer and side (the slots are one run of
    fresh rows)."""
    first, n = slots[0], len(slots)
    if list(slots) != list(range(first, first + n)):
        raise RuntimeError("the ceiling needs one run of slots")
    pairs = []
    for layer, cache in enumerate(caches):
        flat, done = cache.view(torch.uint8).reshape(-1), 0
        for buf in (pool.k_buffer[layer], pool.v_buffer[layer]):
            src = buf[first : first + n].view(torch.uint8).reshape(-1)
            pairs.append((flat[done : done + src.numel()], src))
            done += src.numel()

    def run() -> None:
        for dst, src in pairs:
            if to_pool:
                src.copy_(dst, non_blocking=True)
            else:
                dst.copy_(src, non_blocking=True)

    return run
