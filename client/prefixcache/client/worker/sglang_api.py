"""SGLang's ``BasePrefixCache`` call records, and how the caches here read a request.

SGLang's scheduler talks to its tree cache with small records
(``python/sglang/srt/mem_cache/base_prefix_cache.py``): it passes ``MatchPrefixParams``,
``InsertParams`` and ``EvictParams``, reads ``MatchResult`` / ``InsertResult`` /
``EvictResult``, and keeps the ``IncLockRefResult`` of each lock as the receipt it hands
back to ``dec_lock_ref``. These are our own records of the same shapes (field names and
order as SGLang has them), so that ``RemoteRadixCache`` and ``LocalSGLangCache`` answer
the calls SGLang makes without importing sglang. Fields SGLang has and we never set keep
their defaults. Pure Python: no torch here.

``cache_finished_req`` / ``cache_unfinished_req`` take SGLang's ``Req``; the helpers at
the end read what they need from it, in both layouts SGLang has used (``req.req_pool_idx``
and ``req.cache_protected_len`` directly, or under ``req.kv``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple


@dataclasses.dataclass
class MatchPrefixParams:
    """What ``match_prefix`` is asked: a key (SGLang's ``RadixKey``: ``token_ids``,
    ``extra_key``, optionally ``limit`` and ``cache_salt``; or ours; or plain token ids)
    and, for a scheduler's ranking match, the request it is for."""

    key: Any
    cow_mamba: bool = False
    req: Any = None


@dataclasses.dataclass
class InsertParams:
    key: Any = None
    value: Any = None
    mamba_value: Any = None
    c128_value: Any = None
    prev_prefix_len: int = 0
    swa_evicted_seqlen: int = 0
    swa_branching_seqlen: int | None = None
    chunked: bool = False
    priority: int = 0
    track_adopted_ranges: bool = False


@dataclasses.dataclass
class InsertResult:
    prefix_len: int
    total_len: int = 0
    last_device_node: Any = None
    mamba_exist: bool = False


@dataclasses.dataclass
class EvictParams:
    num_tokens: int = 0
    swa_num_tokens: int = 0
    mamba_num: int = 0


@dataclasses.dataclass
class EvictResult:
    num_tokens_evicted: int = 0
    swa_num_tokens_evicted: int = 0
    mamba_num_evicted: int = 0


@dataclasses.dataclass
class DecLockRefParams:
    """The receipt ``dec_lock_ref`` takes back. ``lock_id`` and ``pinned`` are ours: the
    service's lock the receipt stands for (0: none, or not known yet for a lock still in
    flight; the cache fills it in when the reply comes), and the tokens a lock of a
    ranking estimate held back from the evictable size."""

    node_id: int | None = None
    swa_uuid_for_lock: int | None = None
    swa_uuid_for_host_lock: int | None = None
    skipped_lock_components: tuple[Any, ...] = ()
    lock_id: int = 0
    pinned: int = 0  # ours: tokens a lock of a ranking match's stand-in held back


@dataclasses.dataclass
class IncLockRefResult:
    """What ``inc_lock_ref`` took: ``to_dec_params()`` is the receipt for the release.
    ``delta``: the change of the evictable size (negative: tokens became protected);
    None where the cache cannot tell without a call (the remote one)."""

    delta: int | None = None
    node_id: int | None = None
    swa_uuid_for_lock: int | None = None
    swa_uuid_for_host_lock: int | None = None
    skipped_lock_components: tuple[Any, ...] = ()
    receipt: DecLockRefParams | None = None

    def to_dec_params(self) -> DecLockRefParams:
        if self.receipt is not None:
            return self.receipt
        return DecLockRefParams(
            self.node_id,
            self.swa_uuid_for_lock,
            self.swa_uuid_for_host_lock,
            tuple(self.skipped_lock_components),
        )


@dataclasses.dataclass
class DecLockRefResult:
    delta: int | None = None


@dataclasses.dataclass
class InitLoadBackParams:
    best_match_node: Any
    host_hit_length: int
    mem_quota: int | None = None
    req: Any = None


class MatchResult(NamedTuple):
    """SGLang's match answer. ``device_indices`` are slots usable now (under a lock of
    ``last_device_node``); ``host_hit_length`` tokens more are held elsewhere and come
    with ``init_load_back(best_match_node, ...)`` at admission (the remote cache
    reports its whole estimate this way, see ``sglang_remote``)."""

    device_indices: Any
    last_device_node: Any
    last_host_node: Any
    best_match_node: Any = None
    host_hit_length: int = 0
    swa_host_hit_length: int = 0
    swa_branching_seqlen: int | None = None
    mamba_host_hit_length: int = 0
    mamba_branching_seqlen: int | None = None
    cache_protected_len: int | None = None
    full_kv_hit_length: int = 0
    cache_actions: tuple[Any, ...] = ()


# ------------------------------------------------------------------ reading a request


def is_match_params(value: Any) -> bool:
    """Whether ``value`` is a ``MatchPrefixParams`` (ours or SGLang's, by shape)."""
    return isinstance(value, MatchPrefixParams) or (
        hasattr(value, "key") and hasattr(value, "cow_mamba")
    )


