"""The shared harness of the radix-cache property tests: keys, the position model, rules."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from prefixcache.cache import (
    EVICTION_POLICIES,
    LockError,
    RadixKey,
    TokenToKVPoolAllocator,
    inspection,
)


def _int_pages(ps: int) -> list[tuple[int, ...]]:
    if ps == 1:
        return [(0,), (1,), (2,), (3,), (1,)]
    half = ps // 2
    return [
        (0,) * ps,
        (1,) * ps,
        (0,) * half + (1,) * (ps - half),  # differs from page 0 mid-page
        (0,) * (ps - 1) + (2,),  # differs from page 0 in its last token only
        (0, 1) * half,  # packs like a page of tuple tokens (0, 1)
    ]


def _tuple_pages(ps: int) -> list[tuple[tuple[int, int], ...]]:
    if ps == 1:
        return [((0, 1),), ((0, 0),), ((1, 0),)]
    return [((0, 1),) * ps, ((0, 0),) * ps, ((0, 1),) * (ps - 1) + ((1, 1),)]


# Namespaces: int tokens in None, "" and "a", width-2 tuple tokens in None and "t";
# weighted towards int tokens in None (choice 0, which is also where shrinking goes).
NS_CHOICES = [(None, 1)] * 5 + [("", 1), ("a", 1), (None, 2), ("t", 2)]


# An abstract sequence: namespace choice, page ids, tail tokens, and optionally "start
# from the first k pages of the i-th recent sequence" (which makes prefixes shared and
# nodes split often). The machine turns it into tokens for its page size, so one
# strategy serves every page size; it shrinks towards short fresh int keys.
SEQS = st.tuples(
    st.integers(0, len(NS_CHOICES) - 1),
    st.lists(st.sampled_from([0, 1, 0, 1, 2, 3, 4]), max_size=8),
    st.lists(st.integers(0, 3), max_size=15),
    st.none() | st.tuples(st.integers(0, 15), st.integers(0, 8)),
)


INDEX = st.integers(0, 63)


@dataclass(frozen=True)
class Seq:
    ns: str | None
    width: int
    tokens: tuple[Any, ...]

    def key(self, upto: int | None = None) -> RadixKey:
        return RadixKey(list(self.tokens[:upto]), self.ns)


def make_seq(spec: Any, ps: int, max_pages: int, history: list[Seq]) -> Seq:
    ns_choice, page_ids, tail, reuse = spec
    ns, width = NS_CHOICES[ns_choice]
    head: tuple[Any, ...] = ()
    if reuse is not None and history:
        base = history[reuse[0] % len(history)]
        ns, width = base.ns, base.width
        head = base.tokens[: min(reuse[1], max_pages) * ps]
    page_ids = page_ids[: max_pages - len(head) // ps]
    tail = tail[: ps - 1]
    if width == 1:
        pages = _int_pages(ps)
        tokens = [t for p in page_ids for t in pages[p % len(pages)]] + tail
    else:
        pages = _tuple_pages(ps)
        tokens = [t for p in page_ids for t in pages[p % len(pages)]]
        tokens += [(t % 2, t // 2) for t in tail]
    return Seq(ns, width, head + tuple(tokens))


def ints(x: Any) -> list[int]:
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.tolist()]
    return [int(v) for v in x]


def tensor(slots: list[int]) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.int64)


def walk(root: Any) -> list[Any]:
    """Every node below ``root`` (namespace roots included)."""
    return [node for node, _ in inspection.walk(root)]


def node_path(node: Any) -> tuple[str | None, int, tuple[Any, ...], list[int]]:
    """(extra_key, width, tokens, slots) from the namespace root down to ``node``."""
    toks: list[list[Any]] = []
    vals: list[list[int]] = []
    n = node
    while n.key_len:
        toks.append(list(n.key.token_ids))
        vals.append(ints(n.value))
        n = n.parent
    tokens = tuple(t for part in reversed(toks) for t in part)
    slots = [s for part in reversed(vals) for s in part]
    ns = n.namespace
    if ns is None:
        return (None, 1, tokens, slots)
    return (ns.extra_key, ns.token_width, tokens, slots)


class Model:
    """Token position -> slot, for every position the tree must hold.

    A position is named by ``(extra_key, width, tokens up to the end of its page, offset
    in the page)``: two pages that share their first tokens are different tree children,
    so their common tokens are different positions.
    """

    def __init__(self, page_size: int) -> None:
        self.ps = page_size
        self.slot_of: dict[tuple[Any, ...], int] = {}
        self.pos_of: dict[int, tuple[Any, ...]] = {}

    def key(self, seq: Seq, pos: int) -> tuple[Any, ...]:
        ps = self.ps
        return (seq.ns, seq.width, seq.tokens[: (pos // ps + 1) * ps], pos % ps)

    def aligned(self, seq: Seq) -> int:
        return len(seq.tokens) // self.ps * self.ps

    def present(self, seq: Seq) -> int:
        """Longest page-aligned prefix of ``seq`` the tree must hold."""
        k, end = 0, self.aligned(seq)
        while k < end and self.key(seq, k) in self.slot_of:
            k += self.ps
        return k

    def slots(self, seq: Seq, upto: int, start: int = 0) -> list[int]:
        return [self.slot_of[self.key(seq, p)] for p in range(start, upto)]

    def keys(self, seq: Seq, upto: int) -> list[tuple[Any, ...]]:
        return [self.key(seq, p) for p in range(upto)]

    def add(self, seq: Seq, pos: int, slot: int) -> None:
        key = self.key(seq, pos)
        assert key not in self.slot_of, f"position {pos} of {seq} stored twice"
        assert slot not in self.pos_of, f"slot {slot} stored at two positions"
        self.slot_of[key] = slot
        self.pos_of[slot] = key

    def drop_slot(self, slot: int) -> tuple[Any, ...]:
        assert slot in self.pos_of, f"the cache freed slot {slot}, which the tree did not hold"
        key = self.pos_of.pop(slot)
        del self.slot_of[key]
        return key

    def check_prefix_closed(self) -> None:
        ps = self.ps
        for ns, width, page_end, _ in self.slot_of:
            for o in range(ps):
                assert (ns, width, page_end, o) in self.slot_of, "a partial page in the tree"
            if len(page_end) > ps:
                assert (ns, width, page_end[:-ps], ps - 1) in self.slot_of, (
                    f"the tree holds {page_end} in {ns!r} without its prefix: "
                    "eviction took an inner node"
                )


@dataclass
class Handle:
    """A node the harness was given (by match or insert), with where it ended then."""

    node: Any
    seq: Seq
    length: int
    epoch: int = 0  # the cache's reset count when the handle was taken


MAX_TOKENS = 8 * 16 + 15


POLICIES = ["lru", *sorted(set(EVICTION_POLICIES) - {"lru"})]


# CI budget: about 120 cases of up to 50 steps per machine. The long
# variant (about 8x) runs only when PREFIXCACHE_SLOW=1, since CI runs every test:
#   PREFIXCACHE_SLOW=1 python -m pytest -m slow tests/cache/radix/test_radix_properties.py
LONG = pytest.mark.skipif(
    not os.environ.get("PREFIXCACHE_SLOW"),
    reason="set PREFIXCACHE_SLOW=1 for the long property runs",
)


class CacheHarness(RuleBasedStateMachine):
    """What both cache machines share: setup, handles, lock bookkeeping, and the match,
    reset and unlock rules. Subclasses provide the cache, the model and the checks."""

    @initialize(policy=st.sampled_from(POLICIES), eager_hashes=st.booleans())
    def configure(self, policy: str, eager_hashes: bool) -> None:
        """Any eviction policy must keep every invariant; eager hashes must chain."""
        self.cache = self._new_cache(policy, eager_hashes)

    def seq(self, spec: Any) -> Seq:
        seq = make_seq(spec, self.PAGE, self.MAX_PAGES, self.history)
        self.history.append(seq)
        del self.history[:-16]
        return seq

    def _on_evict(self, node_id: int) -> None:
        assert node_id not in self.evicted_ids, f"on_node_evict({node_id}) called twice"
        self.evicted_ids.add(node_id)
        self.fresh_notified.add(node_id)

    def _free_own(self, slots: list[int]) -> None:
        if slots:
            assert set(slots) <= self.held
            self.alloc.free_own(slots)
            self.held -= set(slots)

    def _remember(self, handle: Handle) -> None:
        handle.epoch = self.epoch
        self.handles.append(handle)
        del self.handles[:-12]

    def own_locks(self, node: Any) -> int:
        return sum(1 for lk in self.locks if lk.handle.node is node)

    def _expect_lock_error(self, fn: Any, *args: Any) -> None:
        before = self.snapshot()
        with pytest.raises(LockError):
            fn(*args)
        assert self.snapshot() == before, "a refused lock call changed the cache"
        self.cache.check_integrity()

    @rule(spec=SEQS)
    def match(self, spec: Any) -> None:
        self._match(self.seq(spec))

    @rule(go=st.integers(0, 19))
    def reset(self, go: int) -> None:
        """Admin reset (rarely): forget the tree and clear the pool; old handles go stale."""
        if go != 13:
            return
        self.cache.reset()
        self.alloc.clear()
        self.model = Model(self.PAGE)
        self.held.clear()
        self.locks.clear()
        self.requests.clear()
        self.seen_ids = set()
        self.epoch += 1
        event("reset")

    @precondition(lambda self: any(lk.owner == "explicit" for lk in self.locks))
    @rule(i=INDEX)
    def unlock(self, i: int) -> None:
        mine = [lk for lk in self.locks if lk.owner == "explicit"]
        self._unlock(mine[i % len(mine)])


class RecordingAllocator(TokenToKVPoolAllocator):
    """The real allocator, logging every slot the cache frees through it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[int] = []

    def free(self, indices: Any) -> None:
        super().free(indices)
        self.log.extend(ints(indices))

    def free_parts(self, parts: Any) -> None:
        super().free_parts(parts)
        for part in parts:
            self.log.extend(ints(part))

    def free_own(self, slots: list[int]) -> None:
        """A free by the harness itself (not logged)."""
        TokenToKVPoolAllocator.free(self, tensor(slots))


def machine_settings(examples: int, steps: int) -> settings:
    """Settings for a state machine run: no deadline (the host is shared), replayable."""
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
        print_blob=True,
    )
