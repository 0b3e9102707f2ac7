"""Every call of PrefixCacheClient against a real server, and the inputs it accepts."""

from __future__ import annotations

from array import array

import numpy as np
import pytest
import torch

from prefixcache.client import (
    InvalidArgument,
    MatchReply,
    PrefixCacheClient,
    StatsReply,
)

pytestmark = pytest.mark.usefixtures("quiet")


def test_list_models_describe_pool_and_stats(client: PrefixCacheClient) -> None:
    models = client.list_models()
    assert [m.name for m in models.models] == ["m", "p", "h", "s"]
    assert [m.cache_kind for m in models.models] == ["radix", "radix", "mamba", "slot"]
    assert (models["m"].page_size, models["m"].pool_size, models["m"].vocab_size) == (1, 256, 1000)
    assert models["h"].state_pool_size == 4
    assert models.server_epoch and client.server_epoch == models.server_epoch
    pool = client.describe_pool("m")
    assert (pool.layer_num, pool.k_head_num, pool.k_head_dim, pool.dtype, pool.device) == (
        1,
        1,
        4,
        "float16",
        "cpu",
    )
    assert (pool.pool_size, pool.num_rows, pool.mamba) == (256, 257, None)
    mamba = client.describe_pool("h").mamba
    assert mamba is not None
    assert (mamba.conv_state_shape, mamba.temporal_state_shape, mamba.state_slots) == (
        (3, 2),
        (2, 2, 2),
        4,
    )
    assert client.describe_pool("s").max_seq_len == 16
    every = client.stats()
    assert isinstance(every, StatsReply)
    assert [s.model for s in every.models] == ["m", "p", "h", "s"]
    assert every.server_epoch == models.server_epoch
    one = client.stats("p")
    assert [s.model for s in one.models] == ["p"]
    assert one["p"].pool_size == 64 and one["p"].free_slots == 64
    with pytest.raises(KeyError):
        one["m"]


def test_two_call_prefill_then_a_hit(client: PrefixCacheClient) -> None:
    tokens = [1, 2, 3, 4, 5]
    with client.session(ttl=30, name="worker-0") as s:
        miss = s.match("m", tokens, lock=True, allocate=True)
        assert (miss.prefix_len, miss.lock_id, len(miss.slots), len(miss.allocated)) == (0, 0, 0, 5)
        assert not miss.hit and not miss.skipped
        ins = s.insert("m", tokens, miss.all_slots(), release_lock_id=miss.lock_id)
        assert (ins.prefix_len, ins.cached_len, len(ins.freed)) == (0, 5, 0) and ins.node_id

        hit = s.match("m", [*tokens, 6, 7], lock=True, allocate=True)
        assert (hit.prefix_len, hit.node_id, len(hit.allocated)) == (5, ins.node_id, 2)
        assert hit.hit and hit.lock_id
        assert list(hit.slots) == list(miss.allocated)
        assert hit.slots_tensor().tolist() == list(hit.slots)
        assert hit.allocated_tensor().dtype == torch.int64
        assert client.stats("m")["m"].protected_tokens == 5
        done = s.insert(
            "m", [*tokens, 6, 7], hit.all_slots(), lock=True, release_lock_id=hit.lock_id
        )
        assert (done.prefix_len, done.cached_len) == (5, 7) and done.lock_id
        assert client.stats("m")["m"].protected_tokens == 7
        s.unlock(done.lock_id)
        # A read-only match needs no session.
        read = client.match("m", [*tokens, 6, 7, 8])
        assert (read.prefix_len, read.lock_id) == (7, 0)
        assert client.stats("m")["m"].protected_tokens == 0


def test_every_kind_of_token_and_slot_input(client: PrefixCacheClient) -> None:
    tokens = [21, 22, 23, 24]
    with client.session() as s:
        m = s.match("m", tokens, allocate=True)
        slots = list(m.allocated)
        s.insert("m", np.array(tokens, dtype=np.int32), torch.tensor(slots, dtype=torch.int32))
    as_u32 = array("I", tokens)
    for given in (
        tokens,
        tuple(tokens),
        range(21, 25),
        as_u32,
        array("q", tokens),
        np.array(tokens),
        np.array(tokens, dtype=np.uint32),
        torch.tensor(tokens),
        torch.tensor(tokens, dtype=torch.int32),
        (np.int64(t) for t in tokens),
        as_u32.tobytes(),
    ):
        reply = client.match("m", given)
        assert (reply.prefix_len, list(reply.slots)) == (4, slots), type(given)
    # Tuple tokens are their own namespace: two width-2 tokens never alias four ids.
    pairs = [(21, 22), (23, 24)]
    assert client.match("m", pairs).prefix_len == 0
    assert client.match("m", np.array(pairs)).prefix_len == 0
    assert client.match("m", as_u32.tobytes(), token_width=2).prefix_len == 0
    # An extra_key is a namespace too, and "" is not None.
    assert client.match("m", tokens, extra_key="").prefix_len == 0
    for bad in (
        [-1],
        [2**32],
        [1.5],
        ["a"],
        "abc",
        np.array([1.0]),
        torch.tensor([True]),
        [(1, 2), (3,)],
        np.zeros((2, 2, 2), dtype=np.int64),
        7,
    ):
        with pytest.raises(InvalidArgument):
            client.match("m", bad)
    with pytest.raises(InvalidArgument):
        client.free("m", [2**63])


