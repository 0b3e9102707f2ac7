"""Fixtures for the vLLM connector's cores: a real server, and a client of it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from harness import ServerThread, client_of, serve_module
from integrations.vllm.vllm_support import MODELS

from prefixcache.client import PrefixCacheClient


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    yield from serve_module(tmp_path_factory, "vllm", MODELS, session_ttl_min=0.2)


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[PrefixCacheClient]:
    yield from client_of(server)


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
