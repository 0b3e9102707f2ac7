"""The shadow index's local overlay against a model: after any mix of the worker's own
notes and Subscribe events, ``match`` sees "the stream's page set, plus the worker's own
pages the stream has not told of yet, minus what it removed since"; the overlay stays
within its capacity and closed under prefixes."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.client import RequestHashes, ShadowIndex
from prefixcache.v1 import prefix_cache_pb2 as pb

EPOCH = 7
# Requests that share prefixes, in two namespaces (page size 1: a token is a page).
CHAINS = ([1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9], [1, 2, 8], [5, 6, 7, 8])
REQUESTS = [RequestHashes(c, page_size=1, extra_key=k) for k in (None, "a") for c in CHAINS]


def ns_pb(req: RequestHashes) -> pb.PageNamespace:
    ns = pb.PageNamespace(token_width=req.token_width)
    if req.extra_key is not None:
        ns.extra_key = req.extra_key
    return ns


def run(op: int, req: RequestHashes, keys: list[int]) -> pb.PageRun:
    data = b"".join(d for d, k in zip(req.digests(), req.keys(), strict=True) if k in keys)
    return pb.PageRun(op=op, namespace=ns_pb(req), page_hashes=data)


class Feed:
    """A stream as the service sends it, applied to a real ShadowIndex."""

    def __init__(self, index: ShadowIndex) -> None:
        self.index, self.seq = index, 0

    def send(self, **body: Any) -> None:
        self.index.apply(
            pb.SubscribeEvent(seq=self.seq, head_seq=self.seq, server_epoch=EPOCH, **body)
        )

    def snapshot_begin(self) -> None:
        self.send(snapshot_begin=pb.SnapshotBegin(reason=pb.SNAPSHOT_REASON_BEHIND, page_size=1))

    def snapshot_end(self, runs: list[pb.PageRun]) -> None:
        if runs:
            self.send(snapshot_pages=pb.PageRuns(runs=runs))
        self.send(snapshot_end=pb.SnapshotEnd())

    def changes(self, runs: list[pb.PageRun]) -> None:
        self.seq += 1
        self.send(changes=pb.PageRuns(runs=runs))


class Model:
    """Stream state S, own unconfirmed pages O (with the generation of their note)."""

    def __init__(self) -> None:
        self.stream: dict[Any, set[int]] = {}
        self.own: dict[tuple[Any, int], int] = {}
        self.generation = 0
        self.begun_at = 0

    def view(self, ns: Any) -> set[int]:
        return self.stream.get(ns, set()) | {k for (n, k) in self.own if n == ns}

    def note(self, ns: Any, keys: list[int]) -> None:
        self.generation += 1
        for key in keys:
            if key not in self.stream.get(ns, ()):
                self.own[(ns, key)] = self.generation

    def forget(self, ns: Any, keys: list[int]) -> None:
        for key in keys:
            self.own.pop((ns, key), None)

    def stored(self, ns: Any, keys: list[int]) -> None:
        self.stream.setdefault(ns, set()).update(keys)
        self.forget(ns, keys)

    def removed(self, ns: Any, keys: list[int]) -> None:
        self.stream.setdefault(ns, set()).difference_update(keys)
        self.forget(ns, keys)

    def snapshot(self, pages: dict[Any, set[int]]) -> None:
        self.stream = pages
        self.own = {
            (ns, k): g
            for (ns, k), g in self.own.items()
            if g > self.begun_at and k not in pages.get(ns, ())
        }


def pages_of(mapping: dict[Any, Any]) -> dict[Any, frozenset[int]]:
    return {ns: frozenset(keys) for ns, keys in mapping.items() if keys}


def expected_match(view: set[int], keys: list[int]) -> int | None:
    """The matched pages, when membership along the chain is a run of hits then misses
    (as the service's page set always is); None when it is not."""
    hits = [k in view for k in keys]
    n = hits.index(False) if False in hits else len(hits)
    return None if any(hits[n:]) else n


req_ix = st.integers(0, len(REQUESTS) - 1)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("note"), req_ix, st.integers(0, 6)),
        st.tuples(st.just("unnote"), req_ix, st.integers(0, 6)),
        st.tuples(st.just("stored"), req_ix, st.integers(0, 6)),  # a chain's first pages
        st.tuples(st.just("removed"), req_ix, st.integers(0, 6)),  # its pages from one on
        st.tuples(
            st.just("cleared"),
        ),
        st.tuples(
            st.just("snapshot"),
            st.lists(st.tuples(req_ix, st.integers(0, 6)), max_size=3),
            st.lists(st.tuples(req_ix, st.integers(0, 6)), max_size=2),
        ),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(steps=ops)
