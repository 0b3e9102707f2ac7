"""Cost of packing token ids into wire bytes, per input container, against a copy of it.

Times the client's ``prefixcache.client._wire.pack_tokens`` and the server's
``prefixcache.cache.key.pack_tokens`` on one long key (13.5 k tokens, a Mooncake
conversation prompt) and one short key (128 tokens, where per-call overhead shows), for
every container a caller may hold, next to "a copy" of the same input: ``bytes(a)`` for an
``array``, ``x.tobytes()`` for numpy, ``t.numpy().tobytes()`` for torch, ``lst.copy()``
for a list (a list has no bytes to copy; its row shows the per-element floor instead).
Prints a markdown table of best-of-N µs per call and each pack's ratio to the copy.

    python bench/pack_keys.py [--tokens 13500 --tokens 128] [--budget-ms 120]
"""

from __future__ import annotations

import argparse
import sys
import timeit
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == _REPO / "bench":
    sys.path[0] = str(_REPO)
sys.path += [p for p in map(str, (_REPO / "server", _REPO / "client")) if p not in sys.path]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from prefixcache.cache.key import pack_tokens as server_pack  # noqa: E402
from prefixcache.client._wire import pack_tokens as client_pack  # noqa: E402

VOCAB = 152_064  # Qwen2's vocabulary: ids span ~17 bits, as in real prompts


def inputs(n: int, seed: int = 0) -> list[tuple[str, Any, Callable[[], Any]]]:
    """(label, container, copy of it) for each container holding the same ``n`` ids."""
    ids = np.random.default_rng(seed).integers(0, VOCAB, n).tolist()
    lst = list(ids)
    aq, ai = array("q", ids), array("I", ids)
    n64, n32, nu32 = (np.array(ids, dtype=d) for d in (np.int64, np.int32, np.uint32))
    t64, t32 = torch.tensor(ids, dtype=torch.int64), torch.tensor(ids, dtype=torch.int32)
    return [
        ("list", lst, lst.copy),
        ("array('q')", aq, lambda: bytes(aq)),
        ("array('I')", ai, lambda: bytes(ai)),
        ("numpy int64", n64, n64.tobytes),
        ("numpy int32", n32, n32.tobytes),
        ("numpy uint32", nu32, nu32.tobytes),
        ("torch int64", t64, lambda: t64.numpy().tobytes()),
        ("torch int32", t32, lambda: t32.numpy().tobytes()),
    ]


def best_us(fns: list[Callable[[], Any]], budget_s: float, repeat: int = 9) -> list[float]:
    """Best-of-``repeat`` µs per call of each of ``fns``, timed in turns (so a slow spell
    of the shared VM hits all of them), each turn about ``budget_s / repeat`` in all."""
    timers = [timeit.Timer(fn) for fn in fns]
    once = [min(t.repeat(repeat=3, number=1)) for t in timers]
    numbers = [max(1, int(budget_s / repeat / len(fns) / max(s, 1e-7))) for s in once]
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, (timer, number) in enumerate(zip(timers, numbers, strict=True)):
            best[i] = min(best[i], timer.timeit(number) / number)
    return [b * 1e6 for b in best]


def rows(sizes: list[int], budget_s: float) -> list[list[str]]:
    out = []
    for n in sizes:
        cases = inputs(n)
        want = client_pack(cases[0][1])  # the list's bytes
        for label, given, copy in cases:
            for pack in (client_pack, server_pack):  # same bytes from every container
                if pack(given) != want:
                    raise SystemExit(f"{pack.__module__} packs {label} differently")
            copy_us, client_us, server_us = best_us(
                [copy, lambda g=given: client_pack(g), lambda g=given: server_pack(g)], budget_s
            )
            out.append(
                [
                    label,
                    f"{n:,}",
                    f"{copy_us:.2f}",
                    f"{client_us:.2f}",
                    f"{client_us / copy_us:.1f}x",
                    f"{server_us:.2f}",
                    f"{server_us / copy_us:.1f}x",
                ]
            )
    return out


def table(body: list[list[str]]) -> str:
    head = [
        "input",
        "tokens",
        "copy µs",
        "client µs",
        "client ÷ copy",
        "server µs",
        "server ÷ copy",
    ]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--tokens", type=int, action="append", help="key length (repeatable; default 13500 and 128)"
    )
    parser.add_argument(
        "--budget-ms", type=float, default=120.0, help="time spent on each row (default 120 ms)"
    )
    args = parser.parse_args(argv)
    print(table(rows(args.tokens or [13_500, 128], args.budget_ms / 1e3)))


if __name__ == "__main__":
    main()
