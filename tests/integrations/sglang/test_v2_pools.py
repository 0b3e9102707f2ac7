"""The v2 calls with Mamba, SWA and indexer pools beside the KV pool, against a real server.

SGLang's hybrid caches hand ``batch_set_v2`` the KV pages of a prefix plus, per extra
pool, the pool pages under the page keys they belong to: a Mamba state under the
prefix's last page, the SWA window's KV under its last pages (``trailing_pages``), an
indexer page under every page (``all_pages``). ``batch_exists_v2`` then answers the
longest prefix every pool can serve, and ``batch_get_v2`` loads each pool's pages into
its host pool. Every page is compared byte for byte (random bytes, NaN patterns
included), and the server's integrity checks and lock/slot counts run after each step.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hicache_hosts import PAGE, HostPool, StatePool, host_indices, make_core
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.cache import hash_token_ids
from prefixcache.integrations.sglang import AuxPools, aux_pools
from prefixcache.integrations.sglang.v2 import exists_v2, restorable, transfer_v2


def chain(seed: int, pages: int) -> list[str]:
    """SGLang's page keys of a prompt of ``pages`` pages."""
    keys: list[str] = []
    for i in range(pages):
        keys.append(
            hash_token_ids(
                [(seed * 7919 + i * PAGE + j) % 50000 for j in range(PAGE)],
                keys[-1] if keys else None,
            )
        )
    return keys


def mamba_pool(seed: int, shape: tuple[int, ...] = (5, 61)) -> StatePool:
    # 1220 bytes a state: three of the KV pool's 512-byte flat pages, the last padded.
    return StatePool(8, shape, torch.float32, seed=seed)


def swa_pool(seed: int) -> StatePool:
    return StatePool(8, (1, 2, 8), torch.bfloat16, page_size=PAGE, seed=seed)


def worker(
    server, cores, seed: int, transfer: str = "auto", **pools: StatePool
) -> tuple[HostPool, AuxPools]:
    kv = HostPool("page_first", seed=seed)
    core = make_core(server.address, kv, transfer=transfer)
    cores.append(core)
    aux = AuxPools(core)
    for name, pool in pools.items():
        aux.register(name, pool)
    return kv, aux


def t(
    name: str,
    keys: list[str],
    pages: list[int] | None = None,
    page_size: int = 1,
    policy: str = "all_pages",
) -> SimpleNamespace:
    """A ``PoolTransfer`` (the fields the v2 calls read)."""
    indices = None if pages is None else host_indices(pages, page_size)
    return SimpleNamespace(name=name, keys=keys, host_indices=indices, hit_policy=policy)


def no_leak(server, client) -> None:
    server.check_integrity()
    stats = client.stats("kv").models[0]
    assert (stats.session_slots, stats.locks) == (0, 0)


@pytest.mark.parametrize("transfer", ["attach", "rpc"])
def test_mamba_and_swa_round_trip(server, client, cores, transfer) -> None:
    """Worker A stores a prefix with its Mamba state and SWA window; worker B finds the
    whole prefix usable and loads all three pools byte for byte into other host pages."""
    a_kv, a = worker(server, cores, 1, transfer, mamba=mamba_pool(1), swa=swa_pool(1))
    b_kv, b = worker(server, cores, 2, transfer, mamba=mamba_pool(2), swa=swa_pool(2))
    keys = chain(40 + len(transfer), 5)
    window = keys[-2:]
    wanted = [
        t("mamba", keys[-1:], policy="trailing_pages"),
        t("swa", window, policy="trailing_pages"),
    ]
    assert exists_v2(b.core, keys, wanted, b) == (0, {}, [])

    got = transfer_v2(
        a.core,
        [
            t("kv", keys, [0, 1, 2, 3, 4], PAGE),
            t("mamba", keys[-1:], [6]),
            t("swa", window, [3, 5], PAGE),
        ],
        None,
        load=False,
        pools=a,
    )
    assert got == {"kv": [True] * 5, "mamba": [True], "swa": [True, True]}
    # 5 KV pages, the state in 3 parts, 2 SWA pages in one part each.
    assert a.core.counters["pages_stored"] == 5 + 3 + 2
    no_leak(server, client)
    assert exists_v2(b.core, keys, wanted, b) == (5, {"kv": 5, "mamba": 5, "swa": 5}, [5])
    no_leak(server, client)

    got = transfer_v2(
        b.core,
        [
            t("kv", keys, [7, 6, 5, 4, 3], PAGE),
            t("mamba", keys[-1:], [2]),
            t("swa", window, [0, 7], PAGE),
        ],
        None,
        load=True,
        pools=b,
    )
    assert got == {"kv": [True] * 5, "mamba": [True], "swa": [True, True]}
    for pa, pb in zip([0, 1, 2, 3, 4], [7, 6, 5, 4, 3], strict=True):
        assert b_kv.page_bytes(pb * PAGE) == a_kv.page_bytes(pa * PAGE)
    assert b.pools["mamba"].host.page_bytes(2) == a.pools["mamba"].host.page_bytes(6)
    for pa, pb in ((3, 0), (5, 7)):
        assert b.pools["swa"].host.page_bytes(pb * PAGE) == a.pools["swa"].host.page_bytes(
            pa * PAGE
        )
    no_leak(server, client)
    # Stored again (a second backup): held already, nothing new taken.
    again = transfer_v2(a.core, [t("mamba", keys[-1:], [6])], None, load=False, pools=a)
    assert again == {"mamba": [True]}
    no_leak(server, client)


