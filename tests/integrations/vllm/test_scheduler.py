"""The scheduler side, driven in the order vLLM calls it, against a real server:
lookups that answer later, reservations (repeated probes, preemption, aborts, leases),
and saves."""

from __future__ import annotations

import pytest
from harness import ServerThread, pb, stub_for
from integrations.vllm.vllm_support import BLOCK, Clock, make_scheduler, settle

from prefixcache.client import PrefixCacheClient, Retention
from prefixcache.integrations.vllm.config import ConnectorConfig
from prefixcache.integrations.vllm.keys import RequestInfo, extra_key, lookup_len, save_len
from prefixcache.integrations.vllm.scheduler import SchedulerCore

pytestmark = pytest.mark.usefixtures("quiet")

PROMPT = list(range(100, 118))  # 18 tokens: 4 whole blocks can be looked up


def info(req_id: str, tokens: list[int] = PROMPT, attempt: int = 0, **kw: object) -> RequestInfo:
    return RequestInfo(req_id, tokens, len(tokens), attempt=attempt, **kw)  # type: ignore[arg-type]


def answer(core: SchedulerCore, req: RequestInfo, num_computed: int = 0) -> tuple[int | None, bool]:
    """Probe until the lookup lands, as vLLM does step after step."""
    first = core.probe(req, num_computed)
    if first != (None, False):
        return first
    core.build_meta()
    settle(core)
    return core.probe(req, num_computed)


def lapsed_tokens(server: ServerThread, outcome: str = "lease_expired") -> int:
    """The service's lookup tokens of the model with ``outcome``, read with a Stats
    call."""
    channel, stub = stub_for(server.address)
    with channel:
        stats = stub.Stats(pb.StatsRequest(model="v")).models[0]
    return stats.lookup_tokens_total[outcome]


def quiesce(core: SchedulerCore) -> None:
    """Two steps with their calls landed: replies that queue releases get them sent."""
    for _ in range(2):
        core.build_meta()
        settle(core)


def cache(client: PrefixCacheClient, tokens: list[int], key: str | None = None) -> None:
    """Put ``tokens`` in the tree of model v (what an earlier save would have done)."""
    with client.session(10.0) as s:
        reply = s.match("v", tokens, extra_key=key, allocate=True)
        s.insert("v", tokens, reply.all_slots(), extra_key=key)


def locks(client: PrefixCacheClient) -> int:
    return client.stats("v")["v"].locks


