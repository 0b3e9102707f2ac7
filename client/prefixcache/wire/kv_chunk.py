"""KVChunk messages (see ``KVChunk`` in the proto) serialized and parsed by hand, without
protobuf, for the KV transfers: the side that sends data chunks (the server's ReadKV
replies, the client's WriteKV) copies the rows once, into the message, instead of into
bytes, a message and its serialization; the side that receives them keeps the data a
view of the message instead of two copies (the parse, then ``.data``).

Byte for byte what protobuf writes and reads (tests hold both to protobuf's). Fields as
in the proto: header 1, role 2, layer 3, offset_bytes 4, data 5.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

ROLE, LAYER, OFFSET_BYTES, DATA = 2, 3, 4, 5
_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5
# The fields' ranges: role an enum (int32), layer a uint32.
_ROLE_MAX, _LAYER_MAX = 0x7FFFFFFF, 0xFFFFFFFF


class ChunkError(ValueError):
    """Bytes that are not a well-formed KVChunk (or, read strictly, not a data chunk)."""


@dataclass(frozen=True, slots=True)
class DataChunk:
    """A KVChunk's data fields as :func:`parse_chunk` reads them: ``data`` a view of the
    message. It reads as a KVChunk message with no header does."""

    role: int
    layer: int
    offset_bytes: int
    data: memoryview
    header: None = None

    def HasField(self, name: str) -> bool:  # as a protobuf message's: no header is set
        return False


def encode_chunk(role: int, layer: int, offset: int, data: memoryview | bytes) -> bytes:
    """A data KVChunk (role, layer, offset_bytes, data) serialized by hand, byte for
    byte what protobuf writes: the data is copied once, into the message."""
    head = bytearray()
    for number, value in ((ROLE, role), (LAYER, layer), (OFFSET_BYTES, offset)):
        if value:  # proto3: zero is the default and is not written
            head += put_varint(number << 3 | _VARINT) + put_varint(value)
    if len(data):
        head += put_varint(DATA << 3 | _LENGTH_DELIMITED) + put_varint(len(data))
    return b"".join((head, data))


def parse_chunk(message: bytes, *, strict: bool = False) -> DataChunk:
    """A serialized KVChunk's data fields, read without protobuf.

    Leniently, other fields (a header, one the parser does not know) are skipped, as
    protobuf skips them. ``strict``: only a data chunk is read, its fields within their
    ranges; anything else is refused, for protobuf to parse (or to refuse).

    Raises:
        ChunkError: malformed bytes, or (``strict``) not a plain data chunk.
    """
    view = memoryview(message)
    ints = {ROLE: 0, LAYER: 0, OFFSET_BYTES: 0}
    data = view[:0]
    for number, wire, value in _fields(view):
        if wire == _VARINT and number in ints:
            ints[number] = value
        elif wire == _LENGTH_DELIMITED and number == DATA:
            data = value
        elif strict:
            raise ChunkError(f"field {number} (wire type {wire}) is not a data chunk's")
    role, layer = ints[ROLE], ints[LAYER]
    if strict and (role > _ROLE_MAX or layer > _LAYER_MAX):
        raise ChunkError(f"role {role} or layer {layer} out of range")
    return DataChunk(role, layer, ints[OFFSET_BYTES], data)


def _fields(view: memoryview) -> Iterator[tuple[int, int, int | memoryview]]:
    """(field number, wire type, value) of each field: an int for a varint, else a view."""
    pos, end = 0, len(view)
    while pos < end:
        tag, pos = get_varint(view, pos)
        number, wire = tag >> 3, tag & 7
        if wire == _VARINT:
            value, pos = get_varint(view, pos)
            yield number, wire, value
            continue
        if wire == _LENGTH_DELIMITED:
            size, pos = get_varint(view, pos)
        elif wire in (_FIXED64, _FIXED32):
            size = 8 if wire == _FIXED64 else 4
        else:
            raise ChunkError(f"wire type {wire}")
        if pos + size > end:
            raise ChunkError("truncated")
        yield number, wire, view[pos : pos + size]
        pos += size


def put_varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def get_varint(view: memoryview, pos: int) -> tuple[int, int]:
    """The varint at ``pos``, and the position after it."""
    value = shift = 0
    end = len(view)
    while True:
        if pos >= end:
            raise ChunkError("truncated varint")
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ChunkError("varint too long")
