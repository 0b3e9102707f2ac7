"""Tier: one tier below the pools of a server (a store, its threads and each model's
hooks), and MooncakeTier, the shared cross-node one; the disk tier is disk/.

Concurrency. The engines are single-writer on the event loop (servicer.py), and a
store call blocks (a dead master holds each for about 4 s). So every call runs on a
small thread pool and the loop awaits it for at most ``tier.timeout``; past that the
call counts as a miss and the loop goes on, while the thread finishes in the
background (what it touched in the pool stays held until then: fetch.py). A timeout
or an unreachable master opens a breaker: for ``cooldown`` seconds lookups answer a
miss at once instead of queueing behind threads that are stuck. Every change to a
tree or pool happens back on the loop.

The store is reached in the background: a master that is down at start, or restarts,
costs misses (and dropped writes), never a failed start or a failed call.

Trust (docs/security.md): with ``tier.secret_file`` every object carries a MAC and its
key is keyed (keys.py, seals.py), so only store clients holding the secret can write a
page this sidecar serves; without it pages carry a digest, which catches corruption but
not a forger, and the start says so once. The tier's session is the service's own: no
per-session quota applies to it (its fetches are bounded by ``tier.max_fetch_slots``,
its writes by the pin cap).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from prefixcache.cache.index.page_index import DIGEST_BYTES
from prefixcache.v1 import prefix_cache_pb2 as pb

from ..access.limits import request_tokens
from ..access.tenants import check_request
from ..codec import MAX_TOKEN_WIDTH, decode_key
from ..config.tier import TierConfig, read_tier_secret
from ..rpc.page_rpcs import max_pages
from ..rpc.servicer_ops import CALLER
from .backend import RPC_FAIL, PageRetention, TierBackend, TierUnavailable
from .fetch import prefetch
from .fetch_pages import prefetch_pages
from .model_tier import ModelTier
from .store_read import Deadline
from .writer import PutQueue

log = logging.getLogger("prefixcache.server")

# Store calls in flight from lookups at most; more answer a miss at once ("busy").
MAX_INFLIGHT = 4
# Seconds between attempts to reach a store that could not be set up.
RECONNECT_SECONDS = 2.0
# Seconds a stopping server waits for the put thread and then the store client to
# leave (each; a dead master holds either for seconds).
CLOSE_SECONDS = 2.0


@dataclass(frozen=True, slots=True)
class TierKind:
    """What tells one tier below the pools from another: its name (its session's,
    ``prefixcache-<name>``, and its threads'), where its hits count (``found``:
    ``prefixcache_tier_hit_tokens_total{tier}``, and its lookups' result when it found
    pages), its ``source`` in ``prefixcache_integrity_failures_total``, and the model
    setting that opts a model out of it (``models[].<flag>``)."""

    name: str
    found: str
    source: str
    flag: str


MOONCAKE = TierKind("tier", "remote", "tier", "tier")
DISK = TierKind("disk", "disk", "disk", "disk")


def _open_backend(cfg: TierConfig) -> TierBackend:
    from .mooncake_backend import MooncakeBackend

    return MooncakeBackend(cfg)


def _guarded(step: Callable[..., Any]) -> Callable[..., Any]:
    """A lookup's tier step never fails the call: anything unexpected is logged and
    counted (``prefixcache_tier_errors_total{code="INTERNAL"}``), and the lookup is
    answered from the local pool."""

    @functools.wraps(step)
    async def run(self: Tier, request: Any) -> None:
        try:
            await step(self, request)
        except Exception:
            log.exception("tier lookup step failed")
            self.error("lookup", "INTERNAL")

    return run


class Tier:
    """One tier of one server: its store calls, its threads, and each model's hooks.

    Args:
        cfg: Its settings (``server.tier``, ``server.disk``): ``timeout``,
            ``min_fetch_bandwidth``, ``write``, ``min_hits``, ``max_fetch_slots``.
        service: The CacheService whose tree models it serves.
        loop: The service's event loop.
        kind: Which tier (``MOONCAKE``, ``DISK``).
    """

    # Whether its store keeps the retention of the pages it is given (model_tier.py).
    keeps_retention = False

    def __init__(
        self, cfg: Any, service: Any, loop: asyncio.AbstractEventLoop, kind: TierKind = MOONCAKE
    ) -> None:
        self.cfg = cfg
        self.kind = kind
        self.loop = loop
        self._pool = ThreadPoolExecutor(MAX_INFLIGHT, thread_name_prefix=f"prefixcache-{kind.name}")
        self.inflight = 0
        self.cooldown = max(1.0, 4 * cfg.timeout)
        self._open_until = 0.0
        self.closed = False
        self.connected = False
        self.puts: PutQueue | None = None
        # Locks of pages being written and slots being fetched belong to this session,
        # so the service's audits and Reset see them like any worker's; it is the
        # service's own, so no client quota applies to it.
        self.session = service.sessions.open(None, f"prefixcache-{kind.name}")
        self.session.internal = True
        self.service = service
        self.models: dict[str, ModelTier] = {}
        # Store calls that failed, by op and code (a timeout is "TIMEOUT").
        self.errors: dict[tuple[str, str], int] = {}

    def serves(self, engine: Any) -> bool:
        """Whether ``engine``'s model takes part (radix models with CPU pools)."""
        if not (getattr(engine.config, self.kind.flag) and engine.kind == "radix"):
            return False
        if engine.config.pool.device != "cpu":
            log.warning(
                "a tier serves CPU pools only: this model stays out of it",
                extra={
                    "tier": self.kind.name,
                    "model": engine.name,
                    "device": engine.config.pool.device,
                },
            )
            return False
        return True

    @property
    def ready(self) -> bool:
        return self.connected and not self.closed

    # ----------------------------------------------------------------- lookups

    @_guarded
    async def before_match(self, request: Any) -> None:
        """A Match's tier step: bring the pages after its local hit in from the store,
        so the handler that follows answers them as a hit (fetch.py). A request the
        handler will refuse is left to it."""
        mt = self.models.get(request.model)
        if mt is None or self.closed:
            return
        engine = mt.engine
        try:
            key = decode_key(
                request.token_ids,
                request.token_width,
                request.extra_key if request.HasField("extra_key") else None,
                engine.config.vocab_size,
                request_tokens(self.service.limits, engine.config),
            )
        except Exception:
            return
        await prefetch(self, mt, key)

    async def before_stream_op(self, request: Any) -> None:
        """A Session stream operation's tier step (a match or a step, as their unary
        calls have); only in namespaces the caller may use (tenants.py)."""
        op = request.WhichOneof("op") if isinstance(request, pb.SessionRequest) else None
        if op not in ("match", "step") or self.closed:
            return
        body = getattr(request, op)
        caller = CALLER.get()
        if caller.bound:
            try:
                check_request(caller, body, self.service)
            except Exception:
                return  # the operation is refused
        await (self.before_match(body) if op == "match" else self.before_step(body))

    @_guarded
    async def before_step(self, request: Any) -> None:
        """A Step's tier step: each admission's pages after its local hit, from the
        store, before the Step runs (so the admissions see them as hits). One deadline
        for all of them: ``tier.timeout``, grown by each fetch's bytes."""
        mt = self.models.get(request.model)
        if mt is None or self.closed or not request.admits:
            return
        engine = mt.engine
        deadline = Deadline(self.cfg)
        cap = request_tokens(self.service.limits, engine.config)
        for item in request.admits:
            if time.monotonic() >= deadline.at or self.closed:
                return
            try:
                key = decode_key(
                    item.token_ids,
                    item.token_width,
                    item.extra_key if item.HasField("extra_key") else None,
                    engine.config.vocab_size,
                    cap,
                )
            except Exception:
                continue  # the Step refuses it
            await prefetch(self, mt, key, deadline)

    @_guarded
    async def before_exists_pages(self, request: Any) -> None:
        """An ExistsPages' tier step (SGLang's ``batch_exists``): the pages after its
        local leading run, from the store, as hash pages (fetch_pages.py). Not for the
        check before a SetPages (``before_set``): the caller is about to store them."""
        mt = self.models.get(request.model)
        if (
            mt is None
            or self.closed
            or request.before_set
            or getattr(mt.engine, "page_index", None) is None
        ):
            return
        data = bytes(request.page_hashes)
        width = request.token_width or 1
        if (
            not data
            or len(data) % DIGEST_BYTES
            or width > MAX_TOKEN_WIDTH
            or len(data) // DIGEST_BYTES > max_pages(self.service.limits, mt.engine)
        ):
            return  # the handler refuses it
        extra_key = request.extra_key if request.HasField("extra_key") else None
        await prefetch_pages(self, mt, (extra_key, width), data)

    # ------------------------------------------------------------ store calls

    async def probe(self, mt: ModelTier, keys: list[str], deadline: Deadline) -> list[int] | None:
        """Which of ``keys`` the store holds (``exists``'s codes), or None (counted)."""
        codes, _ = await self.call("exists", mt.backend.exists, keys, deadline=deadline.at)
        return codes

    def peek(self, mt: ModelTier, keys: list[str]) -> list[int] | None:
        """``exists``'s codes for ``keys`` where they are known on the loop at no cost,
        touching nothing (None: not known without a store call)."""
        return None

    def held(
        self, mt: ModelTier, keys: list[str], retain: PageRetention | None = None
    ) -> list[bool] | None:
        """Whether the store holds each of ``keys``, where that is known on the loop at
        no cost (None: not known); each held one counts as used now (and takes
        ``retain``, in a tier that keeps retentions)."""
        return None

    def promoted(self, mt: ModelTier, key: Any, start: int, keys: list[str]) -> None:
        """The pages of ``keys`` were read from the store and inserted after the first
        ``start`` tokens of ``key``; a tier that keeps retentions gives them theirs in
        the pool."""

    def write_refusal(self, mt: ModelTier) -> str | None:
        """Why a write-back of ``mt``'s pages would be dropped now (a drop reason), or
        None. Lookups in flight (``busy``) are no reason."""
        why = self.available()
        return None if why == "busy" else why

    def available(self) -> str | None:
        """Why a store call would not be made now (a metric label), or None."""
        if not self.ready:
            return "unavailable"
        if time.monotonic() < self._open_until:
            return "breaker_open"
        if self.inflight >= MAX_INFLIGHT:
            return "busy"
        return None

    async def call(
        self, op: str, fn: Callable[..., list[int]], *args: Any, deadline: float | None = None
    ) -> tuple[list[int] | None, asyncio.Future[Any] | None]:
        """Run a store call on the pool until ``deadline`` (monotonic seconds; default
        ``tier.timeout`` from now).

        Returns its codes, or None (counted) when it failed or timed out, with the
        future of the call (None if not made): one that timed out may still be running.
        """
        timeout = self.cfg.timeout if deadline is None else deadline - time.monotonic()
        if self.available() is not None:
            return None, None
        if timeout <= 0:
            self.error(op, "TIMEOUT")
            return None, None
        self.inflight += 1
        fut = self.loop.run_in_executor(self._pool, fn, *args)
        fut.add_done_callback(self._landed)
        try:
            codes = await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            self.error(op, "TIMEOUT")
            self.trip()
            return None, fut
        except Exception as exc:
            self.error(op, type(exc).__name__)
            return None, fut
        if RPC_FAIL in codes:
            self.trip()
        return codes, fut

    def _landed(self, fut: asyncio.Future[Any]) -> None:
        self.inflight -= 1
        if not fut.cancelled():
            fut.exception()  # retrieved: a late failure is counted where it is awaited

    def trip(self) -> None:
        """Skip store calls for a while: the store is slow or unreachable."""
        self._open_until = time.monotonic() + self.cooldown

    def error(self, op: str, code: str) -> None:
        self.errors[(op, code)] = self.errors.get((op, code), 0) + 1

    # --------------------------------------------------------------- lifetime

    def close(self) -> None:
        """Stop the threads and leave the store."""
        if self.closed:
            return
        self.closed = True
        if self.puts is not None:
            for job in self.puts.close(CLOSE_SECONDS):
                job.done([])
        for mt in self.models.values():
            mt.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._leave()
        if not self.session.closed:
            self.service.close_session(self.session)

    def _leave(self) -> None:
        """Close the store (after the put thread)."""


