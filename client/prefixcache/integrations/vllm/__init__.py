"""prefixcache as a vLLM KV connector (``KVConnectorBase_V1``), configuration only::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "PrefixCacheConnector",
        "kv_connector_module_path": "prefixcache.integrations.vllm.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"target": "unix:/run/prefixcache.sock",
                                      "model": "llama-8b"}}'

The engine-free core holds all the logic: ``scheduler`` (asynchronous batched lookups,
leased reservations) with ``fast_miss`` (misses answered from a shadow index) and
``saves`` (prompts saved while their requests run, the rest at the finish), ``meta``
(the step's records; one block table per KV cache group under vLLM's hybrid KV cache
manager; the null block), ``worker`` with ``attn_backends`` (each
attention backend's KV layout), ``layout`` and ``pool_access`` (per-token copies
between the pool and vLLM's blocks), ``layerwise`` (loads issued layer by layer on a
GPU stream), ``keys`` and ``config`` (with vLLM's ``kv_role``: prefill/decode).
``connector`` is the thin vLLM adapter and the only module that imports vLLM; importing
this package does not.
"""

from typing import TYPE_CHECKING, Any

from .config import ConnectorConfig

if TYPE_CHECKING:
    from .connector import PrefixCacheConnector


def __getattr__(name: str) -> Any:
    """``PrefixCacheConnector``, loaded (with vLLM) on first access."""
    if name == "PrefixCacheConnector":
        from .connector import PrefixCacheConnector

        return PrefixCacheConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ConnectorConfig", "PrefixCacheConnector"]
