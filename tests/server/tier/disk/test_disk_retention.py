"""Retention on the disk tier, on a real file system: a full disk evicts unretained
pages before retained ones; a lapsed retention is an ordinary page; a read renews one
in force; one owner retains at most its bound; retentions survive a clean stop and a
crash; index and journal files of the format before retention are refused and made
anew; and through real ``prefixcache serve`` processes, a prompt retained in the pool
keeps its retention on disk, and a page promoted from disk while its retention is in
force is retained in the pool again (up to its deepest retained page, within its
tenant's share; none once lapsed)."""

from __future__ import annotations

import struct
import time
from pathlib import Path
from typing import Any

import torch
import xxhash
from disk_harness import (
    DEMOTED,
    MODEL,
    PAGE,
    POOL,
    READY,
    StoreRig,
    cache,
    disk_config,
    pages,
    read,
    same,
    start,
    tokens_of,
)
from tier_harness import Node

from prefixcache.client import PrefixCacheClient
from prefixcache.server.tier.backend import PageRetention
from prefixcache.server.tier.disk import journal
from prefixcache.server.tier.disk.journal import JOURNAL_HEAD_BYTES


def _keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}/{i}" for i in range(n)]


def _retain(seconds: float = 600.0, priority: int = 50, owner: str | None = None) -> PageRetention:
    return PageRetention(priority, seconds, time.time() + seconds, owner)


def _held(rig: StoreRig, keys: list[str]) -> list[int]:
    return [rig.store.exists([k])[0] for k in keys]


def test_a_full_disk_evicts_unretained_pages_before_retained_ones(tmp_path: Path) -> None:
    rig = StoreRig(tmp_path / "s", slots=8, policy="lru")
    rig.fill(pages(1, 12), seed=1)
    assert rig.put(_keys("kept", 4), pages(1, 4), _retain()) == [0] * 4  # the oldest
    time.sleep(0.01)
    assert rig.put(_keys("plain", 4), pages(5, 4)) == [0] * 4
    assert rig.put(_keys("new", 4), pages(9, 4)) == [0] * 4  # full: 4 go
    assert _held(rig, _keys("kept", 4)) == [1] * 4
    assert _held(rig, _keys("plain", 4)) == [0] * 4
    assert _held(rig, _keys("new", 4)) == [1] * 4
    # Only retained pages left to evict: they go too, the lowest priority first.
    rig.put(_keys("high", 4), pages(1, 4), _retain(priority=90))
    assert _held(rig, _keys("new", 4)) == [0] * 4
    rig.put(_keys("more", 2), pages(5, 2))
    assert sum(_held(rig, _keys("kept", 4))) == 2  # priority 50 before 90
    assert _held(rig, _keys("high", 4)) == [1] * 4


def test_a_lapsed_retention_is_an_ordinary_page(tmp_path: Path) -> None:
    rig = StoreRig(tmp_path / "s", slots=8, policy="lru")
    rig.fill(pages(1, 12), seed=2)
    rig.put(_keys("brief", 4), pages(1, 4), _retain(seconds=0.2))
    time.sleep(0.01)
    rig.put(_keys("plain", 4), pages(5, 4))
    time.sleep(0.3)  # past the retention, with no read to renew it
    assert rig.store.index.retained_slots(None) == 0
    rig.put(_keys("new", 4), pages(9, 4))
    assert _held(rig, _keys("brief", 4)) == [0] * 4  # least recently used, as any page
    assert _held(rig, _keys("plain", 4)) == [1] * 4


def test_a_read_renews_a_retention_in_force(tmp_path: Path) -> None:
    rig = StoreRig(tmp_path / "s", slots=8)
    rig.fill(pages(1, 4), seed=3)
    # The pool had 1 s of it left; each hit renews it for its 600 s.
    soon = PageRetention(50, 600.0, time.time() + 1.0, None)
    rig.put(_keys("a", 2), pages(1, 2), soon)
    index = rig.store.index
    slot = index.slot_of(rig.store.digest("a/0"))
    assert index.retain_until[slot] < time.time() + 2
    before = time.time()
    rig.get(["a/0"], pages(40, 1))
    assert index.retain_until[slot] >= before + 600
    other = index.slot_of(rig.store.digest("a/1"))
    assert index.retain_until[other] < time.time() + 2  # not read: not renewed
    # A lapsed one stays out: a read makes it no retention again.
    rig.put(["b/0"], pages(3, 1), PageRetention(50, 600.0, time.time() + 0.05, None))
    time.sleep(0.1)
    rig.get(["b/0"], pages(41, 1))
    late = index.slot_of(rig.store.digest("b/0"))
    assert index.retain_until[late] < time.time()


