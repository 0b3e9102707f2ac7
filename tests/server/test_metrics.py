"""A real HTTP scrape of /metrics after a known sequence of calls: exact values."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from harness import pb, running, stub_for, toks
from prometheus_client.parser import text_string_to_metric_families


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def test_scrape_after_a_known_sequence(tmp_path) -> None:
    with running(tmp_path, metrics_host="127.0.0.1", metrics_port=0, session_ttl_min=0.1) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
            m = stub.Match(
                pb.MatchRequest(
                    model="m", token_ids=toks([1, 2, 3]), session_id=sid, lock=True, allocate=True
                )
            )
            stub.Insert(
                pb.InsertRequest(
                    model="m",
                    token_ids=toks([1, 2, 3]),
                    session_id=sid,
                    slot_indices=m.allocated_slots,
                    release_lock_id=m.lock_id,
                )
            )
            stub.Match(pb.MatchRequest(model="m", token_ids=toks([1, 2, 3, 4])))
            with pytest.raises(grpc.RpcError):
                stub.Match(pb.MatchRequest(model="nope", token_ids=toks([1])))
            stub.Alloc(pb.AllocRequest(model="m", num_slots=2, session_id=sid))
            ins = stub.Insert(
                pb.InsertRequest(
                    model="m",
                    token_ids=toks([5, 6]),
                    session_id=sid,
                    slot_indices=stub.Alloc(
                        pb.AllocRequest(model="m", num_slots=2, session_id=sid)
                    ).slot_indices,
                    lock=True,
                )
            )
            assert stub.Evict(pb.EvictRequest(model="m", num_tokens=100)).evicted_tokens == 3
            stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=0.1))
            time.sleep(0.6)  # that second session's lease lapses

            s = scrape(srv.server.metrics_port)
            assert value(s, "prefixcache_query_tokens_total", model="m") == 7
            assert value(s, "prefixcache_hit_tokens_total", model="m") == 3
            assert value(s, "prefixcache_rpc_requests_total", method="Match", code="OK") == 2
            assert value(s, "prefixcache_rpc_requests_total", method="Match", code="NOT_FOUND") == 1
            assert (
                value(s, "prefixcache_rpc_duration_seconds_count", method="Insert", code="OK") == 2
            )
            assert value(s, "prefixcache_cache_operations_total", model="m", operation="match") == 2
            assert (
                value(s, "prefixcache_cache_operations_total", model="m", operation="lock") == 1
            )  # the first match missed: no lock
            assert value(s, "prefixcache_evicted_tokens_total", model="m", reason="requested") == 3
            assert value(s, "prefixcache_evicted_tokens_total", model="m", reason="pressure") == 0
            assert value(s, "prefixcache_cached_tokens", model="m", state="evictable") == 0
            assert value(s, "prefixcache_cached_tokens", model="m", state="protected") == 2
            assert value(s, "prefixcache_pool_slots", model="m", state="session") == 2
            assert value(s, "prefixcache_pool_slots", model="m", state="used") == 4
            assert value(s, "prefixcache_pool_slots", model="m", state="free") == 252
            assert value(s, "prefixcache_pool_capacity_slots", model="m") == 256
            assert value(s, "prefixcache_locks", model="m") == 1
            assert value(s, "prefixcache_sessions") == 1
            assert value(s, "prefixcache_leases_expired_total") == 1
            assert value(s, "prefixcache_draining") == 0

            stub.Unlock(pb.UnlockRequest(lock_id=ins.lock_id, session_id=sid))
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
            s = scrape(srv.server.metrics_port)
            assert value(s, "prefixcache_locks", model="m") == 0
            assert value(s, "prefixcache_sessions") == 0
            assert value(s, "prefixcache_pool_slots", model="m", state="session") == 0


def test_allocation_refusals_by_reason_and_process_metrics(tmp_path) -> None:
    """An over-long request is not a pinned pool: the alert's counter tells them apart.
    Process and build metrics are exported too."""
    with running(tmp_path, metrics_host="127.0.0.1", metrics_port=0, max_session_slots=1024) as srv:
        channel, stub = stub_for(srv.address)
        with channel:
            sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
            s = scrape(srv.server.metrics_port)
            for reason in ("pool_exhausted", "larger_than_pool"):
                assert (
                    value(s, "prefixcache_allocation_refusals_total", model="m", reason=reason) == 0
                )
            with pytest.raises(grpc.RpcError) as err:  # the whole pool is 256 slots
                stub.Alloc(pb.AllocRequest(model="m", num_slots=300, session_id=sid))
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            held = stub.Alloc(pb.AllocRequest(model="m", num_slots=250, session_id=sid))
            with pytest.raises(grpc.RpcError) as err:  # sessions pin what is left
                stub.Alloc(pb.AllocRequest(model="m", num_slots=10, session_id=sid))
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            s = scrape(srv.server.metrics_port)
            assert (
                value(
                    s, "prefixcache_allocation_refusals_total", model="m", reason="larger_than_pool"
                )
                == 1
            )
            assert (
                value(
                    s, "prefixcache_allocation_refusals_total", model="m", reason="pool_exhausted"
                )
                == 1
            )
            assert value(s, "process_resident_memory_bytes") > 0
            assert value(s, "process_open_fds") > 0
            build = [labels for (name, labels) in s if name == "prefixcache_build_info"]
            assert len(build) == 1 and dict(build[0])["version"]
            stub.Free(pb.FreeRequest(model="m", slot_indices=held.slot_indices, session_id=sid))
        srv.check_integrity()
