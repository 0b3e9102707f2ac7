"""Object keys: a model fingerprint and a page's chained hash.

A page's chained SHA-256 hash (``hash_pages``, the one KV events and SGLang use) names
its tokens and every token before it in its namespace. The fingerprint adds what makes
the bytes of that page: the model, its pool geometry, dtype and page size, and the
namespace (``extra_key``, where tenants live, and token width). Two sidecars with the
same model config agree on every key; models, layouts, namespaces and tenants never mix.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache

from ..config_types import ModelConfig

KEY_PREFIX = "prefixcache/v1"


def model_fingerprint(model: ModelConfig) -> str:
    """What of a model's config decides a page's bytes, as a canonical string."""
    pool = model.pool
    return json.dumps({
        "name": model.name, "kind": model.kind, "page_size": model.page_size,
        "dtype": pool.dtype, "layers": pool.layers, "k_heads": pool.k_heads,
        "k_head_dim": pool.k_head_dim, "mla": pool.mla,
        "v_heads": 0 if pool.mla else (pool.v_heads or pool.k_heads),
        "v_head_dim": 0 if pool.mla else (pool.v_head_dim or pool.k_head_dim),
    }, sort_keys=True)


class KeyMaker:
    """The keys of one model's pages, per namespace."""

    def __init__(self, model: ModelConfig) -> None:
        self._model = model_fingerprint(model)
        # Namespaces are client strings: the prefixes are cached, but boundedly.
        self._prefix = lru_cache(maxsize=4096)(self._make_prefix)

    def _make_prefix(self, extra_key: str | None, token_width: int) -> str:
        # None and "" are different namespaces, as in the tree.
        ns = json.dumps([extra_key, token_width])
        digest = hashlib.sha256(f"{self._model}\n{ns}".encode()).hexdigest()[:32]
        return f"{KEY_PREFIX}/{digest}/"

    def keys(self, extra_key: str | None, token_width: int, page_hashes: list[str]) -> list[str]:
        prefix = self._prefix(extra_key, token_width)
        return [prefix + h for h in page_hashes]
