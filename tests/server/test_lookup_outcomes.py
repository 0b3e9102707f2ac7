"""Lookup outcomes and the hit-rate ceiling, through a real gRPC server and a
real scrape of /metrics: each outcome caused on purpose, then counted and explained.

Model ``p``: page size 4, 64 slots. Prompt A (16 tokens, 4 pages) is cached under the
namespace ``tenant-a`` and looked up from the default namespace (miss_namespace),
evicted and asked again (miss_evicted), asked with an unaligned tail (below_page),
locked by a session whose lease then lapses (lease_expired), released unused with a
connector's reason (load_failed), and a lookup is refused once a session holds every
slot (capacity).
"""

from __future__ import annotations

import time

import grpc
import pytest
from harness import pb, running, stub_for, toks
from test_metrics import scrape, value

from prefixcache.cache.hashing import hash_token_ids
from prefixcache.server.config import ModelConfig, PoolConfig
from prefixcache.server.engine.lookups import OUTCOMES

MODEL = ModelConfig(name="p", page_size=4, pool=PoolConfig(size=64, k_heads=1, k_head_dim=4))
A = list(range(1, 17))
C = list(range(200, 216))
NS = "tenant-a"
OUT = pb.LookupOutcome


def _outcomes(samples: dict) -> dict[str, float]:
    return {
        o: value(samples, "prefixcache_lookup_tokens_total", model="p", outcome=o) for o in OUTCOMES
    }


def _explain(stub, tokens, extra_key=None) -> pb.ExplainResponse:
    req = pb.ExplainRequest(model="p", token_ids=toks(tokens))
    if extra_key is not None:
        req.extra_key = extra_key
    return stub.Explain(req)


def _ranges(reply: pb.ExplainResponse) -> list[tuple[str, int, int]]:
    return [(OUT.Name(r.outcome), r.start, r.end) for r in reply.ranges]


def _cache(stub, sid: str, tokens: list[int], extra_key: str) -> None:
    m = stub.Match(
        pb.MatchRequest(
            model="p",
            token_ids=toks(tokens),
            extra_key=extra_key,
            session_id=sid,
            lock=True,
            allocate=True,
        )
    )
    stub.Insert(
        pb.InsertRequest(
            model="p",
            token_ids=toks(tokens),
            extra_key=extra_key,
            session_id=sid,
            slot_indices=m.slot_indices + m.allocated_slots,
            release_lock_id=m.lock_id,
        )
    )


