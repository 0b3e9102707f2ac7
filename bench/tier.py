"""The shared tier across two "nodes": hit ratio and fetch throughput.

A ``mooncake_master`` and two ``prefixcache serve`` sidecars with ``server.tier`` on
replay the Mooncake conversation trace, its requests alternated between the two. Each
request is a prefill as a worker does it: a Match that allocates the rest, then an
Insert of the whole prompt (the KV itself is not written: the tier moves the pool's
bytes whatever they hold). After each request the bench waits until that sidecar's
writes have left (put or dropped), as the next request on another node would find them
after a real prefill's time.

Printed, from the same run:

- the token hit ratio of the two nodes with the tier, of the same two without it, and
  of one sidecar serving the whole trace (target: two with the tier >= 0.95 x one);
- our fetch throughput (``prefixcache_tier_fetch_bytes_total`` over
  ``..._fetch_seconds_total``: the store calls of the lookups that fetched, thread
  pool and loop included), beside Mooncake's own ``batch_get_into`` of the same pages
  (same parts per page, the same batches as our lookups fetched, one client reading
  what another process put; only its calls timed), the two interleaved lookup by
  lookup so that both see the same load, and a memcpy of the same bytes (target: ours
  >= 0.8 x Mooncake's);
- the object split, Mooncake alone: the same bytes read as an object per page and as an
  object per page and K/V buffer, call by call, and a lookup's exists probe each way;
- what the seal checks cost a fetch (tier_seal.py): the tier's checked read against the
  same read unchecked, digest and MAC, and the checks' own GB/s (target: <= 1.10x); and
  what sealing costs the tier's put: sealed against unsealed (target: <= 1.05x), and
  the sidecar's save path with the tier (digest, MAC) against without it.

    python bench/tier.py --limit 200 --json tier.json

Every sidecar's pool holds the replayed requests' unique tokens (no eviction), so the
ratios measure sharing, not capacity. The default geometry (2 layers, 1 head of 16,
float16: 128 bytes a token, pages of 512 tokens = 64 KiB) keeps three pools small;
``--limit`` grows the run (the first 200 requests of the trace hold about 2.7M unique
tokens, 340 MB per pool).

This file is the command line and the report; the replays are in tier_replay.py, the
fetch measurement in tier_fetch.py, the seal checks' in tier_seal.py, the master,
sidecars and replay loop they use in tier_nodes.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == _REPO / "bench":
    sys.path[0] = str(_REPO)
sys.path += [p for p in map(str, (_REPO, _REPO / "server", _REPO / "client")) if p not in sys.path]

import numpy as np  # noqa: E402

from bench.tier_fetch import fetch_phase  # noqa: E402
from bench.tier_nodes import model_config, trace_keys, unique_pages  # noqa: E402
from bench.tier_replay import hit_ratios  # noqa: E402
from bench.tier_seal import save_phase, seal_phase  # noqa: E402
from bench.trace import DEFAULT_TRACE, load_expanded  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument(
        "--synthetic",
        action="store_true",
        help="a synthetic conversation trace instead of the file",
    )
    parser.add_argument("--limit", type=int, default=200, help="requests replayed")
    parser.add_argument("--page-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument(
        "--fetch-requests",
        type=int,
        default=8,
        help="requests the fetch measurement replays (0: none)",
    )
    parser.add_argument("--fetch-page-size", type=int, default=64)
    parser.add_argument("--fetch-layers", type=int, default=2)
    parser.add_argument("--fetch-heads", type=int, default=4)
    parser.add_argument("--fetch-head-dim", type=int, default=128)
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of the fetch measurements (the best counts)"
    )
    parser.add_argument(
        "--fetch-only", action="store_true", help="only the fetch measurement (no hit-ratio runs)"
    )
    parser.add_argument(
        "--no-split",
        dest="split",
        action="store_false",
        help="skip Mooncake's reads of an object per page and buffer",
    )
    parser.add_argument(
        "--no-seal",
        dest="seal",
        action="store_false",
        help="skip the fetch with seal checks against the same without",
    )
    parser.add_argument(
        "--seal-pages",
        type=int,
        default=512,
        help="pages the seal measurement reads (at the --fetch-* geometry)",
    )
    parser.add_argument("--seal-batch", type=int, default=128, help="pages a call")
    parser.add_argument(
        "--save-requests", type=int, default=64, help="saves a round of the save measurement"
    )
    parser.add_argument("--save-pages", type=int, default=4, help="pages a save")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    path = None if args.synthetic or not args.trace.exists() else args.trace
    trace = load_expanded(path, args.page_size, args.limit)
    keys = [k for k in trace.keys if len(k)]
    unique = unique_pages(keys, args.page_size)
    pool_tokens = (unique + 2 * args.page_size) * args.page_size + max(map(len, keys))
    model = model_config(args, pool_tokens)
    row_bytes = args.heads * args.head_dim * 2
    parts = [args.page_size * row_bytes] * (2 * args.layers)
    page_bytes = sum(parts)
    out: dict[str, Any] = {
        "trace": str(path or "synthetic"),
        "requests": len(keys),
        "tokens": sum(map(len, keys)),
        "page_size": args.page_size,
        "page_bytes": page_bytes,
        "pool_tokens": pool_tokens,
    }
    with tempfile.TemporaryDirectory(prefix="tier-bench-") as tmp_name:
        tmp = Path(tmp_name)
        if not args.fetch_only:
            out.update(hit_ratios(args, keys, model, unique, page_bytes, tmp))
        if args.fetch_requests:
            out.update(
                fetch_phase(args, trace_keys(args, args.fetch_page_size, args.fetch_requests), tmp)
            )
        if args.seal:
            seal_dir = tmp / "seal"
            seal_dir.mkdir()
            out.update(seal_phase(args, seal_dir))
            save_dir = tmp / "save"
            save_dir.mkdir()
            out.update(save_phase(args, save_dir))
    single = out.get("single_hit_ratio")
    if single is not None:
        out["tier_vs_single"] = out["two_nodes_tier_hit_ratio"] / single if single else None
    if out.get("mooncake_get_gbps_object_per_buffer"):
        out["page_bytes_parts"] = 2 * args.fetch_layers
        out["object_per_buffer_vs_page"] = (
            out["mooncake_get_gbps_object_per_buffer"] / out["mooncake_get_gbps_object_per_page"]
        )
    if out.get("mooncake_get_gbps"):
        out["fetch_vs_mooncake"] = out["fetch_gbps"] / out["mooncake_get_gbps"]
        out["fetch_vs_mooncake_median"] = float(np.median(out["fetch_vs_mooncake_rounds"]))
    _print(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return out


def _print(out: dict[str, Any]) -> None:
    print(
        f"trace {out['trace']}: {out['requests']} requests, {out['tokens']} tokens, "
        f"pages of {out['page_size']} tokens ({out['page_bytes']} bytes)"
    )
    if "single_hit_ratio" in out:
        print("| run | token hit ratio |")
        print("|---|---|")
        print(f"| one sidecar, whole trace | {out['single_hit_ratio']:.4f} |")
        print(f"| two nodes, no tier | {out['two_nodes_no_tier_hit_ratio']:.4f} |")
        print(f"| two nodes, tier | {out['two_nodes_tier_hit_ratio']:.4f} |")
    if out.get("tier_vs_single") is not None:
        print(
            f"two nodes with the tier / one sidecar: {out['tier_vs_single']:.3f} (target >= 0.95)"
        )
    if out.get("mooncake_get_gbps"):
        print(
            f"fetches of {out['fetch_requests']} requests' pages, "
            f"{out['fetch_page_bytes']} bytes each:"
        )
        print("| fetch | GB/s |")
        print("|---|---|")
        print(
            f"| ours (Match's fetch, {out['fetch_pages_per_lookup']} pages a lookup) | "
            f"{out['fetch_gbps']:.3f} |"
        )
        if "replay_fetch_gbps" in out:
            print(
                f"| ours, during the two-node replay ({out['page_bytes']}-byte pages) | "
                f"{out['replay_fetch_gbps']:.3f} |"
            )
        print(
            f"| Mooncake batch_get_into, same pages and batches | {out['mooncake_get_gbps']:.3f} |"
        )
        print(f"| memcpy, same bytes | {out['memcpy_gbps']:.3f} |")
        rounds = ", ".join(f"{r:.2f}" for r in out["fetch_vs_mooncake_rounds"])
        print(
            f"ours / Mooncake's: {out['fetch_vs_mooncake']:.3f} best over best, "
            f"{out['fetch_vs_mooncake_median']:.3f} median of the rounds ({rounds}); "
            "target >= 0.8"
        )
    if out.get("mooncake_get_gbps_object_per_buffer"):
        print(f"the object split, Mooncake alone, {out['split_pages']} pages, call by call:")
        print("| Mooncake batch_get_into | GB/s |")
        print("|---|---|")
        print(
            f"| an object per page ({out['page_bytes_parts']} parts) | "
            f"{out['mooncake_get_gbps_object_per_page']:.3f} |"
        )
        print(
            "| an object per page and K/V buffer | "
            f"{out['mooncake_get_gbps_object_per_buffer']:.3f} |"
        )
        split = ", ".join(f"{r:.2f}" for r in out["object_per_buffer_vs_page_rounds"])
        print(
            f"per buffer / per page: {out['object_per_buffer_vs_page']:.3f} best over "
            f"best, rounds {split}"
        )
        print(
            f"a lookup's exists probe ({out['fetch_pages_per_lookup']} pages): "
            f"{out['exists_ms_object_per_page']:.2f} ms per page object, "
            f"{out['exists_ms_object_per_buffer']:.2f} ms per page and buffer"
        )
    if "seal_check_gbps_digest" in out:
        print(
            f"seal checks, {out['seal_pages']} pages of {out['seal_page_bytes']} bytes, "
            f"{out['seal_batch']} a call, call by call:"
        )
        print(
            "| seal | fetch GB/s unchecked | checked | checked / unchecked time: best "
            "over best (rounds) | median of the call pairs | check alone GB/s |"
        )
        print("|---|---|---|---|---|---|")
        for kind in ("digest", "mac"):
            rounds = ", ".join(f"{r:.2f}" for r in out[f"fetch_checked_cost_{kind}_rounds"])
            print(
                f"| {kind} | {out[f'fetch_gbps_{kind}_unchecked']:.3f} | "
                f"{out[f'fetch_gbps_{kind}_checked']:.3f} | "
                f"{out[f'fetch_checked_cost_{kind}']:.3f} ({rounds}) | "
                f"{out[f'fetch_checked_cost_{kind}_median']:.3f} | "
                f"{out[f'seal_check_gbps_{kind}']:.1f} |"
            )
        print("target: checked / unchecked <= 1.10")
    if "put_sealed_cost_digest" in out:
        print("the tier's put of the same pages, sealed against unsealed, call by call:")
        print(
            "| seal | put GB/s unsealed | sealed | sealed / unsealed time: best over best "
            "(rounds) | median of the call pairs |"
        )
        print("|---|---|---|---|---|")
        for kind in ("digest", "mac"):
            rounds = ", ".join(f"{r:.2f}" for r in out[f"put_sealed_cost_{kind}_rounds"])
            print(
                f"| {kind} | {out[f'put_gbps_{kind}_unsealed']:.3f} | "
                f"{out[f'put_gbps_{kind}_sealed']:.3f} | "
                f"{out[f'put_sealed_cost_{kind}']:.3f} ({rounds}) | "
                f"{out[f'put_sealed_cost_{kind}_median']:.3f} |"
            )
        print("target: sealed / unsealed <= 1.05")
    if "save_cost_digest" in out:
        print(
            f"the sidecar's save path (Match with allocation, then Insert), "
            f"{out['save_requests']} saves of {out['save_bytes']} bytes a round:"
        )
        print("| tier | saves/s | no tier / this: best over best (rounds) |")
        print("|---|---|---|")
        print(f"| none | {out['saves_per_s_none']:.0f} | |")
        for kind in ("digest", "mac"):
            rounds = ", ".join(f"{r:.2f}" for r in out[f"save_cost_{kind}_rounds"])
            print(
                f"| {kind} | {out[f'saves_per_s_{kind}']:.0f} | "
                f"{out[f'save_cost_{kind}']:.3f} ({rounds}) |"
            )
        print(f"mac / digest: {out['save_cost_mac_vs_digest']:.3f}; target <= 1.05")


if __name__ == "__main__":
    main()
