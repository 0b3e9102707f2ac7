"""Fixtures for the SGLang HiCache backend tests: a real server with a model of each kind
the backend meets (helpers in hicache_hosts.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import ServerThread, client_of, serve_module

from prefixcache.client import PrefixCacheClient

sys.path.insert(0, str(Path(__file__).parent))  # the tests import hicache_hosts by name

from hicache_hosts import MODELS

from prefixcache.integrations.sglang import HiCacheCore


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    yield from serve_module(tmp_path_factory, "sglang", MODELS, session_ttl_min=0.2)


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[PrefixCacheClient]:
    yield from client_of(server)


@pytest.fixture
def cores() -> Iterator[list[HiCacheCore]]:
    """Cores made in a test, closed after it (their sessions release what they hold)."""
    made: list[HiCacheCore] = []
    yield made
    for core in made:
        core.close()
