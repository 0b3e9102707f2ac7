"""KVChunk messages on the server's wire, in the hand-made format both sides share
(``prefixcache.wire.kv_chunk``): ReadKV's replies serialized by hand (``encode_chunk``)
and WriteKV's data chunks parsed by hand (``parse_data_chunk``). Anything that is not a
plain data chunk (a header, an unknown field, malformed bytes) is left to protobuf.
"""

from __future__ import annotations

from prefixcache.wire.kv_chunk import ChunkError, DataChunk, encode_chunk, parse_chunk

__all__ = ["DataChunk", "encode_chunk", "parse_data_chunk"]


def parse_data_chunk(message: bytes) -> DataChunk | None:
    """A serialized KVChunk with no header read without protobuf (its data a view, not
    two copies), or None for anything else: protobuf parses those, and refuses what it
    cannot parse."""
    try:
        return parse_chunk(message, strict=True)
    except ChunkError:
        return None
