"""KV transfer for remote workers: the rows of some slots as byte chunks, and back.

A transfer names KV slots, attention layers and (Mamba models) state slots. It covers
one *part* per buffer: for each layer the K rows then the V rows of the slots, then for
each Mamba layer the conv then the temporal state of the state slots. A part is the
named rows, in the order named, as raw bytes of the pool's element type (the host is
little-endian; see ``_check_host``), and chunks may split it anywhere, even in a row.

Concurrency: everything here runs on the service's one event loop. Copies are bounded
(a read copies at most one chunk's rows at a time, a write one buffer's rows when that
buffer's last byte arrives), so no executor is needed and the single-writer model holds:
between awaits nothing else runs. A write re-checks, just before each copy, that the
session still holds every slot, since the session may have freed or inserted them (the
tree would then own them) while the stream was waiting for bytes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from prefixcache.cache import InvalidInputError
from prefixcache.v1 import prefix_cache_pb2 as pb

from .codec import decode_slots
from .errors import DrainingError, PreconditionError
from .sessions import Session
from .slot_checks import check_distinct, check_range


def _check_host() -> None:
    # Buffers go on the wire as their in-memory bytes; the wire format is little-endian.
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI host
        raise RuntimeError("KV transfer needs a little-endian host")


@dataclass(slots=True)
class Part:
    """One buffer's share of a transfer: rows ``index`` of ``view`` (rows on dim 0)."""

    role: int
    layer: int
    view: torch.Tensor
    index: torch.Tensor
    row_shape: tuple[int, ...]
    row_bytes: int

    @property
    def nbytes(self) -> int:
        return int(self.index.numel()) * self.row_bytes


def _part(role: int, layer: int, view: torch.Tensor, rows: np.ndarray) -> Part:
    row_shape = tuple(view.shape[1:])
    row_bytes = int(np.prod(row_shape, dtype=np.int64)) * view.element_size()
    index = torch.from_numpy(rows).to(view.device)
    return Part(role, layer, view, index, row_shape, row_bytes)


