"""KV transfer on the client: ReadKV chunks into tensors, tensors into WriteKV chunks.

The layout of a transfer (see ``KVChunk`` in the proto): for each layer the K rows then
the V rows of the named slots (K only in an MLA pool), then for each Mamba layer the conv
then the temporal state of the named state slots, each as raw little-endian bytes of the
pool's element type. torch is imported inside the functions only (the client must load
without it).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefixcache.v1 import prefix_cache_pb2 as pb
from prefixcache.wire import kv_chunk
from prefixcache.wire.kv_chunk import ChunkError, DataChunk, encode_chunk

from .._wire import pack_slots
from ..errors import FailedPrecondition, InvalidArgument
from ..results import PoolInfo

DEFAULT_CHUNK_BYTES = 1 << 20
READ_KV_METHOD = "/prefixcache.v1.PrefixCache/ReadKV"
WRITE_KV_METHOD = "/prefixcache.v1.PrefixCache/WriteKV"
# Room for a KVChunk's other fields within a message of max_message_bytes.
CHUNK_OVERHEAD = 1024

K, V = pb.BUFFER_ROLE_K, pb.BUFFER_ROLE_V
CONV, TEMPORAL = pb.BUFFER_ROLE_CONV, pb.BUFFER_ROLE_TEMPORAL


@dataclass(frozen=True, slots=True)
class KVData:
    """Rows read by ``read_kv``: one tensor per layer, ``[n, *row]`` each.

    ``k[i]`` and ``v[i]`` belong to attention layer ``layers[i]``; ``conv[j]`` and
    ``temporal[j]`` to Mamba layer ``j`` (empty when no state slots were named).
    """

    layers: tuple[int, ...]
    k: list[Any] = field(default_factory=list)
    v: list[Any] = field(default_factory=list)
    conv: list[Any] = field(default_factory=list)
    temporal: list[Any] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class WriteKVReply:
    """What ``write_kv`` wrote: bytes and buffers (K or V of a layer, a Mamba state)."""

    bytes_written: int
    buffers_written: int


@dataclass(frozen=True, slots=True)
class _Part:
    role: int
    layer: int
    rows: int
    row_shape: tuple[int, ...]
    dtype: str

    def element_size(self) -> int:
        import torch

        return int(torch.empty((), dtype=getattr(torch, self.dtype)).element_size())

    @property
    def nbytes(self) -> int:
        size = self.rows * self.element_size()
        for d in self.row_shape:
            size *= d
        return size


def _check_host() -> None:
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI host
        raise InvalidArgument("KV transfer needs a little-endian host")


def plan(
    info: PoolInfo, num_slots: int, layers: Sequence[int] | None, num_states: int
) -> tuple[tuple[int, ...], list[_Part]]:
    """The layers and the parts of a transfer, in wire order."""
    _check_host()
    wanted = tuple(range(info.layer_num)) if not layers else tuple(int(x) for x in layers)
    seq = (info.max_seq_len,) if info.max_seq_len else ()
    parts: list[_Part] = []
    for layer in wanted:
        parts.append(
            _Part(K, layer, num_slots, (*seq, info.k_head_num, info.k_head_dim), info.dtype)
        )
        if not info.mla:  # an MLA pool's latent is its K; there is no V
            parts.append(
                _Part(V, layer, num_slots, (*seq, info.v_head_num, info.v_head_dim), info.dtype)
            )
    if num_states:
        if info.mamba is None:
            raise FailedPrecondition(f"model {info.model!r} has no Mamba state pool")
        m = info.mamba
        for layer in range(m.layer_num):
            parts.append(_Part(CONV, layer, num_states, m.conv_state_shape, m.conv_dtype))
            parts.append(
                _Part(TEMPORAL, layer, num_states, m.temporal_state_shape, m.temporal_dtype)
            )
    return wanted, parts


def chunk_limit(requested: int | None, max_message_bytes: int) -> int:
    """The data bytes per chunk: ``requested`` (default 1 MiB) within the message limit."""
    cap = max(max_message_bytes - CHUNK_OVERHEAD, 1)
    return min(int(requested or DEFAULT_CHUNK_BYTES), cap)


class Reader:
    """Builds a ReadKVRequest and assembles the chunks that answer it.

    ``out``: a ``KVData`` of an earlier read of the same slots count, layers and pool,
    whose tensors are filled in place (a worker's staging buffers: no new memory, whose
    first touch costs more than the copy itself).
    """

    def __init__(
        self,
        info: PoolInfo,
        slots: Any,
        layers: Sequence[int] | None,
        state_slots: Any,
        chunk_bytes: int,
        out: KVData | None = None,
    ) -> None:
        self._slots, self._states = pack_slots(slots), pack_slots(state_slots)
        self._layers, parts = plan(info, len(self._slots) // 8, layers, len(self._states) // 8)
        self._parts = {(p.role, p.layer): p for p in parts}
        self._order = parts
        self._tensors = self._destinations(parts, out)
        self._data = {key: memoryview(_bytes_of(t)) for key, t in self._tensors.items()}
        self._got = dict.fromkeys(self._parts, 0)
        self.request = pb.ReadKVRequest(
            model=info.model,
            slot_indices=self._slots,
            layers=list(self._layers) if layers else [],
            state_slots=self._states,
            max_chunk_bytes=chunk_bytes,
        )

    def _destinations(self, parts: list[_Part], out: KVData | None) -> dict[Any, Any]:
        import torch

        given: dict[int, list[Any]] = (
            {}
            if out is None
            else {
                K: list(out.k),
                V: list(out.v),
                CONV: list(out.conv),
                TEMPORAL: list(out.temporal),
            }
        )
        seen: dict[int, int] = {}
        tensors = {}
        for part in parts:
            dtype = getattr(torch, part.dtype)
            shape = (part.rows, *part.row_shape)
            i = seen[part.role] = seen.get(part.role, -1) + 1
            mine = given.get(part.role, [])
            tensor = mine[i] if i < len(mine) else None
            if tensor is not None and (
                tuple(tensor.shape) != shape
                or tensor.dtype != dtype
                or tensor.device.type != "cpu"
                or not tensor.is_contiguous()
            ):
                raise InvalidArgument(
                    f"out's {_label(part)} is {tuple(tensor.shape)} "
                    f"{tensor.dtype} on {tensor.device}; this read "
                    f"needs a contiguous CPU {shape} {dtype}"
                )
            if tensor is None:
                if out is not None:
                    raise InvalidArgument(f"out has no tensor for {_label(part)}")
                tensor = torch.empty(shape, dtype=dtype)  # every byte is written
            tensors[(part.role, part.layer)] = tensor
        return tensors

    def add(self, chunk: pb.KVChunk | DataChunk) -> None:
        key = (chunk.role, chunk.layer)
        buf = self._data.get(key)
        end = chunk.offset_bytes + len(chunk.data)
        if buf is None or chunk.offset_bytes != self._got[key] or end > len(buf):
            raise InvalidArgument(
                f"unexpected ReadKV chunk for buffer {key} at offset "
                f"{chunk.offset_bytes} (the pool layout changed?)"
            )
        buf[chunk.offset_bytes : end] = chunk.data
        self._got[key] = end

    def result(self) -> KVData:
        out: dict[int, list[Any]] = {K: [], V: [], CONV: [], TEMPORAL: []}
        for part in self._order:
            key = (part.role, part.layer)
            if self._got[key] != part.nbytes:
                raise InvalidArgument(
                    f"ReadKV ended early: buffer {key} has {self._got[key]} of {part.nbytes} bytes"
                )
            out[part.role].append(self._tensors[key])
        return KVData(self._layers, out[K], out[V], out[CONV], out[TEMPORAL])


def _bytes_of(tensor: Any) -> Any:
    """A contiguous CPU tensor's bytes, writable (a flat uint8 numpy view)."""
    import torch

    return tensor.view(-1).view(torch.uint8).numpy() if tensor.numel() else bytearray()


