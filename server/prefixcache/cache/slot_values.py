"""A node's slots: the tree's own copy of a run of a caller's slot tensor, and a match's
slots joined from several nodes.

On the CPU these go through numpy: a slice, a copy and ``torch.from_numpy`` cost about
half what ``tensor[a:b].clone()`` does, and joining a path's values with
``np.concatenate`` skips ``torch.cat``'s dispatch (a miss's empty result is a few
hundred nanoseconds instead of microseconds). Results are ordinary int64 tensors either
way; other dtypes and devices take the torch calls.
"""

from __future__ import annotations

import numpy as np
import torch

_INT64 = torch.int64


def owned_slots(value: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """``value[start:stop]`` as a tensor sharing no memory with ``value``."""
    if value.dtype is _INT64 and value.is_cpu:
        return torch.from_numpy(value.numpy()[start:stop].copy())
    return value[start:stop].clone()


def joined_slots(values: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The slots of ``values`` end to end, as a new tensor (empty int64 on ``device``
    when there are none)."""
    if not values:
        return empty_slots(device)
    if all(v.dtype is _INT64 and v.is_cpu for v in values):
        return torch.from_numpy(np.concatenate([v.numpy() for v in values]))
    return torch.cat(values)


def empty_slots(device: torch.device) -> torch.Tensor:
    """A new empty int64 slot tensor on ``device``."""
    if device.type == "cpu":
        return torch.from_numpy(np.empty(0, dtype=np.int64))
    return torch.empty((0,), dtype=_INT64, device=device)
