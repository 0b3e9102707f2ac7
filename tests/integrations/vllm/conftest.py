"""Fixtures for the vLLM connector's cores: a real server, and a client of it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from harness import ServerThread, running
from integrations.vllm.vllm_support import MODELS

from prefixcache.client import PrefixCacheClient


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    with running(tmp_path_factory.mktemp("vllm"), MODELS, session_ttl_min=0.2) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[PrefixCacheClient]:
    with PrefixCacheClient(server.address, timeout=5.0) as c:
        yield c


@pytest.fixture
def quiet(server: ServerThread, client: PrefixCacheClient) -> Iterator[None]:
    """Each test ends with no locks or session slots left, and a sound cache; it starts
    with empty caches."""
    for model in MODELS:
        client.reset(model.name)
    yield
    server.check_integrity()
    for model in client.stats().models:
        assert (model.locks, model.session_slots) == (0, 0), model
