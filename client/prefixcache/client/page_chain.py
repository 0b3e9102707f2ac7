"""A request's chained page hashes, computed on the worker, byte-identical to the service's.

The service names each cached page by a hash chained within its namespace (SGLang's
page hash, ``prefixcache.cache.hashing.hash_pages``): SHA-256 over the previous page's
32-byte digest (nothing for the first page) followed by the page's tokens as uint32
little-endian values. A worker computes the same chain from its own tokens with
hashlib, without torch or the cache library, and keeps it with the request: a request
waits many scheduling steps, and each step's ranking match reuses the hashes computed
before. Only whole pages are hashed; ``extend`` grows the chain as tokens are added.

The shadow index keys a page by the first 8 bytes of its digest as a native-order
integer (``page_key``): a set of ints is the cheapest lookup Python has, and 64 bits keep
two pages of one namespace from sharing a key with odds of about 2**-64 per pair.
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any

from ._wire import pack_tokens
from .errors import InvalidArgument

DIGEST_BYTES = 32
_ORDER = sys.byteorder
_sha256 = hashlib.sha256


def page_key(digest: bytes) -> int:
    """The shadow index's key for a page: its digest's first 8 bytes, native order."""
    return int.from_bytes(digest[:8], _ORDER)


def chain_digests(packed: bytes, page_bytes: int, prior: bytes | None = None) -> list[bytes]:
    """The chained digest of each whole ``page_bytes`` page of ``packed`` tokens (a
    shorter last page is left out), the first chained on ``prior`` (None: a namespace's
    first page)."""
    digests = []
    for start in range(0, len(packed) - page_bytes + 1, page_bytes):
        page = packed[start : start + page_bytes]
        prior = _sha256(prior + page).digest() if prior else _sha256(page).digest()
        digests.append(prior)
    return digests


class RequestHashes:
    """One request's tokens and the page hashes of its whole pages, computed once.

    Hashes are computed lazily, as far as a match walks (``keys(n)``), and kept; tokens
    added with ``extend`` (decoded ones, a new turn) only add pages.

    Args:
        tokens: anything the client's calls take (ints, tuples, arrays, packed bytes).
        page_size: the model's tokens per page (``ModelInfo.page_size``).
        extra_key: the namespace, as in ``match``.
        token_width: uint32 values per token, as in ``match`` (inferred when None).
    """

    __slots__ = (
        "_digests",
        "_keys",
        "_packed",
        "_page_bytes",
        "extra_key",
        "page_size",
        "token_width",
    )

    def __init__(
        self,
        tokens: Any = (),
        *,
        page_size: int,
        extra_key: str | None = None,
        token_width: int | None = None,
    ) -> None:
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise InvalidArgument(f"page_size must be an int >= 1, got {page_size!r}")
        if extra_key is not None and not isinstance(extra_key, str):
            raise InvalidArgument(f"extra_key must be a str or None, not {type(extra_key)!r}")
        data, width = pack_tokens(tokens, token_width)
        if len(data) % (4 * width):
            raise InvalidArgument(f"{len(data)} token bytes are not whole tokens of width {width}")
        self._packed = bytearray(data)
        self.token_width = width
        self.page_size = page_size
        self.extra_key = extra_key
        self._page_bytes = 4 * width * page_size
        self._digests: list[bytes] = []
        self._keys: list[int] = []

    @property
    def namespace(self) -> tuple[str | None, int]:
        """``(extra_key, token_width)``: the namespace the request's pages live in."""
        return (self.extra_key, self.token_width)

    def __len__(self) -> int:
        """Tokens in the request."""
        return len(self._packed) // (4 * self.token_width)

    @property
    def num_pages(self) -> int:
        """Whole pages of the request (the ones that can be cached)."""
        return len(self._packed) // self._page_bytes

    def extend(self, tokens: Any) -> None:
        """Add tokens (same width) at the end; their pages are hashed when needed."""
        data, width = pack_tokens(tokens, self.token_width)
        if width != self.token_width or len(data) % (4 * width):
            raise InvalidArgument(
                f"tokens of width {width} do not extend a request of width {self.token_width}"
            )
        self._packed += data

    def extended(self, tokens: Any) -> RequestHashes:
        """A new request of these tokens followed by ``tokens`` (same width), sharing
        the hashes computed so far (a prefix handle's chain, grown by a query)."""
        out = RequestHashes(
            page_size=self.page_size, extra_key=self.extra_key, token_width=self.token_width
        )
        out._packed = bytearray(self._packed)
        out.extend(tokens)
        out._digests, out._keys = list(self._digests), list(self._keys)
        return out

    def prefix(self, num_tokens: int) -> RequestHashes:
        """A new request of this one's first ``num_tokens`` tokens, sharing the hashes
        of its whole pages computed so far."""
        out = RequestHashes(
            page_size=self.page_size, extra_key=self.extra_key, token_width=self.token_width
        )
        out._packed = self._packed[: num_tokens * 4 * self.token_width]
        pages = min(len(self._digests), out.num_pages)
        out._digests, out._keys = self._digests[:pages], self._keys[:pages]
        return out

    def grow_to(self, packed: bytes, token_width: int) -> bool:
        """Become ``packed`` (tokens of ``token_width``) when it starts with this
        request's tokens: only its new pages will be hashed. False, unchanged, if not."""
        have = len(self._packed)
        if (
            token_width != self.token_width
            or len(packed) < have
            or memoryview(packed)[:have] != self._packed
        ):
            return False
        self._packed += packed[have:]
        return True

    def keys(self, n: int | None = None) -> list[int]:
        """The shadow keys of the first ``n`` pages (all whole pages when None). The list
        is the request's own: do not change it."""
        self._grow(self.num_pages if n is None else min(n, self.num_pages))
        return self._keys if n is None else self._keys[:n]

    def digests(self, n: int | None = None) -> list[bytes]:
        """The chained 32-byte digests of the first ``n`` pages (all when None)."""
        self._grow(self.num_pages if n is None else min(n, self.num_pages))
        return self._digests[: self.num_pages if n is None else n]

    def hex_hashes(self, n: int | None = None) -> list[str]:
        """The digests as hex, as the service's ``hash_pages`` and KV events write them."""
        return [d.hex() for d in self.digests(n)]

    def _grow(self, n: int) -> None:
        have = len(self._digests)
        if n <= have:
            return
        step = self._page_bytes
        prior = self._digests[-1] if have else None
        new = chain_digests(bytes(self._packed[have * step : n * step]), step, prior)
        self._digests += new
        # Every digest's first 8 bytes as native ints in one C call (page_key, in bulk).
        self._keys += memoryview(b"".join(new)).cast("Q")[:: DIGEST_BYTES // 8].tolist()

    def __repr__(self) -> str:
        return (
            f"RequestHashes({len(self)} tokens, {len(self._digests)}/{self.num_pages} "
            f"pages hashed, page_size={self.page_size}, extra_key={self.extra_key!r})"
        )
