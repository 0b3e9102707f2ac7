"""prefixcache as SGLang's HiCache storage backend (L3), loaded by configuration only.

``backend.PrefixCacheStorage`` is the ``HiCacheStorage`` subclass SGLang loads with
``--hicache-storage-backend dynamic`` (it imports SGLang); ``core.HiCacheCore`` holds
all of its logic and imports neither SGLang nor, until it moves data, torch. See the
docs/sglang.md for the command line.
"""

from .aux_pools import AuxPools
from .core import GeometryError, HiCacheCore, prior_of
from .host_layout import LAYOUTS, HostLayout
from .settings import Ranks, Settings, rank_namespace

__all__ = [
    "LAYOUTS",
    "AuxPools",
    "GeometryError",
    "HiCacheCore",
    "HostLayout",
    "Ranks",
    "Settings",
    "prior_of",
    "rank_namespace",
]
