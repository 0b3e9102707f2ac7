"""Prefill/decode through one sidecar: a ``kv_producer`` engine and a ``kv_consumer``
engine behind a proxy that sends each request to the producer with ``max_tokens=1``
and, once the producer answered, to the consumer. The consumer's request is a hit of
every whole block the producer just computed, with no wait in between (the producer
inserts a request's save before its output leaves), and its output is vLLM's own
prefix-cache hit's; the producer never looks up or loads, even a prompt the sidecar
holds; the consumer never saves, not even a prompt it computed itself."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e.e2e_support import TOL, Engine, Sidecar, expected_hit, mismatches, prompts

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "p16"
BLOCK = 32
LENGTHS = (77, 96, 160, 257)  # multiples of the block and not
HITS = "vllm:external_prefix_cache_hits"


@pytest.fixture(scope="module")
def pd_sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    """A sidecar of this module's own: its counters see these engines only."""
    side = Sidecar(tmp_path_factory.mktemp("pcpd"))
    yield side
    side.stop()


def proxy(producer: Engine, consumer: Engine, prompt: list[int]) -> dict[str, Any]:
    """The P/D proxy: the request to the producer with ``max_tokens=1``, then, as soon as
    it answered, the same request to the consumer: the consumer's output."""
    producer.generate([prompt], max_tokens=1)
    return consumer.generate([prompt])[0]


def test_the_consumer_hits_what_the_producer_just_computed(
    pd_sidecar: Sidecar, model_dir: Path, tmp_path: Path
) -> None:
    stats = pd_sidecar.client.stats
    producer = Engine(
        tmp_path, "pd-producer", model_dir, BLOCK, pd_sidecar, MODEL, kv_role="kv_producer"
    )
    consumer = Engine(
        tmp_path, "pd-consumer", model_dir, BLOCK, pd_sidecar, MODEL, kv_role="kv_consumer"
    )
    try:
        # A prompt of each engine's own first: each opens its session with the sidecar
        # (the producer's is saved, the consumer's must not be).
        warm, alone = prompts(62, (100, 200))
        producer.generate([warm], max_tokens=1)
        assert consumer.generate([alone])[0]["cached"] == 0

        batch = prompts(61, LENGTHS)
        got = [proxy(producer, consumer, p) for p in batch]
        want = [expected_hit(len(p), BLOCK) for p in batch]
        assert [o["cached"] for o in got] == want, consumer.log_tail()
        assert consumer.metrics()[HITS] == sum(want)
        # Only the producer's saves are cached: each prompt's whole blocks.
        whole = [len(p) // BLOCK * BLOCK for p in batch]
        saved = len(warm) // BLOCK * BLOCK + sum(whole)
        assert stats(MODEL)[MODEL].cached_tokens == saved

        own = producer.generate(batch)  # its own prefix-cache hit, on KV it computed
        assert [o["cached"] for o in own] == want
        assert not (bad := mismatches(got, own, TOL)), "\n".join(bad)

        # The sidecar holds these prompts; the producer, its own cache emptied, computes
        # them: no hit, and its only Matches are its saves' (all cached already).
        assert producer.reset_prefix_cache(), producer.log_tail()
        matched = stats(MODEL)[MODEL].match_tokens_total
        again = producer.generate(batch, max_tokens=1)
        assert [o["cached"] for o in again] == [0] * len(batch)
        assert producer.metrics().get(HITS, 0.0) == 0.0
        assert stats(MODEL)[MODEL].match_tokens_total - matched == sum(whole)

        # The prompt the consumer computed itself stays vLLM's own: nothing is saved,
        # also once it stopped (its connector sends what it has queued before it ends).
        consumer.close()
        assert pd_sidecar.cached_len(MODEL, alone) == 0
        assert stats(MODEL)[MODEL].cached_tokens == saved
    finally:
        consumer.close()
        producer.close()
