"""Token ids and slot indices to the packed wire bytes and back, without torch or numpy.

Inputs may be lists or tuples of ints (or of equal-width tuples, for bigram / EAGLE
tokens), ``array.array``, numpy arrays, torch tensors, or ``bytes`` that are already in
the wire format. numpy and torch are recognised by the type's module and torch is never
imported here unless the caller handed us one of its objects (so it is loaded already).
numpy is imported, if it is installed, the first time an ``array`` of another typecode
than the wire's is packed (``array('q')``, SGLang's key type): it converts and
range-checks the whole array at once, where the interpreter would convert id by id.
Outputs are ``array('q')`` of native int64, which numpy and torch can view without a
copy.

Cost of packing token ids, fastest first: ``bytes`` in the wire format (none);
``array('I')`` (one copy); numpy integer arrays, integer tensors and other integer
``array`` typecodes with numpy installed (a vectorized range check and cast, a few µs
per 10k ids); lists and tuples (the interpreter converts each id, ≈5.5 ns each). See
:func:`pack_tokens` for measured costs.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable
from itertools import chain
from typing import Any

from .errors import InvalidArgument

_LITTLE = sys.byteorder == "little"
_U32 = next(code for code in "IL" if array(code).itemsize == 4)
_I64 = "q"
_U32_LIMIT = 1 << 32
_I64_LOW, _I64_HIGH = -(1 << 63), 1 << 63
_INT_CODES = frozenset("bBhHiIlLqQ")
_UNSET: Any = object()
_numpy_module: Any = _UNSET


def _numpy() -> Any:
    """The numpy module if it is installed, else None (imported on first use)."""
    global _numpy_module
    if _numpy_module is _UNSET:
        try:
            import numpy
        except ImportError:
            _numpy_module = None
        else:
            _numpy_module = numpy
            _TOKEN_PACKERS[numpy.ndarray] = _pack_ndarray
    return _numpy_module


def _module(obj: Any) -> str:
    return type(obj).__module__ or ""


def _le(words: array[int]) -> bytes:
    if not _LITTLE:
        words = array(words.typecode, words)
        words.byteswap()
    return words.tobytes()


def pack_tokens(tokens: Any, token_width: int | None = None) -> tuple[bytes, int]:
    """``tokens`` as little-endian uint32 bytes and the token width.

    ``bytes`` / ``bytearray`` / ``memoryview`` pass through unchanged (the caller
    packed them; ``token_width`` says how many uint32 make a token, default 1). An
    object with a ``packed()`` method (``prefixcache.cache.RadixKey``) gives its own
    bytes and width. A 2-D array or tensor, or a sequence of tuples, is a sequence of
    tuple tokens whose width is the row length.

    Fastest input, after packed ``bytes``: ``array('I')`` (one copy: ≈1.3 µs per 13.5 k
    tokens on the dev VM, ≈0.25 µs for 128), then uint32 numpy (≈1.6 µs). Others, per
    13.5 k tokens: int32 numpy ≈2.6 µs (a sign test, a copy); int64 numpy ≈5 µs and
    ``array('q')`` ≈5.5 µs (one reduction, one cast, one copy: ≈2.5x copying the int64
    input, the floor without a compiled loop); integer tensors ≈1.2 µs more
    (``Tensor.numpy()``); lists ≈75 µs (≈5.5 ns a token in the ``array`` constructor's
    loop, the interpreter's floor). For 128 tokens: lists ≈1 µs, numpy arrays
    ≈0.45-1.5 µs, tensors ≈2-2.8 µs, mostly fixed cost per call.
    ``bench/pack_keys.py`` measures these.

    Raises:
        InvalidArgument: negative or too-large ids, non-integer values, ragged tuples,
            or a ``token_width`` that disagrees with the tokens.
    """
    # One dict lookup on the exact type finds the common containers (numpy's and torch's
    # join once met); everything else goes the general way.
    pack = _TOKEN_PACKERS.get(type(tokens))
    if pack is not None:
        data, width = pack(tokens)
    elif isinstance(tokens, (bytes, bytearray, memoryview)):
        return bytes(tokens), token_width or 1
    else:
        packed = getattr(tokens, "packed", None)
        if callable(packed) and not isinstance(tokens, array):
            data, width = packed()
        else:
            data, width = _pack_tokens(tokens)
    if token_width and token_width != width:
        if width != 1 or len(data) % (4 * token_width):
            raise InvalidArgument(f"token_width {token_width} does not fit tokens of width {width}")
        width = token_width  # flat ids regrouped into tuple tokens by the caller's word
    return data, width


def _pack_list(tokens: list[Any] | tuple[Any, ...]) -> tuple[bytes, int]:
    """Ints in the ``array`` constructor's C loop; what it refuses (tuple tokens, numpy
    scalars, non-ints) goes the general way."""
    try:
        words = array(_U32, tokens)
    except OverflowError as exc:
        raise InvalidArgument("token ids must lie in [0, 2**32)") from exc
    except TypeError:
        return _pack_tokens(tokens)
    return _le(words), 1


def _pack_array(tokens: array[int]) -> tuple[bytes, int]:
    code = tokens.typecode
    if code == _U32:
        return _le(tokens), 1
    if code in _INT_CODES:
        return _pack_int_array(tokens, "<u4", 0, _U32_LIMIT, "token ids"), 1
    return _pack_tokens(tokens)  # float arrays: refused there


def _pack_ndarray(tokens: Any) -> tuple[bytes, int]:
    return _pack_numpy(tokens, "<u4", 0, _U32_LIMIT, "token ids")


def _pack_tensor_tokens(tokens: Any) -> tuple[bytes, int]:
    return _pack_tensor(tokens, "<u4", 0, _U32_LIMIT, "token ids")


_TOKEN_PACKERS: dict[type, Callable[[Any], tuple[bytes, int]]] = {
    list: _pack_list,
    tuple: _pack_list,
    array: _pack_array,
}


def _pack_tokens(tokens: Any) -> tuple[bytes, int]:
    if isinstance(tokens, array):
        if tokens.typecode == _U32:
            return _le(tokens), 1
        if tokens.typecode in _INT_CODES:
            return _pack_int_array(tokens, "<u4", 0, _U32_LIMIT, "token ids"), 1
        tokens = tokens.tolist()
    elif isinstance(tokens, str):
        raise InvalidArgument("token ids must be integers, not a str")
    else:
        mod = _module(tokens)
        if mod.startswith("torch"):
            return _pack_tensor(tokens, "<u4", 0, _U32_LIMIT, "token ids")
        if mod.startswith("numpy"):
            return _pack_numpy(tokens, "<u4", 0, _U32_LIMIT, "token ids")
    if not isinstance(tokens, (list, tuple)):
        try:
            tokens = list(tokens)
        except TypeError as exc:
            raise InvalidArgument(
                f"token ids must be a sequence of ints, not {type(tokens).__name__}"
            ) from exc
    if not tokens:
        return b"", 1
    first = tokens[0]
    if isinstance(first, (tuple, list)) or (
        _module(first).startswith(("numpy", "torch")) and getattr(first, "ndim", 0) == 1
    ):
        width = len(first)
        rows = [tuple(t) for t in tokens]
        if width == 0 or any(len(t) != width for t in rows):
            raise InvalidArgument("tuple tokens in one key must all have the same width >= 1")
        flat: Any = list(chain.from_iterable(rows))
    else:
        width, flat = 1, tokens
    return _le(_to_array(_U32, flat, "token ids must lie in [0, 2**32)")), width


def pack_slots(slots: Any) -> bytes:
    """Slot indices (or state slots, or versions) as little-endian int64 bytes.

    ``bytes`` pass through unchanged; everything else as in :func:`pack_tokens`, flat.
    """
    if isinstance(slots, (bytes, bytearray, memoryview)):
        return bytes(slots)
    if slots is None:
        return b""
    if isinstance(slots, array):
        if slots.typecode == _I64:
            return _le(slots)
        if slots.typecode in _INT_CODES:
            return _pack_int_array(slots, "<i8", _I64_LOW, _I64_HIGH, "slots")
        slots = slots.tolist()
    else:
        mod = _module(slots)
        if mod.startswith("torch"):
            return _pack_tensor(slots, "<i8", _I64_LOW, _I64_HIGH, "slots", flat=True)[0]
        if mod.startswith("numpy"):
            return _pack_numpy(slots, "<i8", _I64_LOW, _I64_HIGH, "slots", flat=True)[0]
    if isinstance(slots, int):
        slots = [slots]
    if not isinstance(slots, (list, tuple)):
        try:
            slots = list(slots)
        except TypeError as exc:
            raise InvalidArgument(
                f"slots must be a sequence of ints, not {type(slots).__name__}"
            ) from exc
    return _le(_to_array(_I64, slots, "slots must fit in a signed 64-bit integer"))


def _pack_int_array(values: array[int], dtype: str, low: int, high: int, what: str) -> bytes:
    """An integer ``array`` of another typecode as ``dtype`` bytes, range-checked: with
    numpy in one vector pass, without it in the ``array`` constructor's C loop."""
    np = _numpy()
    if np is not None:
        # frombuffer is 1-D, so no reshape; a positional dtype parses ≈0.15 µs faster.
        return _pack_numpy(np.frombuffer(values, values.typecode), dtype, low, high, what)[0]
    code = _U32 if dtype == "<u4" else _I64
    return _le(_to_array(code, values, f"{what} out of range [{low}, {high})"))


