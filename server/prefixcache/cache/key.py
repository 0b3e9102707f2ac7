"""RadixKey: a namespaced token sequence, packed once into bytes that compare with memcmp."""

from __future__ import annotations

import sys
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
_LITTLE = sys.byteorder == "little"
# Each integer ``array`` typecode's numpy dtype, parsed once.
_CODE_DTYPES = {code: np.dtype(code) for code in "bBhHiIlLqQ"}
_RANGE_MESSAGE = "token ids must lie in [0, 2**32)"


def pack_tokens(token_ids: Any) -> tuple[bytes, int]:
    """Pack token ids into little-endian uint32 bytes and return them with the token width.

    Accepts a sequence of ints, a sequence of equal-length tuples (bigram / EAGLE tokens,
    width = tuple length), an ``array``, or a 1-D / 2-D numpy array or tensor (2-D: one
    row per tuple token). A tuple token contributes its elements in order, so
    ``[(1, 2), (3, 4)]`` packs like ``[1, 2, 3, 4]``.

    Fastest input: ``array('I')`` (one copy: ≈1.2 µs per 13.5 k tokens on the dev VM,
    ≈0.2 µs for 128), then uint32 numpy (≈1.5 µs). Others, per 13.5 k tokens: int32
    numpy ≈2.5 µs (a sign test, a copy); int64 numpy ≈5 µs and ``array('q')`` ≈5.5 µs
    (one reduction, one cast, one copy: ≈2.5x copying the int64 input, the floor
    without a compiled loop); integer tensors ≈1.2 µs more (``Tensor.numpy()``); lists
    and tuples ≈75 µs (≈5.5 ns a token in the ``array`` constructor's loop, the
    interpreter's floor). For 128 tokens: lists ≈1 µs, numpy arrays ≈0.4-1.4 µs,
    tensors ≈2-2.7 µs, mostly fixed cost per call. ``bench/pack_keys.py`` measures these.
    Bool, float and complex dtypes are refused rather than converted.

    Raises:
        TokenRangeError: a token id is negative or does not fit in 32 bits.
        InvalidInputError: mixed ints and tuples, tuples of different widths, a
            non-integer dtype, or an array of more than two dimensions.
    """
    # Exact types first, most common first: one `is` test each, no isinstance chain.
    kind = type(token_ids)
    if kind is np.ndarray:
        return _pack_ndarray(token_ids)
    if kind is array:
        return _pack_array(token_ids)
    if kind is torch.Tensor:
        return _pack_host(_tensor_on_host(token_ids))
    if kind is list or kind is tuple:
        return _pack_list(token_ids)
    return _pack_other(token_ids)


def _pack_other(token_ids: Any) -> tuple[bytes, int]:
    """Subclasses of the containers above, other array-likes and refusals."""
    if isinstance(token_ids, array):
        return _pack_array(token_ids)
    if isinstance(token_ids, torch.Tensor):
        return _pack_host(_tensor_on_host(token_ids))
    if isinstance(token_ids, np.ndarray):
        return _pack_ndarray(token_ids)
    if hasattr(token_ids, "tolist") and not isinstance(token_ids, (list, tuple)):
        token_ids = token_ids.tolist()  # other array-likes
    return _pack_sequence(token_ids)


def _pack_host(host: Any) -> tuple[bytes, int]:
    return _pack_ndarray(host) if isinstance(host, np.ndarray) else _pack_sequence(host)


def _pack_list(token_ids: list[Any] | tuple[Any, ...]) -> tuple[bytes, int]:
    """A list or tuple of ints in the ``array`` constructor's C loop; anything else it
    refuses (tuple tokens, non-ints) goes the general way."""
    try:
        packed = array(_U32, token_ids)
    except OverflowError as exc:
        raise TokenRangeError(_RANGE_MESSAGE) from exc
    except TypeError:
        return _pack_sequence(token_ids)
    return (packed.tobytes() if _LITTLE else _le(packed).tobytes()), 1


def _pack_sequence(token_ids: Any) -> tuple[bytes, int]:
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


