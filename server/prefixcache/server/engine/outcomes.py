"""What an engine's match and insert answer, whatever the model's kind (slots as host
int64 arrays): the records the rpc package turns into replies."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class MatchOutcome:
    """A match as the service answers it (slots as host int64 arrays)."""

    prefix_len: int
    indices: np.ndarray
    node_id: int
    lock_id: int
    allocated: np.ndarray
    # Mamba models: the matched node's state slot, where the KV alone would have
    # reached, and the state slot allocated for this request.
    state_slot: int | None = None
    branching_seqlen: int | None = None
    allocated_state: int | None = None
    # Slot models: the versions of the matched and the allocated sequence slot.
    slot_version: int | None = None
    allocated_version: int | None = None


@dataclass(slots=True)
class InsertOutcome:
    """An insert as the service answers it; ``freed`` are session slots it freed."""

    prefix_len: int
    cached_len: int
    node_id: int
    lock_id: int
    freed: np.ndarray
    state_exist: bool = False
