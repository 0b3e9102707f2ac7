"""A second vLLM engine process loads what the first saved, and its output (fp32, greedy,
with logprobs) is vLLM's own prefix-cache hit's.

Engines: ``a`` and ``b`` (block 32) and ``c`` (block 64) on the page-16 model; ``d``
(block 32) and ``e`` (block 64) on the page-32 model. The reference is always an
engine's own hit on KV it computed itself (a hit on loaded blocks would repeat a wrong
load). Prompt lengths are and are not multiples of both block sizes; every test uses
fresh prompts, so no engine has them cached locally before it loads them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e.e2e_support import TOL, Engine, Sidecar, expected_hit, mismatches, prompts

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LENGTHS = (77, 96, 128, 160, 257, 300)


def saved_then_loaded(
    sidecar: Sidecar, saver: Engine, loader: Engine, model: str, batch: list[list[int]]
) -> list[dict]:
    """``saver`` computes ``batch`` (saving it), ``loader`` then runs it: its outputs,
    after checking that it loaded every prompt's whole blocks from the sidecar."""
    saver.generate(batch)
    sidecar.wait_cached(model, batch, unit=saver.block_size)
    got = loader.generate(batch)
    hits = [o["cached"] for o in got]
    want = [
        min(
            expected_hit(len(p), loader.block_size),
            len(p) // saver.block_size * saver.block_size // loader.block_size * loader.block_size,
        )
        for p in batch
    ]
    assert hits == want, (
        f"{loader.name} loaded {hits} tokens, expected {want}:\n{loader.log_tail()}"
    )
    return got


# The page-32 cases first: their engines are closed before the page-16 ones start, so
# that at most three engines (about 6 GB) run at once.
@pytest.mark.parametrize(
    ("saver_key", "loader_key", "model", "seed"),
    [
        ((32, "p32", "d"), (64, "p32", "e"), "p32", 4),  # pages of 32
        ((64, "p32", "e"), (32, "p32", "d"), "p32", 5),
        ((32, "p16", "a"), (32, "p16", "b"), "p16", 1),  # the same engine configuration
        ((32, "p16", "a"), (64, "p16", "c"), "p16", 2),  # a bigger block, pages of 16
        ((64, "p16", "c"), (32, "p16", "b"), "p16", 3),  # a smaller block
    ],
    ids=["b32-to-b64-p32", "b64-to-b32-p32", "b32-to-b32-p16", "b32-to-b64-p16", "b64-to-b32-p16"],
)
def test_loaded_output_is_vllms_own_hit(
    sidecar: Sidecar, engines: dict, saver_key: tuple, loader_key: tuple, model: str, seed: int
) -> None:
    engines.close("p32" if model == "p16" else "p16")
    saver, loader = engines[saver_key], engines[loader_key]
    batch = prompts(seed, LENGTHS)
    got = saved_then_loaded(sidecar, saver, loader, model, batch)
    own = saver.generate(batch)  # the saver's own prefix-cache hit on its computed KV
    assert [o["cached"] for o in own] == [expected_hit(len(p), saver.block_size) for p in batch]
    assert not (bad := mismatches(got, own, TOL)), "\n".join(bad)


def test_block_filled_from_two_saves(sidecar: Sidecar, engines: dict) -> None:
    """Two prompts share 208 tokens: pages of 16 end their common cached prefix in the
    middle of a 32-token block, so the loaded block's first page comes from the first
    prompt's save and its second page from the second's."""
    a, b = engines[32, "p16", "a"], engines[32, "p16", "b"]
    shared, tail_x, tail_y, suffix = prompts(6, (208, 40, 40, 30))
    x, y = shared + tail_x, shared + tail_y
    a.generate([x])
    sidecar.wait_cached("p16", [x], unit=32)
    a.generate([y])
    sidecar.wait_cached("p16", [y], unit=32)
    assert sidecar.cached_len("p16", x[:208] + tail_y[:16]) == 224  # two saves' pages
    longer = y + suffix
    # a's own hit first: its save of the next block lets b load all but the last token
    # (the other order would give a that block from b's save).
    own = a.generate([longer])  # a computed y's blocks itself, x's too
    assert own[0]["cached"] == 224
    sidecar.wait_cached("p16", [longer], unit=32)
    got = b.generate([longer])
    assert got[0]["cached"] == 256, b.log_tail()
    assert not (bad := mismatches(got, own, TOL)), "\n".join(bad)


def test_layerwise_loads_give_vllms_own_hit(
    sidecar: Sidecar, engines: dict, model_dir: Path, tmp_path: Path
) -> None:
    """``layerwise_load`` in vLLM's CPU build: the connector issues each step's loads
    layer after layer (on the host: each done when issued) and vLLM calls its
    wait_for_layer_load with each attention layer's name, every one a layer it
    registered (else the connector says so in the log)."""
    engines.close("p32")
    saver = engines[32, "p16", "a"]
    loader = Engine(
        tmp_path,
        "layerwise-b32-p16",
        model_dir,
        32,
        sidecar,
        "p16",
        pc_extra={"layerwise_load": True},
    )
    try:
        batch = prompts(7, LENGTHS)
        got = saved_then_loaded(sidecar, saver, loader, "p16", batch)
        own = saver.generate(batch)
        assert not (bad := mismatches(got, own, TOL)), "\n".join(bad)
        assert "not a layer vLLM registered" not in loader.log_tail(1 << 20)
    finally:
        loader.close()


def test_reset_prefix_cache_right_after_the_replies(sidecar: Sidecar, engines: dict) -> None:
    """``LLM.reset_prefix_cache()`` at once after ``generate`` returned is not refused:
    the prompts were saved while they ran, so no finished request holds blocks for a
    save. The reset empties vLLM's own cache: the same prompts then hit the sidecar."""
    engine = engines[32, "p16", "a"]
    batch = prompts(8, (100, 200))
    engine.generate(batch)
    assert engine.reset_prefix_cache(), engine.log_tail()
    sidecar.wait_cached("p16", batch, unit=32)
    before = engine.metrics().get("vllm:external_prefix_cache_hits", 0.0)
    again = engine.generate(batch)
    assert [o["cached"] for o in again] == [expected_hit(len(p), 32) for p in batch]
    after = engine.metrics()["vllm:external_prefix_cache_hits"]
    assert after - before == sum(o["cached"] for o in again)