def _to_array(code: str, values: Any, range_message: str) -> array[int]:
    try:
        return array(code, values)
    except OverflowError as exc:
        raise InvalidArgument(range_message) from exc
    except TypeError as exc:
        # numpy / torch scalars and other integer-likes: go through int().
        try:
            return array(code, [_as_int(v) for v in values])
        except OverflowError as exc2:
            raise InvalidArgument(range_message) from exc2
        except TypeError:
            raise InvalidArgument(f"expected integers: {exc}") from exc


def _as_int(value: Any) -> int:
    if isinstance(value, (bool, float)) or not hasattr(value, "__index__"):
        raise TypeError(f"{type(value).__name__} is not an integer")
    number: int = value.__index__()
    return number


def _pack_numpy(
    values: Any, dtype: str, low: int, high: int, what: str, flat: bool = False
) -> tuple[bytes, int]:
    np = _numpy()  # only reached with a numpy object in hand, so numpy is loaded
    arr = values if type(values) is np.ndarray else np.asarray(values)
    plan = _PLANS[dtype].get(arr.dtype)
    if plan is None:
        plan = _plan(np, arr.dtype, dtype, low, high, what)
    if flat:
        arr, width = arr.reshape(-1), 1
    elif arr.ndim == 1:
        width = 1
    elif arr.ndim == 2 and arr.shape[1] >= 1:
        width = int(arr.shape[1])
    else:
        raise InvalidArgument(
            f"{what} must be 1-D (or 2-D for tuple tokens), got shape {arr.shape}"
        )
    check, view, limit, cast = plan
    if arr.size and check is not _NONE:
        # argmax / argmin: one SIMD pass, without max()'s ≈0.8 µs ufunc set-up cost.
        if check is _SIGN:
            bad = arr.item(arr.argmin()) < 0
        else:
            words = arr if view is None else arr.view(view)
            bad = words.item(words.argmax()) >= limit
            if check is _BOTH:
                bad = bad or arr.item(arr.argmin()) < low
        if bad:
            raise InvalidArgument(f"{what} out of range [{low}, {high})")
    return (arr.tobytes() if cast is None else arr.astype(cast).tobytes()), width


