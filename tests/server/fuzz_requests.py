"""The fuzzer's requests (tests/reliability/test_fuzz.py): hypothesis draws of every
request message, malformed and adversarial, mixing the world's live ids with garbage.
"""

from __future__ import annotations

import struct
from typing import Any

from fuzz_world import MAX_MESSAGE, NAMES, World
from harness import pack_slots, pb, toks
from hypothesis import strategies as st

EDGES = (0, 1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 63, 64, 65, 255, 256, 257, 1000, 1024,
         2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53, 2**63 - 1, 2**63, 2**64 - 1)
U64 = st.one_of(st.integers(0, 300), st.sampled_from(EDGES), st.integers(0, 2**64 - 1))
U32 = st.one_of(st.integers(0, 300), st.sampled_from([e for e in EDGES if e < 2**32]),
                st.integers(0, 2**32 - 1))
I64 = st.one_of(st.integers(-3, 300),
                st.sampled_from([-(2**63), -(2**31), -1, *[e for e in EDGES if e < 2**63]]),
                st.integers(-(2**63), 2**63 - 1))
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
MODEL = st.one_of(st.sampled_from(NAMES), st.sampled_from(NAMES),
                  st.sampled_from(["", "nope", "M", " m", "m\x00", "é", "x" * 300]), TEXT)