def test_each_outcome_counted_and_explained(tmp_path) -> None:
    with running(
        tmp_path, [MODEL], metrics_host="127.0.0.1", metrics_port=0, session_ttl_min=0.1
    ) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            s0 = scrape(srv.server.metrics_port)
            assert _outcomes(s0) == dict.fromkeys(OUTCOMES, 0)  # every outcome from 0
            assert value(s0, "prefixcache_hit_ratio_ceiling", model="p") == 0
            sid = stub.OpenSession(pb.OpenSessionRequest()).session_id

            _cache(stub, sid, A, NS)  # miss_cold 16
            stub.Match(
                pb.MatchRequest(model="p", token_ids=toks([*A, 7, 7]), extra_key=NS)
            )  # hit 16, tail 2
            stub.Match(pb.MatchRequest(model="p", token_ids=toks(A)))  # miss_namespace 16
            why = _explain(stub, A)
            assert _ranges(why) == [("LOOKUP_OUTCOME_MISS_NAMESPACE", 0, 16)]
            assert why.stop == OUT.LOOKUP_OUTCOME_MISS_NAMESPACE and why.prefix_len == 0
            assert why.other_extra_key == NS

            assert stub.Evict(pb.EvictRequest(model="p", num_tokens=64)).evicted_tokens == 16
            stub.Match(
                pb.MatchRequest(model="p", token_ids=toks(A), extra_key=NS)
            )  # miss_evicted 16
            why = _explain(stub, [*A, 1], NS)
            assert _ranges(why) == [
                ("LOOKUP_OUTCOME_MISS_EVICTED", 0, 16),
                ("LOOKUP_OUTCOME_BELOW_PAGE", 16, 17),
            ]
            assert why.stop == OUT.LOOKUP_OUTCOME_MISS_EVICTED and why.num_tokens == 17
            stub.Match(pb.MatchRequest(model="p", token_ids=toks(C), extra_key=NS))  # miss_cold 16
            assert _ranges(_explain(stub, C, NS)) == [("LOOKUP_OUTCOME_MISS_COLD", 0, 16)]

            _cache(stub, sid, A, NS)  # miss_evicted 16
            why = _explain(stub, A + C[:5], NS)
            assert _ranges(why) == [
                ("LOOKUP_OUTCOME_HIT", 0, 16),
                ("LOOKUP_OUTCOME_MISS_COLD", 16, 20),
                ("LOOKUP_OUTCOME_BELOW_PAGE", 20, 21),
            ]
            assert why.prefix_len == 16 and why.stop == OUT.LOOKUP_OUTCOME_MISS_COLD

            # A reservation whose lease lapses before it is used: lease_expired 16.
            short = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=0.1)).session_id
            held = stub.Match(
                pb.MatchRequest(
                    model="p", token_ids=toks(A), extra_key=NS, session_id=short, lock=True
                )
            )  # hit 16
            assert held.lock_id and held.prefix_len == 16
            deadline = time.monotonic() + 10
            while _outcomes(scrape(srv.server.metrics_port))["lease_expired"] < 16:
                assert time.monotonic() < deadline, "the lease never lapsed"
                time.sleep(0.05)

            # A connector that could not load its hit says so as it lets go: load_failed.
            held = stub.Match(
                pb.MatchRequest(
                    model="p", token_ids=toks(A), extra_key=NS, session_id=sid, lock=True
                )
            )  # hit 16
            stub.Unlock(
                pb.UnlockRequest(
                    session_id=sid,
                    lock_id=held.lock_id,
                    unused_outcome=OUT.LOOKUP_OUTCOME_LOAD_FAILED,
                )
            )
            with pytest.raises(grpc.RpcError) as bad:  # not a reason a client gives
                stub.Unlock(
                    pb.UnlockRequest(
                        session_id=sid, lock_id=1, unused_outcome=OUT.LOOKUP_OUTCOME_HIT
                    )
                )
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            # Every slot held by a session: a lookup that allocates is refused (capacity 8).
            while True:
                try:
                    stub.Alloc(pb.AllocRequest(model="p", num_slots=4, session_id=sid))
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    break
            other = stub.OpenSession(pb.OpenSessionRequest()).session_id
            with pytest.raises(grpc.RpcError) as refused:
                stub.Match(
                    pb.MatchRequest(
                        model="p", token_ids=toks(C[:8]), session_id=other, allocate=True
                    )
                )
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "cannot supply" in refused.value.details()  # the pool's, not a quota's

            s = scrape(srv.server.metrics_port)
            got = _outcomes(s)
            assert got == {
                "hit": 48,
                "miss_cold": 32,
                "miss_evicted": 32,
                "miss_namespace": 16,
                "below_page": 2,
                "load_failed": 16,
                "lease_expired": 16,
                "capacity": 8,
            }
            answered = sum(
                got[o] for o in ("hit", "miss_cold", "miss_evicted", "miss_namespace", "below_page")
            )
            assert answered == value(s, "prefixcache_query_tokens_total", model="p")
            # 8 lookups of one 16-token block (4 pages); 3 distinct blocks (A in two
            # namespaces, C).
            assert value(s, "prefixcache_lookup_pages_total", model="p") == 8
            assert value(s, "prefixcache_lookup_distinct_pages", model="p") == pytest.approx(
                3, abs=0.1
            )
            assert value(s, "prefixcache_hit_ratio_ceiling", model="p") == pytest.approx(
                1 - 3 / 8, abs=0.02
            )

            stats = stub.Stats(pb.StatsRequest(model="p")).models[0]
            assert dict(stats.lookup_tokens_total) == {k: int(v) for k, v in got.items()}
            assert stats.pages_requested_total == 8
            assert stats.hit_ratio_ceiling == pytest.approx(1 - 3 / 8, abs=0.02)
        srv.check_integrity()


