"""HiCacheCore driven as SGLang drives its storage backend, against a real server.

SGLang's order for one request: the prefetch thread asks ``batch_exists`` for the
pages past what its host pool holds, the prefetch-IO thread loads the hits with
``batch_get_v1`` into freshly allocated host pages, and later the backup thread stores
the request's new pages with ``batch_set_v1`` (``prefix_keys`` naming the pages before
them). Every copy is checked byte for byte against the host pool it came from, in each
of SGLang's host layouts, through the mapped pool and through ReadKV/WriteKV.
"""

from __future__ import annotations

import pytest
import torch
from hicache_hosts import LAYERS, MHA_LAYOUTS, MLA_LAYOUTS, PAGE, HostPool, host_indices, make_core

from prefixcache.cache import hash_token_ids
from prefixcache.integrations.sglang import prior_of

TRANSFERS = ("attach", "rpc")


def chain(tokens: list[int], prior: str | None = None) -> list[str]:
    """SGLang's page keys for ``tokens`` (whole pages), chained on ``prior``."""
    keys = []
    for i in range(0, len(tokens) - PAGE + 1, PAGE):
        prior = hash_token_ids(tokens[i : i + PAGE], prior)
        keys.append(prior)
    return keys


def prompt(seed: int, pages: int) -> list[int]:
    return [(seed * 7919 + i) % 50000 for i in range(pages * PAGE)]


@pytest.mark.parametrize("transfer", TRANSFERS)
@pytest.mark.parametrize(
    ("src", "dst"),
    [(a, b) for a, b in zip(MHA_LAYOUTS, MHA_LAYOUTS[1:] + MHA_LAYOUTS[:1], strict=True)],
)
def test_pages_round_trip_between_layouts(server, cores, src, dst, transfer) -> None:
    """Worker A stores pages from its host pool; worker B, in another layout, loads them
    into other host pages: every row arrives byte for byte."""
    a_pool, b_pool = HostPool(src, seed=1), HostPool(dst, seed=2)
    a = make_core(server.address, a_pool, transfer=transfer)
    b = make_core(server.address, b_pool, transfer=transfer)
    cores += [a, b]
    # A prompt of its own per case (the server is shared by the module): hash() of
    # strings changes per process, and two cases once drew the same seed.
    keys = chain(prompt(1 + MHA_LAYOUTS.index(src) * len(TRANSFERS) + TRANSFERS.index(transfer), 5))
    a_pages, b_pages = [3, 0, 7, 1, 12], [9, 4, 2, 15, 6]

    assert b.exists(keys) == 0  # prefetch: nothing stored yet
    assert a.set(keys, host_indices(a_pages)) == [True] * 5  # backup of A's new pages
    assert b.exists(keys) == 5
    assert b.get(keys, host_indices(b_pages)) == [True] * 5
    for pa, pb in zip(a_pages, b_pages, strict=True):
        assert b_pool.page_bytes(pb * PAGE) == a_pool.page_bytes(pa * PAGE)
    assert type(b._io).__name__ == {"attach": "AttachedIO", "rpc": "RemoteIO"}[transfer]
    server.check_integrity()


@pytest.mark.parametrize("layout", MLA_LAYOUTS)
def test_mla_pages_round_trip(server, cores, layout) -> None:
    """An MLA host pool (one latent buffer, no V) stores and loads its pages."""
    a_pool = HostPool(layout, mla=True, dim=12, dtype=torch.bfloat16, seed=3)
    b_pool = HostPool("page_first", mla=True, dim=12, dtype=torch.bfloat16, seed=4)
    a, b = make_core(server.address, a_pool), make_core(server.address, b_pool, transfer="rpc")
    cores += [a, b]
    keys = chain(prompt(11 + len(layout), 3))
    assert a.set(keys, host_indices([5, 1, 2])) == [True] * 3
    assert b.get(keys, host_indices([0, 8, 4])) == [True] * 3
    for pa, pb in zip([5, 1, 2], [0, 8, 4], strict=True):
        assert b_pool.page_bytes(pb * PAGE) == a_pool.page_bytes(pa * PAGE)


def test_leading_run_and_continued_chain(server, client, cores) -> None:
    """A miss ends the run; a second backup batch continues the chain (prefix_keys),
    so the chain is one path: one lock covers it."""
    pool = HostPool("page_first", seed=5)
    core = make_core(server.address, pool)
    cores.append(core)
    keys = chain(prompt(21, 6))
    assert core.set(keys[:3], host_indices([0, 1, 2])) == [True] * 3
    assert core.exists(keys) == 3
    assert core.get(keys, host_indices([8, 9, 10, 11, 12, 13])) == [True] * 3 + [False] * 3
    extra = type("ExtraInfo", (), {"prefix_keys": keys[:3]})()
    assert core.set(keys[3:], host_indices([3, 4, 5]), prior_of(extra)) == [True] * 3
    assert core.exists(keys) == 6
    with client.session() as session:
        reply = client.get_pages("kv", keys, session=session)
        assert reply.found_pages == 6 and len(reply.lock_ids) == 1
        for lock_id in reply.lock_ids:
            client.unlock(lock_id, session=session)
    # Storing pages again sends nothing and holds them all.
    assert core.set(keys, host_indices([0, 1, 2, 3, 4, 5])) == [True] * 6
    assert core.counters["pages_stored"] == 6


