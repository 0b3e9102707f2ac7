"""The sidecar down, restarting or refusing: SGLang sees misses and failed sets (it then
recomputes), never an exception, and the backend recovers on its own."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from harness import ServerThread, make_config, pb, running, stub_for
from hicache_hosts import MODELS, PAGE, HostPool, host_indices, make_core

from prefixcache.cache import hash_token_ids


def keys_for(seed: int, pages: int) -> list[str]:
    keys: list[str] = []
    prior = None
    for p in range(pages):
        prior = hash_token_ids([seed, p, 0, 1][:PAGE], prior)
        keys.append(prior)
    return keys


def test_sidecar_down_answers_misses(tmp_path: Path, cores) -> None:
    pool = HostPool("page_first")
    core = make_core(f"unix:{tmp_path / 'nobody.sock'}", pool, retry_after=60)
    cores.append(core)
    keys = keys_for(1, 3)
    before = pool.kv_buffer.clone()
    assert core.exists(keys) == 0
    assert core.get(keys, host_indices([0, 1, 2])) == [False] * 3
    assert core.set(keys, host_indices([0, 1, 2])) == [False] * 3
    assert not core.set_flat(keys, [pool.flat_page(0)] * 3)
    assert torch.equal(pool.kv_buffer, before)  # nothing written into the host pool
    # One failed call; the rest answered at once without calling (retry_after).
    assert core.counters["failures"] == 1 and core.counters["skipped"] == 3


def test_sidecar_restart_is_survived(tmp_path: Path, cores) -> None:
    """Pages stored before a restart are gone after it; the backend reopens its session,
    maps the new pool and stores and loads again, byte for byte."""
    config = make_config(tmp_path, MODELS, session_ttl_min=0.2)
    first = ServerThread(config)
    a_pool, b_pool = HostPool("page_first", seed=1), HostPool("page_head", seed=2)
    core = make_core(first.address, a_pool, retry_after=0)
    reader = make_core(first.address, b_pool, retry_after=0, transfer="rpc")
    cores += [core, reader]
    keys = keys_for(2, 4)
    try:
        assert core.set(keys, host_indices([0, 1, 2, 3])) == [True] * 4
    finally:
        first.stop()
    assert core.exists(keys) == 0  # down: a miss
    assert core.set(keys, host_indices([0, 1, 2, 3])) == [False] * 4
    second = ServerThread(config)
    try:
        # The first calls after the restart may meet the old session or mapping; within
        # a few calls the backend works again (each failure answers a miss).
        deadline = time.monotonic() + 10
        while core.set(keys, host_indices([0, 1, 2, 3])) != [True] * 4:
            assert time.monotonic() < deadline, "the backend did not recover"
        assert reader.exists(keys) == 4
        while reader.get(keys, host_indices([4, 5, 6, 7])) != [True] * 4:
            assert time.monotonic() < deadline, "the reader did not recover"
        for pa, pb in zip([0, 1, 2, 3], [4, 5, 6, 7], strict=True):
            assert b_pool.page_bytes(pb * PAGE) == a_pool.page_bytes(pa * PAGE)
        assert core._io.info.server_epoch == second.service.epoch
        second.check_integrity()
    finally:
        second.stop()


def test_refused_store_leaks_nothing(server, client, cores) -> None:
    """More pages than the pool holds: the set fails as a whole, and the slots it got
    before failing go back (the session holds none after)."""
    pool = HostPool("layer_first", pages=80)
    core = make_core(server.address, pool)
    cores.append(core)
    keys = keys_for(3, 80)
    assert core.set(keys, host_indices(list(range(80)))) == [False] * 80
    assert core.exists(keys) == 0
    stats = client.stats("kv").models[0]
    assert stats.session_slots == 0 and stats.locks == 0
    assert core.set(keys[:2], host_indices([0, 1])) == [True, True]  # still usable


def test_foreign_keys_are_misses(server, cores) -> None:
    """Keys that are not SHA-256 page hashes (another hash mode) are never found, and a
    store of them fails without touching the sidecar."""
    core = make_core(server.address, HostPool("page_first"))
    cores.append(core)
    good = keys_for(4, 2)
    assert core.set(good, host_indices([0, 1])) == [True, True]
    assert core.exists([*good, "abc", good[0]]) == 2
    assert core.set(["xyz", *good], host_indices([0, 1, 2])) == [False] * 3


def test_a_failed_load_reports_its_run_as_load_failed(tmp_path: Path, cores) -> None:
    """A copy into the host pool that fails answers a miss and releases GetPages' lock
    telling the sidecar ``load_failed``, counted once, for the run the lookup hit: the
    3 pages asked for (SGLang's own cache holds the first 2), not the 5-page prefix
    the lock protects. The failure is one SGLang meets: the sidecar caps one read at
    ``server.max_read_bytes`` (1024 here), and the batch it streams by ReadKV is more
    (3 pages of 512 bytes); a batch under the cap loads, and its lock goes plainly."""
    with running(tmp_path, MODELS, max_read_bytes=1024) as srv:
        channel, stub = stub_for(srv.address)
        src = HostPool("page_first", seed=11)
        writer = make_core(srv.address, src)
        pool = HostPool("page_head", seed=12)
        reader = make_core(srv.address, pool, transfer="rpc")
        cores += [writer, reader]
        keys = keys_for(5, 5)

        def counts() -> dict[str, int]:
            return dict(stub.Stats(pb.StatsRequest(model="kv")).models[0].lookup_tokens_total)

        with channel:
            assert writer.set(keys, host_indices([0, 1, 2, 3, 4])) == [True] * 5
            assert reader.exists(keys[2:]) == 3  # hit 12
            before = pool.kv_buffer.clone()
            assert reader.get(keys[2:], host_indices([8, 9, 10])) == [False] * 3
            assert reader.counters["failures"] == 1
            assert counts()["load_failed"] == 3 * PAGE
            assert stub.Stats(pb.StatsRequest(model="kv")).models[0].locks == 0

            assert reader.exists(keys[3:]) == 2
            assert reader.get(keys[3:], host_indices([8, 9])) == [True] * 2
            assert counts()["load_failed"] == 3 * PAGE  # a load that worked: no outcome
            assert pool.page_bytes(9 * PAGE) == src.page_bytes(4 * PAGE)
            assert torch.equal(pool.kv_buffer[:, 10:], before[:, 10:])
            assert stub.Stats(pb.StatsRequest(model="kv")).models[0].locks == 0
        srv.check_integrity()
