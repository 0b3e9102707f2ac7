"""The disk tier in a real server (in process, real files under tmp_path): a prompt the
pool evicted is answered from disk, byte for byte, through every client path (Match,
Step, the Session stream, vLLM's connector cores, SGLang's backend core), counted as
``tier="disk"``; a page changed on disk is refused, counted and gone; admission by
hits; pages already on disk are not written again; a Reset keeps the disk tier."""

from __future__ import annotations

import re
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from harness import ServerThread, make_config, pb, stub_for, toks

from prefixcache.cache import hash_token_ids
from prefixcache.client import PrefixCacheClient
from prefixcache.client.step import Admit
from prefixcache.integrations.vllm.keys import RequestInfo
from prefixcache.integrations.vllm.layout import split_kv
from prefixcache.server.config import ModelConfig, PoolConfig
from prefixcache.server.config.disk import DiskConfig

sys.path.insert(0, str(Path(__file__).parents[3] / "integrations" / "sglang"))
from hicache_hosts import HostPool, host_indices, make_core
from integrations.vllm.vllm_support import (
    backend_for,
    make_caches,
    make_scheduler,
    make_worker,
    settle,
    token_rows,
)

MODEL = "m"
PAGE = 4
ROW = (2, 8)
POOL = 256
DEMOTED = r'prefixcache_disk_demoted_pages_total\{model="m"\}'


def _model(pool: int = POOL) -> ModelConfig:
    return ModelConfig(
        name=MODEL,
        page_size=PAGE,
        pool=PoolConfig(size=pool, layers=2, k_heads=ROW[0], k_head_dim=ROW[1]),
    )


class Sidecar:
    """A server with the disk tier on, and its /metrics."""

    def __init__(
        self, tmp: Path, disk: dict[str, Any] | None = None, pool: int = POOL, **server: Any
    ) -> None:
        (tmp / "disk").mkdir(exist_ok=True)
        cfg = DiskConfig(path=str(tmp / "disk"), bytes=8 << 20, timeout=5.0, **(disk or {}))
        self.thread = ServerThread(
            make_config(
                tmp,
                [_model(pool)],
                disk=cfg,
                shm_dir="",
                metrics_port=0,
                metrics_host="127.0.0.1",
                **server,
            )
        )
        self.address = self.thread.address

    def metrics(self) -> dict[str, float]:
        port = self.thread.server.metrics_port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def metric(self, pattern: str) -> float:
        return sum(v for k, v in self.metrics().items() if re.fullmatch(pattern, k))

    def wait(self, pattern: str, minimum: float, timeout: float = 20.0) -> float:
        deadline = time.monotonic() + timeout
        while (value := self.metric(pattern)) < minimum:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{pattern} stayed at {value} (< {minimum})")
            time.sleep(0.05)
        return value

    def evict_all(self) -> None:
        with PrefixCacheClient(self.address, timeout=10) as client:
            client.evict(MODEL, POOL)

    def stop(self) -> None:
        self.thread.check_integrity()
        self.thread.stop()


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[Sidecar]:
    car = Sidecar(tmp_path)
    yield car
    car.stop()


def _tokens(seed: int, n: int = 24) -> list[int]:
    return np.random.default_rng(seed).integers(1, 30000, n).tolist()