def _chain(tokens: list[int], page: int = 4) -> list[str]:
    """The chained page hashes of ``tokens``' whole pages (SGLang's page keys)."""
    chain: list[str] = []
    for i in range(0, len(tokens) - page + 1, page):
        chain.append(hash_token_ids(tokens[i : i + page], chain[-1] if chain else None))
    return chain


def test_page_hash_lookups_and_explain(tmp_path) -> None:
    """ExistsPages (SGLang's batch_exists) misses by outcome, and Explain by prompt_hash."""
    with running(tmp_path, [MODEL], metrics_host="127.0.0.1", metrics_port=0) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
            _cache(stub, sid, A, NS)
            chain = _chain(A[:16])
            packed = b"".join(bytes.fromhex(h) for h in chain)

            def exists(extra_key=None) -> int:
                req = pb.ExistsPagesRequest(model="p", page_hashes=packed)
                if extra_key is not None:
                    req.extra_key = extra_key
                return stub.ExistsPages(req).leading_pages

            def by_hash(extra_key=None) -> pb.ExplainResponse:
                req = pb.ExplainRequest(model="p", prompt_hash=chain[-1])
                if extra_key is not None:
                    req.extra_key = extra_key
                return stub.Explain(req)

            assert exists(NS) == 4  # hit 16
            assert exists() == 0  # miss_namespace 16
            why = by_hash()
            assert _ranges(why) == [("LOOKUP_OUTCOME_MISS_NAMESPACE", 0, 16)]
            assert why.other_extra_key == NS
            assert _ranges(by_hash(NS)) == [("LOOKUP_OUTCOME_HIT", 0, 16)]
            stub.Evict(pb.EvictRequest(model="p", num_tokens=64))
            assert exists(NS) == 0  # miss_evicted 16
            assert _ranges(by_hash(NS)) == [("LOOKUP_OUTCOME_MISS_EVICTED", 0, 4)]
            assert _ranges(by_hash("elsewhere")) == [("LOOKUP_OUTCOME_MISS_COLD", 0, 4)]
            with pytest.raises(grpc.RpcError) as bad:
                stub.Explain(pb.ExplainRequest(model="p", prompt_hash="xyz"))
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            s = scrape(srv.server.metrics_port)
            got = _outcomes(s)
            assert (got["hit"], got["miss_namespace"], got["miss_evicted"]) == (16, 16, 16)
            assert got["miss_cold"] == 16  # the first Match of A, when it was cached
        srv.check_integrity()


def test_the_client_reports_an_unused_hit(tmp_path) -> None:
    """``unlock(unused=...)`` of the sync and asyncio clients reaches the counters."""
    import asyncio

    from prefixcache.client import AsyncPrefixCacheClient, PrefixCacheClient

    with running(tmp_path, [MODEL]) as srv:
        channel, stub = stub_for(srv.address)
        with channel, PrefixCacheClient(srv.address) as client:
            sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
            _cache(stub, sid, A, None)

            def locked() -> int:
                return stub.Match(
                    pb.MatchRequest(model="p", token_ids=toks(A), session_id=sid, lock=True)
                ).lock_id

            client.unlock(locked(), session=sid, unused="load_failed")
            with pytest.raises(ValueError, match="unused"):
                client.unlock(locked(), session=sid, unused="hit")

            async def release() -> None:
                async with AsyncPrefixCacheClient(srv.address) as aio:
                    await aio.unlock(locked(), session=sid, unused="lease_expired")

            asyncio.run(release())
            counts = stub.Stats(pb.StatsRequest(model="p")).models[0].lookup_tokens_total
            assert (counts["load_failed"], counts["lease_expired"]) == (16, 16)


EVERY_KIND_PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]  # whole pages of every kind