def test_radix_key_brings_its_namespace(client: PrefixCacheClient) -> None:
    from prefixcache.cache import RadixKey

    key = RadixKey([31, 32, 33], extra_key="lora-a")
    with client.session() as s:
        m = s.match("m", key, allocate=True)
        s.insert("m", key, m.allocated)
    assert client.match("m", key).prefix_len == 3
    assert client.match("m", [31, 32, 33]).prefix_len == 0
    assert client.match("m", [31, 32, 33], extra_key="lora-a").prefix_len == 3
    with pytest.raises(InvalidArgument):
        client.match("m", key, extra_key="lora-b")


def test_lock_unlock_alloc_free_and_evict(client: PrefixCacheClient) -> None:
    client.evict("p", 10**6)
    with client.session() as s:
        got = s.alloc("p", 8)
        assert len(got.slots) == 8 and got.slots_tensor().shape == (8,)
        ins = s.insert("p", range(100, 108), got.slots)
        assert ins.cached_len == 8
        lock = s.lock("p", ins.node_id)
        assert lock.lock_id and not lock.skipped
        assert client.stats("p")["p"].locks == 1
        assert client.evict("p", 8).evicted_tokens == 0  # locked
        assert not s.unlock(lock.lock_id).skipped
        assert client.lock("p", 0, session=s).lock_id == 0  # the root: nothing to lock
        spare = client.alloc("p", 3, session=s.session_id)  # a session id works too
        assert client.stats("p")["p"].session_slots == 3
        client.free("p", spare.slots, session=s)
        s.free("p", [])
        evicted = client.evict("p", 1)
        assert (evicted.evicted_tokens, evicted.swa_evicted_tokens) == (8, 8)
        assert client.stats("p")["p"].free_slots == 64


def test_request_ids_make_locking_calls_idempotent(client: PrefixCacheClient) -> None:
    with client.session() as s:
        m = s.match("m", [41, 42], allocate=True)
        node = s.insert("m", [41, 42], m.allocated).node_id
        first = s.lock("m", node, request_id=77)
        assert s.lock("m", node, request_id=77) == first
        assert s.lock("m", node).lock_id != first.lock_id  # a fresh id: a second lock
        assert client.stats("m")["m"].locks == 2
        s.unlock(first.lock_id, request_id=78)
        s.unlock(first.lock_id, request_id=78)  # the retry succeeds as well
        match = {"lock": True, "allocate": True, "request_id": 79}
        assert s.match("m", [41, 42, 43], **match) == s.match("m", [41, 42, 43], **match)
        assert client.stats("m")["m"].session_slots == 1


def test_open_keep_alive_and_close_a_session_by_hand(client: PrefixCacheClient) -> None:
    info = client.open_session(ttl=5, name="by-hand")
    assert info.ttl == pytest.approx(5) and info.session_id
    assert client.keep_alive(info) == pytest.approx(5)
    m = client.match("m", [51, 52], session=info, lock=True, allocate=True)
    assert isinstance(m, MatchReply)
    closed = client.close_session(info.session_id)
    assert (closed.locks_released, closed.slots_freed) == (0, 2)


def test_mamba_state_slots(client: PrefixCacheClient) -> None:
    with client.session() as s:
        m = s.match("h", [1, 2, 3, 4], lock=True, allocate=True)
        assert m.allocated_state_slot is not None and m.state_slot is None
        ins = s.insert("h", [1, 2, 3, 4], m.allocated, state_slot=m.allocated_state_slot)
        assert ins.cached_len == 4 and not ins.state_exist
        hit = s.match("h", [1, 2, 3, 4, 5, 6], lock=True)
        assert (hit.prefix_len, hit.state_slot) == (4, m.allocated_state_slot)
        s.unlock(hit.lock_id)
        got = s.alloc("h", 0, num_state_slots=2)
        assert len(got.state_slots) == 2 and len(got.slots) == 0
        s.free("h", state_slots=got.state_slots)
    assert client.evict("h", mamba_num=1).mamba_evicted == 1


def test_slot_model_versions(client: PrefixCacheClient) -> None:
    with client.session() as s:
        m = s.match("s", [1, 2, 3], allocate=True)
        assert m.allocated_slot_version is not None and len(m.allocated) == 1
        ins = s.insert("s", [1, 2, 3], m.allocated, slot_version=m.allocated_slot_version)
        assert ins.cached_len == 3
        hit = client.match("s", [1, 2, 3, 4])
        assert (hit.prefix_len, hit.slot_version) == (3, m.allocated_slot_version)
        got = s.alloc("s", 1)
        assert len(got.slot_versions) == 1
        s.free("s", got.slots)
        s.free("s", m.allocated)


def test_reset_drops_the_model(client: PrefixCacheClient) -> None:
    with client.session() as s:
        m = s.match("p", range(200, 204), allocate=True)
        s.insert("p", range(200, 204), m.allocated)
    reset = client.reset("p")
    assert reset.dropped_tokens >= 4 and reset.dropped_locks == 0
    assert client.stats("p")["p"].free_slots == 64
