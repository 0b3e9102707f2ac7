"""The vLLM adapter: a ``KVConnectorBase_V1`` that turns vLLM's objects into calls of the
engine-free cores (``scheduler.SchedulerCore``, ``worker.WorkerCore``). No logic lives
here; this is the only module of the package that imports vLLM.

Load it with ``--kv-transfer-config`` (see the package docstring):
``"kv_connector": "PrefixCacheConnector"`` and
``"kv_connector_module_path": "prefixcache.integrations.vllm.connector"``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

try:  # vLLM's hybrid KV cache manager (HMA): one block table per KV cache group
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # vLLM releases before it: one group, request_finished only

    class SupportsHMA:  # type: ignore[no-redef]
        pass


from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from prefixcache.client import InvalidArgument, Retention

from .attn_backends import BackendInfo
from .backend import RpcBackend
from .config import kv_role, role_config
from .keys import RequestInfo
from .meta import StepMeta
from .scheduler import SchedulerCore
from .worker import WorkerCore

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("prefixcache.integrations.vllm")


@dataclass
class PrefixCacheConnectorMetadata(KVConnectorMetadata):
    """One step's loads and saves, shipped to every worker."""

    step: StepMeta = field(default_factory=StepMeta)


@dataclass
class PrefixCacheWorkerMetadata(KVConnectorWorkerMetadata):
    """A step's failed loads and saves, by reservation (``LoadOp.ref``) and save
    (``SaveOp.ref``), back to the scheduler side; vLLM aggregates the ranks' reports
    into one (a union: each once)."""

    failed_loads: set[int] = field(default_factory=set)
    failed_saves: set[int] = field(default_factory=set)
    # Why a worker disabled the connector ("" if none did): the scheduler side stops.
    disabled: str = ""
    # The copies of running requests the workers made in the step (SaveOp.report).
    copied: set[int] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, PrefixCacheWorkerMetadata):
            self.failed_loads |= other.failed_loads
            self.failed_saves |= other.failed_saves
            self.copied |= other.copied
            self.disabled = self.disabled or other.disabled
        return self


def request_info(request: Request) -> RequestInfo:
    """The core's view of a vLLM request (the token list is not copied)."""
    lora = getattr(request, "lora_request", None)
    return RequestInfo(
        req_id=request.request_id,
        tokens=request.all_token_ids,
        num_prompt_tokens=request.num_prompt_tokens,
        lora_name=getattr(lora, "lora_name", None) if lora is not None else None,
        cache_salt=getattr(request, "cache_salt", None),
        multimodal=bool(
            getattr(request, "mm_features", None) or getattr(request, "mm_positions", None)
        ),
        prompt_embeds=getattr(request, "prompt_embeds", None) is not None,
        attempt=int(getattr(request, "num_preemptions", 0) or 0),
        retention=retention_of(request),
    )


def retention_of(request: Request) -> Retention | None:
    """The request's retention hint: ``kv_transfer_params`` of
    ``{"prefixcache": {"retain_seconds": 600, "priority": "high"}}``. A malformed one is
    logged and ignored, so it never costs the request its cache."""
    params = getattr(request, "kv_transfer_params", None)
    hint = params.get("prefixcache") if isinstance(params, dict) else None
    if hint is None:
        return None
    try:
        return Retention.of(hint)
    except (InvalidArgument, TypeError, AttributeError) as exc:
        log.warning(
            "request %s: kv_transfer_params prefixcache ignored: %s", request.request_id, exc
        )
        return None


