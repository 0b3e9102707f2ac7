"""Fast misses (scheduler.py, "Fast misses"): a prompt the service holds no block of is
answered "no hit" at its first probe, from the shadow index, with no lookup, no lock
and no step spent waiting; anything the shadow cannot rule out still looks up. Against
a real server, whose Subscribe stream feeds the connector's shadow. Saves are off
where a test counts calls or locks: a request's save (its own Match, at the first
probe) is test_scheduler's and test_saves_during_run's."""

from __future__ import annotations

import pytest
from harness import ServerThread
from integrations.vllm.vllm_support import BLOCK, make_scheduler, settle, shadow_holds

from prefixcache.client import PrefixCacheClient
from prefixcache.integrations.vllm.keys import RequestInfo, extra_key
from prefixcache.integrations.vllm.scheduler import SchedulerCore

pytestmark = pytest.mark.usefixtures("quiet")

PROMPT = list(range(300, 318))  # 18 tokens: 4 whole blocks can be looked up


def info(req_id: str, tokens: list[int] = PROMPT, **kw: object) -> RequestInfo:
    return RequestInfo(req_id, tokens, len(tokens), **kw)  # type: ignore[arg-type]


def cache(client: PrefixCacheClient, tokens: list[int], key: str | None = None) -> None:
    with client.session(10.0) as s:
        reply = s.match("v", tokens, extra_key=key, allocate=True)
        s.insert("v", tokens, reply.all_slots(), extra_key=key)


def calls(core: SchedulerCore) -> int:
    settle(core)
    return core.backend.calls  # type: ignore[attr-defined,no-any-return]


def test_a_miss_is_answered_at_the_first_probe_without_a_call(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    cache(client, list(range(900, 916)))  # another prompt: the shadow is not empty
    core = make_scheduler(server.address, save="off")
    try:
        before = calls(core)
        r = info("m")
        assert core.probe(r, 0) == (0, False)  # answered now, not (None, False) a step late
        core.allocated("m", [], 0)
        core.build_meta()
        assert core.probe(r, 0) == (0, False)  # asked again: still no call
        assert calls(core) == before
        assert (core.stats.fast_misses, core.stats.lookups) == (2, 0)
        assert core.reservations() == {}
        assert client.stats("v")["v"].locks == 0
    finally:
        core.close()


def test_a_prefix_the_shadow_holds_still_looks_up_and_hits(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    cache(client, PROMPT[:12])
    core = make_scheduler(server.address, save="off")
    try:
        r = info("h")
        assert core.probe(r, 0) == (None, False)  # a hit needs the lookup's lock
        core.build_meta()
        settle(core)
        assert core.probe(r, 0) == (12, False)
        assert core.stats.fast_misses == 0 and client.stats("v")["v"].locks == 1
        core.finished(r, [], 0)
        core.build_meta()
        settle(core)
    finally:
        core.close()


def test_no_block_beyond_vllms_own_hit_is_a_miss(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    cache(client, PROMPT[:8])
    core = make_scheduler(server.address)
    try:
        assert core.probe(info("own"), 8) == (0, False)  # vLLM has those 8 itself
        assert core.probe(info("more"), 4) == (None, False)  # 4 more to load: look up
        assert (core.stats.fast_misses, core.stats.lookups) == (1, 1)
        core.build_meta()
        settle(core)
        assert core.probe(info("more"), 4) == (4, False)
        core.finished(info("more"), [], 4)
        core.build_meta()
        settle(core)
    finally:
        core.close()


def test_an_insert_turns_the_miss_into_a_hit_once_the_shadow_has_it(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    core = make_scheduler(server.address)
    try:
        assert core.probe(info("before"), 0) == (0, False)
        cache(client, PROMPT[:16])  # another engine saved it
        shadow_holds(core, PROMPT[:16])
        r = info("after")
        assert core.probe(r, 0) == (None, False)
        core.build_meta()
        settle(core)
        assert core.probe(r, 0) == (16, False)
        core.finished(r, [], 0)
        core.build_meta()
        settle(core)
    finally:
        core.close()


def test_namespaces_are_apart_in_the_shadow(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    cache(client, PROMPT[:16], extra_key("lora-a", None))
    core = make_scheduler(server.address)
    try:
        assert core.probe(info("other", lora_name="lora-b"), 0) == (0, False)
        assert core.probe(info("plain"), 0) == (0, False)
        r = info("same", lora_name="lora-a")
        assert core.probe(r, 0) == (None, False)
        core.build_meta()
        settle(core)
        assert core.probe(r, 0) == (16, False)
        core.finished(r, [], 0)
        core.build_meta()
        settle(core)
    finally:
        core.close()


def test_without_a_current_shadow_a_request_looks_up(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    core = make_scheduler(server.address, fast_miss=False)
    try:
        assert core.backend.shadow is None  # type: ignore[attr-defined]
        assert core.probe(info("off"), 0) == (None, False)
    finally:
        core.close()
    core = make_scheduler(server.address)
    try:
        shadow = core.backend.shadow  # type: ignore[attr-defined]
        shadow.close()  # the stream down: what the shadow last knew is not trusted
        assert not shadow.connected
        assert core.probe(info("down"), 0) == (None, False)
        core.build_meta()
        settle(core)
        assert core.probe(info("down"), 0) == (0, False)  # the lookup's answer
        assert (core.stats.fast_misses, core.stats.lookups) == (0, 1)
    finally:
        core.close()


def test_the_block_size_rounds_the_shadow_hit_down(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    cache(client, PROMPT[:6])  # pages of 2: 6 tokens, one whole block of 4 and a half
    core = make_scheduler(server.address)
    try:
        assert BLOCK == 4
        assert core.probe(info("half"), 4) == (0, False)  # 4 whole: vLLM's own
        assert core.probe(info("whole"), 0) == (None, False)
    finally:
        core.close()


def test_this_engines_own_save_is_looked_up_at_once(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    """The shadow hears of an Insert a moment after it lands; a request for what this
    engine just saved is looked up meanwhile, never answered "miss"."""
    core = make_scheduler(server.address)
    try:
        done = info("saved")
        assert core.probe(done, 0) == (0, False)
        assert core.finished(done, [1, 2, 3, 4, 5], 18)
        core.build_meta()
        settle(core)
        core.build_meta()  # the save's copy went to the workers with this step
        core.sends_done({"saved"})  # ... and they are done: the Insert leaves
        settle(core)
        for n in range(3):  # before, as and after the shadow hears of it
            r = info(f"again{n}")
            assert core.probe(r, 0) == (None, False)
            core.build_meta()
            settle(core)
            assert core.probe(r, 0) == (16, False)
            core.finished(r, [], 0)
            shadow_holds(core, PROMPT[:16])
        assert core.stats.fast_misses == 1
        core.build_meta()
        settle(core)
    finally:
        core.close()
