"""What vLLM saved is K and V per token: the pool's rows, read back through ReadKV,
equal the K/V transformers computes for the same prompt and weights.

Both sides hold K after the rotary embedding. A pool that holds a block's bytes in
another order (K transposed, V rows where K rows belong) round-trips through the
engine that wrote it but fails here, as it would for every other reader.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e.e2e_support import Sidecar, prompts

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MIN_COSINE = 0.999


@pytest.fixture(scope="module")
def reference(model_dir: Path):  # type: ignore[no-untyped-def]
    """transformers' K/V of a prompt: per layer, ``[tokens, kv_heads, head_dim]``."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()

    def kv(tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        with torch.no_grad():
            cache = model(torch.tensor([tokens]), use_cache=True).past_key_values
        return [
            (layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1))
            for layer in cache.layers
        ]

    return kv


def cosines(got, want) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """The cosine of the whole layer, and the worst token's."""
    import torch

    flat = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
    per_token = torch.nn.functional.cosine_similarity(got.flatten(1), want.flatten(1), dim=1)
    return float(flat), float(per_token.min())


@pytest.mark.parametrize(
    ("engine_key", "model", "seed"),
    [
        ((32, "p16", "a"), "p16", 11),
        ((64, "p16", "c"), "p16", 12),
    ],
    ids=["b32-p16", "b64-p16"],
)
def test_pool_rows_are_transformers_kv(  # type: ignore[no-untyped-def]
    sidecar: Sidecar, engines: dict, reference, engine_key: tuple, model: str, seed: int
) -> None:
    engine = engines[engine_key]
    batch = prompts(seed, (150, 200))
    engine.generate(batch)
    sidecar.wait_cached(model, batch, unit=engine.block_size)
    with sidecar.client.session(ttl=30) as s:
        for prompt in batch:
            hit = s.match(model, prompt, lock=True)
            assert hit.prefix_len >= (len(prompt) - 1) // engine.block_size * engine.block_size
            rows = s.read_kv(model, hit.slots)
            s.unlock(hit.lock_id)
            want = reference(prompt[: hit.prefix_len])
            bad = []
            for layer, (k, v) in enumerate(want):
                for name, got, ref in (("K", rows.k[layer], k), ("V", rows.v[layer], v)):
                    assert tuple(got.shape) == tuple(ref.shape), (name, layer)
                    whole, worst = cosines(got.float(), ref)
                    if whole < MIN_COSINE or worst < MIN_COSINE:
                        bad.append(
                            f"layer {layer} {name}: cosine {whole:.4f}, worst token {worst:.4f}"
                        )
            assert not bad, f"{len(prompt)}-token prompt, {hit.prefix_len} cached: {bad}"
