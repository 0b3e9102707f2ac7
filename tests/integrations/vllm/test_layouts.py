"""Each attention backend's KV layout, end to end against a real server: a tensor holds
known per-token K/V written the way the backend's own code reads it (the reference
writers below, each citing vLLM 0.32's source), a request is saved from it, and the
pool's rows must be exactly each token's K and V ([token, heads, dim]); then an engine
with another block size loads it, and its blocks must hold each token's K/V where its
backend reads them. A block filled from two saves (pages smaller than the block, the
prompts diverging inside it) must load right too. vLLM itself is not imported: the
vLLM-marked tests (test_layouts_vllm.py) write through vLLM's own cache-write op."""

from __future__ import annotations

import logging
from array import array
from typing import Any

import pytest
import torch
from harness import ServerThread
from integrations.vllm.vllm_support import (
    LATENT,
    LAYERS,
    backend_for,
    make_scheduler,
    shadow_holds,
)
from integrations.vllm.vllm_support import make_worker as _make_worker

from prefixcache.client import PrefixCacheClient
from prefixcache.integrations.vllm.attn_backends import BackendInfo, layout_for
from prefixcache.integrations.vllm.config import LAYOUTS, ConnectorConfig
from prefixcache.integrations.vllm.keys import RequestInfo
from prefixcache.integrations.vllm.layout import KNOWN_LAYOUTS, UnknownLayout
from prefixcache.integrations.vllm.meta import LoadOp, StepMeta
from prefixcache.integrations.vllm.worker import WorkerCore

pytestmark = pytest.mark.usefixtures("quiet")

HEADS, NUM_BLOCKS = 2, 8
# layout -> (model, head dim, block size of the saving engine); the loading one's is twice.
CASES = {
    "bhn2d": ("c", 16, 16),
    "kv_first": ("c", 16, 16),
    "blocks_first": ("c", 16, 16),
    "cpu_vec": ("c", 16, 16),
    "cpu_amx": ("c", 16, 16),
    "mla": ("mla", LATENT, 4),
}