def _pack_array(token_ids: array[int]) -> tuple[bytes, int]:
    code = token_ids.typecode
    if code == _U32:
        return (token_ids.tobytes() if _LITTLE else _le(token_ids).tobytes()), 1
    dtype = _CODE_DTYPES.get(code)
    if dtype is None:
        raise InvalidInputError(f"token ids must be integers, not array({code!r})")
    return _pack_ndarray(np.frombuffer(token_ids, dtype))  # positional: ≈0.15 µs faster


# How ids of one integer dtype are range-checked and cast, decided once per dtype (an
# np.iinfo call costs more than the check itself on short keys): (check, view, same):
# _HIGH: the largest id of the unsigned `view` must be < 2**32 (a negative id read as
# unsigned is huge, so one pass checks both ends); _SIGN: the smallest id must be >= 0;
# _NONE: the dtype cannot leave the range. `same`: checked ids already have the wire's
# bytes (little-endian 4-byte), so the cast is skipped.
_NONE, _SIGN, _HIGH = 0, 1, 2
_PLANS: dict[np.dtype, tuple[int, np.dtype | None, bool]] = {}


def _plan(dtype: np.dtype) -> tuple[int, np.dtype | None, bool]:
    if dtype.kind not in "iu":
        raise InvalidInputError(f"token ids must be integers, got dtype {dtype}")
    view = None
    if dtype.itemsize > 4:
        check = _HIGH
        if dtype.kind == "i":
            view = np.dtype(dtype.str.replace("i", "u"))  # same bytes, same byte order
    else:
        check = _SIGN if dtype.kind == "i" else _NONE
    plan = (check, view, dtype.str in ("<u4", "<i4"))
    _PLANS[dtype] = plan
    return plan


def _pack_ndarray(ids: np.ndarray) -> tuple[bytes, int]:
    """An integer array's ids as uint32 little-endian bytes: at most one range-check pass
    (argmax / argmin: SIMD, and without the ufunc machinery's ≈0.8 µs fixed cost of max())
    and one cast, which tobytes copies once more into the bytes protobuf wants."""
    plan = _PLANS.get(ids.dtype)
    if plan is None:
        if ids.dtype.kind == "O":  # object arrays hold Python ints: the list path
            return _pack_sequence(ids.tolist())
        plan = _plan(ids.dtype)
    ndim = ids.ndim
    if ndim == 1:
        width = 1
    elif ndim == 2:
        width = ids.shape[1]
        if width == 0 and ids.shape[0]:
            raise InvalidInputError("tuple tokens in one key must all have the same width >= 1")
    else:
        raise InvalidInputError(
            f"token ids must be 1-D (2-D for tuple tokens), got shape {ids.shape}"
        )
    if ids.size == 0:
        return b"", 1
    check, view, same = plan
    if check == _HIGH:
        words = ids if view is None else ids.view(view)
        if words.item(words.argmax()) >= _U32_LIMIT:
            raise TokenRangeError(_RANGE_MESSAGE)
    elif check == _SIGN and ids.item(ids.argmin()) < 0:
        raise TokenRangeError(_RANGE_MESSAGE)
    return (ids.tobytes() if same else ids.astype(_LE_U32).tobytes()), int(width)


# Integer tensor dtypes (torch without the unsigned 16/32/64-bit ones lacks those names).
_TORCH_INTS = frozenset(
    getattr(torch, name)
    for name in ("int8", "uint8", "int16", "int32", "int64", "uint16", "uint32", "uint64")
    if hasattr(torch, name)
)


def _tensor_on_host(tensor: torch.Tensor) -> Any:
    """A torch integer tensor as a numpy array (no copy for a CPU tensor), or as a list
    where numpy cannot hold its dtype."""
    dtype = tensor.dtype
    if dtype not in _TORCH_INTS and (
        dtype == torch.bool or tensor.is_floating_point() or tensor.is_complex()
    ):
        raise InvalidInputError(f"token ids must be integers, got dtype {dtype}")
    if tensor.requires_grad:  # only float tensors can, but a subclass might say so
        tensor = tensor.detach()
    if not tensor.is_cpu:
        tensor = tensor.cpu()
    try:
        return tensor.numpy()
    except (TypeError, RuntimeError):  # a dtype numpy lacks: the slow, exact way
        return tensor.tolist()


def _le(words: array[int]) -> array[int]:
    if _LITTLE:
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