def test_flat_pages_round_trip(server, cores) -> None:
    """SGLang's generic path (no interface_v1): flat pages in and out."""
    a_pool, b_pool = HostPool("page_head", seed=6), HostPool("layer_first", seed=7)
    a, b = make_core(server.address, a_pool), make_core(server.address, b_pool)
    cores += [a, b]
    keys = chain(prompt(31, 3))
    assert a.set_flat(keys, [a_pool.flat_page(p * PAGE) for p in (2, 6, 1)])
    targets = [b_pool.dummy_flat_page() for _ in keys]
    got = b.get_flat(keys + chain(prompt(99, 1)), [*targets, b_pool.dummy_flat_page()])
    assert got[3] is None and all(t is not None for t in got[:3])
    # Each flat page is in b's layout (layer_first): a one-page pool of it has A's rows.
    for flat, page in zip(got[:3], (2, 6, 1), strict=True):
        one = HostPool("layer_first", pages=1)
        one.kv_buffer.copy_(flat.view(one.kv_buffer.shape))
        assert one.page_bytes(0) == a_pool.page_bytes(page * PAGE)


def test_token_pages_are_found_by_hash(server, client, cores) -> None:
    """Pages a worker cached under their tokens are SGLang hits: the hash of each page is
    the chained page hash of docs/semantics.md (its test vectors, for page size 2, are
    checked in tests/cache/test_hashing.py; here the chain is recomputed for page size 4)."""
    tokens = prompt(41, 3)
    k = torch.randn(LAYERS, len(tokens), 2, 8).to(torch.float16)
    v = torch.randn(LAYERS, len(tokens), 2, 8).to(torch.float16)
    with client.session() as session:
        match = client.match("kv", tokens, session=session, allocate=True)
        client.write_kv("kv", match.allocated, k=k, v=v, session=session)
        client.insert("kv", tokens, match.allocated, session=session)
    pool = HostPool("page_first_direct", seed=8)
    core = make_core(server.address, pool)
    cores.append(core)
    keys = chain(tokens)
    assert core.exists(keys) == 3
    assert core.get(keys, host_indices([4, 5, 6])) == [True] * 3
    for t in range(len(tokens)):
        for layer in range(LAYERS):
            assert torch.equal(pool.row("k", layer, 4 * PAGE + t), k[layer, t])
            assert torch.equal(pool.row("v", layer, 4 * PAGE + t), v[layer, t])


def test_ranks_are_isolated(server, cores) -> None:
    """Two TP ranks hold different heads of the same page: each finds only its own."""
    from prefixcache.integrations.sglang import Ranks

    r0 = make_core(server.address, HostPool("page_first", seed=9), ranks=Ranks(0, 2))
    r1 = make_core(server.address, HostPool("page_first", seed=10), ranks=Ranks(1, 2))
    cores += [r0, r1]
    keys = chain(prompt(51, 2))
    assert r0.set(keys, host_indices([0, 1])) == [True, True]
    assert r1.exists(keys) == 0
    assert r0.exists(keys) == 2


def test_geometry_mismatch_is_refused(server) -> None:
    from prefixcache.integrations.sglang import GeometryError

    with pytest.raises(GeometryError, match="K rows"):
        make_core(server.address, HostPool("page_first", heads=4))
    with pytest.raises(GeometryError, match="page size"):
        make_core(server.address, HostPool("page_first", page_size=2))


@pytest.mark.gpu
def test_cuda_pool_round_trip(tmp_path) -> None:
    """A sidecar pool on the GPU, mapped through CUDA IPC: pages go host -> GPU pool ->
    another host pool, byte for byte. The server runs in a child process: CUDA IPC
    handles cannot be opened by the process that made them."""
    from harness import serve_process

    config = f"""
server: {{change_log_capacity: 4096}}
models:
  - name: kv
    page_size: {PAGE}
    pool: {{size: 256, layers: {LAYERS}, k_heads: 2, k_head_dim: 8, dtype: float16,
            device: "cuda:0"}}
"""
    with serve_process(tmp_path, config) as (_, address):
        a_pool, b_pool = HostPool("page_first", seed=31), HostPool("page_head", seed=32)
        a, b = make_core(address, a_pool), make_core(address, b_pool)
        try:
            keys = chain(prompt(71, 3))
            assert a.set(keys, host_indices([0, 1, 2])) == [True] * 3
            assert b.get(keys, host_indices([5, 6, 7])) == [True] * 3
            assert type(b._io).__name__ == "AttachedIO"
            for pa, pb in zip([0, 1, 2], [5, 6, 7], strict=True):
                assert b_pool.page_bytes(pb * PAGE) == a_pool.page_bytes(pa * PAGE)
        finally:
            a.close()
            b.close()
