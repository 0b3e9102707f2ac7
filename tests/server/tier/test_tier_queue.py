"""The put queue is bounded and its drops are counted: with the master frozen (SIGSTOP)
the first put hangs, the queue fills to its bound, and every later write is dropped as
``queue_full`` (pages counted) while inserts and lookups go on at local speed. The
queue depth is exported as ``prefixcache_tier_put_queue_depth``. Thawed, the queue
drains and every lock its jobs held is released."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import pytest
from tier_harness import frozen_master_node

from prefixcache.client import PrefixCacheClient
from prefixcache.server.tier.writer import BATCH_JOBS, MAX_JOBS

PAGE = 4
PROMPT = 16  # 4 pages: one put job per prompt
PROMPTS = MAX_JOBS + BATCH_JOBS + 20  # more than the queue and one batch in hand hold
# Large enough that writes in flight (one prompt each) stay under the pin cap, a quarter
# of the pool, so the queue's bound is what refuses them; 256 KiB of KV.
POOL = {"size": 8192, "layers": 1, "k_heads": 1, "k_head_dim": 8}
DEPTH = "prefixcache_tier_put_queue_depth"
DROPPED = r'prefixcache_tier_put_dropped_pages_total\{model="m",reason="%s"\}'


def _locks(client: PrefixCacheClient) -> int:
    (model,) = [m for m in client.stats("m").models if m.model == "m"]
    return int(model.locks)


@pytest.mark.slow
def test_a_full_put_queue_drops_and_counts_and_drains_once_the_store_answers(
    tmp_path: Path,
) -> None:
    model = {"name": "m", "page_size": PAGE, "pool": POOL}
    with (
        frozen_master_node(tmp_path, model) as (master, node),
        PrefixCacheClient(node.address, timeout=10) as client,
    ):
        # Every insert is answered while the master is frozen: none waits on the
        # store, since its write is only queued (a full queue drops it, below).
        for i in range(PROMPTS):
            tokens = (np.arange(PROMPT) + 100 * i + 1).tolist()
            with client.session() as s:
                slots = client.alloc("m", PROMPT, session=s).slots
                client.insert("m", tokens, slots, session=s)
        # The writes are queued after each call: wait for the last one's fate.
        node.wait(DROPPED % "queue_full", 1)
        # Every prompt's write (one job, 4 pages) is waiting, was answered (a hanging
        # put may give up) or was dropped whole: polled, as a scrape may fall between
        # the put thread's answer and the loop's callback.
        deadline = time.monotonic() + 10
        while True:
            depth = node.metric(DEPTH)
            answered = node.metric(r"prefixcache_tier_put_(failed_)?pages_total\{.*\}")
            dropped = node.metric(DROPPED % "queue_full")
            if depth + (answered + dropped) / (PROMPT // PAGE) == PROMPTS:
                break
            assert time.monotonic() < deadline, (depth, answered, dropped)
            time.sleep(0.1)
        assert MAX_JOBS <= depth <= MAX_JOBS + BATCH_JOBS, depth
        assert dropped >= (PROMPTS - MAX_JOBS - BATCH_JOBS) * (PROMPT // PAGE), dropped
        assert node.metric(r"prefixcache_tier_put_dropped_pages_total\{.*\}") == dropped
        assert _locks(client) >= MAX_JOBS  # each waiting write pins its node
        assert master.proc is not None
        master.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 60
        while node.metric(DEPTH) > 0:
            assert time.monotonic() < deadline, node.stderr[-3000:]
            time.sleep(0.2)
        deadline = time.monotonic() + 10
        while _locks(client):  # every write's pin released, stored or failed
            assert time.monotonic() < deadline, _locks(client)
            time.sleep(0.1)