def positions(layout: str, n: int, d: int) -> tuple[Any, Any]:
    """Element offsets of K and V of (token offset o, head h, dim i) in one block of a
    ``[blocks, heads, n, 2 * d]`` CPU cache (flat within the block), ``[n, heads, d]``.

    cpu_attn.py views the block as ``(heads, 2 * n, d)`` and chunks dim 1 (K rows,
    then V rows); within them the kernels' reshape_and_cache stores (vec, vec16) K
    transposed, ``[d, n]``, V as ``[n, d]``; (amx) K in tiles of 16 tokens of dim pairs
    ``[n / 16, d / 2, 16, 2]``, V in groups of 16 dims of token pairs
    ``[d / 16, n / 2, 16, 2]`` (checked against the op in test_layouts_vllm.py)."""
    o = torch.arange(n).view(n, 1, 1)
    h = torch.arange(HEADS).view(1, HEADS, 1)
    i = torch.arange(d).view(1, 1, d)
    head = h * 2 * n * d
    if layout == "cpu_vec":
        return head + i * n + o, head + n * d + o * d + i
    k = ((o // 16 * (d // 2) + i // 2) * 16 + o % 16) * 2 + i % 2
    v = ((i // 16 * (n // 2) + o // 2) * 16 + i % 16) * 2 + o % 2
    return head + k, head + n * d + v


def write_tokens(layout: str, cache: Any, blocks: list[int], n: int, k: Any, v: Any | None) -> None:
    """Put token t's K/V (``[tokens, heads, dim]``) where ``layout``'s backend reads
    token t of a request with vLLM blocks ``blocks`` of ``n`` tokens."""
    t = torch.arange(k.shape[0])
    b = torch.tensor(blocks)[t // n]
    o = t % n
    if layout == "bhn2d":  # flash_attn.py: kv_cache.transpose(1, 2).split(head_size, -1)
        key, value = cache.transpose(1, 2).split(k.shape[-1], dim=-1)
        key[b, o], value[b, o] = k, v
    elif layout == "kv_first":  # FlashAttention before 0.32: [2, blocks, block, h, d]
        cache[0][b, o], cache[1][b, o] = k, v
    elif layout == "blocks_first":  # FlashInfer before 0.32: [blocks, 2, block, h, d]
        cache[:, 0][b, o], cache[:, 1][b, o] = k, v
    elif layout == "mla":  # mla_attention.py: [blocks, 1, block, C].squeeze(1)
        cache.squeeze(1)[b, o] = k[:, 0]
    else:
        pk, pv = positions(layout, n, k.shape[-1])
        flat = cache.view(cache.shape[0], -1)
        flat[b.view(-1, 1, 1), pk[o]] = k
        flat[b.view(-1, 1, 1), pv[o]] = v


def read_tokens(
    layout: str, cache: Any, blocks: list[int], n: int, count: int, d: int
) -> tuple[Any, Any | None]:
    """The K/V of tokens 0 .. count the backend reads from the blocks (the inverse of
    ``write_tokens``)."""
    t = torch.arange(count)
    b = torch.tensor(blocks)[t // n]
    o = t % n
    if layout == "bhn2d":
        key, value = cache.transpose(1, 2).split(d, dim=-1)
        return key[b, o], value[b, o]
    if layout == "kv_first":
        return cache[0][b, o], cache[1][b, o]
    if layout == "blocks_first":
        return cache[:, 0][b, o], cache[:, 1][b, o]
    if layout == "mla":
        return cache.squeeze(1)[b, o].unsqueeze(1), None
    pk, pv = positions(layout, n, d)
    flat = cache.view(cache.shape[0], -1)
    return flat[b.view(-1, 1, 1), pk[o]], flat[b.view(-1, 1, 1), pv[o]]


def empty_cache(layout: str, n: int, d: int) -> Any:
    shape = {
        "kv_first": (2, NUM_BLOCKS, n, HEADS, d),
        "blocks_first": (NUM_BLOCKS, 2, n, HEADS, d),
        "mla": (NUM_BLOCKS, 1, n, d),
    }.get(layout, (NUM_BLOCKS, HEADS, n, 2 * d))
    return torch.zeros(shape, dtype=torch.bfloat16)


def truth(tokens: list[int], layer: int, d: int, heads: int = HEADS) -> tuple[Any, Any]:
    """Each token's K and V, ``[tokens, heads, d]``: a function of its id, position and
    layer, as a model's KV is of its prefix (two requests agree on a shared prefix).
    Small integers: exact in bfloat16."""
    tok = torch.tensor(tokens).view(-1, 1, 1)
    pos = torch.arange(len(tokens)).view(-1, 1, 1)
    h = torch.arange(heads).view(1, -1, 1)
    i = torch.arange(d).view(1, 1, -1)
    k = (tok * 7 + pos * 13 + h * 31 + i * 3 + layer * 5) % 199 - 99
    v = (tok * 11 + pos * 5 + h * 17 + i * 7 + layer * 3) % 193 - 96
    return k.to(torch.bfloat16), v.to(torch.bfloat16)


class Engine:
    """One engine's connector cores and KV tensors in one layout and block size."""

    def __init__(self, address: str, layout: str, block: int) -> None:
        self.model, self.d, _ = CASES[layout]
        self.layout, self.block = layout, block
        self.core = make_scheduler(address, self.model, block=block)
        self.worker = _make_worker(address, self.model, block=block, kv_layout="auto")
        self.caches = {
            f"model.layers.{n}.self_attn.attn": empty_cache(layout, block, self.d)
            for n in range(LAYERS)
        }
        self.worker.register(self.caches, backend_for(layout, self.d))

    def write(self, tokens: list[int], blocks: list[int]) -> None:
        heads = 1 if self.layout == "mla" else HEADS
        for layer, cache in enumerate(self.caches.values()):
            k, v = truth(tokens, layer, self.d, heads)
            write_tokens(self.layout, cache, blocks, self.block, k, v)

    def step(self, finished: set[str] = frozenset()) -> StepMeta:  # type: ignore[assignment]
        meta = self.core.build_meta()
        self.worker.start_step(meta)
        self.core.saves_failed(self.worker.take_failed_saves())
        self.core.sends_done(self.worker.finished_sends(set(finished)))
        self.core.backend.wait_idle(10.0)  # type: ignore[attr-defined]
        return meta

    def save(self, req: str, tokens: list[int], blocks: list[int]) -> None:
        self.write(tokens, blocks)
        assert self.core.finished(RequestInfo(req, tokens, len(tokens)), blocks, len(tokens))
        for _ in range(3):
            self.step({req})
        assert not self.core.has_pending_saves()

    def load(self, req: str, tokens: list[int], blocks: list[int], held: int) -> int:
        """Load what the service holds of ``tokens`` (``held`` of them, saved by another
        engine) into ``blocks``; the hit."""
        # As an engine probing after the save reached its shadow index: before, the
        # probe may answer a fast miss (the stream's delay), which is not under test.
        shadow_holds(self.core, tokens[:held])
        info = RequestInfo(req, tokens, len(tokens))
        assert self.core.probe(info, 0) == (None, False)
        self.step()
        hit, _ = self.core.probe(info, 0)
        assert hit
        self.core.allocated(req, blocks, hit)
        assert len(self.step().loads) == 1
        assert self.worker.take_load_errors() == set()
        self.core.finished(info, [], 0)
        self.step()
        return int(hit)

    def assert_holds(self, tokens: list[int], blocks: list[int], count: int) -> None:
        heads = 1 if self.layout == "mla" else HEADS
        for layer, cache in enumerate(self.caches.values()):
            want_k, want_v = truth(tokens[:count], layer, self.d, heads)
            k, v = read_tokens(self.layout, cache, blocks, self.block, count, self.d)
            assert torch.equal(k, want_k), f"layer {layer}: K"
            if v is not None:
                assert torch.equal(v, want_v), f"layer {layer}: V"

    def close(self) -> None:
        self.core.close()
        self.worker.close()


def pool_rows(
    client: PrefixCacheClient, model: str, tokens: list[int]
) -> tuple[list[Any], list[Any]]:
    """The pool's K and V rows of the cached prefix of ``tokens``, per layer."""
    slots = torch.tensor(list(client.match(model, tokens).slots), dtype=torch.int64)
    pool = client.attach_pool(model)
    try:
        return (
            [k[slots].clone() for k in pool.k_buffer],
            [v[slots].clone() for v in pool.v_buffer],
        )
    finally:
        pool.close()


@pytest.mark.parametrize("layout", list(CASES))
def test_the_pool_holds_each_tokens_kv_and_another_block_size_loads_it(
    server: ServerThread, client: PrefixCacheClient, layout: str
) -> None:
    model, d, block = CASES[layout]
    tokens = list(range(300, 300 + 3 * block + 3))  # 3 whole blocks are saved
    saver = Engine(server.address, layout, block)
    loader = Engine(server.address, layout, 2 * block)
    try:
        saver.save("A", tokens, [5, 2, 7, 1])
        assert [v.layout for v in saver.worker.layers] == [layout] * LAYERS
        ks, vs = pool_rows(client, model, tokens)
        assert len(ks[0]) == 3 * block
        heads = 1 if layout == "mla" else HEADS
        for layer in range(LAYERS):
            k, v = truth(tokens[: 3 * block], layer, d, heads)
            assert torch.equal(ks[layer], k), f"layer {layer}: the pool's K rows"
            if layout != "mla":
                assert torch.equal(vs[layer], v), f"layer {layer}: the pool's V rows"
        blocks = [6, 3, 4]
        # one block of twice the size
        assert loader.load("B", tokens, blocks, 3 * block) == 2 * block
        loader.assert_holds(tokens, blocks, 2 * block)
    finally:
        saver.close()
        loader.close()


@pytest.mark.parametrize("layout", ["cpu_vec", "cpu_amx", "bhn2d"])
def test_a_block_filled_from_two_saves_loads_each_tokens_own_kv(
    server: ServerThread, client: PrefixCacheClient, layout: str
) -> None:
    """Pages of 8 under blocks of 16: A and B share 20 tokens; the tree has A's pages
    to 16, then B's. An engine with blocks of 32 loads B plus a suffix: its first block
    takes tokens 0..15 from A's save and 16..31 from B's, each in its own place."""
    shared = list(range(900, 920))
    a = shared + list(range(100, 112))  # 32 tokens: 2 blocks saved
    b = shared + list(range(200, 229))  # 49 tokens: 3 blocks saved
    saver = Engine(server.address, layout, 16)
    loader = Engine(server.address, layout, 32)
    try:
        saver.save("A", a, [1, 2])
        saver.save("B", b, [3, 4, 5, 6])
        assert client.match("c", b).prefix_len == 48
        c = [*b[:48], 7, 7, 7]
        blocks = [7, 0]
        assert loader.load("C", c, blocks, 48) == 32
        loader.assert_holds(c, blocks, 32)
    finally:
        saver.close()
        loader.close()


def test_an_unknown_backend_disables_the_connector_with_one_log_line(
    server: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    worker = _make_worker(server.address, "c", block=16, kv_layout="auto")
    caches = {f"l{n}": empty_cache("bhn2d", 16, 16) for n in range(LAYERS)}
    rocm = BackendInfo("vllm.v1.attention.backends.rocm_aiter_fa.AiterFlashAttentionBackend", 16)
    try:
        with caplog.at_level(logging.WARNING, "prefixcache.integrations.vllm"):
            worker.register(caches, rocm)
            for _ in range(3):
                worker.start_step(
                    StepMeta([LoadOp("C", array("q", [1]), 0, 16, array("q", range(16)), 1, "x")])
                )
        assert worker.take_load_errors() == {1}
        assert worker.load_failures == {"disabled": 3}
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "AiterFlashAttentionBackend" in errors[0].getMessage()
    finally:
        worker.close()


def test_layouts_come_from_the_backend_never_from_the_shape() -> None:
    cpu = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
    flash = "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"
    t = torch.zeros(2, 2, 32, 32, dtype=torch.bfloat16)  # one shape, two readings
    assert layout_for(BackendInfo(flash, 16), t) == "bhn2d"
    assert layout_for(BackendInfo(cpu, 16, "vec"), t) == "cpu_vec"
    assert layout_for(BackendInfo(cpu, 16, "vec16"), t) == "cpu_vec"
    assert layout_for(BackendInfo(cpu, 16, "amx"), t) == "cpu_amx"
    for isa, dtype in (
        ("neon", torch.bfloat16),
        (None, torch.bfloat16),
        ("amx", torch.float32),
        ("vec", torch.uint8),
    ):
        with pytest.raises(UnknownLayout):
            layout_for(BackendInfo(cpu, 16, isa), t.to(dtype))
    with pytest.raises(UnknownLayout, match="did not report"):
        layout_for(None, t)
    assert layout_for(None, t, "cpu_vec") == "cpu_vec"  # an explicit known name
    with pytest.raises(UnknownLayout, match="not one of"):
        layout_for(None, t, "bhnd")
    assert ("auto", *KNOWN_LAYOUTS) == LAYOUTS
    assert ConnectorConfig(model="m").kv_layout == "auto"
    with pytest.raises(ValueError, match="kv_layout"):
        ConnectorConfig(model="m", kv_layout="guess")


def test_a_save_that_cannot_finish_at_shutdown_is_reported_lost(
    server: ServerThread, client: PrefixCacheClient, caplog: pytest.LogCaptureFixture
) -> None:
    """The first save completes: its insert, sent as the engine stops, is waited for.
    The second never got its copy (the engine stopped first): logged as lost."""
    saver = Engine(server.address, "bhn2d", 16)
    tokens = list(range(40, 73))
    other = list(range(80, 113))
    try:
        saver.write(tokens, [1, 2, 3])
        assert saver.core.finished(RequestInfo("A", tokens, 33), [1, 2, 3], 33)
        saver.step()
        saver.step({"A"})  # copied, insert sent
        assert saver.core.finished(RequestInfo("B", other, 33), [4, 5, 6], 33)
        with caplog.at_level(logging.WARNING, "prefixcache.integrations.vllm"):
            saver.core.close()
        assert client.match("c", tokens).prefix_len == 32
        assert client.match("c", other).prefix_len == 0
        assert saver.core.stats.saves_lost == 1
        assert "1 save(s) in flight at shutdown were lost" in caplog.text
    finally:
        saver.close()


def test_a_cpu_cache_whose_strides_do_not_fit_is_refused_not_raised() -> None:
    """vLLM's CPU backend reads head-major blocks (KVCacheLayout LBHNC); a cache laid
    out otherwise cannot be viewed so and is refused, not an exception in vLLM."""
    token_major = torch.zeros(4, 16, 2, 32, dtype=torch.bfloat16).transpose(1, 2)
    worker = WorkerCore(ConnectorConfig(model="c", target="unix:/nonexistent"), 16)
    try:
        worker.register({"l0": token_major}, backend_for("cpu_vec", 16))
        assert worker.layers == [] and "strides" in (worker._disabled or "")
    finally:
        worker.close()
