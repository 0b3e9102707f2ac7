"""What an inference worker imports to talk to prefixcache. Never imports torch."""

from importlib.metadata import PackageNotFoundError, version

from prefixcache.v1 import prefix_cache_pb2, prefix_cache_pb2_grpc

try:
    __version__ = version("prefixcache")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__", "prefix_cache_pb2", "prefix_cache_pb2_grpc"]