def test_a_page_evicted_again_takes_the_larger_retention(tmp_path: Path) -> None:
    rig = StoreRig(tmp_path / "s", slots=8)
    rig.fill(pages(1, 2), seed=4)
    rig.put(_keys("a", 2), pages(1, 2))  # written unretained
    slot = rig.store.index.slot_of(rig.store.digest("a/0"))
    assert rig.store.index.retain_priority[slot] == 0
    # The pool evicts it again, retained now: the disk holds it, and takes the retention.
    assert rig.store.holds(["a/0"], _retain(priority=70)) == [True]
    assert rig.store.index.retain_priority[slot] == 70
    rig.store.holds(["a/0"], _retain(priority=20))
    assert rig.store.index.retain_priority[slot] == 70


def test_an_owner_retains_at_most_its_bound(tmp_path: Path) -> None:
    rig = StoreRig(tmp_path / "s", slots=16, policy="lru", retain_limit=4)
    rig.fill(pages(1, 16), seed=5)
    index = rig.store.index
    rig.put(_keys("a", 6), pages(1, 6), _retain(owner="t1"))
    assert index.retained_slots("t1") == 4  # the first 4; the rest are ordinary
    rig.put(_keys("b", 4), pages(7, 4), _retain(owner="t2"))  # another tenant's own 4
    assert index.retained_slots("t2") == 4
    rig.put(_keys("c", 2), pages(11, 2), _retain(owner=None))
    assert index.retained_slots(None) == 2
    time.sleep(0.01)
    rig.put(_keys("d", 4), pages(13, 4))  # 16 held: full, the newest
    rig.put(_keys("e", 2), pages(1, 2))  # two must go: t1's two unretained ones
    assert _held(rig, ["a/4", "a/5"]) == [0, 0]
    assert _held(rig, _keys("a", 4)) == [1] * 4
    assert _held(rig, _keys("b", 4)) == [1] * 4


def test_an_owner_at_its_bound_gains_room_as_its_retentions_lapse(tmp_path: Path) -> None:
    rig = StoreRig(tmp_path / "s", slots=16, retain_limit=2)
    rig.fill(pages(1, 4), seed=6)
    index = rig.store.index
    rig.put(_keys("a", 2), pages(1, 2), _retain(seconds=0.2, owner="t"))
    rig.put(["b/0"], pages(3, 1), _retain(owner="t"))
    assert index.retained_slots("t") == 2
    assert index.retain_priority[index.slot_of(rig.store.digest("b/0"))] == 0
    time.sleep(0.3)
    rig.put(["c/0"], pages(4, 1), _retain(owner="t"))  # a/* lapsed: room again
    assert index.retain_priority[index.slot_of(rig.store.digest("c/0"))] == 50
    assert index.retained_slots("t") == 1


def test_retentions_survive_a_clean_stop_and_a_crash(tmp_path: Path) -> None:
    rig = StoreRig(tmp_path / "s", slots=8)
    rig.fill(pages(1, 4), seed=7)
    rig.put(_keys("a", 2), pages(1, 2), _retain(priority=60, owner="t"))
    rig.reopen()  # the index file carries it
    index = rig.store.index
    slot = index.slot_of(rig.store.digest("a/0"))
    assert index.retain_priority[slot] == 60 and index.retained_slots("t") == 2
    rig.put(_keys("b", 2), pages(3, 2), _retain(priority=40, owner="t"))  # journal only
    crashed = rig.store
    rig.store = rig.open()
    index = rig.store.index
    assert index.retained_slots("t") == 4
    assert index.retain_priority[index.slot_of(rig.store.digest("b/1"))] == 40
    crashed.file.close(1.0)


def test_a_start_keeps_an_owner_within_a_smaller_bound(tmp_path: Path) -> None:
    rig = StoreRig(tmp_path / "s", slots=8)
    rig.fill(pages(1, 4), seed=8)
    rig.put(_keys("a", 4), pages(1, 4), _retain(owner="t"))
    rig.store.close()
    rig.retain_limit = 2
    rig.store = rig.open()
    assert rig.store.pages_held == 4
    assert rig.store.index.retained_slots("t") == 2


