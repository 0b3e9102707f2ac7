"""prefixcache.cache: the in-process prefix-cache library (no gRPC, no metrics, no config).

It keeps the class and method names and signatures of ``pymllm.mem_cache`` (the prefix
cache of the mllm project's Python runtime, derived from SGLang's ``mem_cache``), so code
written against either runs on it; where that reference is wrong it follows SGLang.
docs/semantics.md states the exact behaviour and lists every departure.
"""

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
from .mamba.mamba_radix_cache import MambaRadixCache
from .node import TreeNode
from .pools.allocator import TokenToKVPoolAllocator
from .pools.kv_pool import KVPool
from .pools.mamba_pool import MambaPool
from .pools.slot_allocator import SlotAllocator, StaleSlotError
from .pools.swa_allocator import SWATokenToKVPoolAllocator
from .radix.radix_cache import RadixCache
from .radix.swa_radix_cache import SWARadixCache
from .slot.slot_cache import SlotInsertResult, SlotMatch, SlotPrefixCache
from .slot.slot_tree import SlotNode
from .trie.radix_trie import RadixTrie, TrieNode

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
    "RadixTrie",
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
    "TrieNode",
    "get_eviction_policy",
    "hash_bytes",
    "hash_to_int64",
    "hash_token_ids",
]
