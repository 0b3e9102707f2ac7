"""What the scheduler side tells the workers each step: which pool slots to copy into
which of vLLM's blocks (loads) and back (saves). Plain, picklable records: vLLM ships
the step's metadata to every worker process.

Token positions are positions in the request: token ``t`` lives in vLLM block
``block_ids[t // block_size]`` at offset ``t % block_size``.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field


def _ints() -> array:
    return array("q")


@dataclass(slots=True)
class LoadOp:
    """Copy ``len(slots)`` tokens from the pool into the request's blocks.

    Attributes:
        req_id: vLLM's request id.
        block_ids: the request's vLLM block ids, from its first token on.
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

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass(slots=True)
class SaveOp:
    """Copy tokens ``start ..`` of a finished request from its blocks into ``slots``,
    which ``session_id`` holds; with no slots, there is nothing to copy and the worker
    only reports the request done, so that vLLM frees its blocks. ``ref``: the
    scheduler side's save, handed back to it when the copy fails
    (``WorkerCore.take_failed_saves``) so that it gives the slots back instead of
    inserting them."""

    req_id: str
    block_ids: array = field(default_factory=_ints)
    start: int = 0
    slots: array = field(default_factory=_ints)
    server_epoch: int = 0
    session_id: str = ""
    ref: int = 0


@dataclass(slots=True)
class StepMeta:
    """One scheduler step's loads and saves."""

    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves)
