"""Property: for any sequence of inserts, evictions to disk, lookups that promote pages
back, Resets and restarts of a real server (in process, real files), every page a
lookup serves is the page inserted under that prefix, byte for byte.

Each prompt's KV is a function of its tokens: token ``j``'s rows are derived from a hash
of tokens ``0..j`` (what a model computes), so a page served for any prefix can be
checked against what it must be, whichever prompt cached it, whether it came from the
pool or the disk, and across restarts. A small pool (64 slots) makes allocations evict
too; a small disk tier (about 40 pages) makes the disk evict."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from harness import ServerThread, make_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.client import PrefixCacheClient
from prefixcache.server.config import ModelConfig, PoolConfig
from prefixcache.server.config.disk import DiskConfig

PAGE = 4
ROW = (1, 8)
POOL = 64
MODEL = "m"
EXAMPLES = 60 if os.environ.get("PREFIXCACHE_SLOW") else 10
# A few prompt families that share prefixes (so nodes split, and chains share pages).
FAMILY = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12]]


def _prompt(family: int, tail: int, length: int) -> list[int]:
    head = FAMILY[family]
    rest = [100 * (tail + 1) + i for i in range(length)]
    return [*head, *rest]


def _kv(tokens: list[int]) -> list[torch.Tensor]:
    """K layer 0 and V layer 0 of every token, from the hash of its prefix."""
    rows = []
    for j in range(len(tokens)):
        digest = hashlib.sha256(np.asarray(tokens[: j + 1], "<u4").tobytes()).digest()
        rows.append(np.frombuffer(digest, dtype="<u2")[: 2 * ROW[0] * ROW[1]])
    data = torch.from_numpy(np.stack(rows).astype(np.int16)).view(torch.float16)
    return [data[:, :8].reshape(-1, *ROW).clone(), data[:, 8:].reshape(-1, *ROW).clone()]


def _server(tmp: Path) -> ServerThread:
    model = ModelConfig(
        name=MODEL,
        page_size=PAGE,
        pool=PoolConfig(size=POOL, layers=1, k_heads=ROW[0], k_head_dim=ROW[1]),
    )
    disk = DiskConfig(path=str(tmp / "disk"), bytes=1 << 20, timeout=5.0)
    return ServerThread(make_config(tmp, [model], disk=disk, shm_dir=""))


PROMPT = st.tuples(st.integers(0, 1), st.integers(0, 2), st.sampled_from([4, 8, 16, 24]))
OP = st.sampled_from(["insert", "read", "read", "read", "evict", "evict", "reset", "restart"])


@pytest.mark.slow
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_every_served_page_is_the_page_of_its_prefix(tmp_path_factory, data) -> None:
    """Reads draw mostly from the prompts inserted so far (so that pages the pool
    evicted are asked for again)."""
    inserted: list[tuple[int, int, int]] = []
    ops = []
    for _ in range(data.draw(st.integers(4, 24), label="steps")):
        name = data.draw(OP, label="op")
        if name == "insert" or (name == "read" and not inserted):
            ops.append(("insert", data.draw(PROMPT, label="prompt")))
            inserted.append(ops[-1][1])
        elif name == "read":
            pick = st.sampled_from(inserted) if data.draw(st.integers(0, 3)) else PROMPT
            ops.append(("read", data.draw(pick, label="prompt")))
        elif name == "evict":
            ops.append(("evict", data.draw(st.sampled_from([8, 32, POOL]), label="tokens")))
        else:
            ops.append((name,))
    tmp = tmp_path_factory.mktemp("disk-prop")
    (tmp / "disk").mkdir()
    server = _server(tmp)
    served = 0
    try:
        for op in ops:
            if op[0] in ("insert", "read"):
                tokens = _prompt(*op[1])
                with PrefixCacheClient(server.address, timeout=10) as client, client.session() as s:
                    if op[0] == "insert":
                        kv = _kv(tokens)
                        reply = client.match(MODEL, tokens, session=s, lock=True, allocate=True)
                        rest = reply.allocated
                        if len(rest):
                            n = reply.prefix_len
                            client.write_kv(MODEL, rest, [kv[0][n:]], [kv[1][n:]], session=s)
                        slots = np.concatenate(
                            [
                                np.asarray(reply.slots, dtype=np.int64),
                                np.asarray(rest, dtype=np.int64),
                            ]
                        )
                        client.insert(
                            MODEL, tokens, slots, session=s, release_lock_id=reply.lock_id
                        )
                    else:
                        reply = client.match(MODEL, tokens, session=s, lock=True)
                        if reply.prefix_len:
                            got = client.read_kv(MODEL, reply.slots, session=s)
                            want = _kv(tokens[: reply.prefix_len])
                            for g, w in zip([*got.k, *got.v], want, strict=True):
                                assert g.view(torch.int16).equal(w.view(torch.int16)), op
                            served += reply.prefix_len
            elif op[0] == "evict":
                with PrefixCacheClient(server.address, timeout=10) as client:
                    client.evict(MODEL, op[1])
            elif op[0] == "reset":
                with PrefixCacheClient(server.address, timeout=10) as client:
                    client.reset(MODEL)
            else:
                server.check_integrity()
                server.stop()
                server = _server(tmp)
            server.check_integrity()
    finally:
        server.stop()
