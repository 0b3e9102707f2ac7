"""The fuzzer's requests (tests/reliability/test_fuzz.py): hypothesis draws of every
request message, malformed and adversarial, mixing the world's live ids with garbage.
"""

from __future__ import annotations

import struct
from typing import Any

from fuzz_world import MAX_MESSAGE, MODELS, NAMES, World
from harness import pack_slots, pb, toks
from hypothesis import strategies as st

from prefixcache.cache import hash_token_ids

EDGES = (
    0,
    1,
    2,
    3,
    4,
    5,
    7,
    8,
    15,
    16,
    17,
    63,
    64,
    65,
    255,
    256,
    257,
    1000,
    1024,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**53,
    2**63 - 1,
    2**63,
    2**64 - 1,
)
U64 = st.one_of(st.integers(0, 300), st.sampled_from(EDGES), st.integers(0, 2**64 - 1))
U32 = st.one_of(
    st.integers(0, 300), st.sampled_from([e for e in EDGES if e < 2**32]), st.integers(0, 2**32 - 1)
)
I64 = st.one_of(
    st.integers(-3, 300),
    st.sampled_from([-(2**63), -(2**31), -1, *[e for e in EDGES if e < 2**63]]),
    st.integers(-(2**63), 2**63 - 1),
)
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
MODEL = st.one_of(
    st.sampled_from(NAMES),
    st.sampled_from(NAMES),
    st.sampled_from(["", "nope", "M", " m", "m\x00", "é", "x" * 300]),
    TEXT,
)
WIDTH = st.one_of(st.sampled_from([0, 0, 0, 1, 2, 3, 8, 9, 16]), U32)
# Bigger than max_message_bytes once framed: RESOURCE_EXHAUSTED from gRPC itself.
HUGE = b"\x01\x00\x00\x00" * (MAX_MESSAGE // 4 + 16)


# Draws never depend on the world's state (hypothesis requires the same choices to give
# the same draws): a live id is drawn as an index, and its fallback is always drawn too.
INDEX = st.integers(0, 2**16)
PAGE_SIZES = {m.name: m.page_size for m in MODELS}


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
        cut = draw(INDEX) % (len(seq) + 1)  # not integers(0, len(seq)): its range is state
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
    return (
        {"extra_key": draw(st.sampled_from(["", "lora", "x" * 40]))}
        if draw(st.integers(0, 4)) == 0
        else {}
    )


def match_request(draw: Any, world: World) -> pb.MatchRequest:
    model = draw(MODEL)
    return pb.MatchRequest(
        model=model,
        token_ids=token_bytes(draw, world, model),
        token_width=draw(WIDTH) if draw(st.integers(0, 3)) == 0 else 0,
        session_id=session_id(draw, world),
        lock=draw(st.booleans()),
        allocate=draw(st.booleans()),
        request_id=draw(st.sampled_from([0, 0, 1, 2**64 - 1])),
        **_extra(draw),
    )


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
        model=model,
        token_ids=tokens,
        slot_indices=slot_data,
        token_width=draw(WIDTH) if draw(st.integers(0, 3)) == 0 else 0,
        session_id=session_id(draw, world),
        lock=draw(st.booleans()),
        release_lock_id=lock_id(draw, world) if draw(st.booleans()) else 0,
        request_id=draw(st.sampled_from([0, 0, 3])),
        slot_version=_pick(draw, world.versions, U64) if draw(st.booleans()) else draw(U64),
        **_extra(draw),
    )
    if draw(st.booleans()):
        req.state_slot = state_slot(draw, world)
    return req


def evict_request(draw: Any, world: World) -> pb.EvictRequest:
    return pb.EvictRequest(
        model=draw(MODEL), num_tokens=draw(U64), swa_num_tokens=draw(U64), mamba_num=draw(U64)
    )


def lock_request(draw: Any, world: World) -> pb.LockRequest:
    return pb.LockRequest(
        model=draw(MODEL),
        node_id=node_id(draw, world),
        session_id=session_id(draw, world),
        request_id=draw(st.sampled_from([0, 0, 5])),
    )


def unlock_request(draw: Any, world: World) -> pb.UnlockRequest:
    return pb.UnlockRequest(
        lock_id=lock_id(draw, world),
        session_id=session_id(draw, world),
        request_id=draw(st.sampled_from([0, 0, 6])),
    )


def alloc_request(draw: Any, world: World) -> pb.AllocRequest:
    return pb.AllocRequest(
        model=draw(MODEL),
        num_slots=draw(U64),
        session_id=session_id(draw, world),
        num_state_slots=draw(U32),
    )


def free_request(draw: Any, world: World) -> pb.FreeRequest:
    model = draw(MODEL)
    return pb.FreeRequest(
        model=model,
        slot_indices=slot_bytes(draw, world, model),
        session_id=session_id(draw, world),
        state_slots=slot_bytes(draw, world, model, states=True) if draw(st.booleans()) else b"",
    )


