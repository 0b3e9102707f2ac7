"""KV transfer for remote workers: the rows of some slots as byte chunks, and back.

A transfer names KV slots, attention layers and (Mamba models) state slots. It covers
one *part* per buffer: for each layer the K rows then the V rows of the slots, then for
each Mamba layer the conv then the temporal state of the state slots. A part is the
named rows, in the order named, as raw bytes of the pool's element type (the host is
little-endian; see ``_check_host``), and chunks may split it anywhere, even in a row.

Concurrency: everything here runs on the service's one event loop. Copies are bounded
(a read copies at most one chunk's rows at a time, a write the whole rows a chunk
completes), so no executor is needed and the single-writer model holds: between awaits
nothing else runs. A write keeps only the bytes of a row that has not fully arrived
(``WriteBudget`` in kv_access.py caps them), never a whole buffer. Both re-check, just
before each copy, that the rows it touches may still be touched (kv_access.py), since
the session may have freed, inserted or unlocked them while the stream waited.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from prefixcache.cache import InvalidInputError
from prefixcache.cache.pools.kv_pool import byte_view
from prefixcache.v1 import prefix_cache_pb2 as pb

from ..codec import decode_slots
from ..engine.slot_checks import check_distinct, check_range
from ..errors import DrainingError, PreconditionError
from ..sessions.session import Session
from .kv_wire import encode_chunk

# Parts over the Mamba state pool (state slots), as opposed to KV slots.
STATE_ROLES = (pb.BUFFER_ROLE_CONV, pb.BUFFER_ROLE_TEMPORAL)
# Called before rows [start, end) of a part are copied; raises to stop the transfer.
RowCheck = Callable[["Part", int, int], None]


def _check_host() -> None:
    # Buffers go on the wire as their in-memory bytes; the wire format is little-endian.
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI host
        raise RuntimeError("KV transfer needs a little-endian host")


@dataclass(slots=True)
class Part:
    """One buffer's share of a transfer: rows ``index`` of ``view`` (rows on dim 0);
    ``host`` is the same row numbers as a host array, for ownership checks."""

    role: int
    layer: int
    view: torch.Tensor
    index: torch.Tensor
    row_shape: tuple[int, ...]
    row_bytes: int
    host: np.ndarray
    # The first row when ``host`` is one run of consecutive rows (the allocator hands out
    # whole pages, so a request's usually are): then rows are sliced, not gathered.
    first: int | None = None

    @property
    def is_state(self) -> bool:
        return self.role in STATE_ROLES

    @property
    def nbytes(self) -> int:
        return int(self.index.numel()) * self.row_bytes


def _row_bytes(view: torch.Tensor) -> int:
    return int(np.prod(view.shape[1:], dtype=np.int64)) * view.element_size()


def _part(
    role: int,
    layer: int,
    view: torch.Tensor,
    rows: np.ndarray,
    index: torch.Tensor | None = None,
    first: int | None = None,
) -> Part:
    """The part of ``view`` at ``rows``; ``index``, the rows on the view's device, is
    made from them when not given (plan() shares one among its parts); ``first``: the
    first row when the rows are one run (``run_start``)."""
    # One-byte types (fp8) as uint8: the copies are bytewise anyway, and torch has no
    # CPU index_copy_ for float8.
    view = byte_view(view)
    if index is None:
        index = torch.from_numpy(rows).to(view.device)
    return Part(role, layer, view, index, tuple(view.shape[1:]), _row_bytes(view), rows, first)


def run_start(rows: np.ndarray) -> int | None:
    """``rows[0]`` when ``rows`` are consecutive (``rows[i] == rows[0] + i``), else None."""
    if not len(rows):
        return None
    first = int(rows[0])
    if int(rows[-1]) - first != len(rows) - 1:
        return None
    return first if bool((np.diff(rows) == 1).all()) else None


def _buffers(
    engine: Any, layers: Sequence[int], states: bool
) -> list[tuple[int, int, torch.Tensor]]:
    """``(role, layer, view)`` of each buffer a transfer covers, in transfer order:
    views only, nothing copied, so a transfer can be sized before it is planned.

    Raises:
        InvalidInputError: a layer out of range, or named twice.
        PreconditionError: state slots on a model without a Mamba pool.
    """
    if engine.kind == "slot":
        num_layers = engine.k_cache.shape[2]

        def kv(layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            return engine.k_cache[:, :, layer], engine.v_cache[:, :, layer]
    else:
        pool = engine.kv_pool
        num_layers = pool.layer_num

        def kv(layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            # An MLA pool has its latent in K and no V: its transfer has no V parts.
            return pool.k_buffer[layer], None if pool.mla else pool.v_buffer[layer]

    wanted = list(layers) if len(layers) else list(range(num_layers))
    if len(set(wanted)) != len(wanted):
        raise InvalidInputError(f"layers names a layer twice: {wanted}")
    bad = [x for x in wanted if not 0 <= x < num_layers]
    if bad:
        raise InvalidInputError(
            f"layer {bad[0]} is outside model {engine.name!r}'s [0, {num_layers})"
        )
    out = []
    for layer in wanted:
        k, v = kv(layer)
        out.append((pb.BUFFER_ROLE_K, layer, k))
        if v is not None:
            out.append((pb.BUFFER_ROLE_V, layer, v))
    if states:
        mamba = engine.mamba_pool
        if mamba is None:
            raise PreconditionError(f"model {engine.name!r} has no Mamba state pool")
        for layer in range(mamba.num_layers):
            out += [
                (pb.BUFFER_ROLE_CONV, layer, mamba.conv_state[layer]),
                (pb.BUFFER_ROLE_TEMPORAL, layer, mamba.temporal_state[layer]),
            ]
    return out


def transfer_bytes(engine: Any, slots: int, layers: Sequence[int], states: int) -> int:
    """Bytes a transfer of ``slots`` KV slots and ``states`` state slots (duplicates
    counted) covers, from the buffers' row sizes alone: no plan is built."""
    return sum(
        _row_bytes(view) * (states if role in STATE_ROLES else slots)
        for role, _, view in _buffers(engine, layers, states > 0)
    )