def _cache_kind(stub, sid: str, name: str, prompt: list[int]) -> None:
    """Cache ``prompt`` in model ``name`` of any kind (its slot, state, version)."""
    m = stub.Match(
        pb.MatchRequest(model=name, token_ids=toks(prompt), session_id=sid, allocate=True)
    )
    ins = pb.InsertRequest(
        model=name, token_ids=toks(prompt), session_id=sid, slot_indices=m.allocated_slots
    )
    if m.HasField("allocated_state_slot"):
        ins.state_slot = m.allocated_state_slot
    if m.HasField("allocated_slot_version"):
        ins.slot_version = m.allocated_slot_version
    stub.Insert(ins)


def test_every_kind_counts_an_unused_reservation(tmp_path) -> None:
    """A Match with lock is a reservation on every kind that caches, the slot kind's
    too (whose lapsed reservations counted nothing before): released with a connector's
    reason (load_failed) or lapsed with its lease (lease_expired), it counts the tokens
    the Match hit."""
    from harness import EVERY_KIND

    with running(tmp_path, EVERY_KIND, session_ttl_min=0.1) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
            cached = [m for m in EVERY_KIND if m.kind != "chunk"]  # a chunk caches none
            hits = {}
            for model in cached:
                _cache_kind(stub, sid, model.name, EVERY_KIND_PROMPT)
                held = stub.Match(
                    pb.MatchRequest(
                        model=model.name,
                        session_id=sid,
                        token_ids=toks(EVERY_KIND_PROMPT),
                        lock=True,
                    )
                )
                assert held.lock_id and held.prefix_len, model.name
                hits[model.name] = held.prefix_len
                stub.Unlock(
                    pb.UnlockRequest(
                        session_id=sid,
                        lock_id=held.lock_id,
                        unused_outcome=OUT.LOOKUP_OUTCOME_LOAD_FAILED,
                    )
                )
            # Renewed by each Match (a second is ample between two), then let lapse.
            short = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=1)).session_id
            for model in cached:
                assert stub.Match(
                    pb.MatchRequest(
                        model=model.name,
                        session_id=short,
                        token_ids=toks(EVERY_KIND_PROMPT),
                        lock=True,
                    )
                ).lock_id
            deadline = time.monotonic() + 10
            while stub.Stats(pb.StatsRequest()).sessions > 1:
                assert time.monotonic() < deadline, "the lease never lapsed"
                time.sleep(0.05)
            for model in cached:
                counts = stub.Stats(pb.StatsRequest(model=model.name)).models[0].lookup_tokens_total
                assert (counts["load_failed"], counts["lease_expired"]) == (
                    hits[model.name],
                ) * 2, model.name
        srv.check_integrity()


def test_every_kind_counts_its_lookups(tmp_path) -> None:
    """Each cache kind's lookups (Match and Step admissions) add up: hit + misses +
    below_page = the tokens looked up; Explain answers tree kinds and refuses the rest."""
    from harness import EVERY_KIND

    with running(tmp_path, EVERY_KIND) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
            for model in EVERY_KIND:
                name = model.name
                prompt = EVERY_KIND_PROMPT
                _cache_kind(stub, sid, name, prompt)
                step = stub.Step(
                    pb.StepRequest(
                        model=name,
                        session_id=sid,
                        admits=[pb.StepAdmit(token_ids=toks([*prompt, 7]))],
                    )
                )
                assert step.admits[0].HasField("admit"), step.admits[0].error
                stub.Match(pb.MatchRequest(model=name, token_ids=toks([8, *prompt])))
                stats = stub.Stats(pb.StatsRequest(model=name)).models[0]
                counts = stats.lookup_tokens_total
                answered = sum(
                    counts[o]
                    for o in ("hit", "miss_cold", "miss_evicted", "miss_namespace", "below_page")
                )
                assert answered == stats.match_tokens_total, name
                assert counts["hit"] == stats.hit_tokens_total, name
                if model.kind in ("radix", "swa", "mamba"):
                    why = stub.Explain(pb.ExplainRequest(model=name, token_ids=toks([*prompt, 7])))
                    assert why.num_tokens == len(prompt) + 1
                    assert sum(r.end - r.start for r in why.ranges) == why.num_tokens
                else:
                    with pytest.raises(grpc.RpcError) as refused:
                        stub.Explain(pb.ExplainRequest(model=name, token_ids=toks(prompt)))
                    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        srv.check_integrity()


