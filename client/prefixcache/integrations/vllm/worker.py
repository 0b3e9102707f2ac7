"""The worker side of the connector, without vLLM: copies between the pool and vLLM's
blocks, and the failures vLLM must hear about.

vLLM calls, in each model-runner process: ``register`` once with its KV tensors, then
every step ``start_step`` (its ``start_load_kv``) with the step's metadata, then
``finished_sends``, ``take_load_errors``, ``take_failed_loads`` and
``take_failed_saves``. All copies of a step happen in ``start_step``, whole requests at
a time: a load is complete before the forward that reads it, and nothing runs inside
the layers (so any CUDA graph mode works). With ``layerwise_load``, ``start_step``
issues the loads layer after layer instead (``layerwise.py``), and ``wait_layer`` (its
``wait_for_layer_load``) makes the engine wait for one layer's copies, ``end_step``
(its ``wait_for_save``) for all of them.

Loads. Each request's tokens are copied from their pool slots into its blocks, then
(``verify_loads``) one Match checks that the tree still maps those tokens to those
slots (on a GPU, while the copies may still be in flight): the reservation's lock keeps
them there, unless the service was Reset or the lock lapsed, and then what was copied
may be somebody else's KV. A load that fails in any way, the service being down
included, reports every block it was to fill, so that vLLM
(``kv_load_failure_policy``) recomputes them; it is logged and counted under its
reason (``LOAD_FAILURE_REASONS``), and its reservation (``LoadOp.ref``) goes back to the
scheduler side with the step's output (vLLM's worker metadata), which releases it as
``load_failed``: the service counts the hit under that outcome, with no call of its own.

Layouts. ``register`` takes each layer's attention backend (``attn_backends``) and
views the layer through the layout that backend reads; a layer whose layout is not
known disables the connector, with one log line (vLLM then computes everything).

Disabled. A worker that disables itself (an unknown layout, a pool that does not fit)
tells the scheduler side with each step's output (``disabled``): it stops
looking up and saving, so that no later request gets a load that must fail or a save
whose slots are allocated for nothing. The loads and saves already scheduled fail
quietly (counted, logged at debug level): the one error line has said why.

Saves. A finished request's new tokens are copied from its blocks into the slots the
scheduler side allocated; the request is then reported done (vLLM frees its blocks and
the scheduler side inserts). A running request's tokens saved during its run
(``SaveOp.during_run``) are copied in ``end_step``, after the forward that computed
them, and reported by their ``report`` (``take_copied``), not done. A save
that fails is reported done all the same, and its save (``SaveOp.ref``) goes back with
the step's output like a failed load's: the scheduler side then gives the slots back
instead of inserting them, once every rank has reported the request done. The worker
never frees them itself: another rank may not have started its copy into them yet
(``scheduler.py``, "Failed saves").

The null block (``meta.NULL_BLOCK``). A load leaves out the tokens in a table's null
blocks before its first live one (vLLM needs no KV there) and fails, writing nothing,
where a null block follows a live one; a save whose tokens fall into it in any table
fails and reads nothing: the scheduler side plans neither failure, so one is a table
it misread.

Groups. Under vLLM's hybrid KV cache manager each layer belongs to a KV cache group
(``register``'s ``groups``) and its copies use that group's block table (``LoadOp.table``);
layers of different groups on one tensor are separate layers of the pool.

MLA. vLLM's MLA cache is one latent per token (``[blocks, block, head_size]``), held by
an MLA pool (``pool.mla``: K only, one head of ``head_size``); an MLA model with a K/V
pool, or the other way round, disables the connector. Tensor-parallel ranks do not
split the latent by heads: every rank holds all of it. So every rank loads (each has
its own copy of the blocks to fill) but only rank 0 saves; the others report their
saves done without copying, and vLLM's request is done once rank 0's copy is.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from prefixcache.client import (
    DeadlineExceeded,
    PrefixCacheClient,
    PrefixCacheError,
    StaleEpoch,
    Unavailable,
)

from .attn_backends import BackendInfo, layout_for
from .block_copy import SpanMemo, load_span, save_rows, view_spans
from .config import ConnectorConfig
from .layerwise import HostCopies, StepLayers, copies_for
from .layout import LayerView, UnknownLayout, layer_numbers, split_kv
from .layout import unique_layers as _unique_layers
from .meta import NULL_BLOCK, LoadOp, SaveOp, StepMeta, live_from, touches_null
from .pool_access import PoolAccess, Rows, fit_pool, open_access

log = logging.getLogger("prefixcache.integrations.vllm")


class WorkerCore:
    """See the module docstring.

    Args:
        config: the connector's settings.
        block_size: vLLM's block size in tokens.
        tp_rank, tp_size: this worker's tensor-parallel rank and the group's size; the
            pool holds every KV head and each rank copies its own (MLA: see the module
            docstring).
        client: the client to use (default: one made from ``config``).
    """

    def __init__(
        self,
        config: ConnectorConfig,
        block_size: int,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        client: PrefixCacheClient | None = None,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.client = client or PrefixCacheClient(
            config.target, **config.client_kwargs(f"vllm-worker-{tp_rank}")
        )
        self._own_client = client is None
        self.layers: list[LayerView] = []
        self._access: PoolAccess | None = None
        self._heads: slice = slice(None)
        self._write_heads = True
        self._disabled: str | None = None
        self._retry_at = 0.0
        self._load_errors: set[int] = set()
        self._failed_refs: set[int] = set()
        self._failed_saves: set[int] = set()
        self._copied: set[int] = set()
        self._sent: set[str] = set()
        self._finished_seen: set[str] = set()
        self.loaded_tokens = 0
        self.saved_tokens = 0
        self.failed_loads = 0
        self.failed_saves = 0
        # Failed loads by reason (LOAD_FAILURE_REASONS).
        self.load_failures: Counter[str] = Counter()
        self._failures_reported: Counter[str] = Counter()
        # This step's layer-wise loads (``layerwise_load``), set by ``register``.
        self._step = StepLayers({}, HostCopies())
        # This step's saves of running requests, copied after its forward.
        self._after_forward: list[SaveOp] = []

    # ------------------------------------------------------------ vLLM's calls

    def register(
        self,
        kv_caches: dict[str, Any],
        backends: Mapping[str, BackendInfo] | BackendInfo | None = None,
        groups: Mapping[str, int] | None = None,
    ) -> None:
        """``register_kv_caches``: the engine's KV tensors, one per attention layer, and
        the attention backend of each (a mapping by layer name, or one for all);
        ``groups``: each layer's KV cache group (vLLM's hybrid manager), whose block
        table the layer's copies use (default: one group)."""
        layers = []
        try:
            for name, tensor in _unique_layers(kv_caches, groups):
                info = backends.get(name) if isinstance(backends, Mapping) else backends
                layout = layout_for(info, tensor, self.config.kv_layout)
                head = info.head_size if info is not None else _head_size(tensor, layout)
                view = split_kv(name, tensor, layout, head)
                if groups:
                    view = dataclasses.replace(view, group=groups.get(name, 0))
                layers.append(view)
        except UnknownLayout as err:
            self.disable(f"layer {name!r}: {err}")
            return
        self.layers = layers
        if layers:
            self._step = StepLayers(layer_numbers(kv_caches, groups), copies_for(layers[0].device))

    def start_step(self, meta: StepMeta | None, *, by_layer: bool = True) -> None:
        """``start_load_kv``: every save of the step done on return, and every load;
        with ``layerwise_load`` (unless ``by_layer`` is False: vLLM replays this step
        as one CUDA graph and calls no wait), loads are issued layer by layer, each
        layer's complete once ``wait_layer`` returns for it."""
        self._step.begin()
        self._after_forward = []
        if not meta:
            return
        if self.config.layerwise_load and by_layer:
            self._load_by_layer(meta.loads)
        else:
            for op in meta.loads:
                self._load(op)
        for save in meta.saves:
            if save.during_run:
                self._after_forward.append(save)
            else:
                self._save(save)

    def wait_layer(self, layer_name: str) -> bool:
        """``wait_for_layer_load``: the engine's stream waits for the copies into
        ``layer_name``'s cache (no host wait); False, doing nothing, where this step
        loads nothing into it."""
        return self._step.wait(layer_name)

    def end_step(self) -> None:
        """``wait_for_save``: the engine's stream waits for every load of the step,
        layers the forward never waited for included; then the step's saves of running
        requests copy what its forward computed."""
        self._step.wait_all()
        ops, self._after_forward = self._after_forward, []
        for op in ops:
            self._save(op)

    @property
    def issued_layers(self) -> list[str]:
        """The layers this step's layer-wise loads were issued to, in order."""
        return [self.layers[i].name for i in self._step.order]

    def finished_sends(self, finished_req_ids: set[str] | None) -> set[str]:
        """``get_finished``' first half: saves done, of requests vLLM said finished."""
        self._finished_seen |= finished_req_ids or set()
        done = self._sent & self._finished_seen
        self._sent -= done
        self._finished_seen -= done
        return done

    def take_load_errors(self) -> set[int]:
        """``get_block_ids_with_load_errors``: blocks not loaded since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_failed_loads(self) -> set[int]:
        """The reservations (``LoadOp.ref``) whose loads failed since the last call, for
        the scheduler side (``SchedulerCore.loads_failed``)."""
        refs, self._failed_refs = self._failed_refs, set()
        return refs

    @property
    def disabled(self) -> str | None:
        """Why this worker disabled the connector, or None: told to the scheduler side
        (``SchedulerCore.disable``, idempotent) with every step's output, not once, so
        that no one output lost on the way (a rank's, a step's) can keep it unheard."""
        return self._disabled

    def take_failed_saves(self) -> set[int]:
        """The saves (``SaveOp.ref``) whose copies failed since the last call, for the
        scheduler side (``SchedulerCore.saves_failed``)."""
        refs, self._failed_saves = self._failed_saves, set()
        return refs

    def take_copied(self) -> set[int]:
        """The copies during the run (``SaveOp.report``) made since the last call, failed
        ones too (their saves are in ``take_failed_saves``), for the scheduler side
        (``SchedulerCore.saves_copied``)."""
        reports, self._copied = self._copied, set()
        return reports

    def take_load_failures(self) -> dict[str, int]:
        """Failed loads by reason since the last call (vLLM's connector stats)."""
        new = self.load_failures - self._failures_reported
        self._failures_reported = self.load_failures.copy()
        return dict(new)

    def close(self) -> None:
        self._drop_access()
        if self._own_client:
            self.client.close()

    # ---------------------------------------------------------------- the pool

    def _pool(self, epoch: int = 0) -> PoolAccess | None:
        """The pool, connected and checked against vLLM's layers; None while the
        service cannot be reached (tried again after ``timeout`` seconds). Slots of
        another ``epoch`` than the pool's mean the service restarted: connect anew."""
        if self._access is not None and epoch and self._access.info.server_epoch != epoch:
            self._drop_access()
        if self._access is not None or self._disabled is not None:
            return self._access
        now = time.monotonic()
        if now < self._retry_at:
            return None
        try:
            access = open_access(self.client, self.config.model, self.config.transfer)
        except PrefixCacheError as err:
            self._retry_at = now + self.config.timeout
            log.warning(
                "prefixcache pool of %r unavailable (%s): loading nothing, saving nothing",
                self.config.model,
                err,
            )
            return None
        problem = self._check(access)
        if problem is not None:
            self.disable(problem)
            return None
        self._access = access
        if not isinstance(self._step.copies, HostCopies):
            access.pin()  # a host pool, for copies to the GPU that do not stage
        return access

    def _drop_access(self) -> None:
        """Unmap the pool, once no copy from it can still be in flight."""
        old, self._access = self._access, None
        if old is not None:
            self._step.copies.drain()
            close = getattr(old, "close", None)
            if close is not None:
                close()

    def disable(self, problem: str) -> None:
        """Load and save nothing from now on (vLLM computes everything), said once."""
        self._disabled = problem
        log.error("prefixcache connector disabled: %s", problem)

    def _check(self, access: PoolAccess) -> str | None:
        """Why the pool cannot hold these layers' KV, or None (and set the heads)."""
        if not self.layers:
            return "register_kv_caches was never called"
        share = fit_pool(access.info, self.layers, self.tp_rank, self.tp_size)
        if isinstance(share, str):
            return share
        self._heads, self._write_heads = share.heads, share.writes
        return None

    # ------------------------------------------------------------------ copies

    def _fail(self, op: LoadOp, reason: str, detail: str = "") -> None:
        """Report the load's blocks failed, logged with ``reason``'s words and counted
        under it."""
        self.failed_loads += 1
        self.load_failures[reason] += 1
        first = op.start // self.block_size
        last = -(-op.end // self.block_size)
        for table in op.tables:
            self._load_errors.update(b for b in table[first:last] if b != NULL_BLOCK)
        if op.ref:
            self._failed_refs.add(op.ref)
        why = LOAD_FAILURE_REASONS[reason] + (f": {detail}" if detail else "")
        # "disabled": said once, by disable(); the scheduler side stops loading.
        log.log(
            logging.DEBUG if reason == "disabled" else logging.WARNING,
            "prefixcache load of request %s failed (%s): %d blocks recomputed",
            op.req_id,
            why,
            max(last - first, 0),
        )

    def _load(self, op: LoadOp) -> None:
        rows = self._open(op)
        if rows is None:
            return
        memo: dict[int, SpanMemo] = {}
        try:
            for layer in range(len(self.layers)):
                self._copy_layer(op, rows, layer, memo)
        except (PrefixCacheError, ValueError, RuntimeError) as err:
            self._fail_on(op, err)
            return
        self._verify(op)

    def _load_by_layer(self, ops: list[LoadOp]) -> None:
        """The step's loads, layer after layer (layerwise.py): every request's copies
        into layer 0, a mark, then layer 1's... A request whose copy fails is dropped
        from the later layers. Each is then checked as ``_load`` checks it, while its
        copies may still be in flight."""
        live: list[tuple[LoadOp, Rows, dict[int, SpanMemo]]] = []
        for op in ops:
            access = self._pool(op.server_epoch) if not op.fail else None
            if access is not None and not access.mapped:
                self._load(op)  # read into staging rows the next read reuses: whole
                continue
            rows = self._open(op)
            if rows is not None:
                live.append((op, rows, {}))
        # A later op of another epoch may have mapped the pool anew: the earlier
        # ones' rows are of the old mapping, whose slots are gone with it.
        for entry in [e for e in live if e[0].server_epoch != self._epoch()]:
            live.remove(entry)
            self._fail(entry[0], "restarted")
        if not live:
            return
        with self._step.copies.issuing():
            for layer in range(len(self.layers)):
                for entry in list(live):
                    op, rows, memo = entry
                    try:
                        self._copy_layer(op, rows, layer, memo)
                    except (PrefixCacheError, ValueError, RuntimeError) as err:
                        live.remove(entry)
                        self._fail_on(op, err)
                self._step.issued(layer)
        for op, _, _ in live:
            self._verify(op)

    def _epoch(self) -> int:
        return self._access.info.server_epoch if self._access is not None else 0

    def _open(self, op: LoadOp) -> Rows | None:
        """The rows of ``op``'s slots, or None with the load failed."""
        if op.fail:
            self._fail(op, "scheduler")
            return None
        if any(live_from(t, op.start, op.end, self.block_size) is None for t in op.tables):
            self._fail(op, "null_block")  # a null block after a live one
            return None
        access = self._pool(op.server_epoch)
        if access is None:
            if self._disabled is not None:
                self._fail(op, "disabled", self._disabled)
            else:
                self._fail(op, "unavailable")
            return None
        try:
            return access.reader(op.slots, op.server_epoch, op.session_id)
        except (PrefixCacheError, ValueError, RuntimeError) as err:
            self._fail_on(op, err)
            return None

    def _copy_layer(self, op: LoadOp, rows: Rows, layer: int, memo: dict[int, SpanMemo]) -> None:
        """``op``'s rows of cache ``layer`` into its blocks: whole kernel blocks in one
        copy per side (block_copy.py). The layer's group's table gives the blocks; its
        tokens in null blocks before the first live one are left out (``meta``)."""
        view = self.layers[layer]
        table = op.table(view.group)
        first = live_from(table, op.start, op.end, self.block_size)
        if first is None:
            raise ValueError("a null block after a live one in the block table")
        if first >= op.end:
            return
        parts = view_spans(
            view, table, first, op.end - first, self.block_size, memo.setdefault(view.group, {})
        )
        k, v = rows(layer)
        off = first - op.start
        for span in parts:
            load_span(view.k, span, k[off + span.lo : off + span.hi, self._heads])
            if view.v is not None:
                load_span(view.v, span, v[off + span.lo : off + span.hi, self._heads])

    def _verify(self, op: LoadOp) -> None:
        """Count ``op`` loaded, or failed if the tree no longer maps its tokens to the
        slots copied from (``verify_loads``)."""
        try:
            problem = self._still_mapped(op) if self.config.verify_loads else None
        except (PrefixCacheError, ValueError, RuntimeError) as err:
            self._fail_on(op, err)
            return
        if problem is not None:
            self._fail(op, problem)
            return
        self.loaded_tokens += op.num_tokens

    def _fail_on(self, op: LoadOp, err: Exception) -> None:
        """Fail ``op`` under the reason ``err`` means."""
        if isinstance(err, StaleEpoch):
            self._fail(op, "restarted", str(err))
        elif isinstance(err, Unavailable | DeadlineExceeded):
            self._fail(op, "unavailable", str(err))
        else:
            self._fail(op, "copy", str(err))

    def _still_mapped(self, op: LoadOp) -> str | None:
        """Why the tree may no longer map the loaded tokens to the slots copied from
        (a ``LOAD_FAILURE_REASONS`` key), or None when it still does."""
        reply = self.client.match(self.config.model, op.tokens, extra_key=op.extra_key)
        if reply.skipped:
            return "unverified"  # the check got no answer: nothing is known
        if reply.server_epoch != op.server_epoch:
            return "restarted"
        if reply.prefix_len >= op.end and reply.slots[op.start : op.end] == op.slots:
            return None
        return "moved"

    def _save(self, op: SaveOp) -> None:
        try:
            if len(op.slots):
                if any(
                    touches_null(t, op.start, op.start + len(op.slots), self.block_size)
                    for t in op.tables
                ):
                    raise ValueError(
                        f"tokens {op.start}..{op.start + len(op.slots)} fall into vLLM's null block"
                    )
                self._write(op)
                self.saved_tokens += len(op.slots)
        except (PrefixCacheError, ValueError, RuntimeError) as err:
            self.failed_saves += 1
            log.log(
                logging.DEBUG if self._disabled is not None else logging.WARNING,
                "prefixcache save of request %s failed: %s",
                op.req_id,
                err,
            )
            if op.ref:
                self._failed_saves.add(op.ref)
        if op.during_run:
            self._copied.add(op.report)
        else:
            self._sent.add(op.req_id)

    def _write(self, op: SaveOp) -> None:
        access = self._pool(op.server_epoch)
        if access is None:
            raise RuntimeError(self._disabled or "pool unavailable")
        if not self._write_heads:
            return
        source, fill = save_rows(self.layers, op.tables, op.start, len(op.slots), self.block_size)
        access.write(op.slots, source, self._heads, op.session_id, op.server_epoch, fill)


# Why a load failed: the key counts it (``load_failures``), the words log it.
LOAD_FAILURE_REASONS = {
    "scheduler": "the scheduler side could not serve it",
    "disabled": "the connector is disabled",
    "unavailable": "the service could not be reached",
    "restarted": "the service restarted: the slots are gone",
    "unverified": "the service did not answer the check that the slots still hold these tokens",
    "moved": "the slots no longer hold these tokens",
    "copy": "the copy failed",
    "null_block": "vLLM's block table holds its null block where the tokens were to go",
}


def _head_size(tensor: Any, layout: str) -> int:
    """A layer's K head size as its layout puts it (``kv_layout`` named, no backend
    reported): the last dimension, halved where it holds K then V."""
    last = int(tensor.shape[-1])
    return last if layout in ("kv_first", "blocks_first", "mla") else last // 2
