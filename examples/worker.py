"""A simulated inference worker against the prefixcache sidecar.

It runs the whole protocol a real worker runs, with random numbers for "compute":

1. prefill: ``match(lock=True, allocate=True)`` locks the cached prefix and allocates
   slots for the rest; the worker writes K/V for the new tokens into those slots
   (straight into the shared pool with ``--kv attach``, or through WriteKV with
   ``--kv transfer``, as a worker on another host would); ``insert(lock=True,
   release_lock_id=...)`` caches the prompt and moves the lock to the new node.
2. decode: each step allocates one slot and writes its K/V.
3. finish: ``insert`` the prompt plus the generated tokens, releasing the prefill lock,
   and free the slots of the unaligned tail that the tree did not take.

Requests come from a Mooncake trace (``bench/traces/``, or ``--trace FILE``), or, where
no trace file is found, from a synthetic conversation-shaped trace. At the end it prints
requests/s and the token hit ratio.

    prefixcache serve --config examples/worker.yaml &
    python examples/worker.py --limit 200
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path += [p for p in map(str, (REPO, REPO / "client", REPO / "server")) if p not in sys.path]

import torch  # noqa: E402

from bench.trace import DEFAULT_TRACE, load_expanded  # noqa: E402
from prefixcache.client import PrefixCacheClient, ResourceExhausted  # noqa: E402


class Worker:
    """One worker process: a client, one leased session, and the pool's layout."""

    def __init__(
        self, client: PrefixCacheClient, model: str, mode: str, decode_steps: int, seed: int = 0
    ) -> None:
        self.client, self.model, self.mode = client, model, mode
        self.decode_steps = decode_steps
        self.info = client.describe_pool(model)
        self.pool = client.attach_pool(model) if mode == "attach" else None
        self.session = client.session(ttl=30, name="example-worker")
        self.dtype = getattr(torch, self.info.dtype)
        gen = torch.Generator().manual_seed(seed)
        # "Compute": slices of one random bank, so the model costs nothing here.
        self._bank = torch.randn(
            (4096, self.info.k_head_num, self.info.k_head_dim), generator=gen
        ).to(self.dtype)
        self._next_token = 1 << 31  # generated ids, never in the trace's prompts
        self.hit_tokens = self.prompt_tokens = self.skipped = 0

    def _kv(self, n: int, layer: int) -> torch.Tensor:
        start = (layer * 977 + n) % (len(self._bank) - min(n, len(self._bank)) + 1)
        rows = self._bank[start : start + n]
        return rows if len(rows) == n else rows.repeat(n // len(rows) + 1, 1, 1)[:n]

    def _write(self, slots: Any) -> None:
        """The "forward pass": K/V of every layer for ``slots``."""
        n = len(slots)
        if not n:
            return
        layers = range(self.info.layer_num)
        if self.pool is not None:  # zero-copy: the pool is mapped into this process
            index = torch.frombuffer(slots, dtype=torch.int64)
            for layer in layers:
                kv = self._kv(n, layer)
                self.pool.k_buffer[layer].index_copy_(0, index, kv)
                self.pool.v_buffer[layer].index_copy_(0, index, kv)
        else:
            k = [self._kv(n, layer) for layer in layers]
            self.session.write_kv(self.model, slots, k, k, timeout=60)

    def serve(self, tokens: Any) -> bool:
        """Prefill, decode and finish one request; False when the pool cannot hold it."""
        s, model = self.session, self.model
        try:
            hit = s.match(model, tokens, lock=True, allocate=True)
        except ResourceExhausted:
            self.skipped += 1
            return False
        self.prompt_tokens += len(tokens)
        self.hit_tokens += hit.prefix_len
        self._write(hit.allocated)
        slots = hit.all_slots()
        prefill = s.insert(model, tokens, slots, lock=True, release_lock_id=hit.lock_id)
        seq = list(tokens)
        for _ in range(self.decode_steps):
            step = s.alloc(model, 1).slots
            self._write(step)
            slots.extend(step)
            seq.append(self._next_token)
            self._next_token += 1
        done = s.insert(model, seq, slots, release_lock_id=prefill.lock_id)
        # The unaligned tail stays the session's: give it back.
        tail = slots[done.cached_len :]
        if len(tail):
            s.free(model, tail)
        return True

    def close(self) -> None:
        self.session.close()
        if self.pool is not None:
            self.pool.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="unix:/tmp/prefixcache.sock")
    parser.add_argument("--model", default="default")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--limit", type=int, default=200, help="requests to replay")
    parser.add_argument(
        "--kv",
        choices=("attach", "transfer"),
        default="attach",
        help="write KV into the mapped pool, or through WriteKV",
    )
    parser.add_argument("--decode-steps", type=int, default=4)
    args = parser.parse_args(argv)

    with PrefixCacheClient(args.target, timeout=10.0, client_name="example-worker") as c:
        page = c.list_models()[args.model].page_size
        path = args.trace if args.trace.exists() else None
        if path is None:
            print(
                f"{args.trace} not found: replaying a synthetic conversation trace", file=sys.stderr
            )
        trace = load_expanded(path, page, args.limit)
        worker = Worker(c, args.model, args.kv, args.decode_steps)
        start = time.perf_counter()
        served = sum(worker.serve(key) for key in trace.keys)
        elapsed = time.perf_counter() - start
        worker.close()
        stats = c.stats(args.model)[args.model]
    ratio = worker.hit_tokens / max(worker.prompt_tokens, 1)
    print(
        f"{served} requests in {elapsed:.2f} s: {served / elapsed:.1f} requests/s, "
        f"hit ratio {ratio:.3f} ({args.kv}; {worker.skipped} too big for the pool; "
        f"{stats.cached_tokens} tokens cached)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
