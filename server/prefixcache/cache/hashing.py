"""SHA-256 token and page hashes, byte-compatible with SGLang's KV-event block hashes."""

from __future__ import annotations

import hashlib
from typing import Any

from .key import pack_tokens


def hash_token_ids(token_ids: Any, prior_hash: str | None = None) -> str:
    """Hex SHA-256 of ``token_ids`` (uint32 little-endian each), chained on ``prior_hash``.

    The prior is fed as its 32 raw bytes, not as hex text; ``None`` and ``""`` mean no
    prior. Tuple tokens hash like their flattened elements, as in SGLang, so block
    hashes stay compatible with SGLang's KV events.

    Raises:
        TokenRangeError: (an ``OverflowError``) for ids outside ``[0, 2**32)``.
        ValueError: ``prior_hash`` is not hex.
    """
    digest = hashlib.sha256()
    if prior_hash:
        digest.update(bytes.fromhex(prior_hash))
    digest.update(pack_tokens(token_ids)[0])
    return digest.hexdigest()


def hash_pages(packed: bytes, page_bytes: int, prior: bytes | None) -> list[str]:
    """Chained hex hashes of each ``page_bytes`` slice of already packed tokens.

    The last page may be shorter. ``prior`` is the raw digest the first page chains on.
    """
    hashes = []
    sha256 = hashlib.sha256
    for start in range(0, len(packed), page_bytes):
        page = packed[start : start + page_bytes]
        prior = sha256(prior + page).digest() if prior else sha256(page).digest()
        hashes.append(prior.hex())
    return hashes


def hash_to_int64(hex_hash: str) -> int:
    """First 16 hex digits as a signed 64-bit integer (SGLang's KV-event block hash)."""
    value = int(hex_hash[:16], 16)
    return value - (1 << 64) if value >= 1 << 63 else value


def hash_bytes(data: bytes) -> int:
    """First 8 bytes of SHA-256 of ``data`` as an unsigned big-endian integer."""
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")
