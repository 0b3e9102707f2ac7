"""Load Mooncake-format traces and expand their block hash ids into token-id arrays."""

from __future__ import annotations

import contextlib
import ctypes
import json
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

BLOCK_TOKENS = 512  # Mooncake hash ids each stand for one 512-token block
REPO_ROOT = Path(__file__).resolve().parents[1]
TRACES_DIR = REPO_ROOT / "bench" / "traces"
DEFAULT_TRACE = TRACES_DIR / "mooncake_conversation_trace.jsonl"


@dataclass(frozen=True)
class TraceRequest:
    """One trace line: prompt length and its chain of 512-token block ids."""

    input_length: int
    hash_ids: tuple[int, ...]


@dataclass
class ExpandedTrace:
    """Token-id arrays for every request, plus what it cost to build them."""

    path: Path | None
    page_size: int
    keys: list[array]
    build_s: float

    @property
    def total_tokens(self) -> int:
        return sum(len(k) for k in self.keys)


def load_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """Read up to `limit` requests from a JSON-lines trace, in arrival order."""
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if limit is not None and len(out) >= limit:
                break
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            ids = tuple(int(h) for h in rec["hash_ids"])
            length = int(rec["input_length"])
            if length > len(ids) * BLOCK_TOKENS:
                raise ValueError(f"{path}: input_length {length} exceeds {len(ids)} blocks")
            out.append(TraceRequest(length, ids))
    return out


def synthetic_trace(limit: int, seed: int = 0) -> list[TraceRequest]:
    """Conversation-shaped requests where no trace file is at hand (``--trace`` names
    a file that is not there): a few system prompts,
    and sessions whose every turn repeats the previous turn's blocks and adds some."""
    import random

    rng = random.Random(seed)
    next_id = 1000
    systems = [tuple(range(i * 4, i * 4 + 4)) for i in range(4)]  # 4 blocks each
    sessions: list[tuple[int, ...]] = []
    out: list[TraceRequest] = []
    while len(out) < limit:
        if not sessions or rng.random() < 0.3:
            sessions.append(rng.choice(systems))
        i = rng.randrange(len(sessions))
        grown = sessions[i] + tuple(range(next_id, next_id + rng.randint(1, 3)))
        next_id += 3
        sessions[i] = grown
        out.append(TraceRequest(len(grown) * BLOCK_TOKENS - rng.randrange(BLOCK_TOKENS), grown))
    return out


def expand(requests: list[TraceRequest], page_size: int) -> list[array]:
    """Map id h to tokens h*512..h*512+511, cut to input_length, align down to the page."""
    if page_size < 1:
        raise ValueError("page_size must be >= 1")
    # Blocks recur across requests (every conversation request starts with id 0), so
    # each block's bytes are made once, all before any key: a temporary made between
    # two kept keys would leave the heap fragmented, and every medium-size allocation
    # of the replay afterwards (numpy temporaries) would pay for walking the holes.
    block_bytes: dict[int, bytes] = {}
    for req in requests:
        for h in req.hash_ids:
            if h not in block_bytes:
                first = h * BLOCK_TOKENS
                if first + BLOCK_TOKENS > 2**32:
                    raise ValueError(f"hash id {h} does not fit uint32 token ids")
                block_bytes[h] = array("I", range(first, first + BLOCK_TOKENS)).tobytes()
    keys: list[array] = []
    for req in requests:
        n = req.input_length - req.input_length % page_size
        key = array("I", [0]) * n  # one allocation of its final size, filled in place
        out, pos = memoryview(key).cast("B"), 0
        for h in req.hash_ids:
            if pos == len(out):
                break
            block = block_bytes[h]
            take = min(len(block), len(out) - pos)
            out[pos : pos + take] = block[:take] if take < len(block) else block
            pos += take
        out.release()
        keys.append(key)
    return keys


def load_expanded(path: Path | None, page_size: int, limit: int | None = None) -> ExpandedTrace:
    """Load and expand a trace (``path`` None: ``synthetic_trace``), timing the
    expansion (it stays outside req/s)."""
    t0 = time.perf_counter()
    requests = load_trace(path, limit) if path is not None else synthetic_trace(limit or 200)
    keys = expand(requests, page_size)
    build_s = time.perf_counter() - t0
    _return_free_heap()
    return ExpandedTrace(path, page_size, keys, build_s)


def _return_free_heap() -> None:
    # expand() frees its block cache (~370 MB for the conversation trace); glibc keeps
    # that heap, and replays would reuse it without growing RSS, hiding their memory.
    with contextlib.suppress(OSError, AttributeError):  # not glibc: deltas may read low
        ctypes.CDLL("libc.so.6").malloc_trim(0)
