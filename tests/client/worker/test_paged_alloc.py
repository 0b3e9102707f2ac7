"""The drop-in allocator's paged calls (SGLang's ``alloc_extend`` / ``alloc_decode``):
page-aligned slots, one Alloc per call for the whole batch, whole pages freed. Against
a real server (conftest.py: model "p" has pages of 4 tokens, "m" of 1)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from harness import ServerThread

from prefixcache.client import PrefixCacheClient, RemoteRadixCache

pytestmark = pytest.mark.usefixtures("quiet")
PAGE = 4


@pytest.fixture
def cache(client: PrefixCacheClient) -> Iterator[RemoteRadixCache]:
    with RemoteRadixCache(client, "p") as c:
        yield c


def t(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _aligned(slots: list[int], first_position: int) -> None:
    """SGLang's paged layout: a token's offset in its page is its position's."""
    for i, slot in enumerate(slots):
        assert slot % PAGE == (first_position + i) % PAGE, (slots, first_position)
        if i and (first_position + i) % PAGE:
            assert slot == slots[i - 1] + 1  # the rest of a page, in order


def _allocs(server: ServerThread) -> int:
    return server.service.engine("p").ops["alloc"]


def test_extend_and_decode_are_page_aligned_one_alloc_per_batch(
    server: ServerThread, cache: RemoteRadixCache
) -> None:
    alloc = cache.token_to_kv_pool_allocator
    before = _allocs(server)
    out = alloc.alloc_extend(t(0, 0), t(0, 0), t(5, 3), t(5, 3), t(-1, -1), 8).tolist()
    a, b = out[:5], out[5:]
    _aligned(a, 0)
    _aligned(b, 0)
    assert _allocs(server) == before + 1 and cache.stats().session_slots == 3 * PAGE
    # The next chunk of a: the rest of its page, then a new one (an older SGLang's call).
    more = alloc.alloc_extend(t(5), t(10), t(a[-1]), 5).tolist()
    _aligned(more, 5)
    assert more[:3] == [a[-1] + 1, a[-1] + 2, a[-1] + 3]
    a += more
    assert _allocs(server) == before + 2
    # Decode: within the last page where it has room; a new page otherwise.
    step = alloc.alloc_decode(t(11, 4), t(11, 4), t(a[-1], b[-1])).tolist()
    assert step == [a[-1] + 1, b[-1] + 1] and _allocs(server) == before + 2  # no call
    a.append(step[0])
    b.append(step[1])
    step = alloc.alloc_decode(t(12, 5), t(a[-1], b[-1])).tolist()
    assert step[0] == a[-1] + 1 and step[1] % PAGE == 0 and _allocs(server) == before + 3
    a.append(step[0])
    b.append(step[1])
    _aligned(a, 0)
    _aligned(b, 0)
    assert len(set(a + b)) == len(a + b)
    # Freeing a request frees its pages whole (SGLang's paged free), here b's two.
    held = cache.stats().session_slots
    alloc.free(t(*b))
    assert cache.stats().session_slots == held - 2 * PAGE
    # a is finished: its 12 tokens are three whole pages, all cached now.
    done = cache.insert(list(range(12)), t(*a))
    assert done.prefix_len == 0 and cache.stats().session_slots == 0


def test_a_finished_request_s_tail_page_is_freed_whole(cache: RemoteRadixCache) -> None:
    alloc = cache.token_to_kv_pool_allocator
    slots = alloc.alloc_extend(t(0), t(0), t(6), t(6), t(-1), 6).tolist()
    done = cache.insert(list(range(100, 106)), t(*slots))  # the aligned 4 are cached
    assert done.prefix_len == 0 and cache.stats().session_slots == PAGE
    alloc.free(t(*slots[4:]))  # as SGLang frees the unaligned tail: its page goes whole
    assert cache.stats().session_slots == 0


def test_a_short_pool_answers_none_and_takes_nothing(cache: RemoteRadixCache) -> None:
    alloc = cache.token_to_kv_pool_allocator
    before = cache.stats()
    assert alloc.alloc_extend(t(0), t(0), t(1000), t(1000), t(-1), 1000) is None
    assert cache.stats().session_slots == before.session_slots
    with pytest.raises(ValueError):  # a last_loc that is not where the request stands
        alloc.alloc_extend(t(2), t(2), t(4), t(4), t(-1), 2)


def test_page_size_one_is_a_plain_allocation(
    client: PrefixCacheClient, server: ServerThread
) -> None:
    with RemoteRadixCache(client, "m") as c:
        alloc = c.token_to_kv_pool_allocator
        before = server.service.engine("m").ops["alloc"]
        out = alloc.alloc_extend(t(2, 0), t(2, 0), t(5, 3), t(5, 3), t(7, -1), 6)
        step = alloc.alloc_decode(t(6, 4), t(6, 4), t(int(out[2]), int(out[5])))
        assert len(set(out.tolist() + step.tolist())) == 8
        assert server.service.engine("m").ops["alloc"] == before + 2
        alloc.free(torch.cat([out, step]))
        assert c.stats().session_slots == 0