def parse_chunk(message: bytes) -> DataChunk:
    """A serialized ReadKV ``KVChunk`` read without protobuf (``prefixcache.wire``): the
    data stays a view of the message. Fields it does not know are skipped.

    Raises:
        InvalidArgument: the bytes are not a well-formed KVChunk.
    """
    try:
        return kv_chunk.parse_chunk(message)
    except ChunkError as exc:
        raise InvalidArgument(f"malformed ReadKV chunk: {exc}") from None


def serialize_chunk(chunk: pb.KVChunk | bytes) -> bytes:
    """WriteKV's request serializer: chunks from ``encode_chunk`` as they are."""
    return chunk if isinstance(chunk, bytes) else chunk.SerializeToString()


def _per_layer(values: Any, count: int, row_dims: int, what: str) -> list[Any]:
    """One tensor per layer, from a sequence of them or one stacked ``[L, n, *row]``."""
    if values is None:
        raise InvalidArgument(f"{what} is required for this transfer")
    if hasattr(values, "unbind") and values.dim() == row_dims + 2:
        values = values.unbind(0)
    seq = list(values)
    if len(seq) != count:
        raise InvalidArgument(f"{what} has {len(seq)} layers, the transfer {count}")
    return seq


def write_chunks(
    info: PoolInfo,
    session_id: str,
    slots: Any,
    k: Any,
    v: Any,
    layers: Sequence[int] | None,
    state_slots: Any,
    conv: Any,
    temporal: Any,
    chunk_bytes: int,
    server_epoch: int = 0,
) -> Iterator[pb.KVChunk | bytes]:
    """The header chunk (a KVChunk), then the tensors as data chunks, serialized
    already (``encode_chunk``; ``serialize_chunk`` sends both).

    Every shape is checked here, before the first chunk is sent; each tensor is turned
    into bytes only when its chunks are due, so a write holds one buffer's copy at most.
    """
    import torch

    packed, states = pack_slots(slots), pack_slots(state_slots)
    wanted, parts = plan(info, len(packed) // 8, layers, len(states) // 8)
    sources: dict[tuple[int, int], Any] = {}
    if info.mla and v is not None:
        raise InvalidArgument(f"model {info.model!r} has an MLA pool (no V): pass v=None")
    jobs = [(K, k, "k")] + ([] if info.mla else [(V, v, "v")]) if wanted and packed else []
    for role, values, name in jobs:
        row_dims = len(parts[0 if role == K else 1].row_shape)
        for layer, tensor in zip(
            wanted, _per_layer(values, len(wanted), row_dims, name), strict=True
        ):
            sources[(role, layer)] = tensor
    if states and info.mamba is not None:
        m = info.mamba
        for role, values, name, dims in (
            (CONV, conv, "conv", len(m.conv_state_shape)),
            (TEMPORAL, temporal, "temporal", len(m.temporal_state_shape)),
        ):
            for layer, tensor in enumerate(_per_layer(values, m.layer_num, dims, name)):
                sources[(role, layer)] = tensor
    todo = []
    for part in parts:
        if not part.nbytes:
            continue
        tensor = sources[(part.role, part.layer)]
        if not isinstance(tensor, torch.Tensor):
            tensor = torch.as_tensor(tensor)
        shape = (part.rows, *part.row_shape)
        if tuple(tensor.shape) != shape:
            raise InvalidArgument(
                f"{_label(part)} has shape {tuple(tensor.shape)}, expected {shape}"
            )
        todo.append((part, tensor))
    header = pb.WriteKVHeader(
        model=info.model,
        slot_indices=packed,
        layers=list(wanted) if layers else [],
        state_slots=states,
        session_id=session_id,
        server_epoch=server_epoch,
    )
    return _chunks(header, todo, chunk_bytes)


def _chunks(
    header: pb.WriteKVHeader, todo: list[tuple[_Part, Any]], chunk_bytes: int
) -> Iterator[pb.KVChunk | bytes]:
    import torch

    yield pb.KVChunk(header=header)
    for part, tensor in todo:
        host = tensor.detach().to(device="cpu", dtype=getattr(torch, part.dtype))
        data = memoryview(host.contiguous().view(torch.uint8).reshape(-1).numpy())
        for i in range(0, len(data), chunk_bytes):
            yield encode_chunk(part.role, part.layer, i, data[i : i + chunk_bytes])


def wide_pair(a: Any, b: Any) -> tuple[Any, Any]:
    """Tensors ``a`` and ``b`` of one element size, viewed (bytes kept) as the widest
    element type both allow, for copies between them: torch's index kernels copy
    element by element, so a row of 128 bfloat16 values moves faster as 16 elements of
    16 bytes. Unchanged when their element sizes differ or no wider view fits."""
    import torch

    if a.element_size() != b.element_size():
        return a, b
    if a.element_size() == 1:  # fp8 has no indexing kernels on the CPU: as bytes
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    for dtype in (torch.complex128, torch.int64, torch.int32):
        if dtype.itemsize <= a.element_size():
            break
        try:
            return a.view(dtype), b.view(dtype)
        except RuntimeError:  # a stride or size the wider type cannot view
            continue
    if a.dtype != b.dtype:  # one size, two types (fp8 and uint8): as the same one
        return a, b.view(a.dtype)
    return a, b


def _label(part: _Part) -> str:
    names: dict[int, str] = {K: "k", V: "v", CONV: "conv", TEMPORAL: "temporal"}
    name = names[part.role]
    return f"{name}[{part.layer}]"
