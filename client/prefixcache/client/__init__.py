"""What an inference worker imports to talk to prefixcache. Never imports torch.

``PrefixCacheClient`` (blocking) and ``AsyncPrefixCacheClient`` (asyncio) cover every
RPC, with deadlines, retries of idempotent calls, leased sessions renewed in the
background, and an optional fail-open mode. ``RemoteRadixCache`` (with its
``RemoteAllocator``) is the in-process ``BasePrefixCache`` API over the service; it is
loaded on first access, and imports torch then.
"""

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from prefixcache.v1 import prefix_cache_pb2, prefix_cache_pb2_grpc

from ._core import DEFAULT_TARGET, DEFAULT_TIMEOUT
from .aio import AsyncPrefixCacheClient
from .errors import (
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    PrefixCacheError,
    ResourceExhausted,
    SessionLost,
    StaleEpoch,
    Unauthenticated,
    Unavailable,
)
from .page_chain import RequestHashes
from .results import (
    AllocReply,
    BufferInfo,
    CloseReply,
    EvictReply,
    InsertReply,
    LockReply,
    MambaLayout,
    MatchReply,
    ModelInfo,
    ModelList,
    ModelStats,
    PoolInfo,
    ResetReply,
    Retained,
    RetainReply,
    SessionInfo,
    StatsReply,
    UnlockReply,
)
from .retention import Retention
from .sessions.aio_session import AsyncClientSession
from .sessions.aio_stream import AsyncStreamSession
from .sessions.session import ClientSession
from .shadow.shadow import Lag, ShadowIndex
from .shadow.shadow_follow import AsyncShadowFollower, ShadowFollower
from .step import Admit, Finish, Free, FreeReply, StepReply
from .sync import PrefixCacheClient
from .transfer.attach import AttachedPool
from .transfer.kv import KVData, WriteKVReply

if TYPE_CHECKING:
    from .worker.remote_cache import RemoteAllocator, RemoteNode, RemoteRadixCache
    from .worker.remote_mamba import RemoteMambaRadixCache
    from .worker.remote_trie import RemoteRadixTrie, RemoteTrieNode

try:
    __version__ = version("prefixcache")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

_LAZY = ("RemoteAllocator", "RemoteNode", "RemoteRadixCache")
_LAZY_TRIE = ("RemoteRadixTrie", "RemoteTrieNode")


def __getattr__(name: str) -> Any:
    """RemoteRadixCache, RemoteMambaRadixCache and friends, loaded on first use (they
    need torch), and RemoteRadixTrie (loaded on first use too)."""
    if name in _LAZY:
        from .worker import remote_cache

        remote_cache.register_base()
        return getattr(remote_cache, name)
    if name == "RemoteMambaRadixCache":
        from .worker import remote_mamba

        return remote_mamba.RemoteMambaRadixCache
    if name in _LAZY_TRIE:
        from .worker import remote_trie

        return getattr(remote_trie, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_TARGET",
    "DEFAULT_TIMEOUT",
    "Admit",
    "AllocReply",
    "AsyncClientSession",
    "AsyncPrefixCacheClient",
    "AsyncShadowFollower",
    "AsyncStreamSession",
    "AttachedPool",
    "BufferInfo",
    "ClientSession",
    "CloseReply",
    "DeadlineExceeded",
    "EvictReply",
    "FailedPrecondition",
    "Finish",
    "Free",
    "FreeReply",
    "InsertReply",
    "Internal",
    "InvalidArgument",
    "KVData",
    "Lag",
    "LockReply",
    "MambaLayout",
    "MatchReply",
    "ModelInfo",
    "ModelList",
    "ModelStats",
    "NotFound",
    "PermissionDenied",
    "PoolInfo",
    "PrefixCacheClient",
    "PrefixCacheError",
    "RemoteAllocator",
    "RemoteMambaRadixCache",
    "RemoteNode",
    "RemoteRadixCache",
    "RemoteRadixTrie",
    "RemoteTrieNode",
    "RequestHashes",
    "ResetReply",
    "ResourceExhausted",
    "RetainReply",
    "Retained",
    "Retention",
    "SessionInfo",
    "SessionLost",
    "ShadowFollower",
    "ShadowIndex",
    "StaleEpoch",
    "StatsReply",
    "StepReply",
    "Unauthenticated",
    "Unavailable",
    "UnlockReply",
    "WriteKVReply",
    "__version__",
    "prefix_cache_pb2",
    "prefix_cache_pb2_grpc",
]