def _cache(car: Sidecar, tokens: list[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    kv = [torch.randn(len(tokens), *ROW, generator=gen).half() for _ in range(4)]
    with PrefixCacheClient(car.address, timeout=10) as client, client.session() as s:
        slots = client.alloc(MODEL, len(tokens), session=s).slots
        client.write_kv(MODEL, slots, kv[:2], kv[2:], session=s)
        client.insert(MODEL, tokens, slots, session=s)
    return kv


def _read(car: Sidecar, tokens: list[int]) -> tuple[int, list[torch.Tensor]]:
    with PrefixCacheClient(car.address, timeout=10) as client, client.session() as s:
        reply = client.match(MODEL, tokens, session=s, lock=True)
        if not reply.prefix_len:
            return 0, []
        data = client.read_kv(MODEL, reply.slots, session=s)
        return reply.prefix_len, [*data.k, *data.v]


def _same(got: list[torch.Tensor], want: list[torch.Tensor], n: int) -> bool:
    return len(got) == len(want) and all(
        g.view(torch.int16).equal(w[:n].view(torch.int16)) for g, w in zip(got, want, strict=True)
    )


def _demote(car: Sidecar, tokens: list[int], seed: int) -> list[torch.Tensor]:
    """Cache ``tokens``, evict everything, and wait until its pages are on disk."""
    before = car.metric(DEMOTED)
    kv = _cache(car, tokens, seed)
    car.evict_all()
    car.wait(DEMOTED, before + len(tokens) // PAGE)
    return kv


def test_an_evicted_prompt_is_answered_from_disk_byte_for_byte(sidecar: Sidecar) -> None:
    tokens = _tokens(1)
    kv = _cache(sidecar, tokens, seed=1)
    time.sleep(0.3)
    assert sidecar.metric(DEMOTED) == 0  # written back at eviction, not at insert
    sidecar.evict_all()
    sidecar.wait(DEMOTED, len(tokens) // PAGE)
    assert sidecar.metric(r'prefixcache_disk_pages\{model="m"\}') == len(tokens) // PAGE
    hit, got = _read(sidecar, tokens)
    assert hit == len(tokens) and _same(got, kv, hit)
    m = sidecar.metrics()
    assert m['prefixcache_tier_hit_tokens_total{model="m",tier="disk"}'] == len(tokens)
    assert m['prefixcache_disk_lookups_total{model="m",result="disk"}'] == 1
    assert m['prefixcache_disk_promoted_bytes_total{model="m"}'] > 0
    assert m['prefixcache_lookup_tokens_total{model="m",outcome="hit"}'] == len(tokens)
    assert sidecar.metric(r'prefixcache_integrity_failures_total\{.*source="disk".*\}') == 0
    # Held in the pool again: the next lookup is the pool's.
    assert _read(sidecar, tokens)[0] == len(tokens)
    assert sidecar.metrics()['prefixcache_tier_hit_tokens_total{model="m",tier="local"}'] == len(
        tokens
    )


def test_step_and_session_streams_see_disk_pages(sidecar: Sidecar) -> None:
    tokens = _tokens(2)
    kv = _demote(sidecar, tokens, seed=2)
    with PrefixCacheClient(sidecar.address, timeout=10) as client, client.session() as s:
        reply = client.step(MODEL, admits=[Admit([*tokens, 7], allocate=False)], session=s)
        admit = reply.admits[0]
        assert admit.prefix_len == len(tokens)
        got = client.read_kv(MODEL, admit.slots, session=s)
    assert _same([*got.k, *got.v], kv, len(tokens))
    other = _tokens(3)
    _demote(sidecar, other, seed=3)
    channel, stub = stub_for(sidecar.address)
    with channel:
        request = pb.SessionRequest(
            seq=1, match=pb.MatchRequest(model=MODEL, token_ids=toks(other))
        )
        replies = list(stub.Session(iter([request]), timeout=10))
    assert replies[0].match.prefix_len == len(other)


def test_a_lookup_takes_the_pool_then_the_disk(sidecar: Sidecar) -> None:
    """Only what follows the pool's hit is read from disk."""
    tokens = _tokens(4)
    _demote(sidecar, tokens, seed=4)
    assert _read(sidecar, tokens[:8])[0] == 8  # two pages back in the pool
    before = sidecar.metrics()
    hit, _ = _read(sidecar, tokens)
    after = sidecar.metrics()
    assert hit == len(tokens)
    disk = 'prefixcache_tier_hit_tokens_total{model="m",tier="disk"}'
    local = 'prefixcache_tier_hit_tokens_total{model="m",tier="local"}'
    assert after[disk] - before[disk] == len(tokens) - 8
    assert after[local] - before[local] == 8


def _engine_step(core: Any, workers: list[Any], finished: frozenset[str] = frozenset()) -> Any:
    meta = core.build_meta()
    done, failed = None, set()
    for worker in workers:
        worker.start_step(meta)
        sent = worker.finished_sends(set(finished))
        done = sent if done is None else done & sent
        failed |= worker.take_failed_saves()
    core.saves_failed(failed)
    core.sends_done(done or ())
    settle(core)
    return meta


def test_vllm_connector_loads_a_request_the_pool_evicted(sidecar: Sidecar) -> None:
    """vLLM's connector cores: a request saved, evicted to disk, then loaded by another
    engine's cores into other blocks, byte for byte."""
    cores = [
        make_scheduler(sidecar.address, model=MODEL, block=PAGE, transfer="remote")
        for _ in range(2)
    ]
    workers = [
        make_worker(sidecar.address, model=MODEL, block=PAGE, transfer="remote") for _ in range(2)
    ]
    a_blocks, b_blocks = [2, 5, 7, 9, 11], [1, 3, 4, 6, 8]
    prompt = _tokens(5, 18)
    try:
        caches = [make_caches("kv_first"), make_caches("kv_first")]
        for worker, cache in zip(workers, caches, strict=True):
            worker.register(cache, backend_for("kv_first"))
        assert cores[0].finished(RequestInfo("A", prompt, 18), a_blocks, 18)
        for _ in range(3):
            _engine_step(cores[0], workers[:1], frozenset({"A"}))
        sidecar.evict_all()
        sidecar.wait(DEMOTED, 4)
        req = RequestInfo("B", prompt, 18)
        assert cores[1].probe(req, 0) == (None, False)
        _engine_step(cores[1], workers[1:])
        assert cores[1].probe(req, 0) == (16, False)
        cores[1].allocated("B", b_blocks, 16)
        assert len(_engine_step(cores[1], workers[1:]).loads) == 1
        assert workers[1].take_load_errors() == set()
        views = [
            [split_kv(name, t, "kv_first", ROW[1]) for name, t in cache.items()] for cache in caches
        ]
        for va, vb in zip(*views, strict=True):
            assert torch.equal(token_rows(va, a_blocks, 16), token_rows(vb, b_blocks, 16))
        cores[1].finished(req, b_blocks, 17)
        _engine_step(cores[1], workers[1:], frozenset({"B"}))
    finally:
        for closable in (*cores, *workers):
            closable.close()


def _chain(tokens: list[int]) -> list[str]:
    keys: list[str] = []
    for i in range(0, len(tokens) - PAGE + 1, PAGE):
        keys.append(hash_token_ids(tokens[i : i + PAGE], keys[-1] if keys else None))
    return keys


def test_sglang_core_finds_and_loads_pages_on_disk(sidecar: Sidecar) -> None:
    """SGLang's HiCache backend core: pages it stored and the pool evicted are found
    (batch_exists) and loaded (batch_get_v1) from disk, byte for byte; token pages
    evicted to disk are found by hash."""
    put_pool, get_pool = HostPool("page_first", seed=21), HostPool("layer_first", seed=22)
    put_core = make_core(sidecar.address, put_pool, model=MODEL)
    get_core = make_core(sidecar.address, get_pool, model=MODEL)
    try:
        keys = _chain(_tokens(6, 12))
        assert put_core.set(keys, host_indices([3, 0, 7])) == [True] * 3
        sidecar.evict_all()
        sidecar.wait(DEMOTED, 3)
        assert get_core.exists(keys) == 3
        assert get_core.get(keys, host_indices([9, 4, 2])) == [True] * 3
        for pa, pb_ in zip([3, 0, 7], [9, 4, 2], strict=True):
            assert get_pool.page_bytes(pb_ * PAGE) == put_pool.page_bytes(pa * PAGE)
        tokens = _tokens(7)
        _demote(sidecar, tokens, seed=7)
        assert get_core.exists(_chain(tokens)) == len(tokens) // PAGE
    finally:
        put_core.close()
        get_core.close()


def test_a_page_changed_on_disk_is_refused_counted_and_dropped(tmp_path: Path) -> None:
    car = Sidecar(tmp_path)
    try:
        tokens = _tokens(8)
        kv = _demote(car, tokens, seed=8)
        engine_disk = car.thread.server.tier.tiers[0].models[MODEL].backend
        slot = engine_disk.index.slot_of(
            engine_disk.digest(
                car.thread.server.tier.tiers[0].models[MODEL].keys.keys(None, 1, _hashes(tokens))[3]
            )
        )
        pages = (
            tmp_path
            / "disk"
            / next(p.name for p in (tmp_path / "disk").iterdir() if p.is_dir())
            / "pages"
        )
        with open(pages, "r+b") as f:  # one byte of the fourth page
            f.seek(slot * engine_disk.slot_bytes + 5)
            byte = f.read(1)
            f.seek(slot * engine_disk.slot_bytes + 5)
            f.write(bytes([byte[0] ^ 0xFF]))
        hit, got = _read(car, tokens)
        assert hit == 3 * PAGE and _same(got, kv, hit)  # the pages before it
        failures = (
            r'prefixcache_integrity_failures_total\{reason="seal_mismatch",'
            r'source="disk"\}'
        )
        assert car.metric(failures) == 1
        keys = car.thread.server.tier.tiers[0].models[MODEL].keys
        assert engine_disk.exists(keys.keys(None, 1, _hashes(tokens))[3:4]) == [0]
    finally:
        car.stop()


def _hashes(tokens: list[int]) -> list[str]:
    from prefixcache.cache.hashing import hash_pages

    return hash_pages(np.asarray(tokens, "<u4").tobytes(), 4 * PAGE, None)


def test_min_hits_writes_only_pages_touched_twice(tmp_path: Path) -> None:
    car = Sidecar(tmp_path, {"min_hits": 1})
    try:
        once, twice = _tokens(9, 8), _tokens(10, 8)
        _cache(car, once, seed=9)
        _cache(car, twice, seed=10)
        assert _read(car, twice)[0] == 8  # hit once after it was cached
        car.evict_all()
        car.wait(DEMOTED, 2)
        time.sleep(0.3)
        assert car.metric(DEMOTED) == 2
        assert _read(car, once)[0] == 0
        assert _read(car, twice)[0] == 8
    finally:
        car.stop()


def test_pages_already_on_disk_are_not_written_again(sidecar: Sidecar) -> None:
    tokens = _tokens(11)
    _demote(sidecar, tokens, seed=11)
    assert _read(sidecar, tokens)[0] == len(tokens)  # back in the pool from disk
    sidecar.evict_all()
    time.sleep(0.3)
    assert sidecar.metric(DEMOTED) == len(tokens) // PAGE
    assert _read(sidecar, tokens)[0] == len(tokens)


def test_a_reset_keeps_the_disk_tier(sidecar: Sidecar) -> None:
    tokens = _tokens(12)
    kv = _demote(sidecar, tokens, seed=12)
    with PrefixCacheClient(sidecar.address, timeout=10) as client:
        client.reset(MODEL)
    hit, got = _read(sidecar, tokens)
    assert hit == len(tokens) and _same(got, kv, hit)


def test_with_the_tier_secret_disk_pages_carry_a_mac_and_a_new_secret_starts_empty(
    tmp_path: Path,
) -> None:
    """With ``server.tier.secret_file`` the disk tier seals with the keyed MAC (kind 2)
    and keys its object keys; a start under another secret finds none of the pages."""
    import os

    from prefixcache.server.config.tier import TierConfig
    from prefixcache.server.memory.page_seal import MAC

    secret = tmp_path / "secret"

    def start(key: bytes) -> Sidecar:
        secret.write_bytes(key)
        return Sidecar(
            tmp_path,
            tier=TierConfig(
                master="127.0.0.1:1",  # no master
                secret_file=str(secret),
            ),
        )

    car = start(os.urandom(32))
    tokens = _tokens(13)
    try:
        kv = _cache(car, tokens, seed=13)
        car.evict_all()
        car.wait(DEMOTED, len(tokens) // PAGE)
        store = car.thread.server.tier.tiers[0].models[MODEL].backend
        assert set(store.index.seals[store.index.used][:, 0].tolist()) == {MAC}
        hit, got = _read(car, tokens)
        assert hit == len(tokens) and _same(got, kv, hit)
    finally:
        car.stop()
    car = start(os.urandom(32))
    try:
        assert car.metric(r'prefixcache_disk_pages\{model="m"\}') == 0
        assert _read(car, tokens)[0] == 0
    finally:
        car.stop()