def test_files_of_the_format_without_retention_are_made_anew(tmp_path: Path) -> None:
    rig = StoreRig(tmp_path / "s", slots=8)
    rig.fill(pages(1, 2), seed=9)
    rig.put(_keys("a", 2), pages(1, 2))
    rig.store.close()
    folder = tmp_path / "s"
    # The same files as version 1 wrote them would have: their headers say 1.
    for name, head in (("index", journal._INDEX_HEAD), ("journal", journal._JOURNAL_HEAD)):
        path = folder / name
        data = bytearray(path.read_bytes())
        fields = list(head.unpack_from(data, 0))
        fields[1] = 1
        raw = head.pack(*fields)
        data[: head.size] = raw
        struct.pack_into("<Q", data, head.size, xxhash.xxh3_64_intdigest(raw))
        path.write_bytes(bytes(data))
    rig.store = rig.open()
    assert rig.store.pages_held == 0
    assert (folder / "journal").stat().st_size == JOURNAL_HEAD_BYTES
    version = journal._JOURNAL_HEAD.unpack_from((folder / "journal").read_bytes(), 0)[1]
    assert version == journal.VERSION == 2
    rig.put(_keys("b", 2), pages(1, 2), _retain())
    rig.reopen()
    assert rig.store.exists(_keys("b", 2)) == [1, 1]
    assert rig.store.index.retained_slots(None) == 2


# Pages of 16 KiB, so that the smallest disk tier (1 MiB) holds few of them.
WIDE = (8, 64)


def _wide_config(path: Path) -> dict[str, Any]:
    config = disk_config(path, nbytes=1 << 20)
    config["models"][0]["pool"].update(k_heads=WIDE[0], k_head_dim=WIDE[1])
    return config


