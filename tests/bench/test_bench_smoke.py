"""Smoke test of the in-process trace replay: our cache and the yardstick agree per request."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:  # bench/ is a script folder, not an installed package
    sys.path.insert(0, str(_REPO))

from bench.replay import (  # noqa: E402
    Impl,
    RunResult,
    first_divergence,
    ours_impl,
    replay,
    yardstick_impl,
)
from bench.trace import TRACES_DIR, load_expanded  # noqa: E402

# The synthetic trace reuses prefixes within its first 200 requests; the conversation
# trace's first 200 share only block 0 under LRU, which any policy would reproduce.
TRACE = TRACES_DIR / "mooncake_synthetic_trace.jsonl"
LIMIT = 200
PAGE = 16
# 2.7 M tokens pass through a 500 k pool: ~60 evictions, and LRU, FIFO and MRU all
# end with different hit counts, so equal hits mean equal eviction choices.
BUDGET = 500_000
# Tight enough that every cached node goes at some point.
TIGHT_BUDGET = 100_000


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # As replay.py's CLI does: with the default pool, these small tensor ops run
    # 10-40x slower on a busy 2-core VM. Restored so other tests see the default.
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def keys() -> list:
    return load_expanded(TRACE, PAGE, LIMIT).keys


@pytest.fixture(scope="module")
def runs(keys: list) -> dict[str, RunResult]:
    return {impl.name: replay(impl, keys, BUDGET, PAGE) for impl in (yardstick_impl(), ours_impl())}


def _policy(name: str) -> Impl:
    from prefixcache.cache import RadixCache

    base = ours_impl()
    return Impl(
        f"ours-{name}",
        lambda alloc, ps: RadixCache(
            page_size=ps, token_to_kv_pool_allocator=alloc, eviction_policy=name
        ),
        base.prepare,
        base.wrap,
    )


def _assert_clean(r: RunResult) -> None:
    assert r.requests == LIMIT
    assert (r.failed, r.errors, r.integrity) == (0, 0, "ok"), r.integrity
    assert r.ops["evict"].calls > 0, "the budget must force eviction"
    assert r.req_per_s > 0


def test_both_finish_cleanly(runs: dict[str, RunResult]) -> None:
    for r in runs.values():
        _assert_clean(r)


def test_same_hits_request_by_request(runs: dict[str, RunResult]) -> None:
    yard, ours = runs["yardstick"], runs["ours"]
    assert first_divergence(yard, ours) is None
    assert ours.hit_tokens == yard.hit_tokens
    assert ours.ops["evict"].calls == yard.ops["evict"].calls
    assert ours.evicted_tokens == yard.evicted_tokens
    assert 0 < yard.hit_ratio < 1


@pytest.mark.parametrize("policy", ["fifo", "mru"])
def test_comparison_tells_policies_apart(
    keys: list, runs: dict[str, RunResult], policy: str
) -> None:
    """Guards the test above: on this slice another eviction order changes the hits."""
    other = replay(_policy(policy), keys, BUDGET, PAGE)
    assert other.errors == 0
    assert other.prefix_lens != runs["yardstick"].prefix_lens


def test_tight_budget_evicts_everything(keys: list) -> None:
    """A pool so small that evictions empty the namespace under a held miss lock."""
    yard = replay(yardstick_impl(), keys, TIGHT_BUDGET, PAGE)
    ours = replay(ours_impl(), keys, TIGHT_BUDGET, PAGE)
    _assert_clean(yard)
    _assert_clean(ours)
    assert first_divergence(yard, ours) is None
