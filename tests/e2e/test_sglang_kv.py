"""What the SGLang HiCache backend stores is K and V per token: a prompt's K/V,
computed by transformers for the tiny Llama and laid into an SGLang-shaped host pool,
stored with ``batch_set_v1`` into a real `prefixcache serve`, read back through ReadKV,
equals transformers' row for row; ``batch_get_v1`` into a fresh host pool (another
layout, other host pages) returns the same bytes.

SGLang's runtime does not run here (see docs/sglang.md), so no SGLang
engine computes the K/V; transformers does, and the host pools are built with SGLang's
buffer shapes per ``--hicache-mem-layout`` (``hicache_hosts.py``). The K is post-RoPE,
as SGLang keeps it. A backend that put a host page's rows into the pool in another
order (a layout's axes swapped, K and V crossed, pages shifted) round-trips through
itself but fails here.

The stores go through ``PrefixCacheStorage`` loaded by SGLang's own backend factory,
with SGLang's page hashes, where the ``sglang`` package is installed (CI's e2e venv
installs its storage API without its CUDA dependencies, and checks that it imports),
else through ``HiCacheCore``, the logic its ``batch_*_v1`` calls.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e import tiny_llama
from e2e.e2e_support import Sidecar

pytestmark = [pytest.mark.e2e]

MIN_COSINE = 0.999
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
HAS_SGLANG = importlib.util.find_spec("sglang") is not None


@pytest.fixture(scope="module")
def sg_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama.build(tmp_path_factory.mktemp("sg-llama"))


class HiCacheSidecar(Sidecar):
    """The e2e sidecar (models p16 and p32, the tiny Llama's geometry) with the page-hash
    index SGLang's backend looks pages up in, as docs/sglang.md's config sets it."""

    def start(self) -> None:
        config = self.config.read_text()
        if "change_log_capacity" not in config:
            self.config.write_text(
                config.replace("server:\n", "server:\n  change_log_capacity: 65536\n", 1)
            )
        super().start()


@pytest.fixture(scope="module")
def sg_sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    """A sidecar of this module's own (the vLLM tests' holds other pages)."""
    side = HiCacheSidecar(tmp_path_factory.mktemp("sg"), size=4096)
    yield side
    side.stop()


@pytest.fixture(scope="module")
def reference(sg_model: Path):  # type: ignore[no-untyped-def]
    """transformers' K/V of a prompt: per layer, ``[tokens, kv_heads, head_dim]``."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(
        sg_model, dtype=torch.float32, attn_implementation="eager"
    ).eval()

    def kv(tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        with torch.no_grad():
            cache = model(torch.tensor([tokens]), use_cache=True).past_key_values
        return [
            (
                layer.keys[0].transpose(0, 1).contiguous(),
                layer.values[0].transpose(0, 1).contiguous(),
            )
            for layer in cache.layers
        ]

    return kv


def host_pool(layout: str, pages: int, page: int, seed: int):  # type: ignore[no-untyped-def]
    import torch
    from integrations.sglang.hicache_hosts import HostPool

    return HostPool(
        layout,
        pages,
        heads=tiny_llama.KV_HEADS,
        dim=tiny_llama.HEAD_DIM,
        dtype=torch.float32,
        page_size=page,
        layers=tiny_llama.LAYERS,
        seed=seed,
    )


def positions(pages: list[int], page: int):  # type: ignore[no-untyped-def]
    from integrations.sglang.hicache_hosts import host_indices

    return host_indices(pages, page)


class Backend:
    """``batch_set_v1`` / ``batch_get_v1`` on one host pool: SGLang's factory and types
    where SGLang imports, else the core those calls delegate to."""

    def __init__(self, target: str, pool: Any, model: str, page: int, transfer: str) -> None:
        self.page = page
        if HAS_SGLANG:
            from sglang.srt.mem_cache import hicache_storage as storage
            from sglang.srt.mem_cache.storage import StorageBackendFactory

            self.storage = storage
            config = storage.HiCacheStorageConfig(
                tp_rank=0,
                tp_size=1,
                pp_rank=0,
                pp_size=1,
                attn_cp_rank=0,
                attn_cp_size=1,
                is_mla_model=False,
                enable_storage_metrics=False,
                is_page_first_layout=pool.layout == "page_first",
                model_name="tiny",
                extra_config={
                    "backend_name": "prefixcache",
                    "interface_v1": 1,
                    "module_path": "prefixcache.integrations.sglang.backend",
                    "class_name": "PrefixCacheStorage",
                    "target": target,
                    "model": model,
                    "transfer": transfer,
                },
            )
            self.impl = StorageBackendFactory.create_backend("dynamic", config, pool)
            self.impl.register_mem_pool_host(pool)
        else:
            from integrations.sglang.hicache_hosts import make_core

            self.impl = make_core(target, pool, model=model, transfer=transfer)

    def keys(self, tokens: list[int]) -> list[str]:
        """The page keys of ``tokens`` (whole pages): prefixcache's chain, which must be
        SGLang's ``get_hash_str`` byte for byte (else SGLang never finds the pages that
        workers cached under their tokens)."""
        from prefixcache.cache import hash_token_ids

        keys: list[str] = []
        for i in range(0, len(tokens) - len(tokens) % self.page, self.page):
            keys.append(hash_token_ids(tokens[i : i + self.page], keys[-1] if keys else None))
        if HAS_SGLANG:
            from sglang.srt.mem_cache.utils import get_hash_str

            theirs = get_hash_str(tokens, None, page_size=self.page)
            assert theirs == keys, "SGLang's page hashes are not prefixcache's chain"
        return keys

    def set(self, keys: list[str], host: Any, prefix: list[str]) -> list[bool]:
        if HAS_SGLANG:
            info = self.storage.HiCacheStorageExtraInfo(prefix_keys=prefix)
            return self.impl.batch_set_v1(keys, host, info)
        return self.impl.set(keys, host, prefix[-1] if prefix else None)

    def get(self, keys: list[str], host: Any) -> list[bool]:
        if HAS_SGLANG:
            info = self.storage.HiCacheStorageExtraInfo(prefix_keys=[])
            return self.impl.batch_get_v1(keys, host, info)
        return self.impl.get(keys, host)

    def close(self) -> None:
        self.impl.close()


def cosine(got: Any, want: Any) -> tuple[float, float]:
    """The cosine of the whole layer, and the worst token's."""
    import torch

    flat = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
    per_token = torch.nn.functional.cosine_similarity(got.flatten(1), want.flatten(1), dim=1)
    return float(flat), float(per_token.min())


def compare(rows: list[tuple[Any, Any]], want: list[tuple[Any, Any]], what: str) -> None:
    """Each layer's K and V rows against transformers': cosine >= 0.999 per layer and per
    token, and equal bit for bit (fp32 through fp32: nothing is converted)."""
    import torch

    bad = []
    for layer, ((k, v), (ref_k, ref_v)) in enumerate(zip(rows, want, strict=True)):
        for name, got, ref in (("K", k, ref_k), ("V", v, ref_v)):
            if tuple(got.shape) != tuple(ref.shape):
                bad.append(
                    f"layer {layer} {name}: shape {tuple(got.shape)}, want {tuple(ref.shape)}"
                )
                continue
            whole, worst = cosine(got.float(), ref)
            if whole < MIN_COSINE or worst < MIN_COSINE or not torch.equal(got, ref):
                bad.append(
                    f"layer {layer} {name}: cosine {whole:.4f}, worst token "
                    f"{worst:.4f}, max |diff| {float((got - ref).abs().max()):.3g}"
                )
    assert not bad, f"{what}: {bad}"


def host_rows(pool: Any, pages: list[int], page: int) -> list[tuple[Any, Any]]:
    """Per layer, the (K, V) rows of the tokens at host pages ``pages``, in order."""
    import torch

    tokens = positions(pages, page).tolist()
    return [
        tuple(torch.stack([pool.row(part, layer, t) for t in tokens]) for part in ("k", "v"))
        for layer in range(pool.layer_num)
    ]


CASES = [(layout, transfer, "p16", 16) for layout in LAYOUTS for transfer in ("attach", "rpc")] + [
    ("page_first", "auto", "p32", 32),
    ("page_head", "rpc", "p32", 32),
]


@pytest.mark.parametrize(
    ("layout", "transfer", "model", "page"), CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES]
)
def test_batch_set_v1_puts_transformers_kv_in_the_pool(  # type: ignore[no-untyped-def]
    sg_sidecar: Sidecar, reference, layout: str, transfer: str, model: str, page: int
) -> None:
    import random

    seed = CASES.index((layout, transfer, model, page))
    n_pages = 5
    # A prompt of its own per case (else a later case finds the pages held and stores
    # nothing), with a partial page at the end that SGLang never stores.
    rng = random.Random(1000 + seed)
    prompt = [rng.randrange(3, tiny_llama.VOCAB) for _ in range(n_pages * page + page // 2)]
    stored = n_pages * page
    want = reference(prompt[:stored])

    # The writer's host pool: noise, with the prompt's K/V at host pages out of order.
    writer_pool = host_pool(layout, 8, page, seed=seed)
    at = [6, 2, 7, 0, 4]
    for t, position in enumerate(positions(at, page).tolist()):
        for layer, (k, v) in enumerate(want):
            writer_pool.row("k", layer, position).copy_(k[t])
            writer_pool.row("v", layer, position).copy_(v[t])
    compare(host_rows(writer_pool, at, page), want, "the writer's host pool (test set-up)")

    # The reader: another layout, other host pages.
    reader_layout = LAYOUTS[(LAYOUTS.index(layout) + 1) % len(LAYOUTS)]
    reader_pool = host_pool(reader_layout, 8, page, seed=100 + seed)
    back = [1, 5, 3, 6, 0]
    writer = Backend(sg_sidecar.target, writer_pool, model, page, transfer)
    reader = Backend(sg_sidecar.target, reader_pool, model, page, transfer)
    try:
        keys = writer.keys(prompt[:stored])
        assert len(keys) == n_pages
        assert reader.get(keys, positions(back, page)) == [False] * n_pages  # not yet held
        # As SGLang's backup thread: a batch, then the next with the first's keys as prefix.
        held = writer.set(keys[:2], positions(at[:2], page), [])
        held += writer.set(keys[2:], positions(at[2:], page), keys[:2])
        assert held == [True] * n_pages

        # The pool's rows, read through ReadKV as any other client would: the pages'
        # slots by hash (SGLang's pages are keyed by hash, not tokens), locked meanwhile.
        client = sg_sidecar.client
        with client.session(ttl=30) as s:
            found = client.get_pages(model, keys, session=s)
            try:
                assert found.found_pages == n_pages
                data = client.read_kv(model, found.slot_indices, session=s)
            finally:
                for lock_id in found.lock_ids:
                    client.unlock(lock_id, session=s)
        compare(
            list(zip(data.k, data.v, strict=True)),
            want,
            f"the pool's rows ({layout} host, {transfer})",
        )

        assert reader.get(keys, positions(back, page)) == [True] * n_pages
        compare(
            host_rows(reader_pool, back, page),
            want,
            f"batch_get_v1 into a {reader_layout} host pool",
        )
        for a, b in zip(at, back, strict=True):
            assert reader_pool.page_bytes(b * page) == writer_pool.page_bytes(a * page)
    finally:
        writer.close()
        reader.close()