def test_usable_prefix_needs_the_trailing_state(server, client, cores) -> None:
    """The KV pages alone are no usable prefix: only prefix lengths at which every named
    pool can restore count (SGLang's hit policies), and a trailing pool leaves holes, so
    the answer is the longest length all pools share, not the least of their longest."""
    _, a = worker(
        server,
        cores,
        3,
        mamba=mamba_pool(3),
        swa=swa_pool(3),
        indexer=StatePool(8, (4,), torch.float16, page_size=PAGE, seed=3),
    )
    keys = chain(50, 6)
    ops = [
        t("kv", keys, list(range(6)), PAGE),
        t("mamba", [keys[2], keys[5]], [0, 1]),
        t("swa", keys[1:5], [0, 1, 2, 3], PAGE),
        t("indexer", keys[:4], [0, 1, 2, 3], PAGE),
    ]
    assert all(all(r) for r in transfer_v2(a.core, ops, None, load=False, pools=a).values())
    no_leak(server, client)

    def usable(*transfers: SimpleNamespace) -> tuple[int, dict[str, int], list[int]]:
        return exists_v2(a.core, keys, list(transfers), a)

    mamba = t("mamba", keys[-1:], policy="trailing_pages")
    swa = t("swa", keys[-2:], policy="trailing_pages")
    assert usable() == (6, {"kv": 6}, [1, 2, 3, 4, 5, 6])
    assert usable(mamba) == (6, {"kv": 6, "mamba": 6}, [3, 6])
    assert usable(swa) == (5, {"kv": 6, "swa": 5}, [3, 4, 5])
    assert usable(t("swa", keys[-5:], policy="trailing_pages")) == (0, {"kv": 6}, [])
    assert usable(t("indexer", keys)) == (4, {"kv": 6, "indexer": 4}, [1, 2, 3, 4])
    # The pools' longest prefixes are 5, 4 and 6; only 3 is restorable in all three.
    assert usable(swa, t("indexer", keys), mamba) == (
        3,
        {"kv": 6, "swa": 5, "indexer": 4, "mamba": 6},
        [3],
    )
    # A pool SGLang never registered is never stored: no usable prefix.
    assert usable(t("draft", keys)) == (0, {"kv": 6}, [])
    assert transfer_v2(a.core, [t("draft", keys[:1], [0])], None, load=True, pools=a) == {
        "draft": [False]
    }
    # block_groups pools never gate the prefix (that policy's rule) and are not stored.
    assert usable(t("c4", keys, policy="block_groups")) == (6, {"kv": 6}, [1, 2, 3, 4, 5, 6])
    no_leak(server, client)


def test_pools_without_bytes_are_not_taken(server, cores) -> None:
    """A pool with empty pages (SGLang's logical anchors) or none to give is skipped at
    registration, never failing SGLang's start: it answers missing."""

    class Empty:
        def get_dummy_flat_data_page(self) -> torch.Tensor:
            return torch.empty(0, dtype=torch.uint8)

    class Broken:
        def get_dummy_flat_data_page(self) -> torch.Tensor:
            raise RuntimeError("no pages here")

    _, a = worker(server, cores, 9)
    a.register("kv", Empty())  # the KV pool is the core's
    a.register("logical", Empty())
    a.register("broken", Broken())
    assert a.pools == {}
    keys = chain(90, 2)
    assert a.present("logical", keys) == [False, False]


