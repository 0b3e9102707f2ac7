"""`prefixcache explain` and the outcome table of `prefixcache stats`: "why no hit?".

``explain`` asks a running server (the Explain RPC) how far one request hits and why it
stops, by its tokens or by the page hash of its last whole page, and prints each
range's outcome with what it usually means. Client-side only: no torch, no cache.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

_PREFIX = "LOOKUP_OUTCOME_"
# What an operator does about each outcome (docs/operations.md, "Why no hit?").
HINTS = {
    "hit": "cached and answered",
    "miss_cold": "never cached (as far as the record of evicted pages reaches): a first "
    "request, or one no worker saved",
    "miss_evicted": "cached once, evicted since: a larger pool (see the hit-rate "
    "ceiling) or fewer pinned pages would have kept it",
    "miss_namespace": "cached under another namespace (extra_key) of this model: check "
    "the request's extra_key (LoRA adapter, tenant, salt)",
    "below_page": "the tail shorter than a page: never cached",
}
# A tier's part (ExplainTier): what a lookup would do now, and what the last one did.
TIER_STATES = {
    "promote": "a lookup reads them into the pool and answers them as a hit",
    "not_held": "the page after the hit is not there",
    "capacity": "no room for reads now (max_fetch_slots taken)",
    "breaker_open": "reads are skipped for a while: one overran its deadline or failed",
    "unavailable": "the tier is not serving",
    "hit": "every whole page hits in the pool",
}
TIER_RESULTS = {
    "disk": "read {tokens} tokens from disk: a hit",
    "remote": "read {tokens} tokens from the Mooncake store: a hit",
    "miss": "not held there",
    "timeout": "the read missed the lookup's deadline (a slow or busy disk: "
    "timeout, min_fetch_bandwidth)",
    "refused": "the first page failed its seal check (counted in "
    "prefixcache_integrity_failures_total) and was removed",
    "capacity": "no pool room for the read (a fuller pool, max_fetch_slots)",
    "error": "the read failed (prefixcache_disk_errors_total)",
}


def outcome_names() -> list[str]:
    """The outcome labels, in the proto's order (hit, miss_cold, ...)."""
    from prefixcache.v1 import prefix_cache_pb2 as pb

    return [name.removeprefix(_PREFIX).lower() for name, value in pb.LookupOutcome.items() if value]


def add_explain(
    commands: Any, add_target_options: Callable[..., None], run: Callable[[argparse.Namespace], int]
) -> None:
    explain = commands.add_parser(
        "explain",
        help="say how far one request hits and why it stops",
        description="Ask a running server how far a request hits and why it stops: the "
        "outcome of each range of its tokens (hit, miss_cold, miss_evicted, "
        "miss_namespace, below_page), as prefixcache_lookup_tokens_total counts them. "
        "Changes nothing and counts nothing.",
    )
    add_target_options(explain, timeout=5.0)
    explain.add_argument("--model", required=True, help="the model to look in")
    which = explain.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--tokens-file",
        metavar="FILE",
        help="the request's token ids: a JSON list, or integers separated by "
        "spaces, commas or newlines ('-': standard input)",
    )
    which.add_argument(
        "--prompt-hash",
        metavar="HEX",
        help="the chained SHA-256 page hash (64 hex digits, as KV events and "
        "SGLang name pages) of the prompt's last whole page; needs a server "
        "with page hashes (server.change_log_capacity > 0)",
    )
    explain.add_argument(
        "--extra-key", metavar="NS", help="the request's namespace (default: none, which is not '')"
    )
    explain.add_argument("--json", action="store_true", help="print JSON")
    explain.set_defaults(run=run)


def read_tokens(path: str) -> list[int]:
    """Token ids from ``path`` (see --tokens-file), or exit 1 naming the problem."""
    try:
        if path == "-":
            text = sys.stdin.read()
        else:
            with open(path, encoding="utf-8") as f:
                text = f.read()
    except OSError as exc:
        raise SystemExit(f"prefixcache: --tokens-file {path}: {exc.strerror or exc}") from exc
    try:
        if text.lstrip().startswith("["):
            tokens = json.loads(text)
        else:
            tokens = [int(t) for t in text.replace(",", " ").split()]
        if not all(isinstance(t, int) and 0 <= t < 1 << 32 for t in tokens):
            raise ValueError("token ids are integers in [0, 2**32)")
    except ValueError as exc:
        raise SystemExit(
            f"prefixcache: --tokens-file {path}: not a list of token ids ({exc})"
        ) from exc
    return tokens


def request(args: argparse.Namespace) -> Any:
    """The ExplainRequest the arguments name."""
    from array import array

    from prefixcache.v1 import prefix_cache_pb2 as pb

    req = pb.ExplainRequest(model=args.model)
    if args.extra_key is not None:
        req.extra_key = args.extra_key
    if args.prompt_hash:
        req.prompt_hash = args.prompt_hash
    else:
        packed = array("I", read_tokens(args.tokens_file))
        if sys.byteorder != "little":
            packed.byteswap()
        req.token_ids = packed.tobytes()
    return req


def print_explained(args: argparse.Namespace, reply: Any) -> None:
    from google.protobuf.json_format import MessageToDict

    if args.json:
        print(json.dumps(MessageToDict(reply, always_print_fields_with_no_presence=True), indent=2))
        return
    names = outcome_names()
    stop = names[reply.stop - 1] if reply.stop else "hit"
    print(
        f"model {args.model}: {reply.num_tokens} tokens, page size {reply.page_size}; "
        f"hits {reply.prefix_len}"
        + ("" if stop == "hit" else f", stops at token {reply.prefix_len}: {stop}")
    )
    rows = [("outcome", "from", "to", "tokens", "meaning")]
    for r in reply.ranges:
        name = names[r.outcome - 1]
        rows.append((name, str(r.start), str(r.end), str(r.end - r.start), HINTS.get(name, "")))
    print_table(rows)
    if any(names[r.outcome - 1] == "miss_namespace" for r in reply.ranges):
        where = (
            repr(reply.other_extra_key)
            if reply.HasField("other_extra_key")
            else "the default namespace (no extra_key)"
        )
        print(f"cached under namespace {where}")
    for part in reply.tiers:
        print(
            f"{part.tier} tier: {part.tokens} tokens after the hit held there; "
            f"{part.state}: {TIER_STATES.get(part.state, '')}"
        )
        if part.last:
            meaning = TIER_RESULTS.get(part.last, "").format(tokens=part.last_tokens)
            print(f"  its last lookup of this request: {part.last}: {meaning}")


def print_outcomes(models: Any) -> None:
    """`stats`'s table of looked-up tokens by outcome, and the hit-rate ceiling."""
    names = outcome_names()
    rows = [("model", *names, "ceiling")]
    for m in models:
        counts = m.lookup_tokens_total
        rows.append(
            (m.model, *(str(counts.get(n, 0)) for n in names), f"{m.hit_ratio_ceiling:.3f}")
        )
    print("\nlooked-up tokens by outcome; ceiling: the hit ratio an infinite pool would reach")
    print_table(rows)


def print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