# How values of one integer dtype are checked against [low, high) and cast to the wire
# dtype, decided once per (dtype, wire dtype) instead of an np.iinfo per call:
# (check, view, limit, cast). _NONE: the dtype cannot leave the range. _SIGN: its
# smallest value must be >= 0 (low is 0, the dtype fits under high). _HIGH: the largest
# value of `view` (the same bytes read as unsigned, where low is 0: a negative value
# is then huge, so one pass checks both ends) must be below `limit`. _BOTH: _HIGH plus
# a minimum. `cast`: the wire dtype, or None where checked values already have the
# wire's bytes.
_NONE, _SIGN, _HIGH, _BOTH = "none", "sign", "high", "both"
_PLANS: dict[str, dict[Any, tuple[str, Any, int, Any]]] = {"<u4": {}, "<i8": {}}


def _plan(
    np: Any, dtype: Any, wire: str, low: int, high: int, what: str
) -> tuple[str, Any, int, Any]:
    if dtype.kind not in "iu":
        raise InvalidArgument(f"{what} must be integers, got dtype {dtype}")
    info = np.iinfo(dtype)
    view, limit = None, high
    if info.min >= low and info.max < high:
        check = _NONE
    elif low == 0 and dtype.kind == "i" and info.max < high:
        check = _SIGN
    elif low == 0 and dtype.kind == "i":
        check, view = _HIGH, np.dtype(dtype.str.replace("i", "u"))  # same byte order
    else:
        check = _HIGH if info.min >= low else _BOTH
    cast = np.dtype(wire)
    same = dtype.str[0] == cast.str[0] and dtype.itemsize == cast.itemsize
    plan = (check, view, limit, None if same else cast)
    _PLANS[wire][dtype] = plan
    return plan