def test_a_tenant_learns_nothing_of_another_tenants_cache(tmp_path) -> None:
    """Explain names only the tenant's own namespaces, and a tenant's Stats carry no
    outcome counts (they sum every tenant's lookups); the operator sees both."""
    from prefixcache.server.config import TenantConfig

    tenants = (
        TenantConfig("acme", "tok-acme", namespaces=("acme/",)),
        TenantConfig("beta", "tok-beta", namespaces=("beta/",)),
    )
    acme, beta = (("authorization", "Bearer tok-acme"),), (("authorization", "Bearer tok-beta"),)
    operator = (("authorization", "Bearer t0k"),)
    with running(tmp_path, [MODEL], token="t0k", tenants=tenants) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            sid = stub.OpenSession(pb.OpenSessionRequest(), metadata=beta).session_id
            m = stub.Match(
                pb.MatchRequest(
                    model="p", token_ids=toks(A), extra_key="beta/x", session_id=sid, allocate=True
                ),
                metadata=beta,
            )
            stub.Insert(
                pb.InsertRequest(
                    model="p",
                    token_ids=toks(A),
                    extra_key="beta/x",
                    session_id=sid,
                    slot_indices=m.allocated_slots,
                ),
                metadata=beta,
            )
            ask = pb.ExplainRequest(model="p", token_ids=toks(A), extra_key="acme/x")
            assert _ranges(stub.Explain(ask, metadata=acme)) == [
                ("LOOKUP_OUTCOME_MISS_COLD", 0, 16)
            ]
            why = stub.Explain(ask, metadata=operator)
            assert _ranges(why) == [("LOOKUP_OUTCOME_MISS_NAMESPACE", 0, 16)]
            assert why.other_extra_key == "beta/x"
            with pytest.raises(grpc.RpcError) as denied:  # not its namespace to ask of
                stub.Explain(
                    pb.ExplainRequest(model="p", token_ids=toks(A), extra_key="beta/x"),
                    metadata=acme,
                )
            assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
            mine = stub.Stats(pb.StatsRequest(model="p"), metadata=acme).models[0]
            assert not mine.lookup_tokens_total and mine.pages_requested_total == 0
            assert (
                stub.Stats(pb.StatsRequest(model="p"), metadata=operator)
                .models[0]
                .lookup_tokens_total["miss_cold"]
                == 16
            )


def test_mamba_kv_without_state_is_not_a_hit(tmp_path) -> None:
    """A Mamba model's cached KV with no state to resume from (the split point of two
    prompts) is miss_evicted, not hit: a match cannot use it."""
    from harness import EVERY_KIND

    mamba = [m for m in EVERY_KIND if m.kind == "mamba"]
    with running(tmp_path, mamba, metrics_host="127.0.0.1", metrics_port=0) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            sid = stub.OpenSession(pb.OpenSessionRequest()).session_id

            def cache(tokens: list[int]) -> None:
                m = stub.Match(
                    pb.MatchRequest(
                        model="h", token_ids=toks(tokens), session_id=sid, allocate=True
                    )
                )
                stub.Insert(
                    pb.InsertRequest(
                        model="h",
                        token_ids=toks(tokens),
                        session_id=sid,
                        slot_indices=m.slot_indices + m.allocated_slots,
                        state_slot=m.allocated_state_slot,
                    )
                )

            cache([1, 2, 3, 4, 5, 6, 7, 8])
            cache([1, 2, 3, 4, 9, 9])  # splits at 4: no state there
            ask = toks([1, 2, 3, 4, 10, 10])
            assert _ranges(stub.Explain(pb.ExplainRequest(model="h", token_ids=ask))) == [
                ("LOOKUP_OUTCOME_MISS_EVICTED", 0, 4),
                ("LOOKUP_OUTCOME_MISS_COLD", 4, 6),
            ]
            assert stub.Match(pb.MatchRequest(model="h", token_ids=ask)).prefix_len == 0
            got = scrape(srv.server.metrics_port)
            # 4 for this Match, 4 for the second cache()'s (the state was at 8 then).
            assert (
                value(got, "prefixcache_lookup_tokens_total", model="h", outcome="miss_evicted")
                == 8
            )
        srv.check_integrity()


