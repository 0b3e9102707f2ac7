"""Wire bytes to domain values and back; the only place that knows the packed layouts.

Token ids arrive as little-endian uint32 words and slot indices as little-endian int64,
so decoding is one ``numpy.frombuffer`` and never a Python loop.
"""

from __future__ import annotations

import numpy as np
import torch

from prefixcache.cache import InvalidInputError, RadixKey
from prefixcache.cache.index.page_index import is_hash_namespace
from prefixcache.cache.key import TOKEN_BYTES

from .access.limits import check_count

# Wider tokens exist only for bigram / EAGLE keys; anything past this is a client bug.
MAX_TOKEN_WIDTH = 8
_SLOT_BYTES = 8
_LE_I64 = np.dtype("<i8")
_LE_U32 = np.dtype("<u4")


def decode_key(
    token_ids: bytes,
    token_width: int,
    extra_key: str | None,
    vocab_size: int = 0,
    max_tokens: int = 0,
) -> RadixKey:
    """A RadixKey from packed token bytes, checked against the model's vocabulary and,
    before any other work, against ``max_tokens`` per request (0: no limit)."""
    width = token_width or 1
    if width > MAX_TOKEN_WIDTH:
        raise InvalidInputError(f"token_width {width} is above the supported {MAX_TOKEN_WIDTH}")
    if is_hash_namespace(extra_key):  # only SetPages writes there (page_index.py)
        raise InvalidInputError(
            "extra_key: namespaces starting with NUL "
            "'prefixcache/hash-pages' hold pages stored by hash"
        )
    if len(token_ids) % (TOKEN_BYTES * width):
        raise InvalidInputError(
            f"token_ids has {len(token_ids)} bytes, not a multiple of {TOKEN_BYTES * width} "
            f"(4 bytes per id, token_width {width})"
        )
    check_count("token_ids", len(token_ids) // (TOKEN_BYTES * width), max_tokens)
    if vocab_size and token_ids:
        top = int(np.frombuffer(token_ids, dtype=_LE_U32).max())
        if top >= vocab_size:
            raise InvalidInputError(f"token id {top} is outside the vocabulary [0, {vocab_size})")
    return RadixKey.from_bytes(token_ids, width, extra_key)


def decode_slots(data: bytes, field: str = "slot_indices", max_count: int = 0) -> np.ndarray:
    """Packed little-endian int64 slot indices as a native int64 array (a copy); more
    than ``max_count`` of them (0: no limit) are refused before the copy."""
    if len(data) % _SLOT_BYTES:
        raise InvalidInputError(f"{field} has {len(data)} bytes, not a multiple of 8")
    check_count(field, len(data) // _SLOT_BYTES, max_count)
    return np.frombuffer(data, dtype=_LE_I64).astype(np.int64)


def encode_slots(slots: np.ndarray | torch.Tensor) -> bytes:
    """Slot indices as packed little-endian int64 bytes."""
    if isinstance(slots, torch.Tensor):
        slots = slots.detach().to("cpu").numpy()
    return np.ascontiguousarray(slots, dtype=_LE_I64).tobytes()
