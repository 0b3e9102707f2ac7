"""Stateful hypothesis tests of both allocators against a set-of-slots model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from prefixcache.cache import SWATokenToKVPoolAllocator, TokenToKVPoolAllocator
from prefixcache.cache.errors import DoubleFreeError, SlotIndexError


def snapshot(alloc: TokenToKVPoolAllocator) -> tuple[int, int, list[bool]]:
    """Observable state: available size, allocated count and the per-row flags."""
    rows = torch.arange(alloc.size + alloc.page_size)
    return alloc.available_size(), alloc.num_allocated(), alloc.is_allocated(rows).tolist()


PAGE_CONFIGS = [(1, 40), (4, 70), (16, 100)]
STATEFUL = settings(
    max_examples=30,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class _PoolModel:
    """Reference model of one paged pool: allocated slots plus pages held by a group."""

    def __init__(self, size: int, page_size: int) -> None:
        self.size, self.ps = size, page_size
        self.num_pages = size // page_size
        self.allocated: set[int] = set()
        self.page_users: set[int] = set()  # pages handed out and not yet released
        self.group_pending: set[int] = set()
        self.group_depth = 0

    def available(self) -> int:
        return (self.num_pages - len(self.page_users) - len(self.group_pending)) * self.ps

    def can_alloc(self, n: int) -> bool:
        return -(-n // self.ps) * self.ps <= self.available()

    def take(self, slots: list[int]) -> None:
        """Checks a successful allocation's shape against the model and records it."""
        n, ps = len(slots), self.ps
        assert len(set(slots)) == n
        assert not set(slots) & self.allocated
        assert all(ps <= s < (self.num_pages + 1) * ps for s in slots)
        pages = [s // ps for s in slots[::ps]]
        assert not set(pages) & (self.page_users | self.group_pending)
        # Each page contributes its first slots, in order: page*ps + 0, 1, ...
        expect = [p * ps + k for p in pages for k in range(ps)][:n]
        assert slots == expect
        self.allocated |= set(slots)
        self.page_users |= set(pages)

    def release(self, slots: list[int]) -> None:
        self.allocated -= set(slots)
        live_pages = {s // self.ps for s in self.allocated}
        emptied = self.page_users - live_pages
        self.page_users -= emptied
        if self.group_depth:
            self.group_pending |= emptied

    def end_group(self) -> None:
        self.group_depth -= 1
        if self.group_depth == 0:
            self.group_pending.clear()

    def expected_error(self, slots: list[int]) -> type[Exception] | None:
        if any(not self.ps <= s < (self.num_pages + 1) * self.ps for s in slots):
            return SlotIndexError
        if len(set(slots)) != len(slots) or not set(slots) <= self.allocated:
            return DoubleFreeError
        return None


def _check_pool(alloc: TokenToKVPoolAllocator, model: _PoolModel) -> None:
    rows = alloc.size + alloc.page_size
    flags = alloc.is_allocated(torch.arange(rows)).tolist()
    assert {i for i, f in enumerate(flags) if f} == model.allocated
    assert not flags[0]
    assert alloc.available_size() == model.available()
    assert alloc.num_allocated() == len(model.allocated)


def _make_allocator_machine(
    page_size: int, size: int, alternate: bool = False
) -> type[RuleBasedStateMachine]:
    class AllocatorMachine(RuleBasedStateMachine):
        """TokenToKVPoolAllocator against a set-of-slots model."""

        def __init__(self) -> None:
            super().__init__()
            self.alloc = TokenToKVPoolAllocator(size, page_size=page_size, need_sort=not alternate)
            # The alternate run covers an unsorted free list.
            self.model = _PoolModel(size, page_size)

        @rule(n=st.integers(0, size // 2))
        def allocate(self, n: int) -> None:
            out = self.alloc.alloc(n)
            if not self.model.can_alloc(n):
                assert out is None
                return
            assert out is not None and out.dtype == torch.int64
            self.model.take(out.tolist())

        @precondition(lambda self: bool(self.model.allocated))
        @rule(data=st.data())
        def free_some(self, data: st.DataObject) -> None:
            pool = sorted(self.model.allocated)
            chosen = data.draw(st.lists(st.sampled_from(pool), min_size=1, unique=True))
            if data.draw(st.booleans()):
                chosen = data.draw(st.permutations(chosen))
            self.alloc.free(torch.tensor(chosen))
            self.model.release(chosen)

        @rule(data=st.data())
        def invalid_free(self, data: st.DataObject) -> None:
            candidates = st.integers(-2, size + 2 * page_size)
            if self.model.allocated:
                candidates = candidates | st.sampled_from(sorted(self.model.allocated))
            chosen = data.draw(st.lists(candidates, min_size=1, max_size=6))
            expected = self.model.expected_error(chosen)
            if expected is None:
                chosen = chosen + chosen[:1]  # force a repeat
                expected = self.model.expected_error(chosen)
            before = snapshot(self.alloc)
            with pytest.raises(expected):
                self.alloc.free(chosen)
            assert snapshot(self.alloc) == before

        @rule()
        def group_begin(self) -> None:
            self.alloc.free_group_begin()
            self.model.group_depth += 1

        @precondition(lambda self: self.model.group_depth > 0)
        @rule()
        def group_end(self) -> None:
            self.alloc.free_group_end()
            self.model.end_group()

        @invariant()
        def matches_model(self) -> None:
            _check_pool(self.alloc, self.model)

    return AllocatorMachine


def _make_swa_machine(page_size: int, size: int) -> type[RuleBasedStateMachine]:
    size_swa = size // 2 + page_size

    class SWAMachine(RuleBasedStateMachine):
        """SWATokenToKVPoolAllocator against two slot-set models and a mapping dict."""

        def __init__(self) -> None:
            super().__init__()
            self.alloc = SWATokenToKVPoolAllocator(size, size_swa, page_size=page_size)
            self.full = _PoolModel(size, page_size)
            self.swa = _PoolModel(size_swa, page_size)
            self.mapping: dict[int, int] = {}

        def _state(self) -> tuple[object, ...]:
            return (
                snapshot(self.alloc.full_attn_allocator),
                snapshot(self.alloc.swa_attn_allocator),
                self.alloc.full_to_swa_index_mapping.tolist(),
            )

        @rule(n=st.integers(0, size // 3))
        def allocate(self, n: int) -> None:
            out = self.alloc.alloc(n)
            if not (self.full.can_alloc(n) and self.swa.can_alloc(n)):
                assert out is None
                return
            assert out is not None
            full = out.tolist()
            swa = self.alloc.translate_loc_from_full_to_swa(out).tolist()
            self.full.take(full)
            self.swa.take(swa)
            self.mapping.update(zip(full, swa, strict=True))

        @precondition(lambda self: bool(self.full.allocated))
        @rule(data=st.data())
        def free_some(self, data: st.DataObject) -> None:
            pool = sorted(self.full.allocated)
            chosen = data.draw(st.lists(st.sampled_from(pool), min_size=1, unique=True))
            self.alloc.free(chosen)
            self.full.release(chosen)
            self.swa.release([self.mapping.pop(s) for s in chosen if s in self.mapping])

        @precondition(lambda self: bool(self.mapping))
        @rule(data=st.data())
        def free_swa_some(self, data: st.DataObject) -> None:
            pool = sorted(self.mapping)
            chosen = data.draw(st.lists(st.sampled_from(pool), min_size=1, unique=True))
            self.alloc.free_swa(torch.tensor(chosen))
            self.swa.release([self.mapping.pop(s) for s in chosen])

        @rule(data=st.data(), swa_only=st.booleans())
        def invalid_free(self, data: st.DataObject, swa_only: bool) -> None:
            candidates = st.integers(-1, size + 2 * page_size)
            chosen = data.draw(st.lists(candidates, min_size=1, max_size=5))
            expected = self.full.expected_error(chosen)
            if swa_only and expected is None and any(s not in self.mapping for s in chosen):
                expected = DoubleFreeError
            if expected is None:
                chosen = chosen + chosen[:1]
                expected = self.full.expected_error(chosen)
            before = self._state()
            with pytest.raises(expected):
                if swa_only:
                    self.alloc.free_swa(chosen)
                else:
                    self.alloc.free(chosen)
            assert self._state() == before

        @rule()
        def group_begin(self) -> None:
            self.alloc.free_group_begin()
            self.full.group_depth += 1
            self.swa.group_depth += 1

        @precondition(lambda self: self.full.group_depth > 0)
        @rule()
        def group_end(self) -> None:
            self.alloc.free_group_end()
            self.full.end_group()
            self.swa.end_group()

        @invariant()
        def matches_model(self) -> None:
            _check_pool(self.alloc.full_attn_allocator, self.full)
            _check_pool(self.alloc.swa_attn_allocator, self.swa)
            expect = [0] * (size + page_size)
            for full, swa in self.mapping.items():
                expect[full] = swa
            assert self.alloc.full_to_swa_index_mapping.tolist() == expect
            assert set(self.mapping.values()) == self.swa.allocated
            assert self.alloc.available_size() == min(self.full.available(), self.swa.available())

    return SWAMachine


for _ps, _size in PAGE_CONFIGS:
    _machine = _make_allocator_machine(_ps, _size)
    _machine.TestCase.settings = STATEFUL
    globals()[f"TestAllocatorStateful_ps{_ps}"] = _machine.TestCase
    _alt = _make_allocator_machine(_ps, _size, alternate=True)
    _alt.TestCase.settings = STATEFUL
    globals()[f"TestAllocatorStatefulUnsorted_ps{_ps}"] = _alt.TestCase
    _swa = _make_swa_machine(_ps, _size)
    _swa.TestCase.settings = STATEFUL
    globals()[f"TestSWAAllocatorStateful_ps{_ps}"] = _swa.TestCase
