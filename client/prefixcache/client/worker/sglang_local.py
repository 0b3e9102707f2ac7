"""LocalSGLangCache: SGLang's ``BasePrefixCache`` API over the in-process ``RadixCache``.

The reference ``RemoteRadixCache`` is held to: the same calls, made the same way by a
scheduler, must tell the same story (tests/client/worker/test_remote_cache_sglang.py), and the
scheduler benchmark (bench/scheduler_loop.py) runs it as its in-process backend. It
behaves as SGLang's own ``RadixCache`` does (``cache_finished_req`` inserts, frees the
duplicates and the unaligned tail, unlocks; ``cache_unfinished_req`` also re-matches and
moves the request onto the tree's slots), over ``prefixcache.cache``'s tree and
allocator. Its allocator (``LocalAllocator``) adds SGLang's paged calls.

torch and ``prefixcache.cache`` are imported when a cache is made, not when this module
loads (the client package stays torch-free at import).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # loaded when a cache is made (no torch at import)
    from prefixcache.cache import RadixCache

from . import sglang_api as api
from .paged_alloc import PagedCalls, ints, widen


class LocalAllocator(PagedCalls):
    """An in-process ``TokenToKVPoolAllocator`` with SGLang's paged ``alloc_extend`` /
    ``alloc_decode``; frees of any slot of a page those calls took free the whole page,
    as SGLang's paged allocator does."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner.page_size, inner.size, inner.device)
        self.inner = inner

    def available_size(self) -> int:
        return int(self.inner.available_size())

    def alloc(self, need_size: int) -> Any:
        out = self.inner.alloc(need_size)
        if out is not None and self._whole:
            self._handed_out(ints(out))
        return out

    def free(self, indices: Any) -> None:
        if self._whole and len(indices):
            values = widen(ints(indices), self._whole, self.page_size)
            self.inner.free(values)
        else:
            self.inner.free(indices)

    def free_group_begin(self) -> None:
        self.inner.free_group_begin()

    def free_group_end(self) -> None:
        self.inner.free_group_end()

    def _take(self, n: int) -> Sequence[int] | None:
        out = self.inner.alloc(n)
        if out is None:
            return None
        slots = ints(out)
        self._took_pages(slots)
        return slots


