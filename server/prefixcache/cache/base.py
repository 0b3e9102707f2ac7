"""The prefix-cache contract shared by every cache kind, and its result records."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .key import RadixKey


def _empty_indices() -> torch.Tensor:
    return torch.empty((0,), dtype=torch.int64)


@dataclass(slots=True)
class MatchResult:
    """What ``match_prefix`` found.

    Attributes:
        indices: KV slot of every matched token (1-D; empty on a miss). Use them only
            while ``last_node`` is locked, or eviction may hand them to someone else.
        last_node: the node where the match ends (the root on a miss); lock it. An
            opaque handle: each cache kind has its own node type (a ``TreeNode`` of the
            in-process trees, a remote node of ``RemoteRadixCache``, None for
            ``ChunkCache``), so it is typed as anything.
        prefix_len: number of matched tokens, always ``len(indices)``.
        mamba_branching_seqlen: hybrid caches only, see ``MambaRadixCache``.
    """

    indices: torch.Tensor = field(default_factory=_empty_indices)
    last_node: Any = None
    prefix_len: int = 0
    mamba_branching_seqlen: int | None = None


@dataclass(slots=True)
class InsertResult:
    """What ``insert`` did: ``prefix_len`` tokens of the key were already cached."""

    prefix_len: int = 0
    last_node: Any = None
    mamba_exist: bool = False


@dataclass(slots=True)
class EvictResult:
    """Tokens (or, for ``mamba_evicted``, state slots) actually freed; may exceed the ask."""

    full_evicted: int = 0
    swa_evicted: int = 0
    mamba_evicted: int = 0


class SlotFreer(Protocol):
    """What a cache needs of its slot allocator: taking slots back (``free``).

    ``TokenToKVPoolAllocator`` is one; a cache also uses ``free_parts``, ``free_swa``,
    ``is_allocated`` and ``device`` where the allocator has them.
    """

    def free(self, indices: torch.Tensor) -> None: ...


class BasePrefixCache(ABC):
    """A cache from token prefixes to KV-pool slots.

    Contract for every implementation:

    * ``match_prefix`` may split nodes but never frees or allocates slots.
    * Slots returned by a match stay valid only while the returned node is locked
      (``inc_lock_ref``); ``evict`` frees slots of unlocked nodes to the allocator.
    * ``dec_lock_ref`` must balance an earlier ``inc_lock_ref`` on the same node;
      anything else raises ``LockError`` and changes nothing.
    * ``evictable_size() + protected_size() == total_size()`` at all times.
    * Bad input raises ``InvalidInputError`` before any state changes.

    A cache is single-threaded: callers serialise access to one instance.
    """

    @abstractmethod
    def reset(self) -> None: ...

    @abstractmethod
    def match_prefix(self, key: RadixKey) -> MatchResult: ...

    @abstractmethod
    def insert(self, key: RadixKey, value: torch.Tensor | None = None) -> InsertResult:
        """Cache ``key`` with slots ``value``; a kind adds keyword-only options."""

    @abstractmethod
    def evict(self, num_tokens: int, swa_num_tokens: int = 0) -> EvictResult: ...

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> int | None:
        """Lock ``node`` (a ``MatchResult.last_node``); the SWA kind returns the boundary
        id its ``dec_lock_ref`` takes back, every other kind None."""

    @abstractmethod
    def dec_lock_ref(self, node: Any, swa_boundary_id: int | None = None) -> None: ...

    def evictable_size(self) -> int:
        return 0

    def swa_evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def swa_protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def check_integrity(self) -> None:  # noqa: B027 - a cache with no state has nothing to check
        """Recompute every counter from the tree and raise ``IntegrityError`` on a mismatch."""