def test_overlay_view_equals_the_model(steps: list[tuple]) -> None:
    index = ShadowIndex("m")
    feed = Feed(index)
    model = Model()
    feed.snapshot_begin()
    feed.snapshot_end([])
    for step in steps:
        kind = step[0]
        if kind in ("note", "unnote", "stored", "removed"):
            req = REQUESTS[step[1]]
            ns, keys = req.namespace, req.keys()
        if kind == "note":
            index.note(req, step[2])
            model.note(ns, keys[: step[2]])
        elif kind == "unnote":
            index.unnote(req, step[2])
            model.forget(ns, keys[step[2] :])
        elif kind == "stored":
            feed.changes([run(pb.PAGE_OP_STORED, req, keys[: step[2]])])
            model.stored(ns, keys[: step[2]])
        elif kind == "removed":
            feed.changes([run(pb.PAGE_OP_REMOVED, req, keys[step[2] :])])
            model.removed(ns, keys[step[2] :])
        elif kind == "cleared":
            feed.changes([pb.PageRun(op=pb.PAGE_OP_CLEARED)])
            model.stream, model.own = {}, {}
        else:  # a snapshot, with notes made while it streams in
            _, held, during = step
            feed.snapshot_begin()
            model.begun_at = model.generation
            for i, n in during:
                index.note(REQUESTS[i], n)
                model.note(REQUESTS[i].namespace, REQUESTS[i].keys()[:n])
            pages: dict[Any, set[int]] = {}
            for i, n in held:
                pages.setdefault(REQUESTS[i].namespace, set()).update(REQUESTS[i].keys()[:n])
            feed.snapshot_end(
                [run(pb.PAGE_OP_STORED, REQUESTS[i], REQUESTS[i].keys()[:n]) for i, n in held]
            )
            model.snapshot(pages)
        assert pages_of(index.pages()) == pages_of(model.stream)  # (empty runs: no ns)
        own: dict[Any, set[int]] = {}
        for ns, key in model.own:
            own.setdefault(ns, set()).add(key)
        assert index.local_pages() == pages_of(own)
        for req in REQUESTS:
            want = expected_match(model.view(req.namespace), req.keys())
            if want is not None:
                assert index.match_pages(req) == want, (req, step)


@settings(max_examples=200, deadline=None)
@given(
    notes=st.lists(st.tuples(req_ix, st.integers(1, 6)), max_size=30), capacity=st.integers(1, 12)
)
def test_overlay_is_bounded_and_closed_under_prefixes(
    notes: list[tuple[int, int]], capacity: int
) -> None:
    index = ShadowIndex("m", overlay_capacity=capacity)
    feed = Feed(index)
    feed.snapshot_begin()
    feed.snapshot_end([])
    for i, n in notes:
        index.note(REQUESTS[i], n)
        own = index.local_pages()
        assert sum(len(keys) for keys in own.values()) <= capacity
        for req in REQUESTS:  # every chain: noted pages are a run from its first
            chain = req.keys()
            held = [k in own.get(req.namespace, ()) for k in chain]
            first_miss = held.index(False) if False in held else len(held)
            assert not any(held[first_miss:]), (req, held)
        # The newest note is the last thing dropped: as much of it as fits is seen.
        assert index.match_pages(REQUESTS[i]) >= min(n, REQUESTS[i].num_pages, capacity)


def test_an_eviction_the_stream_reports_ends_the_entry() -> None:
    index = ShadowIndex("m")
    feed = Feed(index)
    feed.snapshot_begin()
    feed.snapshot_end([])
    req = REQUESTS[0]
    index.note(req)
    assert index.match_pages(req) == 6
    feed.changes([run(pb.PAGE_OP_STORED, req, req.keys())])  # confirmed: now the stream's
    assert index.local_pages() == {}
    assert index.match_pages(req) == 6
    index.note(req)  # noted again while the stream holds it: nothing to add
    assert index.local_pages() == {}
    feed.changes([run(pb.PAGE_OP_REMOVED, req, req.keys()[3:])])
    assert index.match_pages(req) == 3
    index.note(req)
    feed.changes([run(pb.PAGE_OP_REMOVED, req, req.keys()[4:])])  # an eviction after it
    assert index.match_pages(req) == 4
    assert index.local_pages() == {req.namespace: frozenset(req.keys()[3:4])}


def test_a_note_from_a_later_page_notes_only_the_pages_from_there() -> None:
    """``note(req, first=k)`` leaves pages before ``k`` to what the index knows: a match
    counts the noted pages only once the earlier ones are held."""
    index = ShadowIndex("m")
    feed = Feed(index)
    feed.snapshot_begin()
    feed.snapshot_end([])
    req = REQUESTS[0]
    index.note(req, first=2)
    assert index.match(req) == 0 and len(index.local_pages()[req.namespace]) == 4
    index.note(req, 2)
    assert index.match(req) == 6
