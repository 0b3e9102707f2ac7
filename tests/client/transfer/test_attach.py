"""Pool attach across two processes: `prefixcache serve` in a child process, this test
process maps its pool, and each side sees the other's writes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from harness import running, serve_process

from prefixcache.client import FailedPrecondition, PrefixCacheClient
from prefixcache.server.memory.shared_pool import SharedPools, remove_stale

CONFIG = """
models:
  - name: m
    pool: {size: 128, layers: 2, k_heads: 2, k_head_dim: 8}
  - name: h
    kind: mamba
    page_size: 2
    pool: {size: 64, k_heads: 1, k_head_dim: 4}
    mamba: {state_slots: 4, working_slots: 2, layers: 2, conv_state_shape: [3, 2],
            temporal_state_shape: [2, 2, 2]}
  - name: s
    kind: slot
    max_seq_len: 8
    pool: {size: 4, k_heads: 1, k_head_dim: 2}
"""


def _shm_files(pid: int) -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f.startswith(f"prefixcache-{pid}.")]


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefixCacheClient]:
    """A client of a server that runs in another process."""
    with serve_process(tmp_path_factory.mktemp("attach"), CONFIG) as (proc, address):
        assert _shm_files(proc.pid)
        with PrefixCacheClient(address, timeout=5.0) as client:
            yield client
    # A clean stop unlinks every shared-memory file it made.
    assert _shm_files(proc.pid) == []


def _random(shape: tuple[int, ...], dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.randn(shape).to(dtype)


def test_attached_writes_are_read_through_the_server(remote: PrefixCacheClient) -> None:
    pool = remote.attach_pool("m")
    assert len(pool.k_buffer) == 2 and pool.k_buffer[0].shape == (129, 2, 8)
    assert pool.device == "cpu"
    with remote.session(10.0) as s:
        slots = torch.tensor(list(s.alloc("m", 6).slots))
        k = [_random((6, 2, 8)) for _ in range(2)]
        v = [_random((6, 2, 8)) for _ in range(2)]
        for layer in range(2):  # the worker's "forward pass" writes in place, no RPC
            pool.k_buffer[layer][slots] = k[layer]
            pool.v_buffer[layer][slots] = v[layer]
        back = s.read_kv("m", slots, chunk_bytes=100)
        assert all(torch.equal(back.k[i], k[i]) and torch.equal(back.v[i], v[i]) for i in range(2))

        # ... and the other way round: written through the server, seen in the mapping.
        k2 = _random((2, 6, 2, 8))
        s.write_kv("m", slots, k2, k2 * 2, chunk_bytes=77)
        assert torch.equal(pool.k_buffer[1][slots], k2[1])
        assert torch.equal(pool.v_buffer[0][slots], k2[0] * 2)
        # A second attach maps the same memory.
        again = remote.attach_pool("m")
        assert torch.equal(again.k_buffer[1][slots], k2[1])
        s.free("m", slots)
    pool.close()


def test_attach_mamba_state_and_slot_model(remote: PrefixCacheClient) -> None:
    pool = remote.attach_pool("h")
    assert len(pool.conv_state) == 2 and pool.conv_state[1].shape == (7, 3, 2)
    assert pool.temporal_state[0].dtype == torch.float32
    with remote.session(10.0) as s:
        got = s.alloc("h", 2, num_state_slots=2)
        states = torch.tensor(list(got.state_slots))
        conv = _random((2, 3, 2))
        pool.conv_state[1][states] = conv
        pool.temporal_state[0][states] = torch.ones(2, 2, 2, 2)
        back = s.read_kv("h", state_slots=states)
        assert torch.equal(back.conv[1], conv)
        assert torch.equal(back.temporal[0], torch.ones(2, 2, 2, 2))
        s.free("h", got.slots, state_slots=got.state_slots)

        slot_pool = remote.attach_pool("s")
        assert len(slot_pool.k_buffer) == 1 and slot_pool.k_buffer[0].shape == (4, 8, 1, 2)
        slot = s.alloc("s", 1).slots
        rows = _random((1, 8, 1, 2))
        slot_pool.k_buffer[0][slot[0]] = rows[0]
        assert torch.equal(s.read_kv("s", slot).k[0], rows)
        s.free("s", slot)


def test_attach_refused_when_shared_memory_is_off(tmp_path: Path) -> None:
    with running(tmp_path, shm_dir="") as srv, PrefixCacheClient(srv.address) as c:
        assert c.describe_pool("m").buffers == ()
        with pytest.raises(FailedPrecondition, match="shares no buffers"):
            c.attach_pool("m")


def test_shared_pools_name_files_by_a_locked_owner(tmp_path: Path) -> None:
    """Files carry the pid (for people) and a random part; the lock file is held while the
    pools live, so a sweep leaves them alone, and close removes them all
    (test_shared_pool.py covers the sweep across PID namespaces)."""
    shared = SharedPools(str(tmp_path), epoch=0xBEEF)
    factory = shared.factory("a/b", "cpu")
    assert factory is not None and shared.factory("a", "cuda:0") is None
    assert list(tmp_path.iterdir()) == []  # nothing until the first buffer
    t = factory((3, 2), torch.float32)
    assert torch.equal(t, torch.zeros(3, 2))
    (data,) = tmp_path.glob(f"prefixcache-{os.getpid()}.*-a_b-0")
    (lock,) = tmp_path.glob(f"prefixcache-{os.getpid()}.*.lock")
    assert "epoch beef" in lock.read_text()
    assert remove_stale(tmp_path) == 0 and data.exists() and lock.exists()
    shared.close()
    assert list(tmp_path.iterdir()) == []
