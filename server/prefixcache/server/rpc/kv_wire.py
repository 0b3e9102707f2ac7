"""KVChunk messages on the wire, without protobuf: ReadKV's replies serialized by hand
and WriteKV's data chunks parsed by hand, so a chunk's bytes are copied once (into the
message, or not at all: a view of it) rather than into bytes, a message and its
serialization. Byte for byte what protobuf writes and reads; anything else (a header,
an unknown field) is left to protobuf. Fields as in the proto: role 2, layer 3,
offset_bytes 4, data 5 (header 1).
"""

from __future__ import annotations

from dataclasses import dataclass


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_chunk(role: int, layer: int, offset: int, data: memoryview | bytes) -> bytes:
    """A ``KVChunk`` (role, layer, offset_bytes, data) serialized by hand, byte for byte
    what protobuf writes: the data is copied once, into the message, instead of into a
    bytes object, a message and its serialization."""
    head = bytearray()
    for field, value in ((2, role), (3, layer), (4, offset)):
        if value:  # proto3: zero is the default and is not written
            head += _varint(field << 3) + _varint(value)
    if len(data):
        head += _varint(5 << 3 | 2) + _varint(len(data))
    return b"".join((head, data))


@dataclass(frozen=True, slots=True)
class DataChunk:
    """A WriteKV data chunk read by ``parse_data_chunk``: ``data`` a view of the
    message's bytes, no header."""

    role: int
    layer: int
    offset_bytes: int
    data: memoryview
    header: None = None

    def HasField(self, name: str) -> bool:  # as a protobuf message's
        return False


def parse_data_chunk(message: bytes) -> DataChunk | None:
    """A serialized ``KVChunk`` with no header read without protobuf (its data a view,
    not two copies), or None for anything else (a header, an unknown field, malformed
    bytes): protobuf parses those, and refuses what it cannot parse."""
    view = memoryview(message)
    role = layer = offset = 0
    data = view[:0]
    pos, end = 0, len(view)
    try:
        while pos < end:
            tag, pos = _get_varint(view, pos)
            number, wire = tag >> 3, tag & 7
            if wire == 0 and number in (2, 3, 4):
                value, pos = _get_varint(view, pos)
                if number == 2:
                    role = value
                elif number == 3:
                    layer = value
                else:
                    offset = value
            elif wire == 2 and number == 5:
                size, pos = _get_varint(view, pos)
                if pos + size > end:
                    return None
                data = view[pos:pos + size]
                pos += size
            else:
                return None
    except IndexError:
        return None
    if role > 0x7FFFFFFF or layer > 0xFFFFFFFF:  # out of the fields' ranges
        return None
    return DataChunk(role, layer, offset, data)


def _get_varint(view: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise IndexError("varint too long")


