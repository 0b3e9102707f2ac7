"""PrefixCacheServer: the gRPC server, health, reflection, metrics and shutdown.

One ``grpc.aio`` server runs every RPC on a single event loop (see servicer.py for
why that is our concurrency model). ``serve()`` is what ``prefixcache serve`` runs:
it starts the server, and on SIGTERM or SIGINT drains in-flight calls within the
grace period and returns 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import stat

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from prefixcache.v1 import prefix_cache_pb2 as pb

from .auth import TokenAuthInterceptor
from .config import Config, ConfigError
from .metrics import Metrics
from .registration import add_to_server
from .service import CacheService
from .servicer import PrefixCacheServicer

log = logging.getLogger("prefixcache.server")

_DISPATCH_WINDOW = 0.2  # seconds

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
        self.service = CacheService(config.models, cfg.session_ttl, cfg.session_ttl_min,
                                    cfg.session_ttl_max, shm_dir=cfg.shm_dir or None,
                                    shm_mode=cfg.socket_mode)
        self.metrics = Metrics(self.service)
        self.servicer = PrefixCacheServicer(self.service, self.metrics, self.check_integrity,
                                            cfg.max_message_bytes)
        self.address = cfg.listen
        self.metrics_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._health = health_aio.HealthServicer()
        self._reaper: asyncio.Task[None] | None = None
        self._socket_path: str | None = None

    async def start(self) -> None:
        cfg = self.config.server
        interceptors = []
        if cfg.token or cfg.admin_token:
            interceptors.append(TokenAuthInterceptor(cfg.token, cfg.admin_token))
        limit = cfg.max_message_bytes
        server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            # Two servers on one port would split the traffic silently.
            ("grpc.so_reuseport", 0),
        ])
        add_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), server)
        try:
            self._bind(server)
            await server.start()
        except BaseException:
            self.service.close()  # no shared-memory files left behind by a failed start
            raise
        self._server = server
        for name in ("", SERVICE_NAME, *map(model_health_name, self.service.engines)):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if cfg.metrics_port >= 0:
            self.metrics_port = self.metrics.serve(cfg.metrics_host, cfg.metrics_port)
        self._reaper = asyncio.create_task(self._expire_leases())
        if self.check_integrity:
            log.warning("invariant mode is on: every call that changes a cache runs the "
                        "integrity check (slower; meant for staging)")
        log.info("serving", extra={
            "listen": self.address, "metrics_port": self.metrics_port,
            "models": ",".join(self.service.engines), "tls": bool(cfg.tls_cert),
            "auth": bool(cfg.token or cfg.admin_token), "epoch": self.service.epoch})

    def _bind(self, server: grpc.aio.Server) -> None:
        cfg = self.config.server
        if cfg.listen.startswith("unix:"):
            path = cfg.listen.removeprefix("unix:").removeprefix("//")
            _clear_stale_socket(path)
            old = os.umask(0o777 & ~cfg.socket_mode)  # no window with a looser mode
            try:
                server.add_insecure_port(f"unix:{path}")
            finally:
                os.umask(old)
            os.chmod(path, cfg.socket_mode)
            self._socket_path = path
            self.address = f"unix:{path}"
            return
        if cfg.tls_cert:
            creds = grpc.ssl_server_credentials(
                [(_read(cfg.tls_key), _read(cfg.tls_cert))],
                root_certificates=_read(cfg.tls_client_ca) if cfg.tls_client_ca else None,
                require_client_auth=bool(cfg.tls_client_ca))
            port = server.add_secure_port(cfg.listen, creds)
        elif cfg.insecure:
            log.warning("listening on TCP without TLS: tokens and data travel in clear text",
                        extra={"listen": cfg.listen})
            port = server.add_insecure_port(cfg.listen)
        else:
            raise ConfigError("server.listen: TCP without TLS needs tls_cert and tls_key, "
                              "or insecure: true (--insecure) to accept clear text")
        host = cfg.listen.rpartition(":")[0]
        self.address = f"{host}:{port}"

    async def _expire_leases(self) -> None:
        # Poll at least every half of the shortest lease, so a session opened while we
        # sleep still lapses on time (give or take that half).
        cap = min(1.0, max(0.05, self.config.server.session_ttl_min / 2))
        while True:
            await asyncio.sleep(min(max(self.service.sessions.next_expiry(), 0.05), cap))
            self.service.expire_sessions()

    async def stop(self, grace: float | None = None) -> None:
        """Refuse new calls, let in-flight ones finish within ``grace``, then close."""
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
        await self._server.stop(grace)
        self._server = None
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        self.metrics.close()
        self.service.close()
        if self._socket_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._socket_path)
        log.info("stopped")

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()


def _read(path: str | None) -> bytes:
    assert path is not None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or exc}") from exc


def _clear_stale_socket(path: str) -> None:
    """Remove a socket file left by a dead server; refuse to steal a live one."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ConfigError(f"server.listen: {path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)
            return
    raise ConfigError(f"server.listen: another server is listening on {path}")


async def _serve(config: Config) -> int:
    server = PrefixCacheServer(config)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(server.wait())
    await asyncio.wait([asyncio.create_task(stop.wait()), waiter],
                       return_when=asyncio.FIRST_COMPLETED)
    await server.stop()
    waiter.cancel()
    return 0


def serve(config: Config) -> int:
    """Run the service until SIGTERM or SIGINT; returns the exit code."""
    return asyncio.run(_serve(config))
