"""The `prefixcache` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from . import cli_remote

# A system prompt that both demo requests start with, then each one's own tail.
_SHARED_PREFIX = [101, 2023, 2003, 1037, 2291, 25732, 1012, 102]
_DEMO_PROMPTS = {
    "request A": [*_SHARED_PREFIX, 7592, 2088, 999],
    "request B": [*_SHARED_PREFIX, 2129, 2024, 2017, 1029],
}
_DEMO_QUERY = [*_SHARED_PREFIX, 7592, 2088, 1029, 1029]


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv) and run the chosen subcommand."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.run(args)


def build_parser() -> argparse.ArgumentParser:
    """The parser for every subcommand; importing it loads neither torch nor the cache."""
    parser = argparse.ArgumentParser(
        prog="prefixcache",
        description="A prefix cache for LLM inference, shared by workers over gRPC.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    _add_serve(commands)
    cli_remote.add_commands(commands)

    demo = commands.add_parser(
        "demo",
        help="run a short in-process demo of the cache library",
        description="Insert two prompts that share a prefix, then match a third one.",
    )
    demo.add_argument(
        "--pool-size", type=int, default=64, help="token slots in the demo KV pool (default: 64)"
    )
    demo.set_defaults(run=_demo)
    return parser


def _add_serve(commands: Any) -> None:
    serve = commands.add_parser(
        "serve",
        help="run the prefix-cache server",
        description="Run the prefix-cache server. Without --config it hosts one small CPU "
        "model named 'default'. Settings come from the command line, then PREFIXCACHE_* "
        "environment variables (e.g. PREFIXCACHE_LISTEN), then the config file's "
        "'server:' section.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve.add_argument(
        "--config", metavar="FILE", help="YAML file with 'server:' settings and a 'models:' list"
    )
    net = serve.add_argument_group("listening")
    net.add_argument(
        "--listen",
        metavar="ADDR",
        help="unix:PATH (default unix:/tmp/prefixcache.sock) or HOST:PORT",
    )
    net.add_argument(
        "--metrics-port",
        type=int,
        metavar="N",
        help="Prometheus /metrics port (default 9470; 0 = any free, -1 = off)",
    )
    net.add_argument(
        "--metrics-host",
        metavar="HOST",
        help="address for /metrics (default 127.0.0.1; 0.0.0.0 = every one)",
    )
    sec = serve.add_argument_group("security")
    sec.add_argument("--tls-cert", metavar="FILE", help="server certificate (PEM) for TCP")
    sec.add_argument("--tls-key", metavar="FILE", help="server private key (PEM)")
    sec.add_argument(
        "--tls-client-ca",
        metavar="FILE",
        help="CA bundle; clients must present a certificate it signed (mTLS)",
    )
    sec.add_argument(
        "--token-file",
        metavar="FILE",
        help="file holding the bearer token every call must carry (or set PREFIXCACHE_TOKEN)",
    )
    sec.add_argument(
        "--metrics-token-file",
        metavar="FILE",
        help="file holding a bearer token every /metrics scrape must carry "
        "(or set PREFIXCACHE_METRICS_TOKEN)",
    )
    sec.add_argument(
        "--admin-token-file",
        metavar="FILE",
        help="file holding the token admin calls (Reset) must carry "
        "(or set PREFIXCACHE_ADMIN_TOKEN)",
    )
    sec.add_argument(
        "--insecure", action="store_const", const=True, help="allow TCP without TLS (clear text)"
    )
    ops = serve.add_argument_group("operation")
    ops.add_argument("--log-format", choices=("text", "json"), help="log line format")
    ops.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    ops.add_argument(
        "--shm-dir",
        metavar="DIR",
        help="where CPU pools live as shared memory for workers to attach "
        "(default /dev/shm; 'off' keeps them private)",
    )
    ops.add_argument(
        "--grace-period",
        type=float,
        metavar="SECONDS",
        help="how long SIGTERM (or SIGINT, SIGHUP, ...) waits for in-flight calls (default 10)",
    )
    ops.add_argument(
        "--check-integrity",
        action="store_const",
        const=True,
        help="invariant mode, for staging: check the caches' integrity after "
        "every call that changes them (slower; a failure answers INTERNAL)",
    )
    _add_every_setting(serve)
    serve.add_argument(
        "--check-config",
        action="store_true",
        help="check the configuration as serve would read it, allocate and "
        "bind nothing, and exit: 0 valid and fits this host, 1 valid but "
        "not for this host (a file it names, a device, memory), 2 invalid",
    )
    events = serve.add_argument_group("KV events (server.kv_events)")
    events.add_argument(
        "--kv-events-config",
        dest="kv_events",
        metavar="JSON",
        help="KV-event publisher settings as vLLM's flag takes them, e.g. "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\''
        "; also hash_format (vllm|sglang) and encoding (map|array). "
        "Or PREFIXCACHE_KV_EVENTS_<KEY>",
    )
    serve.set_defaults(run=_serve)


# Settings with no flag of their own: structured ones (the config file, or their own
# environment variables) and secrets, which belong in files (their *_file flags).
_NO_FLAG = frozenset(
    {"kv_events", "tenants", "tier", "retention", "disk", "token", "admin_token", "metrics_token"}
)


def _add_every_setting(serve: argparse.ArgumentParser) -> None:
    """A ``--setting-name`` flag for every scalar ``server:`` setting that has none
    above, so that every key works on the command line (values as the environment
    gives them: coerced and checked by the config loader, which names the key)."""
    from dataclasses import fields

    from .config.types import ServerConfig

    taken = {a.dest for a in serve._actions}
    group = serve.add_argument_group(
        "other server settings",
        "every other key of the config file's 'server:' section; "
        "see docs/configuration.md, which lists every key",
    )
    for f in fields(ServerConfig):
        if f.name in taken or f.name in _NO_FLAG:
            continue
        group.add_argument(
            f"--{f.name.replace('_', '-')}", dest=f.name, metavar="VALUE", help=f"server.{f.name}"
        )


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The server settings given on the command line (None: not given)."""
    from dataclasses import fields

    from .config.types import ServerConfig

    names = [f.name for f in fields(ServerConfig) if f.name not in _NO_FLAG]
    return {name: getattr(args, name) for name in (*names, "kv_events")}