def test_a_lookup_refused_for_room_counts_capacity_on_every_kind(tmp_path) -> None:
    """A Match or Step admission that allocates, refused because sessions hold every
    slot, counts all of its tokens as capacity, on every kind (slot models too)."""
    from harness import EVERY_KIND

    with running(tmp_path, EVERY_KIND, max_session_slots=10**6) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            hog = stub.OpenSession(pb.OpenSessionRequest()).session_id
            sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
            prompt = [3, 1, 4, 1, 5, 9, 2, 6]
            for model in EVERY_KIND:
                name, n = model.name, 1024
                while n:  # the hog takes every slot there is
                    try:
                        stub.Alloc(pb.AllocRequest(model=name, num_slots=n, session_id=hog))
                    except grpc.RpcError as exc:
                        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, name
                        n //= 2
                with pytest.raises(grpc.RpcError) as refused:
                    stub.Match(
                        pb.MatchRequest(
                            model=name, token_ids=toks(prompt), session_id=sid, allocate=True
                        )
                    )
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, name
                step = stub.Step(
                    pb.StepRequest(
                        model=name,
                        session_id=sid,
                        admits=[pb.StepAdmit(token_ids=toks([*prompt, 7]), allocate=True)],
                    )
                )
                assert step.admits[0].HasField("error"), name
                counts = stub.Stats(pb.StatsRequest(model=name)).models[0].lookup_tokens_total
                assert counts["capacity"] == 2 * len(prompt) + 1, (name, dict(counts))
                assert sum(counts.values()) == counts["capacity"], name  # nothing else
        srv.check_integrity()


def test_a_page_lookup_lock_counts_its_run_not_its_prefix(tmp_path) -> None:
    """GetPages locks each run of pages it found on the node that ends the run, whose
    prefix starts before the run when the request does (SGLang asks from where its own
    cache stops). ExistsPages counted the run's pages as the hit, so a GetPages lock
    released unused (load_failed) or lapsed with its lease (lease_expired) counts the
    run's tokens, 12 here, not the 16 its lock protects (which its quota counts)."""
    with running(tmp_path, [MODEL], session_ttl_min=0.1) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
            _cache(stub, sid, A, None)
            chain = _chain(A[:16])
            tail = b"".join(bytes.fromhex(h) for h in chain[1:])  # pages 2-4 of 4

            def counts() -> dict[str, int]:
                return dict(stub.Stats(pb.StatsRequest(model="p")).models[0].lookup_tokens_total)

            def get(session_id: str) -> pb.GetPagesResponse:
                assert (
                    stub.ExistsPages(
                        pb.ExistsPagesRequest(model="p", page_hashes=tail)
                    ).leading_pages
                    == 3
                )  # hit 12
                got = stub.GetPages(
                    pb.GetPagesRequest(model="p", page_hashes=tail, session_id=session_id)
                )
                assert got.found_pages == 3 and len(got.lock_ids) == 1
                return got

            before = counts()
            locked = get(sid)
            assert stub.Stats(pb.StatsRequest(model="p")).models[0].locks == 1
            stub.Unlock(
                pb.UnlockRequest(
                    session_id=sid,
                    lock_id=locked.lock_ids[0],
                    unused_outcome=OUT.LOOKUP_OUTCOME_LOAD_FAILED,
                )
            )
            assert counts()["load_failed"] == 12

            short = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=0.1)).session_id
            get(short)
            deadline = time.monotonic() + 10
            while counts()["lease_expired"] == before["lease_expired"]:
                assert time.monotonic() < deadline, "the lease never lapsed"
                time.sleep(0.05)
            after = counts()
            assert (after["hit"] - before["hit"], after["load_failed"], after["lease_expired"]) == (
                24,
                12,
                12,
            )
            assert stub.Stats(pb.StatsRequest(model="p")).models[0].locks == 0
        srv.check_integrity()
