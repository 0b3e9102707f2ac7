"""Object keys and page identities: a model fingerprint, a tenant, a namespace and a
page's chained hash.

A page's chained SHA-256 hash (``hash_pages``, the one KV events and SGLang use) names
its tokens and every token before it in its namespace. The fingerprint adds what makes
the bytes of that page: the model, its pool geometry, dtype and page size, and its
vocabulary and tokenizer; the namespace adds the ``extra_key`` and token width, and the
**tenant** the tenants that may use that namespace (``server.tenants``: a namespace's
tenants are those with a prefix of it). Two sidecars with the same model and tenant
config agree on every key; models, layouts, namespaces and tenants never mix, and a
sidecar that lacks a tenant's config names none of its pages.

The same fields, with the page's hash, are the identity a page's seal binds
(memory/page_seal.py): a valid object under another key, of another model version or
of another tenant does not check.

Without a secret a key is ``prefixcache/v1/<digest of model and namespace>/<page
hash>``, computable from the tokens by anyone. With ``tier.secret_file`` both parts are
keyed: the first an HMAC under a key per tenant derived from the secret, the second a
keyed BLAKE2b of the page hash, so that a store client without the secret can tell
neither which tenant nor which prompt a key stands for, nor find a prompt's keys.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from prefixcache.cache.index.page_index import (
    DIGEST_BYTES,
    HASH_NAMESPACE_PREFIX,
    is_hash_namespace,
)

from ..access.tenants import Caller
from ..config.tenants import TenantConfig
from ..config.types import ModelConfig
from ..memory.page_seal import PageSeal, derive_key, identity

KEY_PREFIX = "prefixcache/v1"
# Key derivation purposes (page_seal.derive_key): object keys, and page seals.
KEYS_PURPOSE = "tier-keys"
PAGES_PURPOSE = "tier-pages"


def model_fingerprint(model: ModelConfig) -> str:
    """What of a model's config decides a page's bytes, as a canonical string."""
    pool = model.pool
    return json.dumps(
        {
            "name": model.name,
            "kind": model.kind,
            "page_size": model.page_size,
            "vocab_size": model.vocab_size,
            "tokenizer": model.tokenizer,
            "dtype": pool.dtype,
            "layers": pool.layers,
            "k_heads": pool.k_heads,
            "k_head_dim": pool.k_head_dim,
            "mla": pool.mla,
            "v_heads": 0 if pool.mla else (pool.v_heads or pool.k_heads),
            "v_head_dim": 0 if pool.mla else (pool.v_head_dim or pool.k_head_dim),
        },
        sort_keys=True,
    )


def namespace_tenant(tenants: Iterable[TenantConfig], extra_key: str | None) -> str | None:
    """The tenants that may use namespace ``extra_key`` (by the rule of
    ``Caller.may_use``), as the tier names them: their names, sorted, as a JSON list;
    None where no tenant may (no tenants configured, or a namespace only the server and
    admin tokens name)."""
    names = sorted(
        t.name for t in tenants if Caller(tenant=t.name, namespaces=t.namespaces).may_use(extra_key)
    )
    return json.dumps(names) if names else None


@dataclass(frozen=True, slots=True)
class Namespace:
    """One namespace's keys and seals: its key prefix, the key of its page parts (None
    without a secret), the seal its pages carry, and the head of their identity."""

    tenant: str | None
    prefix: str
    page_key: bytes | None
    seal: PageSeal
    ident_head: bytes

    def key(self, page_hash: str) -> str:
        if self.page_key is None:
            return self.prefix + page_hash
        return (
            self.prefix
            + hashlib.blake2b(page_hash.encode(), key=self.page_key, digest_size=16).hexdigest()
        )

    def ident(self, page_hash: str) -> bytes:
        """The identity a page's seal binds: ``identity(..., page_hash)``, built once
        per namespace up to the hash."""
        return self.ident_head + identity(page_hash)


class KeyMaker:
    """The keys and identities of one model's pages, per namespace.

    Args:
        model: The model's config.
        tenants: ``server.tenants``.
        secret: The cluster secret (``tier.secret_file``), or None.
    """

    def __init__(
        self,
        model: ModelConfig,
        tenants: tuple[TenantConfig, ...] = (),
        secret: bytes | None = None,
    ) -> None:
        self._model = model_fingerprint(model)
        self._tenants = tenants
        self._secret = secret
        self.keyed = secret is not None
        self._seals: dict[str | None, PageSeal] = {}
        # Namespaces are client strings: they are cached, but boundedly.
        self.namespace = lru_cache(maxsize=4096)(self._namespace)

    def _seal(self, tenant: str | None) -> PageSeal:
        seal = self._seals.get(tenant)
        if seal is None:
            key = None if self._secret is None else derive_key(self._secret, PAGES_PURPOSE, tenant)
            seal = self._seals[tenant] = PageSeal(key)
        return seal

    def _namespace(self, extra_key: str | None, token_width: int) -> Namespace:
        # None and "" are different namespaces, as in the tree.
        tenant = namespace_tenant(self._tenants, extra_key)
        head = identity("tier-page", self._model, tenant, extra_key, token_width)
        if self._secret is None:
            ns = json.dumps([extra_key, token_width, tenant])
            digest = hashlib.sha256(f"{self._model}\n{ns}".encode()).hexdigest()[:32]
            page_key = None
        else:
            names = derive_key(self._secret, KEYS_PURPOSE, tenant)
            digest = hmac.new(names, b"prefix" + head, "sha256").hexdigest()[:32]
            page_key = hmac.new(names, b"pages" + head, "sha256").digest()
        return Namespace(tenant, f"{KEY_PREFIX}/{digest}/", page_key, self._seal(tenant), head)

    def keys(self, extra_key: str | None, token_width: int, page_hashes: list[str]) -> list[str]:
        ns = self.namespace(extra_key, token_width)
        if ns.page_key is None:
            prefix = ns.prefix
            return [prefix + h for h in page_hashes]
        return [ns.key(h) for h in page_hashes]


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
    return extra_key, width, [data[i : i + DIGEST_BYTES].hex() for i in range(0, len(data), step)]


def token_namespace(hidden: str) -> tuple[str | None, int]:
    """The token namespace ``(extra_key, width)`` whose hash pages live in ``hidden``
    (the inverse of ``page_index.hash_namespace``)."""
    rest = hidden[len(HASH_NAMESPACE_PREFIX) + 2 :]  # past "/w"
    width, sep, extra_key = rest.partition("=")
    return (extra_key if sep else None), int(width)
