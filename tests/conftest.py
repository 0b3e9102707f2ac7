"""Shared pytest configuration: `gpu` tests skip themselves on machines without CUDA."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return  # so that runs without gpu tests never pay for importing torch
    reason = _why_no_cuda()
    if reason is None:
        return
    for item in gpu_items:
        item.add_marker(pytest.mark.skip(reason=reason))


def _why_no_cuda() -> str | None:
    try:
        import torch
    except ImportError:
        return "needs CUDA: torch is not installed"
    if not torch.cuda.is_available():
        return "needs CUDA: torch.cuda.is_available() is False"
    return None