def test_states_of_another_shape_are_misses(server, client, cores) -> None:
    """A worker whose Mamba states have another size never reads this one's (the part
    hashes name the size), and a get of a state not held loads nothing."""
    _, a = worker(server, cores, 4, mamba=mamba_pool(4))
    _, b = worker(server, cores, 5, mamba=mamba_pool(5, shape=(5, 60)))
    keys = chain(60, 2)
    ops = [t("kv", keys, [0, 1], PAGE), t("mamba", keys[-1:], [1])]
    assert transfer_v2(a.core, ops, None, load=False, pools=a)["mamba"] == [True]
    wanted = [t("mamba", keys[-1:], policy="trailing_pages")]
    assert exists_v2(b.core, keys, wanted, b) == (0, {"kv": 2}, [])
    before = b.pools["mamba"].host.page_bytes(3)
    assert transfer_v2(b.core, [t("mamba", keys[-1:], [3])], None, load=True, pools=b) == {
        "mamba": [False]
    }
    assert b.pools["mamba"].host.page_bytes(3) == before
    no_leak(server, client)


def test_refused_state_store_leaks_nothing(server, client, cores) -> None:
    """A state of more parts than one request may carry: the store answers False and
    holds nothing after; bad host indices are refused before any call."""
    _, a = worker(server, cores, 6, mamba=StatePool(2, (40000,), torch.float16, seed=6))
    keys = chain(70, 1)
    assert a.store("mamba", keys, torch.tensor([0])) == [False]
    no_leak(server, client)
    assert a.store("mamba", keys, torch.tensor([0, 1])) == [False]  # 2 positions, 1 key
    assert a.load("mamba", keys, None) == [False]
    assert a.present("mamba", keys) == [False]
    no_leak(server, client)


def test_pages_in_several_calls_chain(server, client, cores, monkeypatch) -> None:
    """Pages beyond one call's parts go in several calls, each continuing the chain of
    the one before; exists and get read them back across the calls."""
    monkeypatch.setattr(aux_pools, "BATCH_PARTS", 4)
    _, a = worker(server, cores, 7, mamba=mamba_pool(7), swa=swa_pool(7))
    _, b = worker(server, cores, 8, mamba=mamba_pool(8), swa=swa_pool(8))
    keys = chain(80, 6)
    ops = [
        t("kv", keys, list(range(6)), PAGE),
        t("mamba", keys[:3], [0, 1, 2]),
        t("swa", keys, list(range(6)), PAGE),
    ]
    assert all(all(r) for r in transfer_v2(a.core, ops, None, load=False, pools=a).values())
    no_leak(server, client)
    assert b.present("mamba", keys) == [True] * 3 + [False] * 3
    assert b.present("swa", keys) == [True] * 6
    got = transfer_v2(
        b.core,
        [t("mamba", keys[:3], [5, 4, 3]), t("swa", keys, [7, 6, 5, 4, 3, 2], PAGE)],
        None,
        load=True,
        pools=b,
    )
    assert got == {"mamba": [True] * 3, "swa": [True] * 6}
    for pa, pb in zip(range(3), [5, 4, 3], strict=True):
        assert b.pools["mamba"].host.page_bytes(pb) == a.pools["mamba"].host.page_bytes(pa)
    for pa, pb in zip(range(6), [7, 6, 5, 4, 3, 2], strict=True):
        assert b.pools["swa"].host.page_bytes(pb * PAGE) == a.pools["swa"].host.page_bytes(
            pa * PAGE
        )
    no_leak(server, client)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), max_size=12), st.integers(1, 14))
def test_trailing_restorable_matches_sglang_rule(held: list[bool], trailing: int) -> None:
    """The stop points are SGLang's (its Mooncake backend's scan): a prefix length
    counts when the window of its last ``trailing`` pages is all held."""
    rule = [p for p in range(1, len(held) + 1) if all(held[max(0, p - trailing) : p])]
    assert restorable(held, "trailing_pages", trailing) == rule
    lead = held.index(False) if False in held else len(held)
    assert restorable(held, "all_pages", trailing) == list(range(1, lead + 1))
