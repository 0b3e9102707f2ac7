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


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Skips are never silent: each distinct reason, with how many tests it skipped
    (a fresh machine without Debian's libibverbs1 skips the tier's tests, say)."""
    reasons: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = getattr(report, "longrepr", None)
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    if reasons:
        terminalreporter.section("skipped, by reason")
        for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"{count:5d}  {reason}")