def test_first_probe_asks_again_and_lookups_leave_as_one_batch(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    cache(client, PROMPT[:12])
    core = make_scheduler(server.address, save="off")  # locks: the lookups'
    try:
        reqs = [info(f"r{i}") for i in range(5)]
        assert [core.probe(r, 0) for r in reqs] == [(None, False)] * 5
        batches = core.backend.batches  # type: ignore[attr-defined]
        core.build_meta()
        assert core.backend.batches == batches + 1  # type: ignore[attr-defined]
        settle(core)
        assert [core.probe(r, 0) for r in reqs] == [(12, False)] * 5
        assert locks(client) == 5
        for r in reqs:
            core.finished(r, [], 0)
        core.build_meta()
        settle(core)
        assert locks(client) == 0
    finally:
        core.close()


def test_repeated_probes_are_idempotent_and_count_beyond_the_local_hit(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    cache(client, PROMPT[:16])
    core = make_scheduler(server.address)
    try:
        r = info("a")
        assert answer(core, r) == (16, False)
        for _ in range(5):  # vLLM could not allocate: it asks again each step
            assert core.probe(r, 0) == (16, False)
            core.build_meta()
        assert core.probe(r, 8) == (8, False)  # vLLM found 8 tokens itself
        settle(core)
        assert core.stats.lookups == 1 and locks(client) == 1
        core.allocated("a", list(range(10, 15)), 8)
        meta = core.build_meta()
        (load,) = meta.loads
        assert (load.start, load.num_tokens, len(load.slots)) == (8, 8, 8)
        assert list(load.tokens) == PROMPT[:16]
        assert core.build_meta().loads == []  # sent once
        core.finished(r, [10, 11, 12, 13, 14], 17)
        quiesce(core)
        assert locks(client) == 0
    finally:
        core.close()


def test_preemption_releases_and_a_new_attempt_looks_up_again(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    cache(client, PROMPT[:16])
    core = make_scheduler(server.address, save="off")
    try:
        r = info("p")
        assert answer(core, r) == (16, False)
        core.allocated("p", [1, 2, 3, 4, 5], 16)
        assert len(core.build_meta().loads) == 1
        core.build_meta(preempted={"p"})  # SchedulerOutput.preempted_req_ids
        settle(core)
        assert core.reservations() == {}
        # The load went out with the last step, which may still be running (vLLM
        # schedules a step while the previous one executes): its slots stay locked
        # two steps more.
        assert locks(client) == 1
        quiesce(core)
        assert locks(client) == 0
        again = info("p", attempt=1)
        assert answer(core, again) == (16, False)
        assert core.stats.lookups == 2 and locks(client) == 1
        # A vLLM without preempted_req_ids: the next attempt's probe says it all.
        core.allocated("p", [1, 2, 3, 4, 5], 16)
        core.build_meta()
        assert core.probe(info("p", attempt=2), 0) == (None, False)
        quiesce(core)
        assert core.stats.lookups == 3 and locks(client) == 1  # the old one released
        core.finished(info("p", attempt=2), [], 0)
        core.build_meta()
        settle(core)
        assert locks(client) == 0
    finally:
        core.close()


def test_aborted_requests_release_even_when_their_lookup_lands_later(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    cache(client, PROMPT[:16])
    core = make_scheduler(server.address, save="off")  # locks: the lookups'
    try:
        r = info("x")
        assert core.probe(r, 0) == (None, False)
        core.build_meta()  # the lookup leaves ...
        assert core.finished(r, [], 0) is False  # ... and the request is aborted
        settle(core)
        core.build_meta()  # the landed lock is nobody's: released
        settle(core)
        assert locks(client) == 0 and core.reservations() == {}
    finally:
        core.close()


def test_an_unclaimed_reservation_lapses_after_its_lease(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    cache(client, PROMPT[:16])
    clock = Clock()
    core = make_scheduler(server.address, clock=clock, lease_ttl=5.0)
    try:
        r = info("l")
        assert answer(core, r) == (16, False)
        clock.now += 4.0
        assert core.probe(r, 0) == (16, False)  # a probe renews the lease
        clock.now += 4.0
        core.build_meta()
        settle(core)
        assert locks(client) == 1
        before = lapsed_tokens(server)
        clock.now += 5.1  # vLLM counted the hit and never came back
        core.build_meta()
        settle(core)
        assert locks(client) == 0 and core.stats.leases_expired == 1
        assert lapsed_tokens(server) == before + 16  # the service counts it, by outcome
        assert core.probe(r, 0) == (None, False)  # asked again: a fresh lookup
        core.finished(r, [], 0)
        core.build_meta()
        settle(core)
    finally:
        core.close()


def test_a_load_vllm_counts_beyond_the_reservation_fails_and_is_counted(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    """vLLM counts more external tokens than the reservation holds: the load fails (its
    blocks are recomputed) and the release tells the service why (load_failed)."""
    cache(client, PROMPT[:8])
    core = make_scheduler(server.address)
    try:
        r = info("f")
        assert answer(core, r) == (8, False)
        before = lapsed_tokens(server, "load_failed")
        core.allocated("f", [1, 2, 3, 4], 16)
        assert [load.fail for load in core.build_meta().loads] == [True]
        core.finished(r, [1, 2, 3, 4], 0)
        quiesce(core)
        assert locks(client) == 0
        assert lapsed_tokens(server, "load_failed") == before + 8
    finally:
        core.close()


def test_allocation_without_external_tokens_releases(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    cache(client, PROMPT[:8])
    core = make_scheduler(server.address, save="off")  # locks: the lookups'
    try:
        r = info("z")
        assert answer(core, r) == (8, False)
        core.allocated("z", [7, 8, 9], 0)  # e.g. MultiConnector chose another child
        assert core.build_meta().loads == []
        settle(core)
        assert locks(client) == 0
    finally:
        core.close()


def test_no_lookup_when_vllm_has_every_whole_block(server: ServerThread) -> None:
    core = make_scheduler(server.address)
    try:
        assert core.probe(info("s"), 16) == (0, False)
        assert core.probe(info("t", PROMPT[:4]), 0) == (0, False)  # no whole block left
        assert core.stats.lookups == 0
    finally:
        core.close()


def test_multimodal_and_embedding_requests_miss_and_are_not_saved(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    cache(client, PROMPT[:16])
    core = make_scheduler(server.address)
    try:
        for r in (info("mm", multimodal=True), info("pe", prompt_embeds=True)):
            assert core.probe(r, 0) == (0, False)
            assert core.finished(r, [1, 2, 3, 4, 5], 18) is False
        assert core.stats.lookups == 0 and core.stats.misses_ineligible == 2
    finally:
        core.close()


def test_namespaces_keep_lora_and_salt_apart(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    key = extra_key("adapter-1", None)
    cache(client, PROMPT[:16], key)
    core = make_scheduler(server.address)
    try:
        assert answer(core, info("plain")) == (0, False)
        assert answer(core, info("lora", lora_name="adapter-1")) == (16, False)
        assert answer(core, info("salted", lora_name="adapter-1", cache_salt="s")) == (0, False)
        for r in ("plain", "lora", "salted"):
            core.finished(info(r), [], 0)
        core.build_meta()
        settle(core)
    finally:
        core.close()


def test_a_save_stores_whole_blocks_once_every_worker_is_done(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    core = make_scheduler(server.address)
    try:
        tokens = [*PROMPT, 7, 8, 9]  # prompt (18) and 3 output tokens
        r = RequestInfo("w", tokens, len(PROMPT))
        assert core.finished(r, [3, 4, 5, 6, 7, 8], 20) is True  # keep the blocks
        core.build_meta()
        settle(core)
        (save,) = core.build_meta().saves
        assert (save.start, len(save.slots), list(save.block_ids)) == (0, 16, [3, 4, 5, 6, 7, 8])
        assert client.match("v", PROMPT).prefix_len == 0  # not before the workers
        core.sends_done({"w"})
        settle(core)
        assert client.match("v", PROMPT).prefix_len == 16
        assert core.stats.saves == 1 and not core.has_pending_saves()
    finally:
        core.close()


def retained(server: ServerThread) -> int:
    return int(server.run(lambda: server.service.engines["v"].retentions.retained_tokens()))


def test_a_requests_retention_goes_with_its_save_and_its_lookup(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    """``kv_transfer_params`` of ``{"prefixcache": {...}}`` (RequestInfo.retention)
    retains what the save inserts, and a later lookup renews it."""
    core = make_scheduler(server.address)
    try:
        hint = Retention(600, "high")
        r = RequestInfo("kept", [*PROMPT, 7, 8], len(PROMPT), retention=hint)
        assert core.finished(r, [3, 4, 5, 6, 7], 18) is True
        core.build_meta()
        settle(core)
        core.build_meta()
        core.sends_done({"kept"})
        settle(core)
        assert client.match("v", PROMPT).prefix_len == 16
        assert retained(server) == 16
        client.retain("v", PROMPT, 0)  # ended: the lookup's hint sets it again
        assert retained(server) == 0
        assert answer(core, info("again", retention=hint)) == (16, False)
        assert retained(server) == 16
        core.finished(info("again"), [], 0)
        quiesce(core)
    finally:
        core.close()


def test_a_save_of_what_is_cached_copies_nothing(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    cache(client, PROMPT[:8])
    core = make_scheduler(server.address)
    try:
        assert core.finished(info("d"), [1, 2, 3, 4, 5], 18) is True
        core.build_meta()
        settle(core)
        (save,) = core.build_meta().saves
        assert (save.start, len(save.slots)) == (8, 8)  # only the new half
        core.sends_done({"d"})
        settle(core)
        assert core.finished(info("e"), [1, 2, 3, 4, 5], 18) is True
        core.build_meta()
        settle(core)
        (save,) = core.build_meta().saves
        assert len(save.slots) == 0  # all cached: the workers only report it done
        core.sends_done({"e"})
        settle(core)
    finally:
        core.close()


def test_the_service_down_means_misses_and_skipped_saves(tmp_path: object) -> None:
    core = make_scheduler(f"unix:{tmp_path}/nobody.sock", timeout=0.3, wait_shadow=False)
    try:
        r = info("down")
        assert answer(core, r) == (0, False)
        assert core.finished(r, [1, 2, 3, 4, 5], 18) is True
        core.build_meta()
        settle(core)
        (save,) = core.build_meta().saves
        assert len(save.slots) == 0  # nothing to copy; vLLM frees the blocks
        core.sends_done({"down"})
        # Skipped twice: the save's Match at the first probe, and the finish's.
        assert core.stats.lookup_errors == 1 and core.stats.saves_skipped == 2
        # Right after a failure, lookups are answered "miss" without waiting out a
        # deadline each.
        assert answer(core, info("next")) == (0, False)
        assert core.backend.held_back >= 2  # type: ignore[attr-defined]
    finally:
        core.close()


@pytest.mark.parametrize(
    ("num_tokens", "expected"), [(0, 0), (1, 0), (4, 0), (5, 4), (8, 4), (9, 8)]
)
def test_lookup_leaves_the_last_token_to_compute(num_tokens: int, expected: int) -> None:
    assert lookup_len(num_tokens, BLOCK) == expected


def test_save_len_takes_whole_computed_blocks_of_the_chosen_tokens() -> None:
    r = RequestInfo("q", list(range(30)), 18)
    assert save_len(r, 29, 8, BLOCK, "prompt") == 16
    assert save_len(r, 29, 8, BLOCK, "all") == 28
    assert save_len(r, 29, 5, BLOCK, "all") == 20  # blocks vLLM still holds
    assert save_len(r, 29, 8, BLOCK, "off") == 0


def test_extra_keys_are_injective_and_bounded() -> None:
    assert extra_key(None, None) is None
    keys = {extra_key(a, b) for a in (None, "a", "a,b", "") for b in (None, "b", "", ",")}
    assert len(keys) == 16
    assert len(extra_key("l" * 1000, "s") or "") < 100


def test_bad_settings_are_refused_with_the_key_named() -> None:
    with pytest.raises(ValueError, match="'model'"):
        ConnectorConfig.from_extra({})
    with pytest.raises(ValueError, match="unknown key"):
        ConnectorConfig.from_extra({"model": "m", "lease_tll": 3})
    with pytest.raises(ValueError, match="'save'"):
        ConnectorConfig.from_extra({"model": "m", "save": "yes"})
    with pytest.raises(ValueError, match="'lease_ttl'"):
        ConnectorConfig.from_extra({"model": "m", "lease_ttl": 0})
    assert ConnectorConfig.from_extra({"model": "m", "timeout": 1}).timeout == 1


def test_disabled_by_a_worker_it_looks_nothing_up_and_saves_nothing(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    """A worker disabled the connector (its step output says so): the reservations
    not yet loading are released, so are the saves of running requests, and no later
    probe looks up, no finish saves."""
    cache(client, PROMPT[:12])
    core = make_scheduler(server.address)
    try:
        assert answer(core, info("r1")) == (12, False)
        assert locks(client) == 2  # the hit's, and the save's (its 4 slots allocated)
        assert client.stats("v")["v"].session_slots == 4
        core.disable("layer 'l0': an unknown backend")
        quiesce(core)
        assert locks(client) == 0
        lookups = core.stats.lookups
        assert core.probe(info("r1"), 0) == (0, False)
        assert core.probe(info("r2"), 0) == (0, False)
        assert not core.finished(info("r3"), [1, 2, 3, 4, 5], len(PROMPT))
        quiesce(core)
        assert core.stats.lookups == lookups and core.stats.saves == 0
        assert client.stats("v")["v"].session_slots == 0
    finally:
        core.close()


def test_vllm_steps_on_until_a_finished_requests_lock_is_released(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    """A loaded hit's lock outlives its request by two steps (the load may run a step
    late), and its save concluded while it ran: with no request left, the core still
    asks vLLM to step (``has_pending_work``) until the release is out, so that an idle
    engine holds no lock."""
    cache(client, PROMPT[:16])
    core = make_scheduler(server.address)
    try:
        r = info("l")
        assert answer(core, r) == (16, False)
        core.allocated("l", [1, 2, 3, 4, 5], 16)
        assert len(core.build_meta().loads) == 1
        assert not core.finished(r, [1, 2, 3, 4, 5], 17)  # the tree has the prompt
        assert not core.has_pending_saves() and core.has_pending_work()
        steps = 0
        while core.has_pending_work():
            core.build_meta()
            settle(core)
            steps += 1
            assert steps <= 4
        assert locks(client) == 0
    finally:
        core.close()
