"""KV events out: a real server publishing, a real ZMQ SUB reading (helpers in
kv_events_harness.py).

Every batch is decoded with a schema written from the published field order (vLLM's and
SGLang's structs) in both encodings. Under a random workload over gRPC the page set
rebuilt from the events equals the tree's at every quiet point, with page hashes
computed here from ``hash_token_ids`` (checked against the spec's vectors) in both hash
formats. Sequence numbers have no gaps and replay from any seq returns exactly the
batches from there; namespaces never share hashes; one call's changes are one batch.
Replay and slow subscribers: test_kv_events_replay.py; settings: test_kv_events_config.py.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from harness import pb, toks
from kv_events_harness import (
    MODELS,
    VECTORS,
    Replica,
    Subscriber,
    Worker,
    decode_batch,
    expected_pages,
    quiet_seq,
    random_step,
    seed,
    start,
    wire,
)

from prefixcache.cache import hash_token_ids


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.term()


def test_page_hashes_are_the_spec_chains_in_both_formats() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7]
    prior = None
    for i, (hex_hash, int64) in enumerate(VECTORS):
        prior = hash_token_ids(tokens[2 * i : 2 * i + 2], prior)
        assert prior == hex_hash
        assert wire(prior, "sglang") == int64
        assert wire(prior, "vllm") == int.from_bytes(bytes.fromhex(hex_hash)[24:], "big")


@pytest.mark.parametrize(("encoding", "hash_format"), [("map", "vllm"), ("array", "sglang")])
def test_events_rebuild_the_tree_under_a_random_workload(
    tmp_path: Path, ctx: zmq.Context, encoding: str, hash_format: str
) -> None:
    srv = start(tmp_path, encoding=encoding, hash_format=hash_format)
    publishers = srv.server.kv_events.publishers
    subs = {m: Subscriber(ctx, p.endpoint, p.replay_endpoint) for m, p in publishers.items()}
    worker = Worker(srv)
    try:
        time.sleep(0.3)  # the SUBs' subscriptions reach the server
        rng = random.Random(f"{encoding}-{hash_format}")
        prefixes = [[rng.randrange(6) for _ in range(rng.randrange(2, 7))] for _ in range(3)]
        replicas = {m: Replica() for m in subs}
        for model, sub in subs.items():  # the first batch predates the SUB: replay it
            (first,) = sub.replay(0)[:1]
            replicas[model].apply(decode_batch(first[1], encoding, hash_format)[1])
        seen = dict.fromkeys(subs, 0)
        for round_ in range(8):
            for _ in range(12):
                random_step(worker, rng, prefixes)
            if round_ == 4:
                worker.stub.Reset(pb.ResetRequest(model=rng.choice(sorted(subs))))
            for model, sub in subs.items():  # a quiet point
                newest = quiet_seq(srv, model)
                batches = sub.until(newest)
                for topic, seq, payload in batches[seen[model] :]:
                    assert topic == publishers[model].topic.encode()
                    assert seq == seen[model] + 1, "a seq gap"  # 0 came by replay
                    replicas[model].apply(decode_batch(payload, encoding, hash_format)[1])
                    seen[model] = seq
                expected = srv.run(
                    lambda m=model: expected_pages(srv.service.engines[m].cache, hash_format)
                )
                assert replicas[model].pages == expected, (model, round_)
        for model, replica in replicas.items():  # the workload did exercise every event
            assert len(replica.kinds) == 3, (model, replica.kinds)
        # Replay from any seq returns exactly the batches from there.
        sub = subs["r"]
        live = {seq: payload for _, seq, payload in sub.received}
        newest = max(live)
        for start_seq in sorted({1, newest // 2, newest, newest + 5, min(live)}):
            answer = sub.replay(start_seq)
            assert [s for s, _ in answer] == list(range(start_seq, newest + 1))
            assert all(live[s] == payload for s, payload in answer)
    finally:
        worker.close()
        for sub in subs.values():
            sub.close()
        srv.stop()


def test_namespaces_never_share_hashes_and_map_to_lora_name(
    tmp_path: Path, ctx: zmq.Context
) -> None:
    srv = start(tmp_path, models=MODELS[:1])
    worker = Worker(srv)
    publisher = srv.server.kv_events.publishers["r"]
    try:
        sub = Subscriber(ctx, publisher.endpoint, publisher.replay_endpoint)
        time.sleep(0.3)
        tokens = [1, 2, 3, 4]
        for extra_key in (None, "a", ""):
            worker.insert("r", tokens, extra_key)
        worker.insert("r", [1, 2, 3, 4, 5, 6, 7, 8], None, width=2)
        stored = [
            e
            for _, _, p in sub.until(quiet_seq(srv, "r"))
            for e in decode_batch(p, "map", "vllm")[1]
            if e.kind == "BlockStored"
        ]
        assert [e.fields["lora_name"] for e in stored] == [None, "a", "", None]
        hashes = [tuple(e.fields["block_hashes"]) for e in stored]
        assert len(set(hashes)) == 4
        assert all(e.fields["token_ids"][:4] == tokens for e in stored)
        assert stored[0].fields["block_hashes"] == [
            wire(VECTORS[0][0], "vllm"),
            wire(hash_token_ids([3, 4], VECTORS[0][0]), "vllm"),
        ]
        # A named namespace is chained as SGLang chains a request salted with its key.
        salted = hash_token_ids([1, 2], seed("a", 1))
        assert stored[1].fields["block_hashes"][0] == wire(salted, "vllm")
        # No extra_keys anywhere (llm-d would read a string there as a multimodal hash).
        assert all("extra_keys" not in e.fields for e in stored)
        sub.close()
    finally:
        worker.close()
        srv.stop()


def test_the_changes_of_one_call_go_out_as_one_batch(tmp_path: Path, ctx: zmq.Context) -> None:
    srv = start(tmp_path, models=MODELS[:1])  # 96 slots, page 2
    worker = Worker(srv)
    publisher = srv.server.kv_events.publishers["r"]
    try:
        sub = Subscriber(ctx, publisher.endpoint, publisher.replay_endpoint)
        time.sleep(0.3)
        for i in range(4):
            worker.insert("r", [100 * i + t for t in range(20)])
        before = quiet_seq(srv, "r")
        # Room for 60 new tokens means evicting three of the four sequences, in one call.
        worker.stub.Match(
            pb.MatchRequest(
                model="r",
                token_ids=toks(range(1000, 1060)),
                session_id=worker.session,
                allocate=True,
            )
        )
        newest = quiet_seq(srv, "r")
        assert newest == before + 1
        ((_, seq, payload),) = sub.until(newest)[-1:]
        assert seq == newest
        _, events = decode_batch(payload, "map", "vllm")
        assert [e.kind for e in events] == ["BlockRemoved"] * 3
        sub.close()
    finally:
        worker.close()
        srv.stop()