class MooncakeTier(Tier):
    """The shared cross-node tier on Mooncake Store (``server.tier``), connecting in the
    background.

    Args:
        cfg: ``server.tier``.
        service: The CacheService whose tree models it serves (``models[].tier`` on).
        loop: The service's event loop.
        open_backend: Makes the store client (blocking; raises TierUnavailable).
    """

    def __init__(
        self,
        cfg: TierConfig,
        service: Any,
        loop: asyncio.AbstractEventLoop,
        open_backend: Callable[[TierConfig], TierBackend] = _open_backend,
    ) -> None:
        # The secret is read before the tier's session opens (a bad file opens none).
        secret = read_tier_secret(cfg.secret_file) if cfg.secret_file else None
        super().__init__(cfg, service, loop, MOONCAKE)
        self.backend: TierBackend | None = None
        self._open_backend = open_backend
        self.keyed = secret is not None
        for name, engine in service.engines.items():
            if self.serves(engine):
                self.models[name] = ModelTier(self, engine, secret)
        self._stop = threading.Event()
        self._connector = threading.Thread(
            target=self._connect, name="prefixcache-tier-setup", daemon=True
        )

    def start(self) -> None:
        if not self.keyed:
            log.warning(
                "tier pages are sealed with a digest only: it catches corruption, "
                "but the tier trusts every client of the master to write the "
                "pages it serves; set tier.secret_file (docs/security.md)",
                extra={"master": self.cfg.master},
            )
        self._connector.start()

    def _connect(self) -> None:
        """Set the store client up (retrying while the master is down), register every
        model's pool with it, then start the put queue. On its own thread."""
        warned = False
        while not self._stop.is_set():
            # Mooncake's setup holds the GIL (the whole event loop) while it retries an
            # unreachable master, about 4 s a try: call it only once the master's port
            # answers.
            if not _reachable(self.cfg.master):
                if not warned:
                    log.warning(
                        "tier master unreachable, retrying",
                        extra={"master": self.cfg.master, "retry_seconds": RECONNECT_SECONDS},
                    )
                    warned = True
                self._stop.wait(RECONNECT_SECONDS)
                continue
            try:
                backend = self._open_backend(self.cfg)
                for mt in self.models.values():
                    for ptr, size in mt.regions():
                        backend.register(ptr, size)
            except TierUnavailable as exc:
                log.warning(
                    "tier unavailable, retrying",
                    extra={"reason": str(exc), "retry_seconds": RECONNECT_SECONDS},
                )
                self._stop.wait(RECONNECT_SECONDS)
                continue
            except Exception:
                log.exception("tier setup failed, retrying")
                self._stop.wait(RECONNECT_SECONDS)
                continue
            try:
                self.loop.call_soon_threadsafe(self._connected, backend)
            except RuntimeError:  # the loop is gone
                backend.close()
            return

    def _connected(self, backend: TierBackend) -> None:
        if self.closed:
            threading.Thread(target=backend.close, daemon=True).start()
            return
        self.puts = PutQueue(backend.put_from, self.loop.call_soon_threadsafe)
        for mt in self.models.values():
            mt.backend = backend
        self.backend = backend
        self.connected = True
        log.info(
            "tier connected", extra={"master": self.cfg.master, "models": ",".join(self.models)}
        )

    def close(self) -> None:
        self._stop.set()
        super().close()

    def _leave(self) -> None:
        backend, self.backend = self.backend, None
        # Leaving the store takes about 1 s, and Mooncake's close holds the GIL all along
        # (7 s against a dead master): skipped when the master is gone, which then drops
        # this client's segment itself once its client_ttl lapses.
        if backend is not None and _reachable(self.cfg.master):
            closer = threading.Thread(target=_close_quietly, args=(backend,), daemon=True)
            closer.start()
            closer.join(CLOSE_SECONDS)


def _reachable(address: str, timeout: float = 1.0) -> bool:
    """Whether ``HOST:PORT`` accepts a TCP connection."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout).close()
        return True
    except (OSError, ValueError):
        return False


def _close_quietly(backend: TierBackend) -> None:
    try:
        backend.close()
    except Exception:
        log.exception("tier close failed")


def start_tier(cfg: TierConfig | None, service: Any) -> MooncakeTier | None:
    """The server's Mooncake tier, connecting in the background; None when
    ``server.tier`` is off or no model takes part. Call on the service's event loop."""
    if cfg is None:
        return None
    tier = MooncakeTier(cfg, service, asyncio.get_running_loop())
    if not tier.models:
        tier.close()
        log.warning(
            "server.tier is on but no model uses it (radix models only; "
            "models[].tier: false opts out)"
        )
        return None
    tier.start()
    return tier
