"""HiCacheCore: everything the SGLang HiCache storage backend does, without SGLang.

SGLang names each page of a prompt by its chained SHA-256 page hash (prefixcache's
``hash_token_ids`` chain, byte for byte) and asks its storage backend, from its
prefetch and backup threads:

* ``exists(keys)``: how many pages, from the first, the sidecar holds (ExistsPages);
* ``get(keys, host_indices)``: copy those pages into SGLang's host pool at
  ``host_indices`` (``page_size`` positions per page): GetPages locks them and answers
  their slots, their rows are copied layer by layer from the pool (mapped, or ReadKV)
  into the host pool's layout, then the locks are released (as ``load_failed`` if the
  copy failed: the sidecar counts the pages it found as a hit that went unused);
* ``set(keys, host_indices, prior)``: store pages from the host pool: the pages the
  sidecar lacks (ExistsPages) get slots (Alloc), their rows are copied in (mapped, or
  WriteKV), and SetPages hands the slots to the cache under the pages' hashes.

Failures never reach SGLang: a sidecar that is down, slow, restarting or refusing
answers as a miss (``exists`` 0, ``get`` all False, ``set`` all False), SGLang
recomputes the KV, and for ``retry_after`` seconds after an unreachable sidecar the
backend answers misses without calling it. A session lost to a restart or a lapsed
lease is replaced, and a pool mapped before a restart is mapped again. Only a
configuration that cannot work (host pool and sidecar pool of different shapes)
raises, when the host pool is registered and the sidecar answers.

Thread-safe: SGLang calls from its prefetch, prefetch-IO and backup threads at once.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections import Counter
from typing import Any

from prefixcache.client import PrefixCacheClient
from prefixcache.client.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    NotFound,
    PrefixCacheError,
    SessionLost,
    StaleEpoch,
    Unavailable,
)
from prefixcache.client.results import PoolInfo

from .host_layout import HostLayout
from .pool_io import AttachedIO, PoolIO, RemoteIO
from .settings import Settings

log = logging.getLogger("prefixcache.integrations.sglang")

_HASH = re.compile(r"[0-9a-f]{64}")
# Rows moved per ReadKV / WriteKV or per mapped copy: bounds the memory a batch of 128
# large pages takes in flight.
GROUP_BYTES = 64 << 20
_LOG_EVERY = 30.0


def prior_of(extra_info: Any) -> str | None:
    """The hash of the page before a batch: the last of SGLang's ``prefix_keys``."""
    keys = getattr(extra_info, "prefix_keys", None)
    return keys[-1] if keys else None


class GeometryError(ValueError):
    """The host pool and the sidecar's pool cannot hold the same pages."""


