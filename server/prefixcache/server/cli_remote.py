"""The commands that ask a running server: `stats`, `explain` and `health`, with where
they connect (--target, $PREFIXCACHE_TARGET, $PREFIXCACHE_LISTEN) and how (TLS CA,
$PREFIXCACHE_TOKEN). Client-side only: no torch, no cache; grpc is imported when a
command runs, so `--help` stays fast."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from . import cli_explain


def add_commands(commands: Any) -> None:
    _add_stats(commands)
    cli_explain.add_explain(commands, add_target_options, _explain)
    _add_health(commands)


_DEFAULT_TARGET = "unix:/tmp/prefixcache.sock"


def add_target_options(parser: argparse.ArgumentParser, timeout: float) -> None:
    """Where a client command connects, the same for `stats` and `health`."""
    parser.add_argument(
        "--target",
        metavar="ADDR",
        help="server address, unix:PATH or HOST:PORT (default: "
        f"$PREFIXCACHE_TARGET, else $PREFIXCACHE_LISTEN, else {_DEFAULT_TARGET})",
    )
    parser.add_argument("--tls-ca", metavar="FILE", help="CA that signed the server certificate")
    parser.add_argument(
        "--timeout", type=float, default=timeout, help="seconds (default: %(default)s)"
    )


def _target(args: argparse.Namespace) -> str:
    # PREFIXCACHE_TARGET is where clients connect; PREFIXCACHE_LISTEN (set in the server's
    # own container, and by the image) is where the server listens.
    return (
        args.target
        or os.environ.get("PREFIXCACHE_TARGET")
        or os.environ.get("PREFIXCACHE_LISTEN")
        or _DEFAULT_TARGET
    )


def _connect(args: argparse.Namespace, target: str) -> tuple[Any, Any]:
    """A channel to ``target`` and the call metadata (PREFIXCACHE_TOKEN), or exit 1."""
    import grpc

    if args.tls_ca:
        try:
            with open(args.tls_ca, "rb") as f:
                ca = f.read()
        except OSError as exc:
            raise SystemExit(f"prefixcache: --tls-ca {args.tls_ca}: {exc.strerror or exc}") from exc
        channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(ca))
    else:
        channel = grpc.insecure_channel(target)
    token = os.environ.get("PREFIXCACHE_TOKEN")
    return channel, [("authorization", f"Bearer {token}")] if token else None


def _add_stats(commands: Any) -> None:
    stats = commands.add_parser(
        "stats",
        help="print the counters of a running server",
        description="Ask a running server for its per-model cache and pool counters.",
    )
    add_target_options(stats, timeout=5.0)
    stats.add_argument("--model", default="", help="only this model")
    stats.add_argument("--json", action="store_true", help="print JSON")
    stats.add_argument(
        "--sessions",
        type=int,
        nargs="?",
        const=10,
        default=0,
        metavar="N",
        help="also list the N sessions holding the most slots and locked "
        "tokens (default N: 10; the server lists at most 1000)",
    )
    stats.set_defaults(run=_stats)


def _stats(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from prefixcache.v1 import prefix_cache_pb2 as pb
    from prefixcache.v1 import prefix_cache_pb2_grpc as pb_grpc

    target = _target(args)
    channel, metadata = _connect(args, target)
    with channel:
        try:
            reply = pb_grpc.PrefixCacheStub(channel).Stats(
                pb.StatsRequest(model=args.model, top_sessions=max(args.sessions, 0)),
                timeout=args.timeout,
                metadata=metadata,
            )
        except grpc.RpcError as exc:
            print(f"prefixcache: {target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(MessageToDict(reply, always_print_fields_with_no_presence=True), indent=2))
        return 0
    print(f"sessions: {reply.sessions}")
    header = ("model", "hit ratio", "cached", "protected", "free slots", "pool", "locks")
    rows = [header]
    for m in reply.models:
        ratio = m.hit_tokens_total / m.match_tokens_total if m.match_tokens_total else 0.0
        rows.append(
            (
                m.model,
                f"{ratio:.3f}",
                str(m.evictable_tokens + m.protected_tokens),
                str(m.protected_tokens),
                str(m.free_slots),
                str(m.pool_size),
                str(m.locks),
            )
        )
    print_table(rows)
    cli_explain.print_outcomes(reply.models)
    if args.sessions:
        print(f"\ntop {len(reply.top_sessions)} sessions by holdings:")
        rows = [
            (
                "session",
                "client",
                "slots",
                "state slots",
                "locks",
                "locked tokens",
                "streams",
                "kind",
                "lease left",
            )
        ]
        rows += [
            (
                h.session,
                h.client_name or "-",
                str(h.slots),
                str(h.state_slots),
                str(h.locks),
                str(h.locked_tokens),
                str(h.streams),
                "stream" if h.stream else "leased",
                f"{h.lease_left_seconds:.1f}s",
            )
            for h in reply.top_sessions
        ]
        print_table(rows)
    return 0


def _explain(args: argparse.Namespace) -> int:
    import grpc

    from prefixcache.v1 import prefix_cache_pb2_grpc as pb_grpc

    req = cli_explain.request(args)
    target = _target(args)
    channel, metadata = _connect(args, target)
    with channel:
        try:
            reply = pb_grpc.PrefixCacheStub(channel).Explain(
                req, timeout=args.timeout, metadata=metadata
            )
        except grpc.RpcError as exc:
            print(f"prefixcache: {target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    cli_explain.print_explained(args, reply)
    return 0


def print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _add_health(commands: Any) -> None:
    health = commands.add_parser(
        "health",
        help="check that a running server is serving (for probes)",
        description="Ask a running server's grpc.health.v1 service for the status of "
        "SERVICE: '' (the default) is the server as a whole, prefixcache.v1.PrefixCache "
        "turns NOT_SERVING while it drains, prefixcache.v1.PrefixCache/MODEL is one model. "
        "Exits 0 when SERVING; otherwise 1, with one line on stderr saying why.",
    )
    add_target_options(health, timeout=3.0)
    health.add_argument(
        "--service",
        default="",
        metavar="NAME",
        help="health service name (default: '', the whole server)",
    )
    health.set_defaults(run=_health)


def _health(args: argparse.Namespace) -> int:
    import grpc

    try:
        from grpc_health.v1 import health_pb2, health_pb2_grpc
    except ImportError as exc:
        raise SystemExit(
            f"prefixcache health needs grpcio-health-checking "
            f"(pip install 'prefixcache[server]'): {exc}"
        ) from exc

    target = _target(args)
    what = f"{target} service {args.service!r}" if args.service else target
    channel, metadata = _connect(args, target)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service),
                timeout=args.timeout,
                metadata=metadata,
            )
        except grpc.RpcError as exc:
            code = exc.code()
            # grpc.health.v1 answers an unknown service NOT_FOUND with no details.
            why = exc.details() or (
                "no such service" if code == grpc.StatusCode.NOT_FOUND else "no details"
            )
            print(f"prefixcache: {what}: {code.name}: {why}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"prefixcache: {what}: {status}", file=sys.stderr)
        return 1
    print(f"{what}: {status}")
    return 0
