"""vLLM's hybrid KV cache manager on the engine-free cores: a request has one block table
per KV cache group, and each layer's copies use its group's (meta.py). Two layers share
one tensor, as the hybrid manager lays them out (one buffer under a layer of each
group), but keep their KV in blocks of their own groups: a full-attention group and a
sliding-window one whose table has the null block where vLLM needs no KV. Real server,
CPU tensors, bytes compared."""

from __future__ import annotations

import pytest
import torch
from harness import ServerThread
from integrations.vllm.vllm_support import DIM, make_scheduler, make_worker, settle, token_rows

from prefixcache.client import PrefixCacheClient
from prefixcache.integrations.vllm.keys import RequestInfo
from prefixcache.integrations.vllm.layout import split_kv
from prefixcache.integrations.vllm.meta import NULL_BLOCK, StepMeta
from prefixcache.integrations.vllm.scheduler import SchedulerCore
from prefixcache.integrations.vllm.worker import WorkerCore

pytestmark = pytest.mark.usefixtures("quiet")

PROMPT = list(range(400, 418))  # 18 tokens: 4 whole blocks
FULL, WINDOW = "model.layers.0.attn", "model.layers.1.attn"
GROUPS = {FULL: 0, WINDOW: 1}


def shared_caches(num_blocks: int = 16) -> dict[str, torch.Tensor]:
    """Two layers on one tensor (kv_first: [2, blocks, block, heads, dim]), random
    bytes: group 0's blocks and group 1's are different blocks of it."""
    raw = torch.randint(0, 256, (2, num_blocks, 4, 2, DIM * 2), dtype=torch.uint8)
    cache = raw.view(torch.float16)
    return {FULL: cache, WINDOW: cache}


def layer_rows(
    caches: dict[str, torch.Tensor], name: str, blocks: list[int], n: int
) -> torch.Tensor:
    return token_rows(split_kv(name, caches[name], "kv_first", DIM), blocks, n)


def step(
    core: SchedulerCore,
    worker: WorkerCore,
    finished: set[str] = frozenset(),  # type: ignore[assignment]
    progress: dict | None = None,
) -> StepMeta:  # type: ignore[type-arg]
    meta = core.build_meta((), progress)
    worker.start_step(meta)
    worker.end_step()
    sent = worker.finished_sends(set(finished))
    core.loads_failed(worker.take_failed_loads())
    core.saves_failed(worker.take_failed_saves())
    core.saves_copied(worker.take_copied())
    core.sends_done(sent)
    settle(core)
    return meta


def pool_rows(client: PrefixCacheClient, tokens: list[int]) -> tuple[int, list[torch.Tensor]]:
    with client.session(10.0) as s:
        hit = s.match("v", tokens, lock=True)
        kv = s.read_kv("v", hit.slots) if hit.prefix_len else None
        s.unlock(hit.lock_id)
    if kv is None:
        return 0, []
    return hit.prefix_len, [
        torch.stack([kv.k[n], kv.v[n]]).view(torch.uint8) for n in range(len(kv.k))
    ]


def test_layers_of_two_groups_on_one_tensor_are_two_pool_layers(server: ServerThread) -> None:
    worker = make_worker(server.address)
    try:
        worker.register(shared_caches(), groups=GROUPS)
        assert [(v.name, v.group) for v in worker.layers] == [(FULL, 0), (WINDOW, 1)]
        one = make_worker(server.address)
        one.register(shared_caches())  # one group: the shared tensor is one layer
        assert len(one.layers) == 1
        one.close()
    finally:
        worker.close()


def test_each_group_saves_and_loads_through_its_own_table(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    """A saves while it runs from two tables (the window's losing its first block
    later); B loads A's 16 tokens: the full group's layer into all four of its blocks,
    the window's layer only into its live blocks (tokens 8..15), the null block's bytes
    untouched."""
    core = make_scheduler(server.address, during_run_saves=True)
    worker = make_worker(server.address)
    try:
        caches = shared_caches()
        worker.register(caches, groups=GROUPS)
        full_a, window_a = [2, 5, 7, 9, 10], [3, 6, 8, 11, 12]
        want = [layer_rows(caches, FULL, full_a, 16), layer_rows(caches, WINDOW, window_a, 16)]
        a = RequestInfo("A", PROMPT, len(PROMPT))
        assert core.probe(a, 0) == (None, False)  # waits for its save's Match
        step(core, worker)
        assert core.probe(a, 0) == (0, False)
        core.allocated("A", (full_a, window_a), 0)
        (op,) = step(core, worker, progress={"A": (18, (full_a, window_a))}).saves
        assert len(op.tables) == 2 and op.during_run
        assert not core.finished(a, (full_a, [NULL_BLOCK, NULL_BLOCK, *window_a[2:]]), 20)
        held, got = pool_rows(client, PROMPT)
        assert held == 16
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))

        null_before = caches[FULL][:, NULL_BLOCK].clone().view(torch.uint8)
        b = RequestInfo("B", PROMPT, len(PROMPT))
        assert core.probe(b, 0) == (None, False)
        step(core, worker)
        assert core.probe(b, 0) == (16, False)
        full_b, window_b = [1, 4, 13, 14, 15], [NULL_BLOCK, NULL_BLOCK, 0, 0, 0]
        window_b[2:] = [12, 11, 10]  # reuses A's freed blocks: overwritten, not read
        core.allocated("B", (full_b, window_b), 16)
        (load,) = step(core, worker).loads
        assert (load.start, load.num_tokens) == (0, 16)  # the full group needs all 16
        assert worker.take_load_errors() == set() and worker.loaded_tokens == 16
        assert torch.equal(layer_rows(caches, FULL, full_b, 16), want[0])
        got_window = layer_rows(caches, WINDOW, [1, 1, *window_b[2:]], 16)
        assert torch.equal(got_window[:, 8:], want[1][:, 8:])
        assert torch.equal(caches[FULL][:, NULL_BLOCK].view(torch.uint8), null_before)
        core.finished(b, (full_b, window_b), 17)
        step(core, worker, {"B"})
    finally:
        core.close()
        worker.close()


def test_a_save_stops_where_any_group_lost_its_block(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    """At the finish, the window's table has the null block at block 1: a pool row
    holds every layer of its token, so only tokens 0..3 are inserted, though the full
    group still has all four blocks."""
    core = make_scheduler(server.address)
    worker = make_worker(server.address)
    try:
        worker.register(shared_caches(), groups=GROUPS)
        assert core.finished(
            RequestInfo("A", PROMPT, len(PROMPT)),
            ([2, 5, 7, 9, 10], [3, NULL_BLOCK, 8, 11, 12]),
            18,
        )
        for _ in range(3):
            step(core, worker, {"A"})
        assert pool_rows(client, PROMPT)[0] == 4 and core.stats.saves_cut == 1
    finally:
        core.close()
        worker.close()