def stats_request(draw: Any, world: World) -> pb.StatsRequest:
    return pb.StatsRequest(model=draw(MODEL))


def step_request(draw: Any, world: World) -> pb.StepRequest:
    """A Step of a few items of each kind, each as malformed as its unary call's."""
    model = draw(MODEL)

    def width() -> int:
        return draw(WIDTH) if draw(st.integers(0, 3)) == 0 else 0

    admits = []
    for _ in range(draw(st.integers(0, 3))):
        admit = pb.StepAdmit(
            token_ids=token_bytes(draw, world, model),
            token_width=width(),
            lock=draw(st.booleans()),
            allocate=draw(st.booleans()),
            **_extra(draw),
        )
        if draw(st.integers(0, 3)) == 0:
            admit.expected_prefix_len = draw(U32)
        admits.append(admit)
    finishes = []
    for _ in range(draw(st.integers(0, 2))):
        finish = pb.StepFinish(
            token_ids=token_bytes(draw, world, model),
            token_width=width(),
            slot_indices=slot_bytes(draw, world, model),
            lock=draw(st.booleans()),
            release_lock_id=lock_id(draw, world) if draw(st.booleans()) else 0,
            keep_tail=draw(st.booleans()),
            slot_version=_pick(draw, world.versions, U64) if draw(st.booleans()) else 0,
            **_extra(draw),
        )
        if draw(st.integers(0, 3)) == 0:
            finish.state_slot = state_slot(draw, world)
        finishes.append(finish)
    frees = [
        pb.StepFree(
            slot_indices=slot_bytes(draw, world, model),
            state_slots=slot_bytes(draw, world, model, states=True) if draw(st.booleans()) else b"",
        )
        for _ in range(draw(st.integers(0, 2)))
    ]
    return pb.StepRequest(
        model=model,
        session_id=session_id(draw, world),
        request_id=draw(st.sampled_from([0, 0, 0, 7])),
        admits=admits,
        finishes=finishes,
        frees=frees,
        unlocks=[lock_id(draw, world) for _ in range(draw(st.integers(0, 2)))],
        decodes=draw(st.lists(st.one_of(st.integers(0, 8), U64), max_size=3)),
    )