def _torch_ints() -> frozenset[Any]:
    """torch's integer dtypes (only called with a tensor in hand, so torch is loaded)."""
    global _torch_int_dtypes
    if _torch_int_dtypes is None:
        torch = sys.modules["torch"]
        names = ("int8", "uint8", "int16", "int32", "int64", "uint16", "uint32", "uint64")
        _torch_int_dtypes = frozenset(getattr(torch, n) for n in names if hasattr(torch, n))
        _TOKEN_PACKERS[torch.Tensor] = _pack_tensor_tokens
    return _torch_int_dtypes


_torch_int_dtypes: frozenset[Any] | None = None


def _pack_tensor(
    tensor: Any, dtype: str, low: int, high: int, what: str, flat: bool = False
) -> tuple[bytes, int]:
    dt = tensor.dtype
    if dt not in _torch_ints() and (
        dt.is_floating_point or dt.is_complex or str(dt) == "torch.bool"
    ):
        raise InvalidArgument(f"{what} must be integers, got dtype {dt}")
    if tensor.requires_grad:
        tensor = tensor.detach()
    if not tensor.is_cpu:
        tensor = tensor.cpu()
    try:
        host = tensor.numpy()
    except (RuntimeError, TypeError):  # torch without numpy, or a dtype numpy lacks
        if flat:
            return pack_slots(tensor.reshape(-1).tolist()), 1
        return _pack_tokens(tensor.tolist())
    return _pack_numpy(host, dtype, low, high, what, flat)


def unpack_slots(data: bytes) -> array[int]:
    """Packed little-endian int64 bytes as a native ``array('q')``."""
    out = array(_I64)
    if len(data) % 8:
        raise InvalidArgument(f"slot bytes of length {len(data)} are not a multiple of 8")
    out.frombytes(data)
    if not _LITTLE:
        out.byteswap()
    return out


def as_tensor(values: array[int], device: Any = None) -> Any:
    """An int64 torch tensor of ``values`` (imports torch; shares memory on the CPU)."""
    import torch

    if len(values) == 0:
        out = torch.empty((0,), dtype=torch.int64)
    else:
        out = torch.frombuffer(values, dtype=torch.int64)
    return out if device is None or str(device) == "cpu" else out.to(device)


def as_numpy(values: array[int]) -> Any:
    """An int64 numpy view of ``values`` (imports numpy; no copy)."""
    import numpy as np

    return np.frombuffer(values, dtype=np.int64) if len(values) else np.zeros(0, np.int64)


def concat(*parts: array[int]) -> array[int]:
    out = array(_I64)
    for part in parts:
        out.extend(part)
    return out


def extra_key_of(tokens: Any, extra_key: str | None) -> str | None:
    """The namespace: ``extra_key``, or the one a RadixKey-like ``tokens`` carries."""
    own = getattr(tokens, "extra_key", None) if hasattr(tokens, "packed") else None
    if extra_key is None:
        return own
    if own is not None and own != extra_key:
        raise InvalidArgument(f"extra_key {extra_key!r} disagrees with the key's own {own!r}")
    if not isinstance(extra_key, str):
        raise InvalidArgument(f"extra_key must be a str or None, not {type(extra_key)!r}")
    return extra_key
