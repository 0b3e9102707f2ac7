"""Our RadixCache against real SGLang's ``RadixCache``, in one process, on the same trace.

Each round replays the trace (``replay.py``'s caller protocol: match, lock, evict the
shortfall, allocate, insert, free the duplicates, unlock) through our cache and through
``sglang.srt.mem_cache.radix_cache.RadixCache``, once per key type (``list`` and
``array('q')``: what an SGLang scheduler holds), rounds interleaved. Both trees free to
the same allocator (ours, with SGLang's ``free_segment`` spelled as ``free``). SGLang's
match is followed by its ``path_device_indices`` (its ``MatchResult`` carries no slots;
the scheduler gathers them so). Reported: CPU µs a request (best round of each) and
SGLang ÷ ours per key type (each round's back-to-back pair, median over rounds: on a
busy machine rounds differ by 1.5x, pairs far less); exit 1 if any request's hit
differs between the two. ``PYTHONPATH=OTHER/server`` runs another checkout's cache.

SGLang is not a dependency: install it beside the project without its dependencies,
then run with it on the path, e.g.::

    pip install --no-deps --target /tmp/sg sglang==0.5.23 orjson ipython traitlets gguf
    PYTHONPATH=/tmp/sg python bench/vs_sglang.py --limit 3000 --budget 1000000

(its ``radix_cache`` import pulls in transformers too, as the e2e venv has). Where
torchvision is missing (or built for another torch), stand-ins for the few names
SGLang's multimodal configs import are installed: no code here runs them.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import statistics
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == _REPO / "bench":
    sys.path[0] = str(_REPO)  # bench/trace.py would shadow the stdlib trace module
sys.path += [p for p in map(str, (_REPO, _REPO / "server", _REPO / "client")) if p not in sys.path]

from bench.replay import (  # noqa: E402
    KEY_TYPES,
    Impl,
    RunResult,
    _in_child,
    first_divergence,
    ours_impl,
    replay,
)
from bench.trace import DEFAULT_TRACE, load_expanded  # noqa: E402


def _stand_in(name: str) -> None:
    module = types.ModuleType(name)
    module.__path__ = []  # a package, so its submodules import too

    def attribute(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return type(attr, (), {})

    module.__getattr__ = attribute  # type: ignore[method-assign]
    sys.modules[name] = module


def import_sglang() -> types.ModuleType:
    """``sglang.srt.mem_cache.radix_cache``, with torchvision stood in for if it will not
    import (SGLang's model configs import it at module level)."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # missing, or built against another torch
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        # transformers reads which packages exist once, at import: before the stand-in.
        importlib.import_module("transformers")
        for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
            _stand_in(name)
    return importlib.import_module("sglang.srt.mem_cache.radix_cache")


@dataclass(slots=True)
class _Match:
    indices: Any
    last_node: Any
    prefix_len: int


@dataclass(slots=True)
class _Count:
    prefix_len: int = 0
    full_evicted: int = 0


class SGLangTree:
    """Real SGLang's RadixCache behind the calls ``replay`` makes (one call each)."""

    def __init__(
        self, radix: types.ModuleType, base: types.ModuleType, alloc: Any, page_size: int
    ) -> None:
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams

        self.cache = radix.RadixCache(
            CacheInitParams(
                disable=False,
                req_to_token_pool=None,
                token_to_kv_pool_allocator=alloc,
                page_size=page_size,
            )
        )
        self._match_params = base.MatchPrefixParams
        self._insert_params = base.InsertParams
        self._evict_params = base.EvictParams

    def match_prefix(self, key: Any) -> _Match:
        cache = self.cache
        found = cache.match_prefix(self._match_params(key=key))
        node = found.last_device_node
        return _Match(cache.path_device_indices(node), node, found.device_prefix_len)

    def inc_lock_ref(self, node: Any) -> None:
        self.cache.inc_lock_ref(node)

    def dec_lock_ref(self, node: Any) -> None:
        self.cache.dec_lock_ref(node)

    def evict(self, num_tokens: int) -> _Count:
        done = self.cache.evict(self._evict_params(num_tokens=num_tokens))
        return _Count(full_evicted=done.num_tokens_evicted)

    def insert(self, key: Any, value: Any) -> _Count:
        return _Count(
            prefix_len=self.cache.insert(self._insert_params(key=key, value=value)).prefix_len
        )

    def total_size(self) -> int:
        return self.cache.total_size()

    def check_integrity(self) -> None:
        """SGLang has none; slot conservation (``replay``) still checks the tree."""


def _allocator(budget: int, page_size: int) -> Any:
    from prefixcache.cache import TokenToKVPoolAllocator

    class SegmentAllocator(TokenToKVPoolAllocator):
        def free_segment(self, free_index: Any, *, start_pos: int) -> None:
            self.free(free_index)  # a tree's values are whole pages: free_segment == free

    return SegmentAllocator(size=budget, device="cpu", page_size=page_size)


def sglang_impl(key_type: str) -> Impl:
    radix = import_sglang()
    base = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
    return Impl(
        f"sglang/{key_type}",
        lambda alloc, ps: SGLangTree(radix, base, alloc, ps),
        KEY_TYPES[key_type],
        radix.RadixKey,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = ap.add_argument
    add("--trace", type=Path, default=DEFAULT_TRACE)
    add("--budget", type=int, default=1_000_000, help="pool size in tokens")
    add("--page-size", type=int, default=16)
    add("--limit", type=int, default=3000, help="replay the first N requests")
    add("--keys", default="list,array_q", help="key types, from list, array_q")
    add("--rounds", type=int, default=3, help="interleaved rounds; the best of each is shown")
    add(
        "--profile",
        type=int,
        metavar="TOP",
        default=0,
        help="cProfile each run and print the TOP entries by own time",
    )
    args = ap.parse_args(argv)
    key_types = [k for k in args.keys.split(",") if k]
    if bad := [k for k in key_types if k not in ("list", "array_q")]:
        ap.error(f"--keys: unknown {bad}")
    import torch

    torch.set_num_threads(1)
    import sglang

    trace = load_expanded(args.trace, args.page_size, args.limit)
    print(
        f"{args.trace.name}: {len(trace.keys):,} requests, {trace.total_tokens:,} tokens; "
        f"sglang {sglang.__version__}",
        file=sys.stderr,
    )
    pairs = [(k, ours_impl(key_type=k), sglang_impl(k)) for k in key_types]
    best: dict[str, RunResult] = {}
    ratios: dict[str, list[float]] = {k: [] for k in key_types}
    notes: list[str] = []
    for rnd in range(args.rounds):
        for key_type, ours, theirs in pairs:
            runs = []
            for impl in (ours, theirs):
                job = functools.partial(
                    replay,
                    impl,
                    trace.keys,
                    args.budget,
                    args.page_size,
                    make_allocator=_allocator,
                    profile_top=args.profile,
                )
                r = _in_child(job)
                runs.append(r)
                print(
                    f"round {rnd + 1} {impl.name}: {r.cpu_us_per_req:,.1f} CPU µs/req, "
                    f"{r.req_per_s:,.0f} req/s, hit {r.hit_ratio:.4f}, {r.integrity}",
                    file=sys.stderr,
                )
                if impl.name not in best or r.cpu_s < best[impl.name].cpu_s:
                    best[impl.name] = r
            # Ours and SGLang ran back to back: their ratio is the round's reading.
            ratios[key_type].append(runs[1].cpu_s / runs[0].cpu_s)
            if rnd == 0 and (note := first_divergence(*runs)):
                notes.append(note)
    print(
        f"\n{args.trace.name}, first {len(trace.keys):,} requests, budget {args.budget:,}, "
        f"page {args.page_size}, sglang {sglang.__version__}, {args.rounds} rounds: CPU "
        "best of the rounds; SGLang ÷ ours per round (back-to-back runs), median [range]\n"
    )
    print(
        "| keys | ours CPU µs/req | SGLang CPU µs/req | **SGLang ÷ ours** | token hit "
        "| ours match / insert / evict µs | SGLang match / insert / evict µs |"
    )
    print("|---|---:|---:|---:|---:|---|---|")
    for key_type, ours, theirs in pairs:
        a, b = best[ours.name], best[theirs.name]

        def ops(r: Any) -> str:
            return " / ".join(f"{r.ops[o].mean_us:,.1f}" for o in ("match", "insert", "evict"))

        r = sorted(ratios[key_type])
        print(
            f"| {key_type} | {a.cpu_us_per_req:,.1f} | {b.cpu_us_per_req:,.1f} "
            f"| **{statistics.median(r):.2f}x** [{r[0]:.2f}-{r[-1]:.2f}] | {a.hit_ratio:.4f} "
            f"| {ops(a)} | {ops(b)} |"
        )
    for note in notes:
        print(f"\nHIT MISMATCH: {note}")
    return 1 if notes else 0


if __name__ == "__main__":
    sys.exit(main())