def _check_config(args: argparse.Namespace) -> int:
    """``serve --check-config``: see its help."""
    from .config import ConfigError, load_config
    from .config.values import files_read_later
    from .memory.sizing import check_fits

    try:
        with files_read_later() as unread:
            config = load_config(args.config, overrides=_overrides(args))
    except ConfigError as exc:
        print(f"prefixcache: config error: {exc}", file=sys.stderr)
        return 2
    notes = list(unread)
    try:
        check_fits(config.models, config.server.shm_dir or None)
    except ConfigError as exc:
        notes.append(str(exc))
    for model in config.models:
        print(
            f"model {model.name}: {model.kind}, page_size {model.page_size}, pool "
            f"{model.pool.size} slots on {model.pool.device}"
        )
    for note in notes:
        print(f"not for this host: {note}")
    print("config OK" + (" (but not for this host)" if notes else ""))
    return 1 if notes else 0


def _serve(args: argparse.Namespace) -> int:
    from .signals import SignalLatch

    # Before the slow imports: a stop signal from here on ends start-up cleanly, exit 0.
    latch = SignalLatch()
    latch.install()
    try:
        import torch

        from .config import ConfigError, load_config, unknown_env_warning
        from .logs import setup_logging
        from .run import serve
    except ImportError as exc:
        raise SystemExit(
            f"prefixcache serve needs the server extra (pip install 'prefixcache[server]'): {exc}"
        ) from exc
    if args.check_config:
        return _check_config(args)
    try:
        config = load_config(args.config, overrides=_overrides(args))
    except ConfigError as exc:
        print(f"prefixcache: config error: {exc}", file=sys.stderr)
        return 2
    # Intra-op threads only fight each other on a small host; the cache's tensor ops
    # are tiny and one thread is several times faster here.
    torch.set_num_threads(1)
    setup_logging(config.server.log_format, config.server.log_level, config.server.log_queue_lines)
    warning = unknown_env_warning(os.environ)
    if warning:
        logging.getLogger("prefixcache.server").warning(warning)
    try:
        return serve(config, latch)
    except ConfigError as exc:  # found while binding: a stale socket, an unreadable cert
        # Log lines queued before the failure (a TLS warning) go out first, so that the
        # error is the last line an operator sees.
        for handler in logging.getLogger().handlers:
            handler.flush()
        print(f"prefixcache: config error: {exc}", file=sys.stderr)
        return 2


def _demo(args: argparse.Namespace) -> int:
    # Imported here so that `--help` works on a client-only install.
    try:
        import torch

        from prefixcache.cache import RadixCache, RadixKey, TokenToKVPoolAllocator
    except ImportError as exc:
        raise SystemExit(
            f"prefixcache demo needs the server extra (pip install 'prefixcache[server]'): {exc}"
        ) from exc

    allocator = TokenToKVPoolAllocator(args.pool_size, device="cpu", page_size=1)
    cache = RadixCache(page_size=1, token_to_kv_pool_allocator=allocator)
    print(f"pool: {allocator.available_size()} free slots")

    for name, tokens in _DEMO_PROMPTS.items():
        # The prefill pattern: reuse the cached prefix, allocate slots only for the rest.
        hit = cache.match_prefix(RadixKey(tokens))
        new_slots = allocator.alloc(len(tokens) - hit.prefix_len)
        if new_slots is None:
            raise SystemExit(f"pool too small for {name}; try a larger --pool-size")
        cache.insert(RadixKey(tokens), torch.cat([hit.indices.to(torch.int64), new_slots]))
        print(
            f"insert {name}: {len(tokens)} tokens, {hit.prefix_len} reused from the cache, "
            f"{len(new_slots)} new slots"
        )

    hit = cache.match_prefix(RadixKey(_DEMO_QUERY))
    print(f"match query: hit {hit.prefix_len} of {len(_DEMO_QUERY)} tokens")
    print(
        f"cache: {cache.evictable_size()} evictable, {cache.protected_size()} protected; "
        f"pool: {allocator.available_size()} free slots"
    )
    cache.pretty_print()
    return 0


def _version() -> str:
    try:
        return version("prefixcache")
    except PackageNotFoundError:
        return "0+unknown"


if __name__ == "__main__":
    raise SystemExit(main())