class LocalSGLangCache(api.FullTreeCapabilities):
    """SGLang's tree-cache API over ``prefixcache.cache.RadixCache``.

    Args:
        pool_size: slots of the in-process pool (ignored when ``cache`` is given).
        page_size: tokens per page.
        req_to_token_pool: SGLang's ``ReqToTokenPool`` (``req_to_token[idx, :n]`` and
            ``write((idx, slice), values)``), for ``cache_(un)finished_req``.
        cache: an existing ``RadixCache`` whose allocator is a ``TokenToKVPoolAllocator``.
    """

    def __init__(
        self,
        pool_size: int = 0,
        page_size: int = 1,
        *,
        req_to_token_pool: Any = None,
        cache: RadixCache | None = None,
        device: Any = "cpu",
        eviction_policy: str = "lru",
    ) -> None:
        from prefixcache.cache import RadixCache, RadixKey, TokenToKVPoolAllocator

        if cache is None:
            inner = TokenToKVPoolAllocator(pool_size, device, page_size)
            cache = RadixCache(
                page_size=page_size,
                token_to_kv_pool_allocator=inner,
                eviction_policy=eviction_policy,
            )
        self.cache = cache
        self._key = RadixKey
        self.page_size = cache.page_size
        self.device = cache.device
        self.disable = False
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = LocalAllocator(cache.token_to_kv_pool_allocator)

    @property
    def root_node(self) -> Any:
        return self.cache.root_node

    def reset(self) -> None:
        self.cache.reset()
        self.token_to_kv_pool_allocator.inner.clear()
        self.token_to_kv_pool_allocator.clear_pages()

    # ---------------------------------------------------------------- the tree

    def _radix_key(self, key: Any) -> Any:
        tokens, extra = api.key_parts(key)
        return self._key(tokens, extra)

    def match_prefix(self, params: api.MatchPrefixParams) -> api.MatchResult:
        hit = self.cache.match_prefix(self._radix_key(params.key))
        node = hit.last_node
        return api.MatchResult(hit.indices, node, node, node, full_kv_hit_length=hit.prefix_len)

    def supports_fast_match_prefix(self) -> bool:
        return False  # as SGLang's RadixCache: a match walks the tree

    def insert(self, params: api.InsertParams) -> api.InsertResult:
        key = self._radix_key(params.key)
        done = self.cache.insert(key, params.value)
        return api.InsertResult(done.prefix_len, len(key), done.last_node)

    def evict(self, params: api.EvictParams) -> api.EvictResult:
        done = self.cache.evict(params.num_tokens)
        return api.EvictResult(done.full_evicted)

    def inc_lock_ref(self, node: Any) -> api.IncLockRefResult:
        before = self.cache.evictable_size()
        self.cache.inc_lock_ref(node)
        return api.IncLockRefResult(
            self.cache.evictable_size() - before, node_id=getattr(node, "id", None)
        )

    def dec_lock_ref(
        self, node: Any, params: api.DecLockRefParams | None = None
    ) -> api.DecLockRefResult:
        before = self.cache.evictable_size()
        self.cache.dec_lock_ref(node)
        return api.DecLockRefResult(self.cache.evictable_size() - before)

    def init_load_back(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("an in-process cache has no host tier")

    # ---------------------------------------------------------- requests

    def cache_finished_req(self, req: Any, is_insert: bool = True, **kwargs: Any) -> None:
        """Insert the request's tokens, free its duplicates and unaligned tail, and
        release its lock (SGLang's ``RadixCache.cache_finished_req``)."""
        kv, aligned, protected = api.req_rows(
            self.req_to_token_pool, req, api.committed_len(req), self.page_size
        )
        alloc = self.token_to_kv_pool_allocator
        if is_insert:
            key = self._key(api.all_tokens(req, aligned), api.namespace(req))
            done = self.cache.insert(key, kv[:aligned].clone())
            alloc.free(kv[protected : done.prefix_len])
            alloc.forget_pages(kv[done.prefix_len : aligned])
        else:
            alloc.free(kv[protected:aligned])
        alloc.free(kv[aligned:])
        self.dec_lock_ref(req.last_node, getattr(req, "lock_receipt", None))

    def cache_unfinished_req(self, req: Any, chunked: bool = False, **kwargs: Any) -> None:
        """Insert what the request has computed so far and move it onto the tree's
        slots (SGLang's ``RadixCache.cache_unfinished_req``)."""
        import torch

        tokens = req.fill_ids
        n = len(tokens)
        kv, aligned, protected = api.req_rows(self.req_to_token_pool, req, n, self.page_size)
        key = self._key(tokens[:aligned], api.namespace(req))
        done = self.cache.insert(key, kv[:aligned].clone())
        alloc = self.token_to_kv_pool_allocator
        alloc.free(kv[protected : done.prefix_len])
        alloc.forget_pages(kv[done.prefix_len : aligned])
        hit = self.cache.match_prefix(key)
        new = hit.indices
        if len(new) != aligned:
            raise RuntimeError(f"the tree holds {len(new)} of the {aligned} tokens just inserted")
        idx = api.req_pool_idx(req)
        self.req_to_token_pool.write((idx, slice(protected, len(new))), new[protected:])
        api.set_protected_len(req, len(new))
        self.dec_lock_ref(req.last_node, getattr(req, "lock_receipt", None))
        req.lock_receipt = self.inc_lock_ref(hit.last_node).to_dec_params()
        req.prefix_indices = torch.cat([new, kv[len(new) :]]) if len(new) < n else new
        req.last_node = hit.last_node

    # ----------------------------------------------------------------- sizes

    def evictable_size(self) -> int:
        return self.cache.evictable_size()

    def protected_size(self) -> int:
        return self.cache.protected_size()

    def total_size(self) -> int:
        return self.cache.total_size()

    def check_integrity(self) -> None:
        self.cache.check_integrity()

    # ------------------------------------------------------------ capabilities

    def is_root(self, node: Any) -> bool:
        return node is self.cache.root_node

    def root_node_handle(self, extra_key: str | None = None) -> Any:
        return self.cache.root_node