def plan(engine: Any, slots: np.ndarray, layers: Sequence[int],
         states: np.ndarray) -> list[Part]:
    """The parts of a transfer over ``engine``'s pools, every index checked.

    Raises:
        InvalidInputError: a slot, state slot or layer out of range, or a layer twice.
        PreconditionError: state slots on a model without a Mamba pool.
    """
    _check_host()
    if engine.kind == "slot":
        num_layers = engine.k_cache.shape[2]
        check_range(slots, 0, engine.pool_size, engine.name)

        def kv(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            return engine.k_cache[:, :, layer], engine.v_cache[:, :, layer]
    else:
        pool = engine.kv_pool
        num_layers = pool.layer_num
        check_range(slots, 1, engine.num_rows, engine.name)

        def kv(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            return pool.k_buffer[layer], pool.v_buffer[layer]
    wanted = list(layers) if len(layers) else list(range(num_layers))
    if len(set(wanted)) != len(wanted):
        raise InvalidInputError(f"layers names a layer twice: {wanted}")
    bad = [x for x in wanted if not 0 <= x < num_layers]
    if bad:
        raise InvalidInputError(f"layer {bad[0]} is outside model {engine.name!r}'s "
                                f"[0, {num_layers})")
    parts = []
    for layer in wanted:
        k, v = kv(layer)
        parts += [_part(pb.BUFFER_ROLE_K, layer, k, slots),
                  _part(pb.BUFFER_ROLE_V, layer, v, slots)]
    if len(states):
        mamba = engine.mamba_pool
        if mamba is None:
            raise PreconditionError(f"model {engine.name!r} has no Mamba state pool")
        if int(states.min()) < 0 or int(states.max()) >= mamba.num_slots:
            raise InvalidInputError(f"state slot outside model {engine.name!r}'s "
                                    f"[0, {mamba.num_slots})")
        for layer in range(mamba.num_layers):
            parts += [_part(pb.BUFFER_ROLE_CONV, layer, mamba.conv_state[layer], states),
                      _part(pb.BUFFER_ROLE_TEMPORAL, layer, mamba.temporal_state[layer],
                            states)]
    return parts


def check_held(engine: Any, session: Session, slots: np.ndarray, states: np.ndarray) -> None:
    """Refuse unless ``session`` holds every slot and state slot, each named once."""
    held = engine._owner[slots] == session.tag
    if not held.all():
        raise PreconditionError(f"slot {int(slots[np.argmin(held)])} is not held by this "
                                "session (only slots a session holds may be written)")
    check_distinct(slots)
    if len(states):
        engine._states().check(session, states)


def _as_bytes(rows: torch.Tensor) -> bytes:
    return rows.contiguous().view(torch.uint8).cpu().numpy().tobytes()


def read_chunks(parts: list[Part], chunk_bytes: int) -> Iterator[pb.KVChunk]:
    """The transfer's bytes as chunks of at most ``chunk_bytes`` of data each.

    Rows are copied out one chunk's worth at a time (a row larger than a chunk alone),
    so the caller may yield to the event loop between chunks.
    """
    for part in parts:
        if not part.nbytes:
            continue
        rows_per = max(1, chunk_bytes // part.row_bytes)
        offset = 0
        for start in range(0, part.index.numel(), rows_per):
            rows = part.view.index_select(0, part.index[start:start + rows_per])
            data = _as_bytes(rows)
            for i in range(0, len(data), chunk_bytes):
                yield pb.KVChunk(role=part.role, layer=part.layer,
                                 offset_bytes=offset + i, data=data[i:i + chunk_bytes])
            offset += len(data)


class Writer:
    """Collects a WriteKV stream's chunks; writes each buffer once it is complete.

    Args:
        parts: The transfer (from ``plan``).
        check: Called just before each buffer is written; raises to refuse.
    """

    def __init__(self, parts: list[Part], check: Callable[[], None]) -> None:
        self._parts = {(p.role, p.layer): p for p in parts if p.nbytes}
        self._pending: dict[tuple[int, int], bytearray] = {}
        self._done: set[tuple[int, int]] = set()
        self._check = check
        self.bytes_written = 0

    def add(self, chunk: pb.KVChunk) -> None:
        key = (chunk.role, chunk.layer)
        part = self._parts.get(key)
        if part is None:
            raise InvalidInputError(f"chunk for buffer {_name(key)}, which the transfer "
                                    "does not cover")
        if key in self._done:
            raise InvalidInputError(f"buffer {_name(key)} is already complete")
        buf = self._pending.setdefault(key, bytearray())
        if chunk.offset_bytes != len(buf):
            raise InvalidInputError(f"buffer {_name(key)}: chunk at offset "
                                    f"{chunk.offset_bytes}, expected {len(buf)} (chunks of a "
                                    "buffer must be contiguous and in order)")
        if len(buf) + len(chunk.data) > part.nbytes:
            raise InvalidInputError(f"buffer {_name(key)}: more than its {part.nbytes} bytes "
                                    f"({part.index.numel()} rows of {part.row_bytes})")
        buf += chunk.data
        if len(buf) == part.nbytes:
            self._check()
            self._write(part, self._pending.pop(key))
            self._done.add(key)

    def finish(self) -> int:
        """Buffers written; raises if a buffer of the transfer is incomplete."""
        missing = [k for k in self._parts if k not in self._done]
        if missing:
            key = missing[0]
            got = len(self._pending.get(key, b""))
            raise InvalidInputError(f"buffer {_name(key)}: {got} of "
                                    f"{self._parts[key].nbytes} bytes arrived")
        return len(self._done)

    def _write(self, part: Part, data: bytearray) -> None:
        view = part.view
        rows = torch.frombuffer(data, dtype=torch.uint8).view(view.dtype)
        rows = rows.view(-1, *part.row_shape).to(view.device)
        view.index_copy_(0, part.index, rows)
        self.bytes_written += len(data)


def open_writer(service: Any, chunk: pb.KVChunk) -> Writer:
    """A Writer for a WriteKV stream, from its first chunk (the header), once the
    session is found to hold every slot it names."""
    if service.draining:
        raise DrainingError("the service is shutting down")
    if not chunk.HasField("header") or chunk.data:
        raise InvalidInputError("the first WriteKV chunk carries the header, and only it")
    head = chunk.header
    engine = service.engine(head.model)
    service.check_epoch(head.server_epoch)
    slots = decode_slots(head.slot_indices)
    states = decode_slots(head.state_slots, "state_slots")
    parts = plan(engine, slots, list(head.layers), states)
    if not head.session_id:
        raise PreconditionError("WriteKV needs a session_id (slots are written only by "
                                "the session that holds them)")
    session_id = head.session_id

    def check() -> None:
        # Looked up again each time: the session may have closed, or given the slots to
        # the tree, while the stream waited for bytes.
        if service.draining:
            raise DrainingError("the service is shutting down")
        check_held(engine, service.session(session_id), slots, states)

    check()
    return Writer(parts, check)


def _name(key: tuple[int, int]) -> str:
    role = pb.BufferRole.Name(key[0]) if key[0] in pb.BufferRole.values() else str(key[0])
    return f"{role.removeprefix('BUFFER_ROLE_')}[{key[1]}]"
