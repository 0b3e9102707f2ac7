"""What a vLLM request is keyed by in the service, and how much of it to look up or save.

The key is the request's token ids in a namespace (``extra_key``) made from its LoRA
adapter and its ``cache_salt``: two requests share cached KV only when both agree, as in
vLLM's own prefix cache. Requests whose KV does not follow from their token ids alone
(multimodal inputs, whose placeholder tokens are the same for every image, and prompt
embeddings) are always a miss and are never saved.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Namespaces longer than this are replaced by a digest (the service caps extra_key).
MAX_EXTRA_KEY_CHARS = 256


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What the core needs of a vLLM request (the adapter fills it in).

    Attributes:
        req_id: vLLM's request id.
        tokens: every token id so far (prompt, then output); not copied.
        num_prompt_tokens: how many of ``tokens`` are the prompt.
        lora_name: the LoRA adapter's name, None without one.
        cache_salt: the request's ``cache_salt``, None without one.
        multimodal: the request has multimodal inputs.
        prompt_embeds: the prompt came as embeddings.
        attempt: vLLM's preemption count: a new attempt means vLLM dropped the
            request's blocks and computes (or loads) it again from scratch.
        retention: the request's retention hint (``kv_transfer_params["prefixcache"]``,
            a ``prefixcache.client.Retention``), passed on with its lookup and save.
    """

    req_id: str
    tokens: Sequence[int]
    num_prompt_tokens: int
    lora_name: str | None = None
    cache_salt: str | None = None
    multimodal: bool = False
    prompt_embeds: bool = False
    attempt: int = 0
    retention: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def miss_reason(self) -> str | None:
        """Why this request can never hit or be saved, or None when it can."""
        if self.multimodal:
            return "multimodal inputs"
        if self.prompt_embeds:
            return "prompt embeddings"
        return None

    @property
    def extra_key(self) -> str | None:
        return extra_key(self.lora_name, self.cache_salt)


def extra_key(lora_name: str | None, cache_salt: str | None) -> str | None:
    """The namespace of a request: None (shared with every plain client of the model)
    without LoRA and salt, else an injective encoding of the pair."""
    if lora_name is None and cache_salt is None:
        return None
    # JSON of the pair is injective: no two pairs give the same string.
    key = "vllm:" + json.dumps([lora_name, cache_salt], separators=(",", ":"))
    if len(key) > MAX_EXTRA_KEY_CHARS:
        key = "vllm-sha256:" + hashlib.sha256(key.encode()).hexdigest()
    return key


def lookup_len(num_tokens: int, block_size: int) -> int:
    """Tokens worth looking up: whole blocks, leaving at least the last token to compute
    (vLLM needs one token to run the forward on, as its own prefix cache does)."""
    if num_tokens <= 1:
        return 0
    return (num_tokens - 1) // block_size * block_size


def save_len(
    info: RequestInfo, num_computed: int, num_blocks: int, block_size: int, mode: str
) -> int:
    """Tokens of a finished request to store: whole blocks whose KV vLLM computed and
    still holds, of the prompt only or of prompt and output (``mode``)."""
    if mode == "off" or info.miss_reason() is not None:
        return 0
    limit = min(num_computed, num_blocks * block_size, info.num_tokens)
    if mode == "prompt":
        limit = min(limit, info.num_prompt_tokens)
    return max(limit, 0) // block_size * block_size