def _cache(node: Node, tokens: list[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    kv = [torch.randn(len(tokens), *WIDE, generator=gen).half() for _ in range(4)]
    with PrefixCacheClient(node.address, timeout=10) as client, client.session() as s:
        slots = client.alloc(MODEL, len(tokens), session=s).slots
        client.write_kv(MODEL, slots, kv[:2], kv[2:], session=s)
        client.insert(MODEL, tokens, slots, session=s)
    return kv


def _evict_all(node: Node, pages_more: int) -> None:
    before = node.metric(DEMOTED)
    with PrefixCacheClient(node.address, timeout=10) as client:
        client.evict(MODEL, POOL)
    node.wait(DEMOTED, before + pages_more)


def test_a_prompt_retained_in_the_pool_keeps_its_retention_on_disk(tmp_path: Path) -> None:
    path = tmp_path / "disk"
    path.mkdir()
    node = Node(tmp_path, "a", _wide_config(path))
    try:
        node.wait(READY, 1)
        slots = node.metric(r'prefixcache_disk_capacity_bytes\{model="m"\}') // (16 << 10)
        assert 16 < slots < 64
        kept, plain = tokens_of(1), tokens_of(2)
        kv = _cache(node, kept, seed=1)
        with PrefixCacheClient(node.address, timeout=10) as client:
            reply = client.retain(MODEL, kept, {"retain_seconds": 600, "priority": "high"})
            assert reply.retained is not None and reply.retained.outcome == "accepted"
        _cache(node, plain, seed=2)
        _evict_all(node, 12)  # both to disk, the retained one evicted from the pool last
        for seed in range(100, 100 + 2 * int(slots) // 6):  # twice what the disk holds
            _cache(node, tokens_of(seed), seed=seed)
            _evict_all(node, 6)
        assert node.metric(r'prefixcache_disk_evicted_pages_total\{model="m"\}') > 0
        hit, got = read(node, kept)
        assert hit == len(kept) and same(got, kv, hit)
        with PrefixCacheClient(node.address, timeout=10) as client:
            assert client.match(MODEL, plain).prefix_len == 0
    finally:
        assert node.stop() == 0


LOOKUPS = r'prefixcache_disk_lookups_total\{model="m",result="%s"\}'


def _promote_then_flood(tmp_path: Path, seconds: float, wait: float) -> tuple[bool, bool]:
    """A prompt retained for ``seconds`` goes to disk; after ``wait`` seconds a lookup
    promotes it, then a flood of unretained prompts (half again the pool) fills the
    pool. Whether the retained prompt and the flood's first prompt were each then
    answered from the pool (not from disk)."""
    path = tmp_path / "disk"
    path.mkdir()
    node = start(tmp_path, "a", path)
    try:
        kept = tokens_of(1)
        kv = cache(node, kept, seed=1)
        with PrefixCacheClient(node.address, timeout=10) as client:
            reply = client.retain(MODEL, kept, {"retain_seconds": seconds, "priority": "high"})
            assert reply.retained is not None and reply.retained.outcome == "accepted"
        _evict_all(node, len(kept) // PAGE)
        time.sleep(wait)
        promoted = node.metric(LOOKUPS % "disk")
        hit, got = read(node, kept)
        assert hit == len(kept) and same(got, kv, hit)
        assert node.metric(LOOKUPS % "disk") == promoted + 1  # read from disk
        flood = [tokens_of(seed) for seed in range(100, 100 + 3 * POOL // 2 // len(kept))]
        for seed, tokens in enumerate(flood, 100):
            cache(node, tokens, seed=seed)
        outcomes = []
        for tokens in (kept, flood[0]):
            local = node.metric(LOOKUPS % "local")
            with PrefixCacheClient(node.address, timeout=10) as client:
                reply = client.match(MODEL, tokens)
            outcomes.append(
                reply.prefix_len == len(tokens) and node.metric(LOOKUPS % "local") == local + 1
            )
        return outcomes[0], outcomes[1]
    finally:
        assert node.stop() == 0


def test_a_retained_page_promoted_from_disk_keeps_its_retention_in_the_pool(
    tmp_path: Path,
) -> None:
    kept, first = _promote_then_flood(tmp_path, seconds=600, wait=0)
    assert kept  # a hit from the pool: the flood evicted around it
    assert not first  # the flood's own first prompt went


def test_a_page_promoted_after_its_retention_lapsed_is_an_ordinary_page(
    tmp_path: Path,
) -> None:
    kept, first = _promote_then_flood(tmp_path, seconds=1, wait=1.5)
    assert not kept and not first


def test_a_promotion_retains_only_up_to_its_deepest_retained_page(tmp_path: Path) -> None:
    path = tmp_path / "disk"
    path.mkdir()
    node = start(tmp_path, "a", path)
    try:
        head, tail = tokens_of(1), tokens_of(2)
        cache(node, head, seed=1)
        with PrefixCacheClient(node.address, timeout=10) as client:
            reply = client.retain(MODEL, head, {"retain_seconds": 600, "priority": "high"})
            assert reply.retained is not None and reply.retained.outcome == "accepted"
        cache(node, head + tail, seed=2)  # its tail unretained
        _evict_all(node, len(head + tail) // PAGE)
        with PrefixCacheClient(node.address, timeout=10) as client:
            disk = node.metric(LOOKUPS % "disk")
            assert client.match(MODEL, head + tail).prefix_len == len(head + tail)
            assert node.metric(LOOKUPS % "disk") == disk + 1  # both parts in one read
            for seed in range(100, 100 + 3 * POOL // 2 // len(head)):
                cache(node, tokens_of(seed), seed=seed)
            local = node.metric(LOOKUPS % "local")
            assert client.match(MODEL, head).prefix_len == len(head)
            assert node.metric(LOOKUPS % "local") == local + 1  # the head stayed
            disk = node.metric(LOOKUPS % "disk")
            assert client.match(MODEL, head + tail).prefix_len == len(head + tail)
            assert node.metric(LOOKUPS % "disk") == disk + 1  # the tail went
    finally:
        assert node.stop() == 0


RETAINED = r'prefixcache_retained_tokens\{model="m"\}'


def test_a_promotion_retains_within_its_tenants_share_of_the_pool(tmp_path: Path) -> None:
    """A tenant's promoted retention counts against that tenant, and past its share of
    the pool it is clipped as that tenant's hint would be."""
    path = tmp_path / "disk"
    path.mkdir()
    config = disk_config(path)
    config["server"]["tenants"] = [{"name": "acme", "token": "tok-acme", "namespaces": ["acme/"]}]
    config["server"]["retention"] = {"tenant_share": 0.125}  # 32 of the pool's 256 tokens
    node = Node(tmp_path, "a", config)
    try:
        node.wait(READY, 1)
        first, second = tokens_of(1), tokens_of(2)
        with PrefixCacheClient(node.address, token="tok-acme", timeout=10) as acme:
            for tokens, ns in ((first, "acme/a"), (second, "acme/b")):
                with acme.session() as s:
                    slots = acme.alloc(MODEL, len(tokens), session=s).slots
                    acme.insert(MODEL, tokens, slots, session=s, extra_key=ns)
                if ns == "acme/b":
                    continue
                reply = acme.retain(MODEL, tokens, {"retain_seconds": 600}, extra_key=ns)
                assert (reply.retained.outcome, reply.retained.tokens) == ("accepted", 24)
                before = node.metric(DEMOTED)
                acme.evict(MODEL, POOL)
                node.wait(DEMOTED, before + len(tokens) // PAGE)
            assert node.metric(RETAINED) == 0
            reply = acme.retain(MODEL, second, {"retain_seconds": 600}, extra_key="acme/b")
            assert (reply.retained.outcome, reply.retained.tokens) == ("accepted", 24)
            disk = node.metric(LOOKUPS % "disk")
            assert acme.match(MODEL, first, extra_key="acme/a").prefix_len == len(first)
            assert node.metric(LOOKUPS % "disk") == disk + 1
        # The promotion took acme's last 8 tokens (2 pages), not all 24 of its prompt.
        assert node.metric(RETAINED) == 32
    finally:
        assert node.stop() == 0