def plan(engine: Any, slots: np.ndarray, layers: Sequence[int], states: np.ndarray) -> list[Part]:
    """The parts of a transfer over ``engine``'s pools, every index checked.

    The parts share the row vectors: one index per (slots or states, device), not one
    per buffer, so a plan costs the decoded vectors (and, on a GPU, one copy of each).

    Raises:
        InvalidInputError: a slot, state slot or layer out of range, or a layer twice.
        PreconditionError: state slots on a model without a Mamba pool.
    """
    _check_host()
    buffers = _buffers(engine, layers, len(states) > 0)
    if engine.kind == "slot":
        check_range(slots, 0, engine.pool_size, engine.name)
    else:
        check_range(slots, 1, engine.num_rows, engine.name)
    if len(states):
        num_states = engine.mamba_pool.num_slots
        if int(states.min()) < 0 or int(states.max()) >= num_states:
            raise InvalidInputError(f"state slot outside model {engine.name!r}'s [0, {num_states})")
    indexes: dict[tuple[bool, torch.device], torch.Tensor] = {}
    runs = {False: run_start(slots), True: run_start(states)}
    parts = []
    for role, layer, view in buffers:
        is_state = role in STATE_ROLES
        rows = states if is_state else slots
        index = indexes.get((is_state, view.device))
        if index is None:
            index = indexes[is_state, view.device] = torch.from_numpy(rows).to(view.device)
        parts.append(_part(role, layer, view, rows, index, runs[is_state]))
    return parts


def check_held(engine: Any, session: Session, slots: np.ndarray, states: np.ndarray) -> None:
    """Refuse unless ``session`` holds every slot and state slot, each named once."""
    held = engine._owner[slots] == session.tag
    if not held.all():
        raise PreconditionError(
            f"slot {int(slots[np.argmin(held)])} is not held by this "
            "session (only slots a session holds may be written)"
        )
    check_distinct(slots)
    if len(states):
        engine._states().check(session, states)


def _rows(part: Part, start: int, end: int) -> torch.Tensor:
    """Rows ``start .. end`` of a part: a slice of the pool when its rows are one run
    (copied once, into the chunk's bytes), else gathered."""
    if part.first is not None:
        return part.view[part.first + start : part.first + end]
    return part.view.index_select(0, part.index[start:end])


