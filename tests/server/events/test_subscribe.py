"""The Subscribe stream against a real server: snapshot, deltas, resume, refusals."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server.harness import EVERY_KIND, ServerThread, pb, running, stub_for

from prefixcache.client import PrefixCacheClient
from prefixcache.server.config import ModelConfig, PoolConfig
from prefixcache.server.events.subscriptions import Bound, _batches

MODELS = (
    ModelConfig(
        name="m", page_size=1, pool=PoolConfig(size=1024, layers=1, k_heads=1, k_head_dim=4)
    ),
    ModelConfig(name="p", page_size=4, pool=PoolConfig(size=64, k_heads=1, k_head_dim=4)),
)
TIMEOUT = 10.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    # A small log, so that falling behind it is easy to arrange.
    with running(tmp_path_factory.mktemp("sub"), MODELS, change_log_capacity=6) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[PrefixCacheClient]:
    with PrefixCacheClient(server.address, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(autouse=True)
def clean(client: PrefixCacheClient) -> Iterator[None]:
    yield
    for model in ("m", "p"):
        client.reset(model)


def cache(
    client: PrefixCacheClient, model: str, tokens: list[int], extra_key: str | None = None
) -> None:
    """Prefill ``tokens`` as a worker does: match with lock and allocate, insert, free
    the unaligned tail."""
    with client.session() as s:
        m = s.match(model, tokens, extra_key=extra_key, lock=True, allocate=True)
        slots = [*m.slots, *m.allocated]
        r = s.insert(model, tokens, slots, extra_key=extra_key, release_lock_id=m.lock_id)
        if r.cached_len < len(tokens):
            s.free(model, slots[r.cached_len :])


def last_seq(server: ServerThread, model: str) -> int:
    return server.run(lambda: server.service.engine(model).change_log.last_seq)


def read_snapshot(events: Iterator[pb.SubscribeEvent]) -> list[pb.SubscribeEvent]:
    out = [next(events)]
    assert out[0].HasField("snapshot_begin")
    while not out[-1].HasField("snapshot_end"):
        out.append(next(events))
    return out


def hashes(events: list[pb.SubscribeEvent], body: str) -> list[bytes]:
    data = b"".join(
        run.page_hashes for e in events if e.HasField(body) for run in getattr(e, body).runs
    )
    return [data[i : i + 32] for i in range(0, len(data), 32)]


def test_snapshot_then_changes(server: ServerThread, client: PrefixCacheClient) -> None:
    cache(client, "p", list(range(10)))  # two whole pages
    events = client.subscribe("p")
    snap = read_snapshot(events)
    begin = snap[0].snapshot_begin
    assert (begin.reason, begin.pages, begin.page_size) == (pb.SNAPSHOT_REASON_NEW, 2, 4)
    assert snap[-1].seq == last_seq(server, "p") == snap[-1].head_seq
    assert all(e.server_epoch == server.service.epoch for e in snap)
    cache(client, "p", [*range(8), 50, 51, 52, 53])  # one more page, chained on page 2
    event = next(events)
    assert event.seq == last_seq(server, "p") and event.made_unix_ns > 0
    (run,) = event.changes.runs
    assert run.op == pb.PAGE_OP_STORED and not run.namespace.HasField("extra_key")
    assert len(run.page_hashes) == 32
    client.evict("p", 100)
    removed = []
    while len(removed) < 3:  # every page leaves, in one event per node or more
        removed += hashes([next(events)], "changes")
    assert sorted(removed) == sorted([*hashes(snap, "snapshot_pages"), run.page_hashes])
    client.reset("p")
    assert next(events).changes.runs[0].op == pb.PAGE_OP_CLEARED
    events.close()


def test_large_changes_are_split(server: ServerThread, client: PrefixCacheClient) -> None:
    """Split into events of max_pages_per_event, which is at least 256 (a smaller value
    is raised to it: events of a page or three cost ten times the CPU per page)."""
    for asked in (3, 256):
        events = client.subscribe("m", max_pages_per_event=asked)
        start = read_snapshot(events)[-1].seq
        cache(client, "m", list(range(asked, asked + 600)))
        split = [next(events) for _ in range(3)]
        assert [len(e.changes.runs[0].page_hashes) // 32 for e in split] == [256, 256, 88]
        assert [e.seq for e in split] == [start, start, start + 1]
        assert len(hashes(split, "changes")) == 600
        events.close()
        client.reset("m")


def test_resume_without_snapshot(server: ServerThread, client: PrefixCacheClient) -> None:
    events = client.subscribe("m")
    seq = read_snapshot(events)[-1].seq
    events.close()
    cache(client, "m", [1, 2, 3])
    resumed = client.subscribe("m", after_seq=seq, server_epoch=server.service.epoch)
    event = next(resumed)
    assert event.HasField("changes") and event.seq == seq + 1
    resumed.close()


def test_resume_from_another_epoch_or_too_late_gets_a_snapshot(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    events = client.subscribe("m")
    seq = read_snapshot(events)[-1].seq
    events.close()
    epoch = server.service.epoch
    other = client.subscribe("m", after_seq=seq, server_epoch=epoch + 1)
    assert next(other).snapshot_begin.reason == pb.SNAPSHOT_REASON_EPOCH
    other.close()
    for i in range(8):  # more changes than the log keeps (6)
        cache(client, "m", [100 + i])
    late = client.subscribe("m", after_seq=seq, server_epoch=epoch)
    assert next(late).snapshot_begin.reason == pb.SNAPSHOT_REASON_BEHIND
    late.close()


def test_falling_behind_while_following_sends_a_snapshot(
    server: ServerThread, client: PrefixCacheClient
) -> None:
    """A burst larger than the log in one loop turn (one Evict of many leaves): the
    subscriber cannot have read it in time, and gets a snapshot instead of a gap."""
    for i in range(8):
        cache(client, "m", [200 + i, 1])
    events = client.subscribe("m")
    snap = read_snapshot(events)
    assert snap[0].snapshot_begin.pages == 16
    client.evict("m", 1000)  # 8 leaves, 8 records in one turn
    begin = next(events)
    assert begin.snapshot_begin.reason == pb.SNAPSHOT_REASON_BEHIND
    assert begin.snapshot_begin.pages == 0
    rest = read_snapshot_tail(events)
    assert rest[-1].seq == last_seq(server, "m")
    events.close()


def read_snapshot_tail(events: Iterator[pb.SubscribeEvent]) -> list[pb.SubscribeEvent]:
    out = [next(events)]
    while not out[-1].HasField("snapshot_end"):
        out.append(next(events))
    return out


def test_namespace_filter(server: ServerThread, client: PrefixCacheClient) -> None:
    cache(client, "m", [1, 2], extra_key="a")
    cache(client, "m", [1, 2, 3])
    events = client.subscribe("m", namespaces=["a"])
    snap = read_snapshot(events)
    assert snap[0].snapshot_begin.pages == 2
    assert {r.namespace.extra_key for e in snap[1:-1] for r in e.snapshot_pages.runs} == {"a"}
    cache(client, "m", [7])  # another namespace: the seq moves, no runs
    event = next(events)
    assert event.seq == last_seq(server, "m") and not event.changes.runs
    events.close()


# ------------------------------------------------------------------- refusals


def code_of(client: PrefixCacheClient, model: str, **kwargs: object) -> grpc.StatusCode:
    channel, stub = stub_for(client.target)
    with channel, pytest.raises(grpc.RpcError) as info:
        next(stub.Subscribe(pb.SubscribeRequest(model=model, **kwargs), timeout=TIMEOUT))
    return info.value.code()


def test_unknown_model_is_not_found(client: PrefixCacheClient) -> None:
    assert code_of(client, "nope") == grpc.StatusCode.NOT_FOUND


def test_seq_from_the_future_is_invalid(server: ServerThread, client: PrefixCacheClient) -> None:
    seq = last_seq(server, "m")
    assert (
        code_of(client, "m", after_seq=seq + 5, server_epoch=server.service.epoch)
        == grpc.StatusCode.INVALID_ARGUMENT
    )


@pytest.mark.parametrize(
    "namespaces",
    [
        [pb.PageNamespace(extra_key="x" * 5000)],
        [pb.PageNamespace(token_width=9)],
        [pb.PageNamespace(extra_key=str(i)) for i in range(1025)],
    ],
)
def test_bad_namespace_filter_is_invalid(client: PrefixCacheClient, namespaces: list) -> None:
    assert code_of(client, "m", namespaces=namespaces) == grpc.StatusCode.INVALID_ARGUMENT


def test_malformed_request_is_invalid(client: PrefixCacheClient) -> None:
    channel = grpc.insecure_channel(client.target)
    with channel:
        call = channel.unary_stream(
            "/prefixcache.v1.PrefixCache/Subscribe", request_serializer=lambda b: b
        )
        with pytest.raises(grpc.RpcError) as info:
            next(call(b"\xff\xff\xff", timeout=TIMEOUT))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_kinds_without_pages_and_logs_off(tmp_path: Path) -> None:
    with running(tmp_path, EVERY_KIND) as srv, PrefixCacheClient(srv.address) as c:
        for model in ("s", "c"):
            assert code_of(c, model) == grpc.StatusCode.FAILED_PRECONDITION
        for model in ("m", "p", "w", "h"):
            assert next(c.subscribe(model)).HasField("snapshot_begin")
    with (
        running(tmp_path, MODELS, change_log_capacity=0) as srv,
        PrefixCacheClient(srv.address) as c,
    ):
        assert code_of(c, "m") == grpc.StatusCode.FAILED_PRECONDITION


def test_shutdown_ends_streams_unavailable(tmp_path: Path) -> None:
    srv = running(tmp_path, MODELS)
    thread = srv.__enter__()
    channel, stub = stub_for(thread.address)
    call = stub.Subscribe(pb.SubscribeRequest(model="m"))
    read_snapshot(call)
    codes: list[grpc.StatusCode] = []

    def drain() -> None:
        try:
            for _ in call:
                pass
        except grpc.RpcError as exc:
            codes.append(exc.code())

    reader = threading.Thread(target=drain)
    reader.start()
    srv.__exit__(None, None, None)  # stops with a 1 s grace; the stream ends first
    reader.join(TIMEOUT)
    channel.close()
    assert codes == [grpc.StatusCode.UNAVAILABLE]


# ------------------------------------------------------------------ batching

_item = st.one_of(
    st.tuples(
        st.sampled_from([pb.PAGE_OP_STORED, pb.PAGE_OP_REMOVED]),
        st.sampled_from([(None, 1), ("a", 1), ("k" * 300, 2)]),
        st.integers(1, 12),
    ),
    st.just((pb.PAGE_OP_CLEARED, None, 0)),
    st.just((None, None, 0)),  # a change of a namespace left out
)


@settings(max_examples=100, deadline=None)
@given(raw=st.lists(_item, max_size=20), pages=st.integers(1, 7), budget=st.integers(64, 2000))
def test_batches_keep_every_change_in_order_within_bounds(
    raw: list, pages: int, budget: int
) -> None:
    items, expected, n = [], [], 0
    for seq, (op, ns, count) in enumerate(raw, start=11):
        hexes = tuple(f"{n + i:064x}" for i in range(count))
        n += count
        items.append((seq, op, ns, hexes))
        if op == pb.PAGE_OP_CLEARED:
            expected.append((op, None, ""))
        elif op is not None:
            expected += [(op, ns, h) for h in hexes]
    out = list(_batches(items, 10, Bound(pages, budget)))
    got, seqs = [], []
    for runs, seq, first in out:
        assert sum(len(r.page_hashes) for r in runs) <= 32 * pages
        assert pb.PageRuns(runs=runs).ByteSize() <= budget + 400  # one namespace over
        assert first <= max(seq + 1, 11)
        seqs.append(seq)
        for run in runs:
            ns = (
                None
                if run.op == pb.PAGE_OP_CLEARED
                else (
                    run.namespace.extra_key if run.namespace.HasField("extra_key") else None,
                    run.namespace.token_width,
                )
            )
            if run.op == pb.PAGE_OP_CLEARED:
                got.append((run.op, None, ""))
            data = run.page_hashes.hex()
            got += [(run.op, ns, data[i : i + 64]) for i in range(0, len(data), 64)]
    assert got == expected
    assert seqs == sorted(seqs)
    assert (seqs[-1] if seqs else 10) == (10 + len(raw))
