"""SGLang's pool-transfer calls (``batch_exists_v2``, ``batch_get_v2``, ``batch_set_v2``).

Hybrid models keep state beside the KV pages: Mamba and SWA pools (whose pages only
need to exist at the end of a prefix, ``trailing_pages``), DSA indexer pools and draft
pools (``all_pages``). The sidecar stores the KV pool's pages (the ``kv`` transfer, the
same pages as ``batch_get_v1``/``batch_set_v1``) and none of the others yet, so those
are answered as missing: an existence check that names another pool finds no usable
prefix, and SGLang recomputes instead of loading KV without the state it needs.
"""

from __future__ import annotations

from typing import Any

KV = "kv"


def pool_name(name: Any) -> str:
    """A ``PoolName`` (a str enum) or a plain string as its value."""
    return str(getattr(name, "value", name))


def exists_v2(core: Any, keys: list[str],
              pool_transfers: list[Any] | None) -> tuple[int, dict[str, int]]:
    """``(usable pages, hits per pool)``: the KV pool's leading run, cut to 0 when
    another pool is asked for (it is never stored)."""
    kv = core.exists(keys)
    hits = {KV: kv} if kv else {}
    if any(pool_name(t.name) != KV for t in pool_transfers or ()):
        return 0, hits
    return kv, hits


def transfer_v2(core: Any, transfers: list[Any], prior: str | None,
                load: bool) -> dict[str, list[bool]]:
    """Each transfer's per-page results: the KV pool's through the core, every other
    pool's all False."""
    out: dict[str, list[bool]] = {}
    for transfer in transfers:
        name, keys = pool_name(transfer.name), list(transfer.keys or ())
        if name == KV and transfer.host_indices is not None:
            out[name] = core.get(keys, transfer.host_indices) if load \
                else core.set(keys, transfer.host_indices, prior)
        else:
            out[name] = [False] * len(keys)
    return out