def read_chunks(
    parts: list[Part], chunk_bytes: int, check: RowCheck | None = None
) -> Iterator[bytes]:
    """The transfer's bytes as serialized ``KVChunk`` messages of at most
    ``chunk_bytes`` of data each (``encode_chunk``: the rows are copied once, into the
    message; registration.py sends them as they are).

    Rows are copied out one chunk's worth at a time (a row larger than a chunk alone),
    so the caller may yield to the event loop between chunks; ``check`` runs before
    each copy, with the rows it is about to read.
    """
    for part in parts:
        if not part.nbytes:
            continue
        rows_per = max(1, chunk_bytes // part.row_bytes)
        offset = 0
        count = part.index.numel()
        for start in range(0, count, rows_per):
            end = min(start + rows_per, count)
            if check is not None:
                check(part, start, end)
            data = _byte_rows(_rows(part, start, end))
            for i in range(0, len(data), chunk_bytes):
                yield encode_chunk(part.role, part.layer, offset + i, data[i : i + chunk_bytes])
            offset += len(data)


def _byte_rows(rows: torch.Tensor) -> memoryview:
    """Rows as a flat byte view (a copy only where they are not contiguous on the host)."""
    host = rows.contiguous().cpu()
    return memoryview(host.view(torch.uint8).reshape(-1).numpy())


class Writer:
    """Writes a WriteKV stream's chunks into the pool as they arrive.

    Each chunk's whole rows are written at once; the bytes of a row that a chunk only
    begins are kept until the rest arrives (at most one row per buffer), so a stream
    pins memory in proportion to a row, not to a layer.

    Args:
        parts: The transfer (from ``plan``).
        check: Called with the rows about to be written; raises to refuse them.
        hold: Called with the change in bytes kept for partial rows; raises to refuse
            an increase (kv_access.WriteBudget).
    """

    def __init__(
        self, parts: list[Part], check: RowCheck, hold: Callable[[int], None] | None = None
    ) -> None:
        self._parts = {(p.role, p.layer): p for p in parts if p.nbytes}
        self._got: dict[tuple[int, int], int] = {}
        self._carry: dict[tuple[int, int], bytearray] = {}
        self._done: set[tuple[int, int]] = set()
        self._check = check
        self._hold = hold
        self.held = 0
        self.bytes_written = 0

    def add(self, chunk: pb.KVChunk) -> None:
        key = (chunk.role, chunk.layer)
        part = self._parts.get(key)
        if part is None:
            raise InvalidInputError(
                f"chunk for buffer {_name(key)}, which the transfer does not cover"
            )
        if key in self._done:
            raise InvalidInputError(f"buffer {_name(key)} is already complete")
        got = self._got.get(key, 0)
        if chunk.offset_bytes != got:
            raise InvalidInputError(
                f"buffer {_name(key)}: chunk at offset "
                f"{chunk.offset_bytes}, expected {got} (chunks of a "
                "buffer must be contiguous and in order)"
            )
        if got + len(chunk.data) > part.nbytes:
            raise InvalidInputError(
                f"buffer {_name(key)}: more than its {part.nbytes} bytes "
                f"({part.index.numel()} rows of {part.row_bytes})"
            )
        if not chunk.data:
            return
        size = part.row_bytes
        carry = self._carry.get(key, bytearray())
        total = got + len(chunk.data)
        first, last = got // size, total // size  # rows [first, last) complete now
        keep = total % size
        # Accounted, then checked, before anything changes: a refusal writes nothing.
        grow = keep - len(carry)
        if grow > 0 and self._hold is not None:
            self._hold(grow)
        self.held += grow
        if last > first:
            self._check(part, first, last)
            payload = chunk.data  # one copy out of the message; sliced without copying
            whole = memoryview(payload)[: len(payload) - keep]
            data = carry + whole if carry else whole
            self._write(part, first, last, data)
            carry = bytearray(payload[len(payload) - keep :]) if keep else bytearray()
        else:
            carry += chunk.data
        if grow < 0 and self._hold is not None:
            self._hold(grow)
        if carry:
            self._carry[key] = carry
        else:
            self._carry.pop(key, None)
        self._got[key] = total
        if total == part.nbytes:
            self._done.add(key)

    def finish(self) -> int:
        """Buffers written; raises if a buffer of the transfer is incomplete."""
        missing = [k for k in self._parts if k not in self._done]
        if missing:
            key = missing[0]
            raise InvalidInputError(
                f"buffer {_name(key)}: {self._got.get(key, 0)} of "
                f"{self._parts[key].nbytes} bytes arrived"
            )
        return len(self._done)

    def close(self) -> None:
        """Drop the partial rows (the stream ended), handing their bytes back."""
        self._carry.clear()
        if self.held and self._hold is not None:
            self._hold(-self.held)
        self.held = 0

    def _write(self, part: Part, first: int, last: int, data: bytearray | memoryview) -> None:
        view = part.view
        with warnings.catch_warnings():
            # The message's bytes are read-only: they are only read here.
            warnings.simplefilter("ignore", UserWarning)
            rows = torch.frombuffer(data, dtype=torch.uint8).view(view.dtype)
        rows = rows.view(last - first, *part.row_shape).to(view.device)
        if part.first is not None:  # one run of rows: a slice copy
            view[part.first + first : part.first + last].copy_(rows)
        else:
            view.index_copy_(0, part.index[first:last], rows)
        self.bytes_written += len(data)


def open_writer(
    service: Any, chunk: pb.KVChunk, hold: Callable[[str, int], None] | None = None
) -> Writer:
    """A Writer for a WriteKV stream, from its first chunk (the header), once the
    session is found to hold every slot it names. ``hold(session_id, bytes)`` accounts
    the bytes kept for partial rows (kv_access.WriteBudget.hold)."""
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
        raise PreconditionError(
            "WriteKV needs a session_id (slots are written only by the session that holds them)"
        )
    session_id = head.session_id
    check_held(engine, service.session(session_id), slots, states)

    def check(part: Part, first: int, last: int) -> None:
        # Looked up again each time: the session may have closed, or given the slots to
        # the tree, while the stream waited for bytes. Only the rows about to be
        # written are checked, so a long stream costs in proportion to its bytes.
        if service.draining:
            raise DrainingError("the service is shutting down")
        session = service.session(session_id)
        rows = part.host[first:last]
        if part.is_state:
            engine._states().check(session, rows)
            return
        held = engine._owner[rows] == session.tag
        if not held.all():
            raise PreconditionError(
                f"slot {int(rows[np.argmin(held)])} is no longer held "
                "by this session (freed or inserted during the write)"
            )

    return Writer(parts, check, None if hold is None else (lambda n: hold(session_id, n)))


def _name(key: tuple[int, int]) -> str:
    role = pb.BufferRole.Name(key[0]) if key[0] in pb.BufferRole.values() else str(key[0])
    return f"{role.removeprefix('BUFFER_ROLE_')}[{key[1]}]"
