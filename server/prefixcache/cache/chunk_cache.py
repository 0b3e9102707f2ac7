"""ChunkCache: the no-op prefix cache used when radix caching is off."""

from __future__ import annotations

import torch

from .base import BasePrefixCache, EvictResult, InsertResult, MatchResult
from .key import RadixKey


class ChunkCache(BasePrefixCache):
    """Caches nothing: every match misses, insert and evict do nothing, sizes are 0.

    The caller keeps ownership of every slot and frees request KV itself.
    """

    def __init__(
        self, token_to_kv_pool_allocator: object = None, device: str | torch.device | None = None
    ) -> None:
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.device = torch.device(
            device or getattr(token_to_kv_pool_allocator, "device", None) or "cpu"
        )

    def reset(self) -> None:
        pass

    def match_prefix(self, key: RadixKey) -> MatchResult:
        return MatchResult(torch.empty((0,), dtype=torch.int64, device=self.device), None, 0)

    def insert(
        self, key: RadixKey, value: torch.Tensor | None = None, **options: object
    ) -> InsertResult:
        """Caches nothing; any kind's options are accepted and ignored."""
        return InsertResult()

    def evict(self, num_tokens: int, swa_num_tokens: int = 0) -> EvictResult:
        return EvictResult()

    def inc_lock_ref(self, node: object) -> None:
        return None

    def dec_lock_ref(self, node: object, swa_boundary_id: int | None = None) -> None:
        return None
