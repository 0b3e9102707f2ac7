"""PrefixCacheServer: the gRPC server, health, reflection, metrics and shutdown.

One ``grpc.aio`` server runs every RPC on a single event loop (see rpc/servicer.py for
why that is our concurrency model). ``stop`` drains in-flight calls within the grace
period, then closes the pools and removes the files; ``hurry`` cuts a drain short.
run.py runs it as a process (``prefixcache serve``), listen.py says where it listens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from prefixcache.cache.index.change_log import DEFAULT_CAPACITY
from prefixcache.v1 import prefix_cache_pb2 as pb

from .access.auth import TokenAuthInterceptor
from .access.limits import limits_of
from .access.loopback_peers import listening
from .access.tenants import Callers
from .access.unix_peers import UnixPeerRelay
from .config import Config, ConfigError
from .events.publisher import KvEventPublishers, start_kv_events
from .listen import clear_stale_socket, keepalive_options, read_pem
from .memory.checkpoints import Checkpoints
from .memory.shared_pool import (
    AdoptError,
    kept_elsewhere,
    service_tag,
    shm_file_mode,
    sweep,
)
from .memory.sizing import check_fits, is_out_of_memory
from .memory.warm_restart import Takeover, WarmRestart, WarmRestartCollector
from .metrics import Metrics
from .reaper import reap_leases
from .rpc.registration import add_to_server
from .rpc.servicer import PrefixCacheServicer
from .service import CacheService

log = logging.getLogger("prefixcache.server")

_DISPATCH_WINDOW = 0.2  # seconds
# grpc's per-call task (cygrpc's _schedule_rpc_coro), and how long a stop waits for those
# its cancel left running (they end within a few loop turns).
_GRPC_CALL_TASK = "_schedule_rpc_coro"
_SETTLE_LIMIT = 2.0  # seconds

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PrefixCache"].full_name


def model_health_name(model: str) -> str:
    """The grpc.health.v1 service name that reports one model's status."""
    return f"{SERVICE_NAME}/{model}"


