"""RadixKey: a namespaced token sequence, packed once into bytes that compare with memcmp."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import chain
from typing import Any

import numpy as np
import torch

from .errors import InvalidInputError, TokenRangeError

# Token ids travel and compare as unsigned 32-bit little-endian words: the same bytes the
# reference hash feeds to SHA-256, so a node's key is also its hash input.
_U32 = next(code for code in "IL" if array(code).itemsize == 4)
TOKEN_BYTES = 4
_U32_LIMIT = 1 << 32
_LE_U32 = np.dtype("<u4")
_INT_CODES = frozenset("bBhHiIlLqQ")
_RANGE_MESSAGE = "token ids must lie in [0, 2**32)"


def pack_tokens(token_ids: Any) -> tuple[bytes, int]:
    """Pack token ids into little-endian uint32 bytes and return them with the token width.

    Accepts a sequence of ints, a sequence of equal-length tuples (bigram / EAGLE tokens,
    width = tuple length), an ``array``, or a 1-D / 2-D numpy array or tensor (2-D: one
    row per tuple token). A tuple token contributes its elements in order, so
    ``[(1, 2), (3, 4)]`` packs like ``[1, 2, 3, 4]``.

    Cost, fastest first: ``array('I')`` (one copy); integer numpy arrays, other integer
    ``array`` typecodes (``array('q')`` included) and integer tensors (a vectorized range
    check and cast, a few µs per 10k tokens); lists and tuples of ints (the interpreter
    converts each element, ≈10 ns a token); anything else goes through ``tolist()``.
    Bool, float and complex dtypes are refused rather than converted.

    Raises:
        TokenRangeError: a token id is negative or does not fit in 32 bits.
        InvalidInputError: mixed ints and tuples, tuples of different widths, a
            non-integer dtype, or an array of more than two dimensions.
    """
    if isinstance(token_ids, array):
        if token_ids.typecode == _U32:
            return _le(token_ids).tobytes(), 1
        code = token_ids.typecode
        if code not in _INT_CODES:
            raise InvalidInputError(f"token ids must be integers, not array({code!r})")
        return _pack_ndarray(np.frombuffer(token_ids, dtype=code))
    if isinstance(token_ids, torch.Tensor):
        token_ids = _tensor_on_host(token_ids)
    if isinstance(token_ids, np.ndarray):
        if token_ids.dtype.kind != "O":  # object arrays hold Python ints: the list path
            return _pack_ndarray(token_ids)
        token_ids = token_ids.tolist()
    elif hasattr(token_ids, "tolist") and not isinstance(token_ids, (list, tuple)):
        token_ids = token_ids.tolist()  # other array-likes
    if isinstance(token_ids, (bytes, bytearray, memoryview, str)):
        raise InvalidInputError(
            "token ids must be a sequence of ints; use RadixKey.from_bytes for packed bytes"
        )
    if not hasattr(token_ids, "__len__"):  # a scalar (or a 0-d array's tolist())
        raise InvalidInputError(f"token ids must be a sequence of ints, not {token_ids!r}")
    if len(token_ids) == 0:
        return b"", 1
    first = token_ids[0]
    if isinstance(first, (tuple, list)):
        width = len(first)
        if width == 0 or any(len(t) != width for t in token_ids):
            raise InvalidInputError("tuple tokens in one key must all have the same width >= 1")
        flat: Sequence[Any] = list(chain.from_iterable(token_ids))
    else:
        width = 1
        flat = token_ids
    try:
        packed = array(_U32, flat)
    except OverflowError as exc:
        raise TokenRangeError(_RANGE_MESSAGE) from exc
    except TypeError as exc:
        raise InvalidInputError(f"token ids must be ints or tuples of ints: {exc}") from exc
    return _le(packed).tobytes(), width


def _pack_ndarray(ids: np.ndarray) -> tuple[bytes, int]:
    """An integer array's ids as uint32 little-endian bytes: one range check, one cast."""
    kind = ids.dtype.kind
    if kind not in "iu":
        raise InvalidInputError(f"token ids must be integers, got dtype {ids.dtype}")
    if ids.ndim == 1:
        width = 1
    elif ids.ndim == 2:
        width = ids.shape[1]
        if width == 0 and ids.shape[0]:
            raise InvalidInputError("tuple tokens in one key must all have the same width >= 1")
    else:
        raise InvalidInputError(f"token ids must be 1-D (2-D for tuple tokens), got shape "
                                f"{ids.shape}")
    if ids.size == 0:
        return b"", 1
    size = ids.dtype.itemsize
    # One reduction decides the range: read as unsigned, a negative id is huge, so the
    # largest unsigned value is below the limit only if every id lies in [0, limit).
    if kind == "i":
        unsigned = ids.view(ids.dtype.str.replace("i", "u"))  # same bytes, same byte order
        if unsigned.max() >= min(_U32_LIMIT, 1 << (8 * size - 1)):
            raise TokenRangeError(_RANGE_MESSAGE)
    elif size > 4 and ids.max() >= _U32_LIMIT:
        raise TokenRangeError(_RANGE_MESSAGE)
    return ids.astype(_LE_U32, copy=False).tobytes(), int(width)


