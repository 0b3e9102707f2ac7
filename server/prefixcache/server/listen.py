"""Where the server listens: gRPC keepalive options, TLS material, and a unix socket
file left by a dead server (removed) or held by a live one (refused)."""

from __future__ import annotations

import os
import socket
import stat

from .config import ConfigError, ServerConfig


def keepalive_options(cfg: ServerConfig) -> list[tuple[str, int]]:
    """gRPC keepalive: the server pings every connection that has been silent for
    keepalive_time and closes it when a ping goes unanswered for keepalive_timeout, so
    a frozen client, or one behind a half-open connection, loses its streams (and their
    sessions' holdings) instead of pinning them for grpc's default two hours."""
    return [
        ("grpc.keepalive_time_ms", int(cfg.keepalive_time * 1000)),
        ("grpc.keepalive_timeout_ms", int(cfg.keepalive_timeout * 1000)),
        # Ping idle connections too, and keep pinging a stream that sends no data.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.ping_timeout_ms", int(cfg.keepalive_timeout * 1000)),
        # Clients' own pings: allowed this often; more often earns a GOAWAY.
        (
            "grpc.http2.min_ping_interval_without_data_ms",
            int(cfg.keepalive_min_client_interval * 1000),
        ),
    ]


def read_pem(path: str | None) -> bytes:
    if path is None:  # the config check requires both tls files together
        raise ConfigError("server.tls_cert and server.tls_key must be set together")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or exc}") from exc


def clear_stale_socket(path: str) -> None:
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