class PrefixCacheServer:
    """A configured service, bound and serving once ``start`` returns.

    Attributes:
        service: The models and sessions (for in-process inspection, e.g. tests).
        address: Where clients connect (``unix:PATH`` or ``HOST:PORT`` with the real
            port when 0 was configured).
        metrics_port: The bound metrics port, or None when metrics are off.
    """

    def __init__(self, config: Config, *, check_integrity: bool = False) -> None:
        self.config = config
        cfg = config.server
        # Invariant mode: from the config (server.check_integrity), or forced by tests.
        self.check_integrity = check_integrity or cfg.check_integrity
        # Warm restart (warm_restart.py): the snapshot is read, and the files it names
        # claimed, before the sweep, which would remove them as a dead service's.
        self.warm = WarmRestart(config) if cfg.warm_restart else None
        takeover = self.warm.prepare() if self.warm is not None else None
        try:
            self.service = self._build(takeover)
        except BaseException:
            if takeover is not None:
                takeover.release()
            raise
        if takeover is not None and self.warm is not None and self.warm.outcome is None:
            self.warm.restore(self.service, takeover)
        self.metrics = Metrics(self.service)
        self.metrics.registry.register(WarmRestartCollector(self.warm))
        if self.warm is not None:
            for (model, reason), pages in self.warm.integrity.items():
                self.service.integrity.count("snapshot", reason, pages, model=model)
        self.servicer = PrefixCacheServicer(
            self.service,
            self.metrics,
            self.check_integrity,
            cfg.max_message_bytes,
            callers=Callers(cfg.admin_token, cfg.tenants),
        )
        self.address = cfg.listen
        self.metrics_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._health = health_aio.HealthServicer()
        self._reaper: asyncio.Task[None] | None = None
        self._socket_path: str | None = None
        self._port = 0
        # A unix socket's connections, relayed to gRPC with their peers' credentials.
        self._relay: UnixPeerRelay | None = None
        # A second stop signal: cut the drain short (hurry).
        self._cut = False
        self._hurry: asyncio.Future[None] | None = None
        # Checkpoints of the trees while serving (warm_restart), once started.
        self.checkpoints: Checkpoints | None = None
        # Reserving the shared pools' memory after the start (shared_pool.reserve).
        self._reserving: asyncio.Task[None] | None = None
        # KV events out (server.kv_events): one ZMQ publisher per tree model, or None.
        self.kv_events: KvEventPublishers | None = None
        # The tiers below the pools (server.disk, server.tier: tier/chain.py), or None.
        self.tier: Any = None

    def _build(self, takeover: Takeover | None) -> CacheService:
        cfg = self.config.server
        # Dead services' pool files go first: the check counts only what this start adds
        # (a killed server's files would otherwise refuse its own restart).
        pinned = sweep(cfg.shm_dir, service_tag(cfg.listen)) if cfg.shm_dir else 0
        # Every pool added up before any is allocated: a pool larger than the host would
        # otherwise fill /dev/shm, or wake the OOM killer, instead of failing here.
        try:
            check_fits(
                self.config.models,
                cfg.shm_dir or None,
                takeover.budget() if takeover is not None else None,
            )
        except ConfigError as exc:
            kept, until = (
                kept_elsewhere(cfg.shm_dir, service_tag(cfg.listen)) if cfg.shm_dir else (0, 0.0)
            )
            if not pinned and not kept:
                raise
            why = str(exc)
            if pinned:
                why += (
                    f"; {pinned / 2**20:.1f} MiB of what is taken is a dead server's "
                    "pool that a process (a worker?) still maps: it is freed when that "
                    "process unmaps it or exits"
                )
            if kept:
                why += (
                    f"; {kept / 2**20:.1f} MiB of it is the pool of a stopped warm-"
                    f"restart service, kept for its next start for "
                    f"{max(0.0, until - time.time()):.0f} s more (server.warm_keep): "
                    "start that service, or remove its files from shm_dir"
                )
            raise ConfigError(why) from exc
        try:
            return CacheService(
                self.config.models,
                cfg.session_ttl,
                cfg.session_ttl_min,
                cfg.session_ttl_max,
                shm_dir=cfg.shm_dir or None,
                shm_mode=shm_file_mode(cfg),
                limits=limits_of(cfg),
                change_logs=(cfg.kv_events.enable_kv_cache_events or cfg.change_log_capacity > 0),
                change_log_capacity=cfg.change_log_capacity or DEFAULT_CAPACITY,
                adopt=takeover.files if takeover is not None else None,
                shm_service=service_tag(cfg.listen),
            )
        except AdoptError as exc:  # a file changed between the check and the rename
            if takeover is None or self.warm is None:
                raise
            takeover.release()
            self.warm.cold("stale", str(exc))
            return self._build(None)
        except (MemoryError, RuntimeError) as exc:
            if not is_out_of_memory(exc):  # the check's backstop: memory taken meanwhile
                raise
            raise ConfigError(
                f"models: the pools could not be allocated ("
                f"{str(exc).splitlines()[0]}); make them smaller"
            ) from exc

    async def start(self) -> None:
        cfg = self.config.server
        interceptors = []
        if cfg.token or cfg.admin_token or cfg.tenants:
            interceptors.append(
                TokenAuthInterceptor(cfg.token, cfg.admin_token, self.servicer.callers.tokens)
            )
        limit = cfg.max_message_bytes
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                # Two servers on one port would split the traffic silently.
                ("grpc.so_reuseport", 0),
                *keepalive_options(cfg),
            ],
        )
        add_to_server(
            self.servicer,
            server,
            self.servicer.limits,
            [e.config for e in self.servicer.service.engines.values()],
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        try:
            try:
                self._bind(server)
            except RuntimeError as exc:  # grpc's "Failed to bind" (it logs the reason)
                raise ConfigError(
                    f"server.listen: cannot listen on {cfg.listen} (in use, "
                    "or not an address of this host)"
                ) from exc
            # Before the server starts, so that a port in use fails the start cleanly.
            if cfg.metrics_port >= 0:
                self.metrics_port = self._serve_metrics()
            self.kv_events = start_kv_events(
                cfg.kv_events,
                self.service.engines,
                cfg.tenants,
                cfg.tier.secret_file if cfg.tier else None,
            )
            if self.kv_events is not None:
                self.metrics.watch_kv_events(self.kv_events.publishers)
            self._start_tier()
            await server.start()
            if self._relay is not None:
                self._relay.start()
        except BaseException:
            await self._undo_start(server)  # no socket or shared-memory files left behind
            raise
        self._server = server
        for name in ("", SERVICE_NAME, *map(model_health_name, self.service.engines)):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._reaper = asyncio.create_task(self._expire_leases())
        if self.service.shared.unreserved_bytes:
            self._reserving = asyncio.create_task(self._reserve_pools())
        if self.warm is not None and cfg.warm_checkpoint_interval > 0:
            self.checkpoints = Checkpoints(self.warm, self.service, cfg.warm_checkpoint_interval)
            # After a restore at once: the restored tree's files have this owner's names.
            self.checkpoints.start(
                0.0 if self.warm.outcome in ("restored", "restored_from_checkpoint") else None
            )
        if self.check_integrity:
            log.warning(
                "invariant mode is on: every call that changes a cache runs the "
                "integrity check (slower; meant for staging)"
            )
        log.info(
            "serving",
            extra={
                "listen": self.address,
                "metrics_port": self.metrics_port,
                "models": ",".join(self.service.engines),
                "tls": bool(cfg.tls_cert),
                "auth": bool(cfg.token or cfg.admin_token),
                "epoch": self.service.epoch,
            },
        )

    async def _reserve_pools(self) -> None:
        """Reserve the shared pools' memory off the start's path (shared_pool.reserve);
        a directory that filled up meanwhile turns health NOT_SERVING, with the reason
        logged: the pages not reserved could fault (SIGBUS) when first written."""
        shared = self.service.shared
        nbytes, started = shared.unreserved_bytes, time.monotonic()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[str | None] = loop.create_future()

        def reserve() -> None:
            # At the lowest priority: seconds of kernel time for a large pool, which
            # must not slow the calls the service is answering meanwhile.
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            why = shared.reserve()
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                loop.call_soon_threadsafe(done.set_result, why)

        threading.Thread(target=reserve, name="pool-reserve", daemon=True).start()
        why = await done
        if why is None:
            log.info(
                "pool memory reserved",
                extra={"bytes": nbytes, "seconds": round(time.monotonic() - started, 3)},
            )
            return
        log.error(
            "the pools' shared memory could not be reserved; NOT_SERVING", extra={"reason": why}
        )
        for name in ("", SERVICE_NAME, *map(model_health_name, self.service.engines)):
            await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    def _serve_metrics(self) -> int:
        cfg = self.config.server
        try:
            return self.metrics.serve(cfg.metrics_host, cfg.metrics_port, cfg.metrics_token)
        except OSError as exc:  # in use, or a host that is not ours
            raise ConfigError(
                f"server.metrics_port: cannot listen on {cfg.metrics_host}:"
                f"{cfg.metrics_port}: {exc.strerror or exc}"
            ) from exc

    def _start_tier(self) -> None:
        """The tiers below the pools: the disk tier (server.disk), opened now, and the
        shared cross-node one (server.tier), connecting in the background."""
        from .tier import start_tiers
        from .tier.metrics import TierCollector

        self.tier = start_tiers(self.config.server, self.service)
        if self.tier is not None:
            self.servicer.tier = self.tier
            self.metrics.registry.register(TierCollector(self.tier))

    def _close_tier(self) -> None:
        if self.tier is not None:
            self.servicer.tier = None
            self.tier.close()
            self.tier = None

    def _close_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None

    async def _undo_start(self, server: grpc.aio.Server) -> None:
        with contextlib.suppress(Exception):
            await server.stop(None)
        self._close_kv_events()
        self._close_tier()
        self.metrics.close()
        self.service.close()
        self._close_socket()

    def _close_socket(self) -> None:
        """Remove the unix socket (and end its relay), or forget the TCP port."""
        if self._port:
            listening(self._port, on=False)
            self._port = 0
        if self._relay is not None:
            self._relay.close()
            self._relay = None
        if self._socket_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._socket_path)
            self._socket_path = None

    def _bind(self, server: grpc.aio.Server) -> None:
        cfg = self.config.server
        if cfg.listen.startswith("unix:"):
            path = cfg.listen.removeprefix("unix:").removeprefix("//")
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder):  # grpc would only say "Failed to bind"
                raise ConfigError(
                    f"server.listen: the socket's directory {folder} does "
                    "not exist; create it (a volume shared with the "
                    "workers) or choose another path"
                )
            clear_stale_socket(path)
            self.address = f"unix:{path}"
            if cfg.peer_credentials:
                try:
                    self._relay = UnixPeerRelay(path, cfg.socket_mode)
                except OSError as exc:
                    raise ConfigError(
                        f"server.listen: cannot listen on {path}: {exc.strerror or exc}"
                    ) from exc
                server.add_insecure_port(f"unix:{self._relay.inner}")
                return
            old = os.umask(0o777 & ~cfg.socket_mode)  # no window with a looser mode
            try:
                server.add_insecure_port(f"unix:{path}")
            finally:
                os.umask(old)
            os.chmod(path, cfg.socket_mode)
            self._socket_path = path
            return
        if cfg.tls_cert:
            creds = grpc.ssl_server_credentials(
                [(read_pem(cfg.tls_key), read_pem(cfg.tls_cert))],
                root_certificates=read_pem(cfg.tls_client_ca) if cfg.tls_client_ca else None,
                require_client_auth=bool(cfg.tls_client_ca),
            )
            port = server.add_secure_port(cfg.listen, creds)
        elif cfg.insecure:
            log.warning(
                "listening on TCP without TLS: tokens and data travel in clear text",
                extra={"listen": cfg.listen},
            )
            port = server.add_insecure_port(cfg.listen)
        else:
            raise ConfigError(
                "server.listen: TCP without TLS needs tls_cert and tls_key, "
                "or insecure: true (--insecure) to accept clear text"
            )
        host = cfg.listen.rpartition(":")[0]
        self.address = f"{host}:{port}"
        self._port = port
        listening(port)  # loopback callers are told apart by their sockets' owners

    async def _expire_leases(self) -> None:
        # Poll at least every half of the shortest lease, so a session opened while we
        # sleep still lapses on time (give or take that half).
        cfg = self.config.server
        await reap_leases(
            self.service, min(1.0, max(0.05, min(cfg.session_ttl_min, cfg.stream_ttl) / 2))
        )

    def hurry(self) -> None:
        """Cut a drain in progress short: the calls still in flight are cancelled now,
        and ``stop`` goes on at once to close the pools and remove the files."""
        if self._cut:
            return
        self._cut = True
        if self._server is not None and self.service.draining:
            # stop(None) cancels every call; the graceful stop() awaiting the same
            # server returns as soon as the server is down.
            self._hurry = asyncio.ensure_future(self._server.stop(None))

    async def stop(self, grace: float | None = None) -> None:
        """Refuse new calls, let in-flight ones finish within ``grace``, then close
        (at once after ``hurry``)."""
        if self._server is None:
            return
        grace = self.config.server.grace_period if grace is None else grace
        self.service.draining = True
        log.info("draining", extra={"grace_seconds": grace})
        await self._health.enter_graceful_shutdown()
        # Calls already received but not yet dispatched would be cancelled by the
        # server's stop; a moment on the loop lets them reach a handler, which answers
        # UNAVAILABLE (retryable, fail-open) instead of CANCELLED.
        await asyncio.sleep(min(_DISPATCH_WINDOW, grace))
        await self._server.stop(None if self._cut else grace)
        if self._hurry is not None:
            await self._hurry
            self._hurry = None
        await _settle_calls()
        self._server = None
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        self._close_kv_events()  # after the last call: its changes go out first
        self._close_tier()
        self.metrics.close()
        if self.checkpoints is not None:  # a checkpoint in flight lands before the snapshot
            await self.checkpoints.close()
            self.checkpoints = None
        if self._reserving is not None:
            self.service.shared.stop_reserving()
            await self._reserving
            self._reserving = None
        # Warm restart: every session ends, the trees are written down and the pool
        # files stay for the next start (none when it is not safe; logged).
        keep = self.warm.save(self.service) if self.warm is not None else frozenset()
        self.service.close(keep)
        self._close_socket()
        log.info("stopped")

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()


async def _settle_calls(limit: float = _SETTLE_LIMIT) -> None:
    """Let the calls grpc's stop cancelled finish on the loop.

    grpc's stop returns once its core has cancelled every call, before each call's own
    task has run its cancellation. Were the loop to end first, asyncio would cancel
    those tasks a second time, inside grpc's bookkeeping, which prints a CancelledError
    traceback for each (a clean shutdown that logs like a crash)."""
    calls = [
        t
        for t in asyncio.all_tasks()
        if not t.done() and getattr(t.get_coro(), "__name__", "") == _GRPC_CALL_TASK
    ]
    if calls:
        await asyncio.wait(calls, timeout=limit)
