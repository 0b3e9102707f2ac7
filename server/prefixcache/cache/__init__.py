"""prefixcache.cache: the in-process prefix-cache library (no gRPC, no metrics, no config).

Drop-in names for ``pymllm.mem_cache``, with the reference's bugs fixed (see each
class's docstring and ``spec/semantics.md`` §10).
"""

from .allocator import TokenToKVPoolAllocator
from .base import BasePrefixCache, EvictResult, InsertResult, MatchResult
from .chunk_cache import ChunkCache
from .errors import (
    CacheError,
    DoubleFreeError,
    IntegrityError,
    InvalidInputError,
    LockError,
    SlotIndexError,
    TokenRangeError,
)
from .eviction import EVICTION_POLICIES, get_eviction_policy
from .hashing import hash_bytes, hash_to_int64, hash_token_ids
from .key import RadixKey
from .kv_pool import KVPool
from .mamba_pool import MambaPool
from .mamba_radix_cache import MambaRadixCache
from .node import TreeNode
from .radix_cache import RadixCache
from .slot_allocator import SlotAllocator, StaleSlotError
from .slot_cache import SlotInsertResult, SlotMatch, SlotNode, SlotPrefixCache
from .swa_allocator import SWATokenToKVPoolAllocator
from .swa_radix_cache import SWARadixCache

__all__ = [
    "EVICTION_POLICIES",
    "BasePrefixCache",
    "CacheError",
    "ChunkCache",
    "DoubleFreeError",
    "EvictResult",
    "InsertResult",
    "IntegrityError",
    "InvalidInputError",
    "KVPool",
    "LockError",
    "MambaPool",
    "MambaRadixCache",
    "MatchResult",
    "RadixCache",
    "RadixKey",
    "SWARadixCache",
    "SWATokenToKVPoolAllocator",
    "SlotAllocator",
    "SlotIndexError",
    "SlotInsertResult",
    "SlotMatch",
    "SlotNode",
    "SlotPrefixCache",
    "StaleSlotError",
    "TokenRangeError",
    "TokenToKVPoolAllocator",
    "TreeNode",
    "get_eviction_policy",
    "hash_bytes",
    "hash_to_int64",
    "hash_token_ids",
]

