"""A Reset while a tier fetch is still writing: the fetch's slots are handed to no one
until its thread has returned.

A fetch's store call cannot be cancelled: past ``tier.timeout`` the lookup answers a
miss, but the thread goes on and writes the pages into the slots it was given whenever
the transfer ends. Node A holds the pages in its segment and is frozen (SIGSTOP), so
node B's transfer from it hangs; B's lookup times out, B is Reset, and B's whole free
pool is allocated and written with other KV. When A thaws, the late transfer must land
in slots nobody holds (quarantined across the Reset), not in that other KV.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from tier_harness import Master, Node, needs_mooncake, tier_config

from prefixcache.client import PrefixCacheClient

PAGE = 4
POOL = 256  # slots of the harness's model "m"
PROMPT = 96  # 24 pages: under the fetch's cap (half the 256-slot pool)
FROM_A, FROM_B = 7.0, -3.0  # the KV each node writes


def _write(client: PrefixCacheClient, session: object, slots: np.ndarray, value: float) -> None:
    """Fill ``slots``' K and V rows, every layer, with ``value``."""
    rows = client.read_kv("m", slots[:1], session=session)
    k = [torch.full((len(slots), *t.shape[1:]), value, dtype=t.dtype) for t in rows.k]
    v = [torch.full((len(slots), *t.shape[1:]), value, dtype=t.dtype) for t in rows.v]
    client.write_kv("m", slots, k, v, session=session)


def _model(client: PrefixCacheClient) -> object:
    return next(m for m in client.stats("m").models if m.model == "m")


@pytest.mark.slow
@pytest.mark.parametrize("when", ["after_the_timeout", "before_the_timeout"])
def test_a_fetch_still_writing_at_a_reset_writes_into_no_one_elses_slots(
    tmp_path: Path, when: str
) -> None:
    needs_mooncake()
    master = Master(tmp_path)
    master.start()
    a = Node(tmp_path, "a", tier_config(master.address, timeout=5.0))
    # after_the_timeout: the lookup gave up (0.5 s) and its thread writes on; before:
    # the lookup itself still waits (5 s) when the Reset comes.
    b = Node(
        tmp_path,
        "b",
        tier_config(master.address, timeout=0.5 if when == "after_the_timeout" else 5.0),
    )
    prompt = (np.arange(PROMPT) + 1000).tolist()
    try:
        a.wait(r"prefixcache_tier_connected", 1)
        b.wait(r"prefixcache_tier_connected", 1)
        with PrefixCacheClient(a.address, timeout=10) as ca, ca.session() as s:
            slots = np.asarray(ca.alloc("m", PROMPT, session=s).slots)
            _write(ca, s, slots, FROM_A)
            ca.insert("m", prompt, slots, session=s)
        a.wait(r'prefixcache_tier_put_pages_total\{model="m"\}', PROMPT // PAGE)
        a.proc.send_signal(signal.SIGSTOP)  # B's transfer from A's segment now hangs
        with PrefixCacheClient(b.address, timeout=10) as cb, ThreadPoolExecutor(1) as pool:
            lookup = pool.submit(cb.match, "m", prompt)
            if when == "after_the_timeout":
                assert lookup.result(30).prefix_len == 0  # timed out: a miss
                assert b.metric(r'prefixcache_tier_errors_total\{.*code="TIMEOUT".*\}') >= 1
            # The fetch holds its slots (the transfer is under way) ...
            deadline = time.monotonic() + 30
            while _model(cb).free_slots == POOL and time.monotonic() < deadline:
                time.sleep(0.02)
            assert _model(cb).free_slots < POOL
            cb.reset("m")  # ... when the Reset comes
            # Every slot the pool hands out now, written with B's own KV.
            with cb.session() as s:
                free = _model(cb).free_slots
                mine = np.asarray(cb.alloc("m", free, session=s).slots)
                _write(cb, s, mine, FROM_B)
                a.proc.send_signal(signal.SIGCONT)  # the late transfer lands now
                assert lookup.result(10).prefix_len == 0  # void: the Reset came between
                # Once the fetch's thread has returned its slots come free again.
                deadline = time.monotonic() + 20
                while _model(cb).free_slots + free < POOL and time.monotonic() < deadline:
                    time.sleep(0.1)
                time.sleep(0.5)  # a transfer into B's slots (the old bug) lands meanwhile
                rows = cb.read_kv("m", mine, session=s)
                wrong = sum(int((t.float() != FROM_B).sum()) for t in [*rows.k, *rows.v])
                assert wrong == 0, f"{wrong} values of B's KV overwritten by the fetch"
                stats = _model(cb)
                assert stats.free_slots + free == POOL, stats  # nothing else held
                assert stats.session_slots == free
                assert stats.evictable_tokens + stats.protected_tokens == 0
                # A call that changes the pool runs the integrity check (invariant mode).
                cb.free("m", mine[:PAGE], session=s)
            # And the pages are fetched whole, A's KV, once asked again (past the
            # breaker's cooldown).
            deadline = time.monotonic() + 10
            while cb.match("m", prompt).prefix_len < PROMPT and time.monotonic() < deadline:
                time.sleep(0.5)
            with cb.session() as s:
                hit = cb.match("m", prompt, session=s, lock=True)
                assert hit.prefix_len == PROMPT
                rows = cb.read_kv("m", np.asarray(hit.slots), session=s)
                assert all(bool((t.float() == FROM_A).all()) for t in [*rows.k, *rows.v])
    finally:
        if a.proc.poll() is None:
            a.proc.send_signal(signal.SIGCONT)
        codes = a.stop(), b.stop()
        master.stop()
    assert codes == (0, 0), (a.stderr[-2000:], b.stderr[-2000:])