def _tensor_on_host(tensor: torch.Tensor) -> Any:
    """A torch integer tensor as a numpy array (no copy for a CPU tensor), or as a list
    where numpy cannot hold its dtype."""
    if tensor.dtype == torch.bool or tensor.is_floating_point() or tensor.is_complex():
        raise InvalidInputError(f"token ids must be integers, got dtype {tensor.dtype}")
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    try:
        return tensor.numpy()
    except (TypeError, RuntimeError):  # a dtype numpy lacks: the slow, exact way
        return tensor.tolist()


def _le(words: array) -> array:
    if array("H", [1]).tobytes()[0] == 1:
        return words
    swapped = array(_U32, words)
    swapped.byteswap()
    return swapped


def unpack_tokens(packed: bytes, width: int) -> list[Any]:
    """Inverse of :func:`pack_tokens`: ints for width 1, tuples otherwise."""
    words = array(_U32)
    words.frombytes(packed)
    words = _le(words)
    if width == 1:
        return words.tolist()
    flat = words.tolist()
    return [tuple(flat[i : i + width]) for i in range(0, len(flat), width)]


class RadixKey:
    """Token ids plus the namespace (``extra_key``) they live in.

    ``len(key)`` counts tokens (a tuple token counts once). Slicing returns a new key in
    the same namespace; an integer index returns a one-token key, as in the reference.
    ``extra_key`` must be a ``str`` or ``None``; ``None`` and ``""`` are different
    namespaces, and keys of different token widths never share a subtree.
    """

    __slots__ = ("_len", "_packed", "_token_ids", "_width", "extra_key")

    def __init__(self, token_ids: Any = (), extra_key: str | None = None) -> None:
        if extra_key is not None and not isinstance(extra_key, str):
            raise InvalidInputError(f"extra_key must be a str or None, not {type(extra_key)!r}")
        self._token_ids = token_ids
        self.extra_key = extra_key
        self._packed: bytes | None = None
        self._width = 1
        self._len = len(token_ids)

    @classmethod
    def from_bytes(
        cls, packed: bytes, token_width: int = 1, extra_key: str | None = None
    ) -> RadixKey:
        """Build a key from little-endian uint32 bytes (the wire format), without decoding."""
        if token_width < 1:
            raise InvalidInputError("token_width must be >= 1")
        if len(packed) % (TOKEN_BYTES * token_width):
            raise InvalidInputError(
                f"{len(packed)} bytes is not a whole number of width-{token_width} tokens"
            )
        key = cls.__new__(cls)
        if extra_key is not None and not isinstance(extra_key, str):
            raise InvalidInputError(f"extra_key must be a str or None, not {type(extra_key)!r}")
        key._token_ids = None
        key.extra_key = extra_key
        key._packed = bytes(packed)
        key._width = token_width
        key._len = len(packed) // (TOKEN_BYTES * token_width)
        return key

    @property
    def token_ids(self) -> Any:
        if self._token_ids is None:
            self._token_ids = unpack_tokens(self._packed or b"", self._width)
        return self._token_ids

    def packed(self) -> tuple[bytes, int]:
        """The key as ``(uint32 little-endian bytes, token width)``, computed once."""
        if self._packed is None:
            self._packed, self._width = pack_tokens(self._token_ids)
        return self._packed, self._width

    @property
    def token_width(self) -> int:
        return self.packed()[1]

    def page_aligned(self, page_size: int) -> RadixKey:
        """This key cut down to a whole number of pages."""
        return self[: len(self) // page_size * page_size]

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, idx: int | slice) -> RadixKey:
        if isinstance(idx, int):
            if idx < 0:
                idx += self._len
            if not 0 <= idx < self._len:
                raise IndexError("RadixKey index out of range")
            idx = slice(idx, idx + 1)
        if self._token_ids is not None:
            return RadixKey(self._token_ids[idx], self.extra_key)
        start, stop, step = idx.indices(self._len)
        if step != 1:
            return RadixKey(self.token_ids[idx], self.extra_key)
        tb = TOKEN_BYTES * self._width
        packed = self._packed or b""
        return RadixKey.from_bytes(
            packed[start * tb : max(start, stop) * tb], self._width, self.extra_key
        )

    def __repr__(self) -> str:
        ids = self.token_ids
        head = list(ids[:8])
        more = "..." if self._len > 8 else ""
        return f"RadixKey(extra_key={self.extra_key!r}, token_ids={head}{more}, len={self._len})"