@dataclass
class PrefixCacheStats(KVConnectorStats):
    """The workers' failed loads by reason (``worker.LOAD_FAILURE_REASONS``), summed
    over the workers (a failed load of a tensor-parallel request counts once per
    rank)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for reason, count in other.data.items():
            self.data[reason] = self.data.get(reason, 0) + int(count)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {
            f"prefixcache load failures ({reason})": int(count)
            for reason, count in sorted(self.data.items())
        }

    def is_empty(self) -> bool:
        return not any(self.data.values())


class PrefixCachePromMetrics(KVConnectorPromMetrics):
    """``vllm:prefixcache_load_failures_total``, by ``reason``."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._failures = self._counter_cls(
            name="vllm:prefixcache_load_failures_total",
            documentation="Loads from prefixcache that failed (their blocks were "
            "recomputed), by reason.",
            labelnames=[*labelnames, "reason"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for reason, count in (transfer_stats_data or {}).items():
            self._failures.labels(*labels, reason).inc(int(count))


class PrefixCacheConnector(KVConnectorBase_V1, SupportsHMA):
    """prefixcache as vLLM's external KV cache tier (see the package docstring).

    It supports vLLM's hybrid KV cache manager for attention groups (full attention,
    sliding window: each layer's copies use its group's block table) and refuses, with
    one error line, a layout with any other group (Mamba state), which it would have
    to save at block boundaries (``group_problem``): vLLM then computes everything.
    """

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        try:
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        except TypeError:  # vLLM releases before kv_cache_config
            super().__init__(vllm_config=vllm_config, role=role)
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if policy != "recompute":
            log.warning(
                "prefixcache: kv_load_failure_policy is %r: a load that fails (the "
                "service restarted or is down) fails its request; set it to "
                "'recompute' to have vLLM recompute instead",
                policy,
            )
        extra = getattr(self._kv_transfer_config, "kv_connector_extra_config", None)
        kv = kv_role(getattr(self._kv_transfer_config, "kv_role", None))
        config = role_config(kv, extra)
        block_size = int(vllm_config.cache_config.block_size)
        tp_size = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
        self._scheduler: SchedulerCore | None = None
        self._worker: WorkerCore | None = None
        self._groups = layer_groups(kv_cache_config)
        self._group_problem = group_problem(kv_cache_config)
        # MLA ranks each hold the whole latent and rank 0 alone saves it, whole rows:
        # WriteKV serves that at any tensor-parallel size.
        mla = bool(getattr(getattr(vllm_config, "model_config", None), "use_mla", False))
        if role == KVConnectorRole.SCHEDULER:
            if config.transfer == "remote" and tp_size > 1 and config.save != "off" and not mla:
                log.warning(
                    "prefixcache: WriteKV cannot save from %d tensor-parallel "
                    "ranks; saves are off (use transfer 'attach')",
                    tp_size,
                )
                config = dataclasses.replace(config, save="off")
            if kv.orders_saves and config.save == "all":
                log.warning(
                    "prefixcache: kv_role 'kv_producer' with save 'all' saves at the "
                    "finish, after the request's output: a consumer asked at once may "
                    "miss (save 'prompt' is inserted before the output)"
                )
            self._scheduler = SchedulerCore(
                RpcBackend(config),
                config,
                block_size,
                during_run_saves=frees_blocks_while_running(kv_cache_config),
                ordered_saves=kv.orders_saves,
            )
            if self._group_problem is not None:  # the workers say why, once
                self._scheduler.disable(self._group_problem)
        else:
            self._worker = WorkerCore(config, block_size, tp_rank=_tp_rank(), tp_size=tp_size)

    @property
    def _sched(self) -> SchedulerCore:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side call on the worker-side connector")
        return self._scheduler

    @property
    def _work(self) -> WorkerCore:
        if self._worker is None:
            raise RuntimeError("a worker-side call on the scheduler-side connector")
        return self._worker

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a save that is dropped is only a later miss

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched.probe(request_info(request), num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        ids = blocks.get_block_ids() if num_external_tokens > 0 else ()
        self._sched.allocated(request.request_id, ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        preempted = getattr(scheduler_output, "preempted_req_ids", None) or ()
        return PrefixCacheConnectorMetadata(
            self._sched.build_meta(preempted, self._progress(scheduler_output))
        )

    def _progress(
        self, scheduler_output: SchedulerOutput
    ) -> dict[str, tuple[int, tuple[list[int], ...]]] | None:
        """For the requests saved while they run that this step runs: their tokens
        computed once it ran, and their block tables now (one per KV cache group, with
        the null block where vLLM freed blocks), as vLLM offers them to connectors (the
        scheduler output's ``kv_connector_block_state``; before it, the KV cache
        manager's)."""
        want = self._sched.saving_during_run()
        if not want:
            return None
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        manager = getattr(self, "_kv_cache_manager", None)
        resolve = (
            state.resolve_block_ids
            if state is not None
            else getattr(manager, "get_block_ids", None)
        )
        if resolve is None:  # no table: the finish saves what is left (saves.py)
            return None
        scheduled = scheduler_output.num_scheduled_tokens
        out = {}
        for req_id, before in computed_before(scheduler_output):
            if req_id in want and req_id in scheduled:
                out[req_id] = (
                    before + int(scheduled[req_id]),
                    tuple(list(table) for table in resolve(req_id)),
                )
        return out

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        keep = self._sched.finished(
            request_info(request), block_ids, int(request.num_computed_tokens)
        )
        return keep, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        keep = self._sched.finished(
            request_info(request), tuple(block_ids), int(request.num_computed_tokens)
        )
        return keep, None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, PrefixCacheWorkerMetadata):
            self._sched.loads_failed(meta.failed_loads)
            self._sched.saves_failed(meta.failed_saves)
            self._sched.saves_copied(meta.copied)
            if meta.disabled:
                self._sched.disable(meta.disabled)
        self._sched.sends_done(connector_output.finished_sending or ())

    # --------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self._group_problem is not None:
            self._work.disable(self._group_problem)
            return
        backends = attention_backends(self._vllm_config, kv_caches)
        self._work.register(kv_caches, backends, self._groups)
        problem = check_cpu_layout(self._work, kv_caches, backends)
        if problem is not None:
            self._work.disable(problem)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        # A step replayed as one full CUDA graph calls no wait_for_layer_load.
        mode = getattr(forward_context, "cudagraph_runtime_mode", None)
        self._work.start_step(
            meta.step if isinstance(meta, PrefixCacheConnectorMetadata) else None,
            by_layer=getattr(mode, "name", "") != "FULL",
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._work.wait_layer(layer_name)  # layerwise_load: else a no-op

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # requests are saved whole, when they finish

    def wait_for_save(self) -> None:
        self._work.end_step()  # layers the forward never waited for (layerwise_load)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._work.finished_sends(finished_req_ids) or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        loads, saves = self._work.take_failed_loads(), self._work.take_failed_saves()
        copied, disabled = self._work.take_copied(), self._work.disabled or ""
        return (
            PrefixCacheWorkerMetadata(loads, saves, disabled, copied)
            if loads or saves or disabled or copied
            else None
        )

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is None:
            return None
        failures = self._worker.take_load_failures()
        return PrefixCacheStats(data=failures) if failures else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return PrefixCacheStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return PrefixCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def has_pending_push_work(self) -> bool:
        # Keep vLLM stepping until every finished request's save is through, and every
        # release of its locks sent.
        return self._scheduler is not None and self._scheduler.has_pending_work()

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None:
            self._worker.close()


def layer_groups(kv_cache_config: Any) -> dict[str, int] | None:
    """Each layer's KV cache group, where vLLM made more than one (its hybrid
    manager): the group whose block table the layer's copies use."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    if len(groups) <= 1:
        return None
    return {name: index for index, group in enumerate(groups) for name in group.layer_names}


def group_problem(kv_cache_config: Any) -> str | None:
    """Why the connector cannot serve ``kv_cache_config``'s groups, or None: every
    group must hold attention K/V per token (full attention, sliding window, MLA); a
    Mamba group's state lives at block boundaries, which the connector does not save."""
    if kv_cache_config is None:
        return None
    from vllm.v1.kv_cache_interface import AttentionSpec, UniformTypeKVCacheSpecs

    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        specs = (
            spec.kv_cache_specs.values() if isinstance(spec, UniformTypeKVCacheSpecs) else (spec,)
        )
        for one in specs:
            if not isinstance(one, AttentionSpec):
                return (
                    f"KV cache group {index} is {type(one).__name__} (layers "
                    f"{', '.join(group.layer_names[:3])}...): the connector saves and "
                    "loads attention K/V only, not Mamba or other state"
                )
    return None


def frees_blocks_while_running(kv_cache_config: Any) -> bool:
    """Whether vLLM frees blocks of running requests in ``kv_cache_config``'s groups:
    any group but full attention (sliding window, chunked local attention, ...),
    whose requests the connector saves while they run."""
    if kv_cache_config is None:  # vLLM releases before kv_cache_config
        return False
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SinkFullAttentionSpec,
        UniformTypeKVCacheSpecs,
    )

    keeps = (FullAttentionSpec, MLAAttentionSpec, SinkFullAttentionSpec)

    def keeps_blocks(spec: Any) -> bool:
        if isinstance(spec, UniformTypeKVCacheSpecs):
            return all(keeps_blocks(s) for s in spec.kv_cache_specs.values())
        return type(spec) in keeps

    return not all(keeps_blocks(group.kv_cache_spec) for group in kv_cache_config.kv_cache_groups)


def computed_before(scheduler_output: Any) -> list[tuple[str, int]]:
    """Each request the step runs, with its tokens computed before the step."""
    out = [(r.req_id, int(r.num_computed_tokens)) for r in scheduler_output.scheduled_new_reqs]
    cached = scheduler_output.scheduled_cached_reqs
    out.extend(
        (req_id, int(n))
        for req_id, n in zip(cached.req_ids, cached.num_computed_tokens, strict=True)
    )
    return out


def attention_backends(vllm_config: Any, kv_caches: dict[str, Any]) -> dict[str, BackendInfo]:
    """The attention backend of each layer of ``kv_caches``, as vLLM reports it (the
    layer's ``get_attn_backend``), with what picks the layout: the head size and, on
    CPU, the kernel ISA its metadata builder set on the layer."""
    try:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    except ImportError:  # another vLLM: no backend known, the connector is disabled
        return {}
    out = {}
    for name, layer in get_layers_from_vllm_config(
        vllm_config, AttentionLayerBase, list(kv_caches)
    ).items():
        backend = layer.get_attn_backend()
        head_size = getattr(layer, "head_size", None)
        if head_size is None:
            continue
        out[name] = BackendInfo(
            f"{backend.__module__}.{backend.__qualname__}",
            int(head_size),
            getattr(layer, "isa", None),
        )
    return out


def check_cpu_layout(
    work: WorkerCore, kv_caches: dict[str, Any], backends: dict[str, BackendInfo]
) -> str | None:
    """On vLLM's CPU backend, one block of known K/V written through vLLM's own
    cache-write op (the op its layers write every token with) must read back through
    the layout the connector took: why not, or None (also where there is nothing to
    check)."""
    view = work.layers[0] if work.layers else None
    info = backends.get(view.name) if view is not None else None
    if (
        view is None
        or info is None
        or info.isa is None
        or not info.cls_name.endswith("cpu_attn.CPUAttentionBackend")
        or view.layout not in ("bhn2d", "cpu_vec", "cpu_amx")
    ):  # kv_layout may force
        return None
    try:
        import torch
        from vllm import _custom_ops as ops

        from .layout import gather_blocks, split_kv
    except ImportError:
        return None
    if not hasattr(ops, "cpu_attn_reshape_and_cache"):
        return None
    tensor = kv_caches[view.name]
    _, heads, block, _ = (int(d) for d in tensor.shape)
    dim = view.head_dim
    scratch = torch.zeros((1, heads, block, 2 * dim), dtype=tensor.dtype)
    k = torch.randn(block, heads, dim).to(tensor.dtype)
    v = torch.randn(block, heads, dim).to(tensor.dtype)
    key_cache, value_cache = scratch.view(1, heads, 2 * block, dim).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        k, v, key_cache, value_cache, torch.arange(block, dtype=torch.int64), info.isa
    )
    probe = split_kv("probe", scratch, view.layout, dim)
    blocks, offsets = torch.zeros(block, dtype=torch.int64), torch.arange(block)
    if torch.equal(gather_blocks(probe.k, blocks, offsets), k) and torch.equal(
        gather_blocks(probe.v, blocks, offsets), v
    ):
        return None
    return (
        f"vLLM's CPU backend (ISA {info.isa}) does not write K/V the way the "
        f"{view.layout} layout reads them"
    )


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (ImportError, AssertionError, AttributeError):
        return 0
