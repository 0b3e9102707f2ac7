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
from typing import Any

from prefixcache.cache.index.page_index import (
    DIGEST_BYTES,
    HASH_NAMESPACE_PREFIX,
    is_hash_namespace,
)

from ..config.types import ModelConfig

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


def page_names(node: Any) -> tuple[str | None, int, list[str]]:
    """A tree node's pages as the tier names them: ``(extra_key, token width, page
    hashes)``. A token node's pages are its chained page hashes; a *hash page* node
    (pages SGLang stored by hash alone, page_index.py) holds each page's hash in its
    "tokens", under a hidden namespace named after the token namespace it stands for,
    so its pages get the keys the same pages have as token pages."""
    ns = node.require_namespace()
    if not is_hash_namespace(ns.extra_key):
        return ns.extra_key, ns.token_width, list(node.hash_values or ())
    extra_key, width = token_namespace(ns.extra_key)
    data, step = node.key_bytes, ns.page_bytes
    return extra_key, width, [data[i:i + DIGEST_BYTES].hex() for i in range(0, len(data), step)]


def token_namespace(hidden: str) -> tuple[str | None, int]:
    """The token namespace ``(extra_key, width)`` whose hash pages live in ``hidden``
    (the inverse of ``page_index.hash_namespace``)."""
    rest = hidden[len(HASH_NAMESPACE_PREFIX) + 2:]  # past "/w"
    width, sep, extra_key = rest.partition("=")
    return (extra_key if sep else None), int(width)
