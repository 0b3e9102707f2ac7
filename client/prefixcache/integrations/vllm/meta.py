"""What the scheduler side tells the workers each step: which pool slots to copy into
which of vLLM's blocks (loads) and back (saves). Plain, picklable records: vLLM ships
the step's metadata to every worker process.

Token positions are positions in the request: token ``t`` lives in vLLM block
``block_ids[t // block_size]`` at offset ``t % block_size``. With vLLM's hybrid KV cache
manager a request has one block table per KV cache group (each group its own layers,
full attention or sliding window): ``group_block_ids`` holds them all, in vLLM's group
order, and ``block_ids`` is the first; ``tables`` and ``table`` read either form.

The null block. vLLM's block 0 is its null block: a placeholder that holds no request's
KV. A sliding-window request's table has it where blocks left the window (vLLM freed
them), and a hit's table where vLLM needs no KV. A load never writes it: in each table
the tokens in null blocks before the first live one are not loaded (vLLM needs no KV
there), and a null block after a live one fails the load; a save never reads it: the
scheduler side plans none that would, and a worker fails one that does.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

NULL_BLOCK = 0


Tables = tuple[array, ...]


def as_tables(block_ids: Sequence[int] | Sequence[Sequence[int]]) -> Tables:
    """One request's block table per group, from vLLM's tuple of lists (the hybrid
    manager's ``get_block_ids()``) or one list (a single group)."""
    if len(block_ids) and not isinstance(block_ids[0], int):
        return tuple(array("q", table) for table in block_ids)  # type: ignore[arg-type]
    return (array("q", block_ids),)


def live_end(block_ids: Sequence[int], start: int, end: int, block_size: int) -> int:
    """Where the tokens from ``start`` stop having a block that holds them: ``end``,
    or the first token of the first null block (or of the first one beyond the table)
    at or after ``start``'s block."""
    for index in range(start // block_size, -(-end // block_size)):
        if index >= len(block_ids) or block_ids[index] == NULL_BLOCK:
            return max(index * block_size, start)
    return end


def live_from(block_ids: Sequence[int], start: int, end: int, block_size: int) -> int | None:
    """The first token from ``start`` on whose block, and every later one's up to
    ``end``, is not the null block (``end`` if every one is); None where a null block
    follows a block that is not (vLLM puts null blocks before the live ones only)."""
    first = start
    seen_live = False
    for index in range(start // block_size, -(-end // block_size)):
        null = index < len(block_ids) and block_ids[index] == NULL_BLOCK
        if null and seen_live:
            return None
        if null:
            first = min((index + 1) * block_size, end)
        else:
            seen_live = True
    return max(first, start)


def touches_null(block_ids: Sequence[int], start: int, end: int, block_size: int) -> bool:
    """Whether tokens ``start .. end`` fall into the null block."""
    return live_end(block_ids, start, end, block_size) < end


def tables_live_end(tables: Tables, start: int, end: int, block_size: int) -> int:
    """``live_end`` over every table: where a token from ``start`` stops having a live
    block in every group (a pool row holds every layer's KV of its token)."""
    return min((live_end(t, start, end, block_size) for t in tables), default=end)


def _ints() -> array:
    return array("q")


@dataclass(slots=True)
class LoadOp:
    """Copy ``len(slots)`` tokens from the pool into the request's blocks.

    Attributes:
        req_id: vLLM's request id.
        block_ids: the request's vLLM block ids, from its first token on (the first
            group's; ``group_block_ids``: every group's, see the module docstring).
        start: the first token to load (what vLLM had cached itself before it).
        num_tokens: how many tokens to load.
        slots: the pool slot of each token from ``start`` on (``num_tokens`` of them).
        server_epoch: the service's epoch the slots belong to.
        session_id: the scheduler side's session, whose lock keeps the slots (ReadKV
            reads only what the session holds or has locked).
        tokens: the request's tokens up to the last one loaded, and ``extra_key``
            their namespace: to check, after copying, that the tree still maps them
            to these slots.
        fail: load nothing and report the blocks of tokens ``start .. end`` as failed
            (vLLM counted tokens the scheduler side cannot serve).
        ref: the scheduler side's reservation, handed back to it when the load fails
            (``WorkerCore.take_failed_loads``) so that the service hears ``load_failed``;
            0: none to tell.
    """

    req_id: str
    block_ids: array = field(default_factory=_ints)
    start: int = 0
    num_tokens: int = 0
    slots: array = field(default_factory=_ints)
    server_epoch: int = 0
    session_id: str = ""
    tokens: array = field(default_factory=_ints)
    extra_key: str | None = None
    fail: bool = False
    ref: int = 0
    group_block_ids: Tables = ()

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def tables(self) -> Tables:
        return self.group_block_ids or (self.block_ids,)

    def table(self, group: int) -> array:
        return self.group_block_ids[group] if self.group_block_ids else self.block_ids


@dataclass(slots=True)
class SaveOp:
    """Copy tokens ``start ..`` of a finished request from its blocks into ``slots``,
    which ``session_id`` holds; with no slots, there is nothing to copy and the worker
    only reports the request done, so that vLLM frees its blocks. ``ref``: the
    scheduler side's save, handed back to it when the copy fails
    (``WorkerCore.take_failed_saves``) so that it gives the slots back instead of
    inserting them.

    ``during_run``: a running request's prompt tokens computed so far, copied after
    the step's forward (vLLM's ``wait_for_save``) and not reported done (the request
    has not finished); the worker hands ``report`` back once it made the copy
    (``WorkerCore.take_copied``), failed or not."""

    req_id: str
    block_ids: array = field(default_factory=_ints)
    start: int = 0
    slots: array = field(default_factory=_ints)
    server_epoch: int = 0
    session_id: str = ""
    ref: int = 0
    during_run: bool = False
    report: int = 0
    group_block_ids: Tables = ()

    @property
    def tables(self) -> Tables:
        return self.group_block_ids or (self.block_ids,)

    def table(self, group: int) -> array:
        return self.group_block_ids[group] if self.group_block_ids else self.block_ids


@dataclass(slots=True)
class StepMeta:
    """One scheduler step's loads and saves."""

    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves)