def page_hashes(draw: Any, world: World, model: str) -> bytes:
    """Packed page hashes: a cached sequence's chain (so pages are found), random
    digests, bytes that are not whole digests, none, or more than a message holds."""
    kind = draw(st.integers(0, 7))
    if kind <= 3:
        seq = _pick(draw, world.seqs.get(model) or world.seqs["m"], st.just([1, 2, 3, 4]))
        size = PAGE_SIZES.get(model, 1)
        chain, prior = [], None
        for start in range(0, len(seq) - len(seq) % size, size):
            prior = hash_token_ids(seq[start : start + size], prior)
            chain.append(bytes.fromhex(prior))
        return b"".join(chain[: draw(INDEX) % (len(chain) + 1)])
    if kind == 4:
        return draw(st.binary(min_size=32, max_size=32)) * draw(st.integers(1, 3))
    if kind == 5:
        return draw(st.binary(max_size=70))
    if kind == 6:
        return b""
    return b"\x07" * 32 * (MAX_MESSAGE // 32 + 1)


def _page_fields(draw: Any, world: World) -> dict[str, Any]:
    model = draw(MODEL)
    fields = {
        "model": model,
        "page_hashes": page_hashes(draw, world, model),
        "token_width": draw(WIDTH) if draw(st.integers(0, 3)) == 0 else 0,
    }
    return {**fields, **_extra(draw)}


def exists_pages_request(draw: Any, world: World) -> pb.ExistsPagesRequest:
    return pb.ExistsPagesRequest(
        **_page_fields(draw, world),
        before_set=draw(st.booleans()),
        session_id=session_id(draw, world) if draw(st.booleans()) else "",
    )


def get_pages_request(draw: Any, world: World) -> pb.GetPagesRequest:
    return pb.GetPagesRequest(
        **_page_fields(draw, world),
        session_id=session_id(draw, world),
        request_id=draw(st.sampled_from([0, 0, 8])),
    )


def set_pages_request(draw: Any, world: World) -> pb.SetPagesRequest:
    fields = _page_fields(draw, world)
    prior = draw(st.sampled_from([b"", b"", b"\x05" * 32, b"\x05" * 31, b"\x05" * 64]))
    return pb.SetPagesRequest(
        **fields,
        prior_hash=prior,
        slot_indices=slot_bytes(draw, world, fields["model"]),
        session_id=session_id(draw, world),
        request_id=draw(st.sampled_from([0, 0, 9])),
    )


def subscribe_request(draw: Any, world: World) -> pb.SubscribeRequest:
    """A Subscribe; ``server_epoch`` 1 is replaced by the live epoch when sent."""
    namespaces = [
        pb.PageNamespace(**_extra(draw), token_width=draw(WIDTH))
        for _ in range(draw(st.integers(0, 2)))
    ]
    if draw(st.integers(0, 9)) == 0:
        namespaces = [pb.PageNamespace(extra_key=str(i)) for i in range(1025)]
    request = pb.SubscribeRequest(
        model=draw(MODEL),
        namespaces=namespaces,
        server_epoch=draw(st.sampled_from([0, 1, 1, 2**64 - 1])),
        max_pages_per_event=draw(U32),
        session_id=session_id(draw, world) if draw(st.booleans()) else "",
    )
    after = draw(st.one_of(st.none(), st.integers(0, 40), U64))
    if after is not None:
        request.after_seq = after
    return request


STREAM_OPS = {
    "match": match_request,
    "insert": insert_request,
    "evict": evict_request,
    "lock": lock_request,
    "unlock": unlock_request,
    "alloc": alloc_request,
    "free": free_request,
    "stats": stats_request,
    "step": step_request,
}
UNARY_BUILDERS = {
    "Match": match_request,
    "Insert": insert_request,
    "Evict": evict_request,
    "Lock": lock_request,
    "Unlock": unlock_request,
    "Alloc": alloc_request,
    "Free": free_request,
    "Stats": stats_request,
    "Step": step_request,
    "ExistsPages": exists_pages_request,
    "GetPages": get_pages_request,
    "SetPages": set_pages_request,
    "DescribePool": lambda draw, w: pb.DescribePoolRequest(model=draw(MODEL)),
    "ListModels": lambda draw, w: pb.ListModelsRequest(),
    "OpenSession": lambda draw, w: pb.OpenSessionRequest(
        ttl_seconds=draw(st.floats(allow_nan=True, allow_infinity=True)), client_name=draw(TEXT)
    ),
    "KeepAlive": lambda draw, w: pb.KeepAliveRequest(session_id=session_id(draw, w)),
    "CloseSession": lambda draw, w: pb.CloseSessionRequest(session_id=session_id(draw, w)),
    # Reset of a live model is allowed (no admin token here) and re-baselines.
    "Reset": lambda draw, w: pb.ResetRequest(
        model=draw(MODEL) if draw(st.integers(0, 9)) == 0 else draw(TEXT)
    ),
}


def read_request(draw: Any, world: World) -> pb.ReadKVRequest:
    model = draw(MODEL)
    return pb.ReadKVRequest(
        model=model,
        slot_indices=slot_bytes(draw, world, model),
        layers=draw(st.lists(st.one_of(st.integers(0, 3), U32), max_size=4)),
        state_slots=slot_bytes(draw, world, model, states=True) if draw(st.booleans()) else b"",
        max_chunk_bytes=draw(U64),
        session_id=session_id(draw, world),
    )


def write_chunks(draw: Any, world: World) -> list[pb.KVChunk]:
    model = draw(MODEL)
    chunks = []
    if draw(st.integers(0, 5)):
        header = pb.WriteKVHeader(
            model=model,
            slot_indices=slot_bytes(draw, world, model),
            layers=draw(st.lists(st.one_of(st.integers(0, 2), U32), max_size=3)),
            state_slots=slot_bytes(draw, world, model, states=True) if draw(st.booleans()) else b"",
            session_id=session_id(draw, world),
        )
        chunks.append(pb.KVChunk(header=header, data=b"" if draw(st.integers(0, 5)) else b"x"))
    for _ in range(draw(st.integers(0, 4))):
        chunks.append(
            pb.KVChunk(
                role=draw(st.one_of(st.integers(0, 6), U32.map(lambda v: v % 2**31))),
                layer=draw(st.one_of(st.integers(0, 2), U32)),
                offset_bytes=draw(st.one_of(st.sampled_from([0, 0, 8, 16]), U64)),
                data=draw(
                    st.one_of(st.binary(max_size=40), st.sampled_from([b"\0" * 8, b"\0" * 16]))
                ),
            )
        )
    return chunks


RAW = st.one_of(
    st.binary(max_size=64),
    st.binary(max_size=8).map(lambda b: b"\x0a\xff\xff\xff\x0f" + b),  # huge length
    st.lists(
        st.sampled_from(
            [
                b"\x08\x01",
                b"\x10\xff\x01",
                b"\x1a\x03abc",
                b"\x22\x00",
                b"\x0a\x01m",
                b"\x30\x01",
                b"\x38\x01",
                b"\xff",
            ]
        ),
        max_size=6,
    ).map(b"".join),
)
