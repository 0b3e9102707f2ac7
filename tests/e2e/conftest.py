"""tests/e2e: real vLLM engines against a real `prefixcache serve`.

Every test here is marked ``e2e``. Where vLLM is not installed (the main venv) they
skip; with ``PREFIXCACHE_E2E=1`` (CI's e2e stage) a skip of any of them is a failure,
so that a broken vLLM install cannot pass as "skipped".
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e import tiny_llama
from e2e.e2e_support import Engine, Sidecar

REQUIRED = os.environ.get("PREFIXCACHE_E2E") == "1"


def _why_not_runnable() -> str | None:
    for module in ("vllm", "transformers", "tokenizers"):
        if importlib.util.find_spec(module) is None:
            return f"needs {module} (the e2e venv: see .ci/run)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    mine = [item for item in items if here in Path(str(item.path)).parents]
    for item in mine:
        item.add_marker(pytest.mark.e2e)
    if not mine or (reason := _why_not_runnable()) is None:
        return
    if REQUIRED:
        raise pytest.UsageError(f"PREFIXCACHE_E2E=1, but tests/e2e {reason}")
    for item in mine:
        item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if REQUIRED and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped under PREFIXCACHE_E2E=1: {report.longrepr}"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama.build(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    # A short path: unix socket paths are limited to 107 bytes.
    side = Sidecar(tmp_path_factory.mktemp("pc"))
    yield side
    side.stop()


@pytest.fixture(scope="session")
def engines(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, sidecar: Sidecar
) -> Iterator[EngineCache]:
    cache = EngineCache(tmp_path_factory.mktemp("engines"), model_dir, sidecar)
    yield cache
    for engine in cache.values():
        engine.close()


class EngineCache(dict[tuple[int, str, str], Engine]):
    """Engines by (block size, sidecar model, name), started on first use and kept for
    the session: each start costs tens of seconds."""

    def __init__(self, tmp: Path, model_dir: Path, sidecar: Sidecar) -> None:
        super().__init__()
        self.tmp, self.model_dir, self.sidecar = tmp, model_dir, sidecar

    def close(self, pc_model: str | None = None) -> None:
        """Close the engines on ``pc_model``, or all (each holds about 2 GB)."""
        for key in [key for key in self if pc_model in (None, key[1])]:
            self.pop(key).close()

    def __missing__(self, key: tuple[int, str, str]) -> Engine:
        block, pc_model, name = key
        engine = Engine(
            self.tmp, f"{name}-b{block}-{pc_model}", self.model_dir, block, self.sidecar, pc_model
        )
        self[key] = engine
        return engine
