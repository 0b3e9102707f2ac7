"""vLLM's ``kv_role`` (``config.KVRole``) on the engine-free cores, in vLLM's order, against a
real server: a producer never looks up and inserts a finished request's save before
the step's outputs leave (the calls vLLM makes before it sends them return after the
insert); a consumer loads and never saves; an unknown role, or a setting the role
rules out, is an error at start."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from harness import ServerThread
from integrations.vllm.vllm_support import DIM, Clock, make_caches, make_worker, settle
from integrations.vllm.vllm_support import token_rows as _token_rows

from prefixcache.client import PrefixCacheClient
from prefixcache.integrations.vllm.backend import RpcBackend
from prefixcache.integrations.vllm.config import ROLES, kv_role, role_config
from prefixcache.integrations.vllm.keys import RequestInfo
from prefixcache.integrations.vllm.layout import split_kv
from prefixcache.integrations.vllm.scheduler import SchedulerCore
from prefixcache.integrations.vllm.worker import WorkerCore

PROMPT = list(range(900, 918))  # 18 tokens: 4 whole blocks to save, 16 to look up
BLOCKS = [2, 5, 7, 9, 11]


def test_each_role_loads_and_saves_what_it_names() -> None:
    extra = {"model": "v", "timeout": 1.5}
    got = {}
    for name in ROLES:
        role = kv_role(name)
        config = role_config(role, extra)
        got[name] = (
            role.loads,
            role.saves,
            role.orders_saves,
            config.load,
            config.save,
            config.fast_miss,
        )
        assert config.timeout == 1.5  # the other settings stay
    assert got == {
        "kv_producer": (False, True, True, False, "prompt", True),
        "kv_consumer": (True, False, False, True, "off", False),  # looks every request up
        "kv_both": (True, True, False, True, "prompt", True),
    }


@pytest.mark.parametrize("value", ["kv_prod", "KV_BOTH", "", None, 1, "kv_disagg"])
def test_an_unknown_role_is_an_error_naming_the_roles(value: object) -> None:
    with pytest.raises(ValueError, match="'kv_role' must be one of kv_producer, kv_consumer"):
        kv_role(value)


@pytest.mark.parametrize(
    ("name", "extra", "message"),
    [
        ("kv_producer", {"load": True}, "'load' is true, but kv_role 'kv_producer'"),
        ("kv_consumer", {"save": "prompt"}, "'save' is 'prompt', but kv_role 'kv_consumer'"),
        ("kv_consumer", {"save": "all"}, "'save' is 'all', but kv_role 'kv_consumer'"),
    ],
)
def test_a_setting_the_role_rules_out_is_refused(
    name: str, extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        role_config(kv_role(name), {"model": "v", **extra})


def test_settings_the_role_agrees_with_are_taken() -> None:
    assert not role_config(kv_role("kv_producer"), {"model": "v", "load": False}).load
    assert role_config(kv_role("kv_consumer"), {"model": "v", "save": "off"}).save == "off"
    assert role_config(kv_role("kv_consumer"), {"model": "v", "fast_miss": True}).fast_miss
    with pytest.raises(ValueError, match="unknown key"):  # the settings' own checks too
        role_config(kv_role("kv_consumer"), {"model": "v", "saev": "off"})


# ----------------------------------------------------------- the cores, per role


def scheduler(address: str, role: str, **settings: object) -> SchedulerCore:
    """A scheduler core as the connector makes it for ``role``."""
    kv = kv_role(role)
    config = role_config(kv, {"model": "v", "target": address, **settings})
    backend = RpcBackend(config)
    if backend.shadow is not None and not backend.wait_fast_miss(10.0):
        raise TimeoutError("the connector's shadow index got no snapshot")
    return SchedulerCore(backend, config, 4, Clock(), ordered_saves=kv.orders_saves)


def forward(core: SchedulerCore, worker: WorkerCore, progress: dict[str, Any]) -> set[int]:
    """A step's metadata and its worker's copies: the copies the worker reports."""
    meta = core.build_meta((), progress)
    worker.start_step(meta)
    worker.end_step()
    return worker.take_copied()


def held(client: PrefixCacheClient, tokens: list[int]) -> tuple[int, list[torch.Tensor]]:
    """The service's cached prefix of ``tokens`` and each layer's K and V bytes, read
    under a lock."""
    with client.session(10.0) as s:
        hit = s.match("v", tokens, lock=True)
        kv = s.read_kv("v", hit.slots) if hit.prefix_len else None
        s.unlock(hit.lock_id)
    if kv is None:
        return 0, []
    return hit.prefix_len, [
        torch.stack([kv.k[n], kv.v[n]]).view(torch.uint8) for n in range(len(kv.k))
    ]


def rows(caches: dict[str, torch.Tensor], n: int) -> list[torch.Tensor]:
    return [
        _token_rows(split_kv(name, t, "kv_first", DIM), BLOCKS, n) for name, t in caches.items()
    ]


def after_the_insert(
    server: ServerThread, call: Callable[[], Any], before: Callable[[], Any] | None = None
) -> Any:
    """Run ``before``, then ``call``, while the server's loop is held up (a sidecar slow
    to answer): ``call`` must still be waiting half a second on, and return once the
    loop, let go, answered the insert."""
    go = threading.Event()
    server.loop.call_soon_threadsafe(go.wait, 30.0)
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(call()))
    try:
        if before is not None:
            before()
        thread.start()
        thread.join(0.5)
        early = not thread.is_alive()
    finally:
        go.set()
    thread.join(30.0)
    assert not early, "returned while the service could not have answered the insert"
    return out[0]


def cache(client: PrefixCacheClient, tokens: list[int]) -> None:
    with client.session(10.0) as s:
        reply = s.match("v", tokens, allocate=True)
        s.insert("v", tokens, reply.all_slots())


def matched_tokens(client: PrefixCacheClient) -> int:
    return client.stats("v")["v"].match_tokens_total


@pytest.mark.usefixtures("quiet")
def test_a_producer_inserts_the_save_before_the_steps_outputs_leave(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    """One token of output (the proxy's ``max_tokens=1``): the request finishes in the
    step that computes its prompt. Its first probe waits for the save's Match, so that
    the step copies the prompt; vLLM then calls ``finished`` and ``saves_copied``
    before it sends the step's outputs: once they returned, the prompt is cached, its
    KV the request's blocks'."""
    core = scheduler(server.address, "kv_producer")
    worker = make_worker(server.address)
    try:
        caches = make_caches("kv_first")
        worker.register(caches)
        a = RequestInfo("A", PROMPT, len(PROMPT))
        assert core.probe(a, 0) == (None, False)  # the save's Match goes out first
        core.build_meta()
        settle(core)
        assert core.probe(a, 0) == (0, False)
        core.allocated("A", BLOCKS, 0)
        copied = forward(core, worker, {"A": (18, BLOCKS)})
        assert copied  # the prompt's copy ran with the step that computed it
        assert not core.finished(a, BLOCKS, 18)  # nothing left to copy: no block held
        after_the_insert(server, lambda: core.saves_copied(copied))
        n, got = held(client, PROMPT)
        assert n == 16
        assert all(torch.equal(g, w) for g, w in zip(got, rows(caches, 16), strict=True))
        assert (core.stats.lookups, core.stats.saves, core.stats.inserts_unordered) == (0, 1, 0)
        assert not core.has_pending_saves()
    finally:
        core.close()
        worker.close()


@pytest.mark.usefixtures("quiet")
def test_a_producer_finishing_after_its_insert_went_out_waits_for_it(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    """Several tokens of output: the save inserts while the request still runs; the
    finish, a step later, returns once that insert is answered."""
    core = scheduler(server.address, "kv_producer")
    worker = make_worker(server.address)
    try:
        worker.register(make_caches("kv_first"))
        a = RequestInfo("A", PROMPT, len(PROMPT))
        core.probe(a, 0)
        core.build_meta()
        settle(core)
        core.probe(a, 0)
        core.allocated("A", BLOCKS, 0)
        copied = forward(core, worker, {"A": (18, BLOCKS)})
        assert not after_the_insert(
            server,
            lambda: core.finished(a, BLOCKS, 19),
            before=lambda: core.saves_copied(copied),  # the insert leaves; A runs on
        )
        assert held(client, PROMPT)[0] == 16
        assert core.stats.inserts_unordered == 0
    finally:
        core.close()
        worker.close()


@pytest.mark.usefixtures("quiet")
def test_a_producer_waits_for_an_unanswered_insert_no_longer_than_its_deadline(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    """The service does not answer the insert (its loop held up): the output goes after
    twice the call deadline, counted; the next calls do not wait for it again."""
    core = scheduler(server.address, "kv_producer", timeout=0.2)
    worker = make_worker(server.address)
    go = threading.Event()
    try:
        worker.register(make_caches("kv_first"))
        a = RequestInfo("A", PROMPT, len(PROMPT))
        core.probe(a, 0)
        core.build_meta()
        settle(core)
        core.probe(a, 0)
        core.allocated("A", BLOCKS, 0)
        copied = forward(core, worker, {"A": (18, BLOCKS)})
        core.finished(a, BLOCKS, 18)
        server.loop.call_soon_threadsafe(go.wait, 30.0)
        core.saves_copied(copied)
        assert core.stats.inserts_unordered == 1
        core.sends_done(())
        assert core.stats.inserts_unordered == 1  # not waited for twice
    finally:
        go.set()
        settle(core)
        core.build_meta()  # whatever the late answer queued (the slots given back)
        settle(core)
        core.close()
        worker.close()


@pytest.mark.usefixtures("quiet")
def test_a_producer_never_looks_up_a_cached_prompt(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    """The prompt is cached: the producer computes it all the same. The service sees
    the save's Match only (its 16 tokens), no lookup (16 more)."""
    cache(client, PROMPT[:16])
    before = matched_tokens(client)
    core = scheduler(server.address, "kv_producer")
    try:
        a = RequestInfo("A", PROMPT, len(PROMPT))
        answers = [core.probe(a, 0)]
        core.build_meta()
        settle(core)
        answers.append(core.probe(a, 0))
        assert answers == [(None, False), (0, False)]
        core.allocated("A", BLOCKS, 0)
        assert core.reservations() == {}
        assert not core.finished(a, BLOCKS, 18)  # the tree had it all: nothing to save
        settle(core)
        assert (core.stats.lookups, core.stats.hit_tokens, core.stats.loads) == (0, 0, 0)
        assert matched_tokens(client) - before == 16
    finally:
        core.close()


@pytest.mark.usefixtures("quiet")
def test_a_consumer_loads_and_never_saves(server: ServerThread, client: PrefixCacheClient) -> None:
    """A cached prompt is a hit the consumer loads; a prompt it computes itself is not
    saved: no save's Match, no slot, nothing inserted."""
    cache(client, PROMPT[:16])
    core = scheduler(server.address, "kv_consumer")
    worker = make_worker(server.address)
    try:
        worker.register(make_caches("kv_first"))
        a = RequestInfo("A", PROMPT, len(PROMPT))
        assert core.probe(a, 0) == (None, False)  # the lookup
        core.build_meta()
        settle(core)
        assert core.probe(a, 0) == (16, False)
        core.allocated("A", BLOCKS, 16)
        forward(core, worker, {"A": (18, BLOCKS)})
        assert worker.take_failed_loads() == set()
        assert not core.finished(a, BLOCKS, 19)
        other = list(range(2000, 2022))  # computed here, never seen by the service
        b = RequestInfo("B", other, len(other))
        assert core.probe(b, 0) == (None, False)  # its lookup, and no save's Match
        assert core.saving_during_run() == set()
        core.build_meta()
        settle(core)
        assert core.probe(b, 0) == (0, False)
        core.allocated("B", [1, 3, 4, 6, 8, 10], 0)
        forward(core, worker, {"B": (22, [1, 3, 4, 6, 8, 10])})
        assert not core.finished(b, [1, 3, 4, 6, 8, 10], 23)
        settle(core)
        assert client.stats("v")["v"].session_slots == 0
        assert held(client, other)[0] == 0
        assert (core.stats.loads, core.stats.load_tokens) == (1, 16)
        assert (core.stats.saves, core.stats.saves_skipped) == (0, 0)
    finally:
        core.close()
        worker.close()
