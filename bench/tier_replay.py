"""The two-node replay (``tier.py`` without ``--fetch-only``): the token hit ratio of one
sidecar serving the whole trace, of two without the tier and of two sharing it, the
requests alternated between the two."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.tier_nodes import Master, Sidecar, replay, stop_all


def hit_ratios(
    args: argparse.Namespace,
    keys: list[Any],
    model: dict[str, Any],
    unique: int,
    page_bytes: int,
    tmp: Path,
) -> dict[str, Any]:
    """The three replays: one sidecar, two without the tier, two with it (the sidecars
    without the tier start together, and so do those with it)."""
    out: dict[str, Any] = {}
    plain = [Sidecar(tmp, name, model, None) for name in ("one", "plain0", "plain1")]
    try:
        out["single_hit_ratio"] = replay(plain[:1], keys, args.page_size, False)
        out["two_nodes_no_tier_hit_ratio"] = replay(plain[1:], keys, args.page_size, False)
    finally:
        stop_all(plain)
    master = Master(tmp)
    tier = {
        "master": master.address,
        "timeout": 5.0,
        "segment_bytes": max(64 << 20, 2 * unique * page_bytes),
    }
    pair = [Sidecar(tmp, f"tier{i}", model, tier) for i in range(2)]
    try:
        for node in pair:
            node.wait(r"prefixcache_tier_connected", 1)
        out["two_nodes_tier_hit_ratio"] = replay(pair, keys, args.page_size, True)
        fetched = sum(n.metric(r"prefixcache_tier_fetch_bytes_total\{.*\}") for n in pair)
        seconds = sum(n.metric(r"prefixcache_tier_fetch_seconds_total\{.*\}") for n in pair)
        out["replay_fetch_bytes"] = fetched
        out["replay_fetch_gbps"] = fetched / seconds / 1e9 if seconds else 0.0
    finally:
        stop_all(pair)
        master.stop()
    return out