class HiCacheCore:
    """The backend's logic over a prefixcache client (see the module docstring).

    Args:
        settings: Parsed extra-config and ranks.
        client: A client to use (tests); by default one is made from ``settings``.
    """

    def __init__(self, settings: Settings, client: PrefixCacheClient | None = None) -> None:
        self.settings = settings
        self.client = client or PrefixCacheClient(
            settings.target,
            timeout=settings.timeout,
            token=settings.token,
            retries=1,
            client_name=f"sglang-hicache/{settings.model}",
        )
        self.host: HostLayout | None = None
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._session: Any = None
        self._io: PoolIO | None = None
        self._down_until = 0.0
        self._disabled: str | None = None
        self._last_log = -_LOG_EVERY
        self._warned_keys = False

    # -------------------------------------------------------------- set-up

    def register_host_pool(self, host: HostLayout) -> None:
        """Take SGLang's host pool; check it against the sidecar's pool if it answers.

        Raises:
            GeometryError: the two pools cannot hold the same pages.
        """
        self.host = host
        try:
            self._ready()
        except GeometryError:
            raise
        except PrefixCacheError as exc:
            log.warning(
                "prefixcache sidecar at %s is not reachable yet (%s); HiCache "
                "storage answers misses until it is",
                self.settings.target,
                exc,
            )

    def close(self) -> None:
        with self._lock:
            session, io, self._session, self._io = self._session, self._io, None, None
        for closing in (session, io):
            if closing is not None:  # a dead session must not fail SGLang's exit
                with contextlib.suppress(Exception):
                    closing.close()
        self.client.close()

    # ------------------------------------------------------------ the calls

    def exists(self, keys: list[str]) -> int:
        """Pages held from the first key."""
        hashes = self._hashes(keys)
        if not hashes:
            return 0
        reply = self._guard(
            "exists",
            lambda: self.client.exists_pages(
                self.settings.model,
                hashes,
                extra_key=self.settings.namespace,
                token_width=self.settings.token_width,
                session=self._ready()[0],
            ),
        )
        found = 0 if reply is None else reply.leading_pages
        self._count(exists_calls=1, pages_asked=len(keys), pages_found=found)
        return found

    def get(self, keys: list[str], host_indices: Any) -> list[bool]:
        """Copy the leading run of held pages into the host pool at ``host_indices``."""
        loaded = self._guard("get", lambda: self._load(keys, host_indices, None)) or 0
        self._count(pages_loaded=loaded)
        return [True] * loaded + [False] * (len(keys) - loaded)

    def get_flat(self, keys: list[str], targets: list[Any]) -> list[Any]:
        """SGLang's non-zero-copy read: fill flat pages (``targets``) of held pages."""
        loaded = self._guard("get", lambda: self._load(keys, None, targets)) or 0
        self._count(pages_loaded=loaded)
        return [targets[i] if i < loaded else None for i in range(len(keys))]

    def set(self, keys: list[str], host_indices: Any, prior: str | None = None) -> list[bool]:
        """Store pages from the host pool at ``host_indices``; per key, held after."""
        held = self._guard("set", lambda: self._store(keys, host_indices, None, prior))
        return held if held is not None else [False] * len(keys)

    def set_flat(self, keys: list[str], values: list[Any], prior: str | None = None) -> bool:
        """SGLang's non-zero-copy write: store flat pages ``values``."""
        held = self._guard("set", lambda: self._store(keys, None, values, prior))
        return held is not None and all(held)

    # ------------------------------------------------------------ the work

    def _load(self, keys: list[str], host_indices: Any, flat: list[Any] | None) -> int:
        hashes = self._hashes(keys)
        if not hashes:
            return 0
        pages = self._host_pages(len(hashes), host_indices, flat)
        session, io = self._ready()
        reply = self.client.get_pages(
            self.settings.model,
            hashes,
            extra_key=self.settings.namespace,
            token_width=self.settings.token_width,
            session=session,
        )
        # Until every page found is in the host pool, the hit went unused: the locks
        # are released saying so, and the sidecar counts their pages as load_failed
        # (once: a lock already gone, with its lapsed session, refuses the unlock).
        unused: str | None = "load_failed"
        try:
            found = reply.found_pages
            if not found:
                return 0
            io = self._io_for(reply.server_epoch)
            slots = _as_long(reply.slot_indices)
            for layers in self._groups(io.info):
                io.load(slots, pages[:found], layers, session)
            unused = None
            return found
        finally:
            for lock_id in reply.lock_ids:  # else its session's end releases it
                with contextlib.suppress(PrefixCacheError):
                    self.client.unlock(lock_id, session=session, unused=unused)

    def _store(
        self, keys: list[str], host_indices: Any, flat: list[Any] | None, prior: str | None
    ) -> list[bool]:
        import torch

        hashes = self._hashes(keys)
        if len(hashes) < len(keys):
            return [False] * len(keys)
        pages = self._host_pages(len(keys), host_indices, flat)
        if prior is not None and not _HASH.fullmatch(prior):
            prior = None
        model, ns, width = self.settings.model, self.settings.namespace, self.settings.token_width
        session, io = self._ready()
        present = self.client.exists_pages(
            model, hashes, extra_key=ns, token_width=width, before_set=True, session=session
        ).present
        missing = [i for i, held in enumerate(present) if not held]
        if not missing:
            return [True] * len(keys)
        size = self._host().page_size
        alloc = self.client.alloc(model, len(missing) * size, session=session)
        slots = _as_long(alloc.slots)
        try:
            io = self._io_for(alloc.server_epoch)
            for layers in self._groups(io.info):
                io.store(slots, [pages[i] for i in missing], layers, session)
            per_page = torch.zeros((len(keys), size), dtype=torch.int64)
            per_page[missing] = slots.view(len(missing), size)
            reply = self.client.set_pages(
                model,
                hashes,
                per_page.view(-1),
                extra_key=ns,
                token_width=width,
                prior_hash=prior,
                session=session,
                server_epoch=alloc.server_epoch,
            )
        except BaseException:
            with contextlib.suppress(PrefixCacheError):  # else gone with the session
                self.client.free(
                    model, alloc.slots, session=session, server_epoch=alloc.server_epoch
                )
            raise
        held = reply.held
        self._count(set_calls=1, pages_stored=sum(held) - (len(keys) - len(missing)))
        return held

    # --------------------------------------------------------- connection

    def _ready(self) -> tuple[Any, PoolIO]:
        """The session and pool access to use, (re)made as needed."""
        with self._lock:
            if self._disabled is not None:
                raise GeometryError(self._disabled)
            if self._io is None:
                self._io = self._open_io()
            session = self._session
            if session is None or session.lost is not None or session.closed:
                session = self._session = self.client.session(
                    self.settings.session_ttl, name=f"sglang-hicache/{self.settings.model}"
                )
            return session, self._io

    def _io_for(self, epoch: int) -> PoolIO:
        """Pool access valid in ``epoch`` (the pool is mapped again after a restart)."""
        with self._lock:
            io = self._io
            if io is not None and io.info.server_epoch == epoch:
                return io
            self._io = None
            if io is not None:
                io.close()
            self._io = io = self._open_io()
            if io.info.server_epoch != epoch:
                raise StaleEpoch(
                    f"the sidecar restarted during the call (epoch "
                    f"{epoch} became {io.info.server_epoch})"
                )
            return io

    def _open_io(self) -> PoolIO:
        info = self.client.describe_pool(self.settings.model)
        self._check(info)
        transfer = self.settings.transfer
        if transfer != "rpc" and info.buffers:
            try:
                return AttachedIO(self.client.attach_pool(self.settings.model))
            except (FailedPrecondition, OSError, RuntimeError) as exc:
                if transfer == "attach":
                    raise
                log.info(
                    "prefixcache pool of %r is not mappable here (%s): streaming pages over RPC",
                    self.settings.model,
                    exc,
                )
        elif transfer == "attach":
            raise FailedPrecondition(
                f"model {self.settings.model!r}: the sidecar shares "
                "no pool buffers (transfer: attach)"
            )
        return RemoteIO(self.client, info)

    def _check(self, info: PoolInfo) -> None:
        host = self._host()
        problems = []
        if info.page_size != host.page_size:
            problems.append(f"page size {info.page_size} vs SGLang's {host.page_size}")
        if info.layer_num != host.layer_num:
            problems.append(f"{info.layer_num} layers vs {host.layer_num}")
        if (info.k_head_num, info.k_head_dim) != (host.head_num, host.head_dim):
            problems.append(
                f"K rows [{info.k_head_num}, {info.k_head_dim}] vs "
                f"[{host.head_num}, {host.head_dim}]"
            )
        if not host.is_mla and (info.v_head_num, info.v_head_dim) != (
            host.v_head_num,
            host.v_head_dim,
        ):
            problems.append(
                f"V rows [{info.v_head_num}, {info.v_head_dim}] vs "
                f"[{host.v_head_num}, {host.v_head_dim}]"
            )
        itemsize = _itemsize(info.dtype)
        if itemsize is not None and itemsize != host.dtype.itemsize:
            problems.append(f"dtype {info.dtype} vs {host.dtype}")
        if problems:
            self._disabled = (
                f"prefixcache model {info.model!r} cannot hold this SGLang "
                f"worker's pages: {'; '.join(problems)}"
            )
            raise GeometryError(self._disabled)

    # ------------------------------------------------------------- helpers

    def _guard(self, what: str, call: Any) -> Any:
        """``call()``, or None (a miss) when the sidecar cannot answer."""
        if self.host is None or self._disabled is not None or time.monotonic() < self._down_until:
            self._count(skipped=1)
            return None
        try:
            return call()
        except Exception as exc:  # SGLang must never see a sidecar failure
            self._failed(what, exc)
            return None

    def _failed(self, what: str, exc: Exception) -> None:
        self._count(failures=1)
        if isinstance(exc, StaleEpoch | SessionLost | NotFound):
            with self._lock:  # the sidecar restarted, or our lease lapsed: start over
                session, self._session = self._session, None
            if session is not None:  # stops its renewal; the service forgot it anyway
                with contextlib.suppress(Exception):
                    session.close()
        if isinstance(exc, Unavailable | DeadlineExceeded):
            self._down_until = time.monotonic() + self.settings.retry_after
        now = time.monotonic()
        if now - self._last_log >= _LOG_EVERY:
            self._last_log = now
            detail = str(exc) if isinstance(exc, PrefixCacheError | GeometryError) else repr(exc)
            log.warning(
                "prefixcache HiCache %s failed, answering a miss (SGLang recomputes): %s",
                what,
                detail,
                exc_info=not isinstance(exc, PrefixCacheError | GeometryError),
            )

    def _hashes(self, keys: list[str]) -> list[str]:
        """The leading keys that are SHA-256 page hashes (64 lowercase hex digits)."""
        for i, key in enumerate(keys):
            if not (isinstance(key, str) and _HASH.fullmatch(key)):
                if not self._warned_keys:
                    self._warned_keys = True
                    log.warning(
                        "SGLang page key %r is not a SHA-256 page hash: such pages "
                        "are never found or stored (is SGLANG_USE_XXH3_HASH set?)",
                        key,
                    )
                return list(keys[:i])
        return list(keys)

    def _host_pages(
        self, count: int, host_indices: Any, flat: list[Any] | None
    ) -> list[tuple[HostLayout, int]]:
        """Where each of ``count`` pages lives on the host: a position in the host pool
        (``host_indices``, ``page_size`` consecutive positions a page) or a flat page."""
        host = self._host()
        if flat is not None:
            if len(flat) < count:
                raise ValueError(f"{len(flat)} flat pages for {count} keys")
            return [(host.flat_page(page), 0) for page in flat[:count]]
        size = host.page_size
        tokens = _as_long(host_indices)
        if len(tokens) < count * size:
            raise ValueError(f"{len(tokens)} host positions for {count} pages of {size}")
        per_page = tokens[: count * size].view(count, size)
        if size > 1 and not bool((per_page[:, 1:] - per_page[:, :-1] == 1).all()):
            raise ValueError("host positions of a page are not consecutive")
        return [(host, start) for start in per_page[:, 0].tolist()]

    def _host(self) -> HostLayout:
        if self.host is None:
            raise FailedPrecondition("no host pool registered yet")
        return self.host

    def _groups(self, info: PoolInfo) -> list[list[int]]:
        """Layers in groups of at most ``GROUP_BYTES`` per page batch (at least one)."""
        per_layer = max(
            1,
            (info.k_head_num * info.k_head_dim + info.v_head_num * info.v_head_dim)
            * (_itemsize(info.dtype) or 2)
            * 128
            * max(1, info.page_size),
        )
        step = max(1, GROUP_BYTES // per_layer)
        layers = list(range(info.layer_num))
        return [layers[i : i + step] for i in range(0, len(layers), step)]

    def _count(self, **deltas: int) -> None:
        with self._lock:
            self.counters.update(deltas)


def _as_long(values: Any) -> Any:
    import torch

    if isinstance(values, torch.Tensor):
        return values.reshape(-1).to(device="cpu", dtype=torch.int64)
    if len(values) == 0:
        return torch.zeros(0, dtype=torch.int64)
    return (
        torch.frombuffer(bytearray(values), dtype=torch.int64)
        if hasattr(values, "typecode")
        else torch.as_tensor(values, dtype=torch.int64)
    )


def _itemsize(dtype: str) -> int | None:
    import torch

    found = getattr(torch, dtype, None)
    return found.itemsize if isinstance(found, torch.dtype) else None
