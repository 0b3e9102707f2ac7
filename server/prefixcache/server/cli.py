"""The `prefixcache` command line."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

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
