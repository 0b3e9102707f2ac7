"""Fixtures for the client tests: a real server on a unix socket, in-process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from harness import SMALL_POOL, ServerThread, client_of, serve_module

from prefixcache.client import PrefixCacheClient
from prefixcache.server.config import MambaConfig, ModelConfig, PoolConfig

MODELS = (
    ModelConfig(name="m", page_size=1, vocab_size=1000, pool=SMALL_POOL),
    ModelConfig(name="p", page_size=4, pool=PoolConfig(size=64, k_heads=1, k_head_dim=4)),
    ModelConfig(
        name="h",
        kind="mamba",
        page_size=2,
        pool=SMALL_POOL,
        mamba=MambaConfig(
            state_slots=4,
            working_slots=2,
            layers=2,
            conv_state_shape=(3, 2),
            temporal_state_shape=(2, 2, 2),
        ),
    ),
    ModelConfig(
        name="s", kind="slot", max_seq_len=16, pool=PoolConfig(size=4, k_heads=1, k_head_dim=2)
    ),
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    yield from serve_module(tmp_path_factory, "client", MODELS, session_ttl_min=0.2)


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[PrefixCacheClient]:
    yield from client_of(server)


@pytest.fixture
def quiet(server: ServerThread, client: PrefixCacheClient) -> Iterator[None]:
    """Each test starts and ends with no locks or session slots, and a sound cache."""
    yield
    server.check_integrity()
    for model in client.stats().models:
        assert (model.locks, model.session_slots, model.session_state_slots) == (0, 0, 0), model
