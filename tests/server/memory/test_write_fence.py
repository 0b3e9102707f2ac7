"""Write fences (write_fence.py) over gRPC, with the client's fence (real OFD locks on the
real fence file): an ended session's slots wait for a writer that holds its fence, are
freed once it lets go, and its record never again reads as its token; Reset and the
integrity check account for the waiting slots; a service without shared memory refuses.
The frozen-engine version of this, with a stopped process, is in
tests/integrations/vllm/test_frozen_save.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import ServerThread, running

from prefixcache.client import FailedPrecondition, NotFound, PrefixCacheClient, SessionLost
from prefixcache.client.write_fence import WriteFence, open_fence
from prefixcache.server.config import ModelConfig, PoolConfig

MODELS = (
    ModelConfig(name="m", page_size=2, pool=PoolConfig(size=64, layers=1, k_heads=1, k_head_dim=4)),
)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    with running(tmp_path, MODELS, session_ttl_min=0.1) as srv:
        yield srv


@pytest.fixture
def client(server: ServerThread) -> Iterator[PrefixCacheClient]:
    with PrefixCacheClient(server.address, timeout=5) as c:
        yield c


def _held(client: PrefixCacheClient) -> int:
    return client.stats("m").models[0].session_slots


def test_a_held_fence_keeps_an_ended_sessions_slots_until_let_go(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    session = client.open_session(60)
    slots = client.alloc("m", 8, session=session).slots
    fence = open_fence(client, session.session_id)
    assert open_fence(client, session.session_id).info == fence.info  # idempotent
    with fence.held():
        client.close_session(session)
        # Ended, but its writer is inside: the slots stay out of the pool.
        assert _held(client) == len(slots)
        with pytest.raises(SessionLost):
            fence.check()  # the copy it made is not the session's any more
        server.check_integrity()
        server.run(server.service.settle_fences)
        assert _held(client) == len(slots)
    assert server.run(server.service.settle_fences) == len(slots)
    assert _held(client) == 0
    with pytest.raises(SessionLost), fence.held():
        pass  # a writer that comes later copies nothing
    server.check_integrity()


def test_an_unheld_fence_frees_at_once_and_its_record_is_reused(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    first = client.open_session(60)
    old = open_fence(client, first.session_id)
    client.alloc("m", 4, session=first)
    client.close_session(first)
    assert _held(client) == 0
    second = client.open_session(60)
    new = open_fence(client, second.session_id)
    # The same record, another token: the old session's writer never reads its own.
    assert (new.info.shm_path, new.info.offset_bytes) == (old.info.shm_path, old.info.offset_bytes)
    assert new.info.token != old.info.token
    with new.held():
        pass
    with pytest.raises(SessionLost), old.held():
        pass
    client.close_session(second)


def test_reset_keeps_waiting_slots_until_let_go(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    session = client.open_session(60)
    client.alloc("m", 6, session=session)
    fence = open_fence(client, session.session_id)
    with fence.held():
        client.close_session(session)
        client.reset("m")
        assert _held(client) == 6  # the writer may still copy into them
        server.check_integrity()
        assert server.run(server.service.settle_fences) == 0
    assert server.run(server.service.settle_fences) == 6
    assert _held(client) == 0
    server.check_integrity()


def test_no_fence_for_an_ended_session_or_without_shared_memory(
    tmp_path: Path, client: PrefixCacheClient
) -> None:
    session = client.open_session(60)
    client.close_session(session)
    with pytest.raises(NotFound):
        open_fence(client, session.session_id)
    (tmp_path / "private").mkdir()
    with (
        running(tmp_path / "private", MODELS, shm_dir="") as srv,
        PrefixCacheClient(srv.address, timeout=5) as other,
    ):
        mine = other.open_session(60)
        with pytest.raises(FailedPrecondition, match="WriteKV"):
            open_fence(other, mine.session_id)


def test_a_fence_file_that_cannot_be_opened_is_refused(tmp_path: Path) -> None:
    from prefixcache.client.write_fence import WriteFenceInfo

    with pytest.raises(FailedPrecondition):
        WriteFence(WriteFenceInfo(str(tmp_path / "none"), 0, 1))


def test_a_worker_without_a_fence_record_writes_through_writekv(tmp_path: Path) -> None:
    import torch

    from prefixcache.integrations.vllm.pool_access import MappedAccess

    with (
        running(tmp_path, MODELS, session_ttl_min=0.1, max_sessions=1) as srv,
        PrefixCacheClient(srv.address, timeout=5) as client,
    ):
        first = client.open_session(60)
        held = open_fence(client, first.session_id)  # the only record
        with held.held():
            client.close_session(first)  # its record waits for this writer
            second = client.open_session(60)
            slots = client.alloc("m", 4, session=second).slots
            access = MappedAccess(client, "m")
            rows = torch.arange(4 * 4, dtype=torch.float16).view(4, 1, 4)
            # No record left for the second session: the rows go through WriteKV.
            access.write(
                slots,
                lambda layer: (rows, rows + 1),
                slice(None),
                second.session_id,
                second.server_epoch,
            )
            got = client.read_kv("m", slots, session=second)
            assert torch.equal(got.k[0], rows) and torch.equal(got.v[0], rows + 1)
            assert not access._fences
            client.close_session(second)
        srv.run(srv.service.settle_fences)
        srv.check_integrity()