def is_insert_params(value: Any) -> bool:
    return isinstance(value, InsertParams) or (
        hasattr(value, "key") and hasattr(value, "prev_prefix_len")
    )


def is_evict_params(value: Any) -> bool:
    return isinstance(value, EvictParams) or (
        hasattr(value, "num_tokens") and hasattr(value, "mamba_num")
    )


def key_parts(key: Any) -> tuple[Any, str | None]:
    """The token ids of a key (cut to its ``limit``) and its namespace.

    An SGLang ``cache_salt`` is folded into the namespace: keys with different salts
    never share pages, as in SGLang.
    """
    if hasattr(key, "token_ids"):
        tokens = key.token_ids
        limit = getattr(key, "limit", None)
        if limit is not None:
            tokens = tokens[:limit]
        return tokens, _salted(getattr(key, "extra_key", None), getattr(key, "cache_salt", None))
    return key, getattr(key, "extra_key", None)


def key_len(key: Any) -> int:
    """Tokens ``key_parts`` would return, without copying them."""
    tokens = getattr(key, "token_ids", key)
    limit = getattr(key, "limit", None)
    return len(tokens) if limit is None else min(len(tokens), limit)


def key_namespace(key: Any) -> str | None:
    """The namespace ``key_parts`` would return."""
    if hasattr(key, "token_ids"):
        return _salted(getattr(key, "extra_key", None), getattr(key, "cache_salt", None))
    return getattr(key, "extra_key", None)


def _salted(extra_key: str | None, salt: str | None) -> str | None:
    return f"{extra_key or ''}\x00cache_salt={salt}" if salt else extra_key


def namespace(req: Any) -> str | None:
    """The namespace of a request's pages: its ``extra_key`` (with its ``cache_salt``
    folded in, as ``key_parts`` does for its match keys)."""
    return _salted(getattr(req, "extra_key", None), getattr(req, "cache_salt", None))


def _kv(req: Any) -> Any:
    kv = getattr(req, "kv", None)
    return kv if kv is not None and hasattr(kv, "req_pool_idx") else req


def req_pool_idx(req: Any) -> int:
    return int(_kv(req).req_pool_idx)


def protected_len(req: Any) -> int:
    return int(getattr(_kv(req), "cache_protected_len", 0) or 0)


def set_protected_len(req: Any, n: int) -> None:
    _kv(req).cache_protected_len = n


def committed_len(req: Any) -> int:
    """Tokens of ``req`` whose KV is written: SGLang's ``pop_committed_kv_cache()``
    where the request has it, else all but the last token (whose KV the next decode
    step would write)."""
    pop = getattr(req, "pop_committed_kv_cache", None)
    if callable(pop):
        return int(pop())
    return len(req.origin_input_ids) + len(req.output_ids) - 1


def all_tokens(req: Any, n: int) -> Any:
    """The first ``n`` of the request's input and output token ids."""
    inputs, outputs = req.origin_input_ids, req.output_ids
    if n <= len(inputs):
        return inputs[:n]
    try:  # lists with lists, arrays with arrays: one C-level concatenation
        return inputs + outputs[: n - len(inputs)]
    except TypeError:
        return list(inputs) + list(outputs[: n - len(inputs)])


def kv_row(pool: Any, req: Any, n: int) -> Any:
    """The first ``n`` KV slots of the request's row of ``req_to_token_pool``."""
    if pool is None:
        raise ValueError(
            "this cache was made without a req_to_token_pool; pass one to "
            "use cache_finished_req / cache_unfinished_req"
        )
    return pool.req_to_token[req_pool_idx(req), :n]


def req_rows(pool: Any, req: Any, n: int, page_size: int) -> tuple[Any, int, int]:
    """What ``cache_(un)finished_req`` works on: the first ``n`` KV slots of the
    request's row (``kv_row``), how many of them fill whole pages, and how many its
    cached prefix already covers (``protected_len``)."""
    return kv_row(pool, req, n), n - n % page_size, protected_len(req)


class FullTreeCapabilities:
    """The capability answers SGLang's scheduler asks of a plain radix tree cache: a tree
    (not a chunk cache), full attention only (no SWA, no Mamba state), node handles that
    are the nodes themselves, and no KV events of its own. Both caches here are that."""

    def is_chunk_cache(self) -> bool:
        return False

    def is_tree_cache(self) -> bool:
        return True

    def supports_swa(self) -> bool:
        return False

    def supports_mamba(self) -> bool:
        return False

    def resolve_node_handle(self, node: Any) -> Any:
        return node

    def take_events(self) -> list[Any]:
        return []

    # Sizes: with full attention only, the full sizes are the sizes and SWA has none.

    def evictable_size(self) -> int:
        raise NotImplementedError

    def protected_size(self) -> int:
        raise NotImplementedError

    def full_evictable_size(self) -> int:
        return self.evictable_size()

    def full_protected_size(self) -> int:
        return self.protected_size()

    def swa_evictable_size(self) -> int:
        return 0

    def swa_protected_size(self) -> int:
        return 0
