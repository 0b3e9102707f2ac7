"""A tiny Llama and its tokenizer, built locally with a fixed seed (nothing downloaded,
no weights committed); with ``sliding_window``, the same model Mistral-style: every
layer attends to the last ``sliding_window`` tokens only. ``build_gemma3`` makes a
Gemma-3-style hybrid of the same KV geometry: sliding-window layers and a full one.

The e2e tests and ``bench/e2e_vllm.py`` load it in vLLM and in transformers. Its KV
geometry (``LAYERS`` x ``KV_HEADS`` x ``HEAD_DIM``) is what the sidecar's pool must hold.
The initializer range is wider than Llama's 0.02 so that attention is peaked: with
near-uniform attention, wrong K/V would barely move the logits and the correctness
checks could not fail.
"""

from __future__ import annotations

import json
from pathlib import Path

LAYERS = 2
HIDDEN = 256
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64
VOCAB = 512  # words w0 .. w(VOCAB - 4), then the special tokens
SEED = 1234
INIT_RANGE = 0.1
SPECIALS = ("<unk>", "<s>", "</s>")


def build(
    path: str | Path,
    *,
    layers: int = LAYERS,
    hidden: int = HIDDEN,
    heads: int = HEADS,
    kv_heads: int = KV_HEADS,
    head_dim: int = HEAD_DIM,
    dtype: str = "float32",
    sliding_window: int | None = None,
) -> Path:
    """Write the model and tokenizer to ``path`` (created) and return it; idempotent.
    The defaults are the tests' model; ``bench/e2e_vllm.py`` builds a bigger one."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    out = Path(path)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    vocab = _tokenizer(out)

    config_cls, model_cls = (
        (LlamaConfig, LlamaForCausalLM)
        if sliding_window is None
        else (MistralConfig, MistralForCausalLM)
    )
    window = {} if sliding_window is None else {"sliding_window": sliding_window}
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        initializer_range=INIT_RANGE,
        tie_word_embeddings=False,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        torch_dtype=dtype,
        **window,
    )
    torch.manual_seed(SEED)
    model = model_cls(config).to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    # Greedy runs must not stop at a random EOS: vLLM reads generation_config.json.
    (out / "generation_config.json").write_text(json.dumps({"_from_model_config": True}))
    return out


def _tokenizer(out: Path) -> dict[str, int]:
    """Write the word-level tokenizer (one word, one token) to ``out``: its vocab."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    words = [f"w{i}" for i in range(VOCAB - len(SPECIALS))]
    vocab = {w: i for i, w in enumerate([*SPECIALS, *words])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(out)
    return vocab


def build_gemma3(path: str | Path, *, sliding_window: int, layers: int = 4) -> Path:
    """A Gemma-3-style text model (``Gemma3ForCausalLM``): every fourth layer full
    attention, the others attending to the last ``sliding_window`` tokens; the Llama's
    heads, KV heads and head size, so its pool is the Llama's with ``layers`` layers.
    Idempotent."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    out = Path(path)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    vocab = _tokenizer(out)
    kinds = ["full_attention" if (n + 1) % 4 == 0 else "sliding_attention" for n in range(layers)]
    config = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        query_pre_attn_scalar=HEAD_DIM,
        sliding_window=sliding_window,
        layer_types=kinds,
        max_position_embeddings=4096,
        initializer_range=INIT_RANGE,
        tie_word_embeddings=True,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        pad_token_id=vocab["<unk>"],
        torch_dtype="float32",
    )
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(SEED)
    model = Gemma3ForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({"_from_model_config": True}))
    return out


if __name__ == "__main__":
    import sys

    print(build(sys.argv[1]))