WIDTH = st.one_of(st.sampled_from([0, 0, 0, 1, 2, 3, 8, 9, 16]), U32)
# Bigger than max_message_bytes once framed: RESOURCE_EXHAUSTED from gRPC itself.
HUGE = b"\x01\x00\x00\x00" * (MAX_MESSAGE // 4 + 16)


# Draws never depend on the world's state (hypothesis requires the same choices to give
# the same draws): a live id is drawn as an index, and its fallback is always drawn too.
INDEX = st.integers(0, 2**16)


def _pick(draw: Any, items: list[Any], fallback: st.SearchStrategy[Any]) -> Any:
    i, other = draw(INDEX), draw(fallback)
    return items[i % len(items)] if items else other


def _picks(draw: Any, items: list[Any], max_size: int) -> list[Any]:
    chosen = draw(st.lists(INDEX, max_size=max_size))
    return [items[i % len(items)] for i in chosen] if items else []


def token_bytes(draw: Any, world: World, model: str) -> bytes:
    kind = draw(st.integers(0, 9))
    seqs = world.seqs.get(model) or world.seqs["m"]
    if kind <= 3:  # a cached sequence, cut and maybe extended
        seq = _pick(draw, seqs, st.just([1, 2, 3]))
        cut = draw(st.integers(0, len(seq)))
        tail = draw(st.lists(st.integers(0, 50), max_size=6))
        return toks(seq[:cut] + tail)
    if kind <= 5:
        return toks(draw(st.lists(st.integers(0, 60), max_size=24)))
    if kind == 6:  # ids out of any vocabulary
        return toks(draw(st.lists(st.integers(0, 2**32 - 1), max_size=8)))
    if kind == 7:
        return draw(st.binary(max_size=41))  # often not a multiple of 4
    if kind == 8:
        return toks(draw(st.lists(st.integers(0, 60), min_size=40, max_size=300)))
    return HUGE if draw(st.integers(0, 20)) == 0 else b""


def slot_bytes(draw: Any, world: World, model: str, *, states: bool = False) -> bytes:
    live = world.states if states else world.held.get(model, []) + world.tree.get(model, [])
    kind = draw(st.integers(0, 7))
    if kind <= 1:  # live slots, maybe repeated (double free, named twice)
        return pack_slots(_picks(draw, live, 8))
    if kind == 2:  # every held slot, in order: a valid free (then a double free)
        return pack_slots(world.states if states else world.held.get(model, []))
    if kind <= 4:
        return pack_slots(draw(st.lists(I64, max_size=8)))
    if kind == 5:
        return draw(st.binary(max_size=25))
    if kind == 6:
        return struct.pack("<q", draw(I64)) * draw(st.integers(1, 3))
    return b""


def session_id(draw: Any, world: World) -> str:
    kind = draw(st.integers(0, 9))
    if kind <= 5:
        return _pick(draw, world.sessions, st.just(""))
    if kind == 6:
        return _pick(draw, world.dead, st.just("0" * 32))
    if kind == 7:
        return ""
    if kind == 8:
        return draw(st.binary(min_size=16, max_size=16)).hex()
    return draw(TEXT)


def lock_id(draw: Any, world: World) -> int:
    return _pick(draw, world.locks, U64) if draw(st.integers(0, 2)) else draw(U64)


def node_id(draw: Any, world: World) -> int:
    return _pick(draw, world.nodes, U64) if draw(st.booleans()) else draw(U64)


def state_slot(draw: Any, world: World) -> int:
    return _pick(draw, world.states, I64) if draw(st.booleans()) else draw(I64)


def _extra(draw: Any) -> dict[str, Any]:
    return {"extra_key": draw(st.sampled_from(["", "lora", "x" * 40]))} \
        if draw(st.integers(0, 4)) == 0 else {}


def match_request(draw: Any, world: World) -> pb.MatchRequest:
    model = draw(MODEL)
    return pb.MatchRequest(
        model=model, token_ids=token_bytes(draw, world, model),
        token_width=draw(WIDTH) if draw(st.integers(0, 3)) == 0 else 0,
        session_id=session_id(draw, world), lock=draw(st.booleans()),
        allocate=draw(st.booleans()), request_id=draw(st.sampled_from([0, 0, 1, 2**64 - 1])),
        **_extra(draw))


def insert_request(draw: Any, world: World) -> pb.InsertRequest:
    model = draw(MODEL)
    tokens = token_bytes(draw, world, model)
    if draw(st.booleans()) and model in NAMES:  # slots that line up with the tokens
        n = len(tokens) // 4
        pool = world.tree.get(model, [])[:n] + world.held.get(model, [])
        slot_data = pack_slots((pool + [1] * n)[:n]) if n else b""
    else:
        slot_data = slot_bytes(draw, world, model)
    req = pb.InsertRequest(
        model=model, token_ids=tokens, slot_indices=slot_data,
        token_width=draw(WIDTH) if draw(st.integers(0, 3)) == 0 else 0,
        session_id=session_id(draw, world), lock=draw(st.booleans()),
        release_lock_id=lock_id(draw, world) if draw(st.booleans()) else 0,
        request_id=draw(st.sampled_from([0, 0, 3])),
        slot_version=_pick(draw, world.versions, U64) if draw(st.booleans()) else draw(U64),
        **_extra(draw))
    if draw(st.booleans()):
        req.state_slot = state_slot(draw, world)
    return req


def evict_request(draw: Any, world: World) -> pb.EvictRequest:
    return pb.EvictRequest(model=draw(MODEL), num_tokens=draw(U64),
                           swa_num_tokens=draw(U64), mamba_num=draw(U64))


def lock_request(draw: Any, world: World) -> pb.LockRequest:
    return pb.LockRequest(model=draw(MODEL), node_id=node_id(draw, world),
                          session_id=session_id(draw, world),
                          request_id=draw(st.sampled_from([0, 0, 5])))


def unlock_request(draw: Any, world: World) -> pb.UnlockRequest:
    return pb.UnlockRequest(lock_id=lock_id(draw, world), session_id=session_id(draw, world),
                            request_id=draw(st.sampled_from([0, 0, 6])))


def alloc_request(draw: Any, world: World) -> pb.AllocRequest:
    return pb.AllocRequest(model=draw(MODEL), num_slots=draw(U64),
                           session_id=session_id(draw, world), num_state_slots=draw(U32))


def free_request(draw: Any, world: World) -> pb.FreeRequest:
    model = draw(MODEL)
    return pb.FreeRequest(model=model, slot_indices=slot_bytes(draw, world, model),
                          session_id=session_id(draw, world),
                          state_slots=slot_bytes(draw, world, model, states=True)
                          if draw(st.booleans()) else b"")


def stats_request(draw: Any, world: World) -> pb.StatsRequest:
    return pb.StatsRequest(model=draw(MODEL))


STREAM_OPS = {"match": match_request, "insert": insert_request, "evict": evict_request,
              "lock": lock_request, "unlock": unlock_request, "alloc": alloc_request,
              "free": free_request, "stats": stats_request}
UNARY_BUILDERS = {
    "Match": match_request, "Insert": insert_request, "Evict": evict_request,
    "Lock": lock_request, "Unlock": unlock_request, "Alloc": alloc_request,
    "Free": free_request, "Stats": stats_request,
    "DescribePool": lambda draw, w: pb.DescribePoolRequest(model=draw(MODEL)),
    "ListModels": lambda draw, w: pb.ListModelsRequest(),
    "OpenSession": lambda draw, w: pb.OpenSessionRequest(
        ttl_seconds=draw(st.floats(allow_nan=True, allow_infinity=True)),
        client_name=draw(TEXT)),
    "KeepAlive": lambda draw, w: pb.KeepAliveRequest(session_id=session_id(draw, w)),
    "CloseSession": lambda draw, w: pb.CloseSessionRequest(session_id=session_id(draw, w)),
    # Reset of a live model is allowed (no admin token here) and re-baselines.
    "Reset": lambda draw, w: pb.ResetRequest(
        model=draw(MODEL) if draw(st.integers(0, 9)) == 0 else draw(TEXT)),
}


def read_request(draw: Any, world: World) -> pb.ReadKVRequest:
    model = draw(MODEL)
    return pb.ReadKVRequest(
        model=model, slot_indices=slot_bytes(draw, world, model),
        layers=draw(st.lists(st.one_of(st.integers(0, 3), U32), max_size=4)),
        state_slots=slot_bytes(draw, world, model, states=True) if draw(st.booleans()) else b"",
        max_chunk_bytes=draw(U64), session_id=session_id(draw, world))


def write_chunks(draw: Any, world: World) -> list[pb.KVChunk]:
    model = draw(MODEL)
    chunks = []
    if draw(st.integers(0, 5)):
        header = pb.WriteKVHeader(
            model=model, slot_indices=slot_bytes(draw, world, model),
            layers=draw(st.lists(st.one_of(st.integers(0, 2), U32), max_size=3)),
            state_slots=slot_bytes(draw, world, model, states=True)
            if draw(st.booleans()) else b"",
            session_id=session_id(draw, world))
        chunks.append(pb.KVChunk(header=header,
                                 data=b"" if draw(st.integers(0, 5)) else b"x"))
    for _ in range(draw(st.integers(0, 4))):
        chunks.append(pb.KVChunk(
            role=draw(st.one_of(st.integers(0, 6), U32.map(lambda v: v % 2**31))),
            layer=draw(st.one_of(st.integers(0, 2), U32)),
            offset_bytes=draw(st.one_of(st.sampled_from([0, 0, 8, 16]), U64)),
            data=draw(st.one_of(st.binary(max_size=40), st.sampled_from([b"\0" * 8, b"\0" * 16])))))
    return chunks


RAW = st.one_of(st.binary(max_size=64),
                st.binary(max_size=8).map(lambda b: b"\x0a\xff\xff\xff\x0f" + b),  # huge length
                st.lists(st.sampled_from([b"\x08\x01", b"\x10\xff\x01", b"\x1a\x03abc", b"\x22\x00",
                                          b"\x0a\x01m", b"\x30\x01", b"\x38\x01", b"\xff"]),
                         max_size=6).map(b"".join))
