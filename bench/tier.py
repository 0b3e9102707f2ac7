"""The shared tier across two "nodes": hit ratio and fetch throughput (issue 22).

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
  what another process put; only its calls timed), the two in alternate rounds so that
  both see the same load, and a memcpy of the same bytes (target: ours >= 0.8 x
  Mooncake's).

    python bench/tier.py --limit 200 --json tier.json

Every sidecar's pool holds the replayed requests' unique tokens (no eviction), so the
ratios measure sharing, not capacity. The default geometry (2 layers, 1 head of 16,
float16: 128 bytes a token, pages of 512 tokens = 64 KiB) keeps three pools small;
``--limit`` grows the run (the first 200 requests of the trace hold about 2.7M unique
tokens, 340 MB per pool).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == _REPO / "bench":
    sys.path[0] = str(_REPO)
sys.path += [p for p in map(str, (_REPO, _REPO / "server", _REPO / "client")) if p not in sys.path]

import numpy as np  # noqa: E402
import yaml  # noqa: E402

from bench.trace import DEFAULT_TRACE, load_expanded  # noqa: E402
from prefixcache.client import PrefixCacheClient  # noqa: E402

MODEL = "m"
_CLI = [sys.executable, "-c", "from prefixcache.server.cli import main; raise SystemExit(main())"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXCACHE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(_REPO / "server"), str(_REPO / "client")])
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("MC_LOG_LEVEL", "ERROR")
    return env


class Master:
    def __init__(self, tmp: Path) -> None:
        self.port = _free_port()
        log = open(tmp / "master.log", "w")  # noqa: SIM115 (lives with the process)
        self.proc = subprocess.Popen(
            ["mooncake_master", f"--rpc_port={self.port}", "--rpc_address=127.0.0.1",
             f"--metrics_port={_free_port()}", "--metrics_host=127.0.0.1",
             "--enable_metric_reporting=false"],
            env={**os.environ, "GLOG_minloglevel": "1"}, stdout=log, stderr=log)
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.5).close()
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("mooncake_master did not start") from None
                time.sleep(0.05)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Sidecar:
    """One ``prefixcache serve`` (a node), with its metrics scraped over HTTP."""

    def __init__(self, tmp: Path, name: str, model: dict[str, Any],
                 tier: dict[str, Any] | None) -> None:
        folder = tmp / name
        folder.mkdir()
        server: dict[str, Any] = {"shm_dir": "off"}
        if tier is not None:
            server["tier"] = tier
        (folder / "pc.yaml").write_text(yaml.safe_dump({"server": server, "models": [model]}))
        self.address = f"unix:{folder / 'pc.sock'}"
        self.metrics_port = _free_port()
        self.stderr = open(folder / "stderr", "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [*_CLI, "serve", "--config", str(folder / "pc.yaml"), "--listen", self.address,
             "--metrics-port", str(self.metrics_port), "--metrics-host", "127.0.0.1"],
            env=_env(), stdout=subprocess.DEVNULL, stderr=self.stderr)
        self.client: PrefixCacheClient | None = None
        self.pages_out = 0.0
        pool = model["pool"]
        self.page_bytes = (model["page_size"] * pool["k_heads"] * pool["k_head_dim"] * 2
                           * 2 * pool["layers"])

    def metric(self, pattern: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                    timeout=10) as reply:
            text = reply.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                if re.fullmatch(pattern, name):
                    total += float(value)
        return total

    def wait(self, pattern: str, minimum: float, timeout: float = 60.0) -> float:
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.metric(pattern)
                if value >= minimum:
                    return value
            except OSError:
                value = float("nan")
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{pattern} stayed at {value} (< {minimum}); see "
                                   f"{self.stderr.name}")
            time.sleep(0.05)

    def connect(self) -> PrefixCacheClient:
        """A client, once the sidecar answers."""
        self.client = PrefixCacheClient(self.address, timeout=60)
        deadline = time.monotonic() + 60
        while True:
            try:
                self.client.list_models(timeout=2)
                return self.client
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the sidecar did not start; see {self.stderr.name}"
                                       ) from None
                time.sleep(0.1)

    def stop(self) -> None:
        self.signal()
        self.join()

    def signal(self) -> None:
        """Ask the sidecar to stop (``join`` waits for it): several stop at once."""
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def join(self) -> None:
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


def _stop_all(nodes: list[Sidecar]) -> None:
    """Stop sidecars together (each takes a second or more to leave the store)."""
    for node in nodes:
        node.signal()
    for node in nodes:
        node.join()


def _model(args: argparse.Namespace, pool_tokens: int) -> dict[str, Any]:
    return {"name": MODEL, "page_size": args.page_size,
            "pool": {"size": pool_tokens, "layers": args.layers, "k_heads": args.heads,
                     "k_head_dim": args.head_dim, "dtype": "float16"}}


_WRITTEN = r"prefixcache_tier_put_(pages|failed_pages|dropped_pages)_total\{.*\}"


def replay(nodes: list[Sidecar], keys: list[Any], page_size: int, tiered: bool) -> float:
    """Every request on node ``i % len(nodes)``; the token hit ratio."""
    hit = total = 0
    clients = [node.connect() for node in nodes]
    sessions = [client.open_session(600) for client in clients]
    for i, key in enumerate(keys):
        node = i % len(nodes)
        client, session = clients[node], sessions[node]
        reply = client.match(MODEL, key, session=session, allocate=True)
        hit += reply.prefix_len
        total += len(key)
        inserted = client.insert(MODEL, key, reply.all_slots(), session=session)
        if tiered:
            new_pages = (len(key) - inserted.prefix_len) // page_size
            nodes[node].pages_out += new_pages
            nodes[node].wait(_WRITTEN, nodes[node].pages_out)
    for client, session in zip(clients, sessions, strict=True):
        client.close_session(session)
    return hit / total if total else 0.0


def fetch_batches(node: Sidecar, keys: list[Any]) -> list[int]:
    """A warm-up round of ``node`` (empty) looking every prompt up: the pages each
    lookup fetched (those that fetched), scraped between lookups. Later rounds, a Reset
    before each, fetch the same batches."""
    client = node.connect()
    client.reset(MODEL)
    batches = []
    with client.session(600) as session:
        for key in keys:
            b0 = node.metric(r"prefixcache_tier_fetch_bytes_total\{.*\}")
            client.match(MODEL, key, session=session)
            got = node.metric(r"prefixcache_tier_fetch_bytes_total\{.*\}") - b0
            if got:
                batches.append(round(got / node.page_bytes))
    return batches


def fetch_round(node: Sidecar, keys: list[Any]) -> tuple[float, float]:
    """One round of ``node`` looking every prompt up after a Reset: the bytes fetched
    and the GB/s (fetch bytes over fetch seconds, as the metrics count them: each
    fetch from before its store call is handed to a worker thread until the loop has
    its answer)."""
    client = node.connect() if node.client is None else node.client
    client.reset(MODEL)
    b0 = node.metric(r"prefixcache_tier_fetch_bytes_total\{.*\}")
    s0 = node.metric(r"prefixcache_tier_fetch_seconds_total\{.*\}")
    with client.session(600) as session:
        for key in keys:
            client.match(MODEL, key, session=session)
    fetched = node.metric(r"prefixcache_tier_fetch_bytes_total\{.*\}") - b0
    seconds = node.metric(r"prefixcache_tier_fetch_seconds_total\{.*\}") - s0
    return fetched, fetched / seconds / 1e9 if seconds else 0.0


class MooncakeReader:
    """Mooncake's own ``batch_get_into_multi_buffers``: this process reads ``pages``
    pages of these parts that another process put into its own segment (the baseline
    of our fetch path). Only the calls are timed; their arguments are built before."""

    def __init__(self, master: str, parts: list[int], pages: int) -> None:
        self.parts, self.pages = parts, pages
        self.page_bytes = sum(parts)
        prefix = f"bench/{len(parts)}x{parts[0]}/"
        self.writer = subprocess.Popen([sys.executable, "-c", _WRITER, master, str(pages),
                                        json.dumps(parts), prefix],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       env=_env(), text=True)
        self.store: Any = None
        try:
            line = self.writer.stdout.readline() if self.writer.stdout else ""
            if line.strip() != "ready":
                raise RuntimeError(f"the Mooncake writer did not start: {line!r}")
            os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
            from mooncake.store import MooncakeDistributedStore

            self.store = MooncakeDistributedStore()
            if self.store.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "",
                                master):
                raise RuntimeError("Mooncake setup failed")
            self.buf = np.zeros(pages * self.page_bytes, np.uint8)
            self.store.register_buffer(self.buf.ctypes.data, self.buf.nbytes)
            self.keys = [f"{prefix}{i}" for i in range(pages)]
        except BaseException:
            self.close()
            raise

    def round(self, batches: list[int]) -> float:
        """Read the pages, ``batches[i]`` pages in call ``i``: GB/s."""
        calls, at = [], 0
        for n in batches:
            ptrs = [[self.buf.ctypes.data + i * self.page_bytes + sum(self.parts[:j])
                     for j in range(len(self.parts))] for i in range(at, at + n)]
            calls.append((self.keys[at:at + n], ptrs, [self.parts] * n))
            at += n
        seconds = 0.0
        for keys, ptrs, sizes in calls:
            start = time.perf_counter()
            codes = self.store.batch_get_into_multi_buffers(keys, ptrs, sizes)
            seconds += time.perf_counter() - start
            if any(c != self.page_bytes for c in codes):
                raise RuntimeError(f"Mooncake get failed: {codes[:4]}")
        return at * self.page_bytes / seconds / 1e9

    def memcpy(self, rounds: int) -> float:
        """A memcpy of the same bytes, a page at a time: GB/s, best of ``rounds``."""
        buf, step = self.buf, self.page_bytes
        dst = np.empty_like(buf)
        best = float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            for i in range(0, buf.nbytes, step):
                np.copyto(dst[i:i + step], buf[i:i + step])
            best = min(best, time.perf_counter() - start)
        return buf.nbytes / best / 1e9

    def close(self) -> None:
        if self.writer.stdin and not self.writer.stdin.closed:
            self.writer.stdin.close()  # the writer leaves the store meanwhile
        if self.store is not None:
            self.store.close()
            self.store = None
        self.writer.wait(30)


def mooncake_get_gbps(master: str, parts: list[int], pages: int, batch: int,
                      rounds: int = 3) -> float:
    """Mooncake's own reads of ``pages`` pages of these parts, ``batch`` a call: GB/s,
    best of ``rounds`` (after one to warm up)."""
    reader = MooncakeReader(master, parts, pages)
    try:
        batches = [min(batch, pages - at) for at in range(0, pages, batch)]
        reader.round(batches)
        return max(reader.round(batches) for _ in range(rounds))
    finally:
        reader.close()


# The other process of mooncake_get_gbps: puts the pages into its own segment and holds
# them until its stdin closes.
_WRITER = """
import json, os, sys
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
import numpy as np
from mooncake.store import MooncakeDistributedStore, ReplicateConfig
master, pages, parts, prefix = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
page = sum(parts)
store = MooncakeDistributedStore()
assert store.setup("127.0.0.1", "P2PHANDSHAKE", pages * page + (64 << 20), 16 << 20, "tcp", "",
                   master) == 0
buf = np.random.default_rng(0).integers(0, 255, pages * page, dtype=np.uint8)
store.register_buffer(buf.ctypes.data, buf.nbytes)
cfg = ReplicateConfig(); cfg.replica_num = 1; cfg.preferred_segment = store.get_hostname()
for at in range(0, pages, 64):
    n = min(64, pages - at)
    ptrs = [[buf.ctypes.data + (at + i) * page + sum(parts[:j]) for j in range(len(parts))]
            for i in range(n)]
    codes = store.batch_put_from_multi_buffers([f"{prefix}{at + i}" for i in range(n)], ptrs,
                                               [parts] * n, cfg)
    assert all(c == 0 for c in codes), codes
print("ready", flush=True)
sys.stdin.read()
store.close()
"""


def _unique_pages(keys: list[Any], page_size: int) -> int:
    """Distinct pages of the trace, each named by its chained hash (a page is the same
    page only after the same prefix): what one sidecar must hold to evict nothing."""
    seen: set[bytes] = set()
    step = 4 * page_size
    for key in keys:
        data, prior = memoryview(key).cast("B"), b""
        for at in range(0, len(data) - step + 1, step):
            prior = hashlib.sha256(prior + data[at:at + step]).digest()
            seen.add(prior)
    return len(seen)


def trace_keys(args: argparse.Namespace, page_size: int, limit: int) -> list[Any]:
    path = None if args.synthetic or not args.trace.exists() else args.trace
    return [k for k in load_expanded(path, page_size, limit).keys if len(k)]


def fetch_phase(args: argparse.Namespace, keys: list[Any], tmp: Path) -> dict[str, Any]:
    """The fetch path alone, at a realistic page size (``--fetch-*``): a sidecar caches
    ``keys`` and writes them to the store, then another, empty, looks every prompt up,
    so everything it fetches crosses from the first one's segment (a warm-up round,
    then ``--rounds`` rounds, a Reset before each); in alternate rounds, Mooncake's own
    reads of as many pages, in the same batches, from another process's segment."""
    page_size = args.fetch_page_size
    unique = _unique_pages(keys, page_size)
    geometry = argparse.Namespace(page_size=page_size, layers=args.fetch_layers,
                                  heads=args.fetch_heads, head_dim=args.fetch_head_dim)
    model = _model(geometry, (unique + 2) * page_size + max(map(len, keys)))
    row = args.fetch_heads * args.fetch_head_dim * 2
    parts = [page_size * row] * (2 * args.fetch_layers)
    master = Master(tmp)
    tier = {"master": master.address, "timeout": 10.0,
            "segment_bytes": max(64 << 20, 2 * unique * sum(parts))}
    # The reader starts beside the writer (it looks nothing up until the writer is done).
    nodes = [Sidecar(tmp, "fetch-writer", model, tier), Sidecar(tmp, "fetch-reader", model, tier)]
    out: dict[str, Any] = {"fetch_page_bytes": sum(parts), "fetch_requests": len(keys)}
    reader: MooncakeReader | None = None
    try:
        for node in nodes:
            node.wait(r"prefixcache_tier_connected", 1)
        replay(nodes[:1], keys, page_size, True)
        batches = fetch_batches(nodes[1], keys)
        pages = sum(batches)
        if not pages:
            return out
        out["fetch_bytes"] = pages * sum(parts)
        out["fetch_pages_per_lookup"] = round(pages / len(batches))
        # Ours and Mooncake's in alternate rounds, the same batches of the same pages,
        # so that both see the same load of the machine (which swings either by 2x).
        reader = MooncakeReader(master.address, parts, pages)
        reader.round(batches)  # warm-up: its buffer's first touch
        ours, theirs = [], []
        for _ in range(args.rounds):
            ours.append(fetch_round(nodes[1], keys)[1])
            theirs.append(reader.round(batches))
        out["fetch_gbps"], out["mooncake_get_gbps"] = max(ours), max(theirs)
        out["fetch_vs_mooncake_rounds"] = [o / t for o, t in zip(ours, theirs, strict=True)]
        out["memcpy_gbps"] = reader.memcpy(args.rounds)
        for node in nodes:  # they leave the store while the reader does
            node.signal()
        reader.close()
        reader = None
        _stop_all(nodes)
        if args.split:
            # The other split (docs/across-nodes.md): an object per page and buffer
            # (layer, K or V), the same bytes in len(parts) times the objects.
            batch = out["fetch_pages_per_lookup"]
            out["mooncake_get_gbps_object_per_buffer"] = mooncake_get_gbps(
                master.address, parts[:1], pages * len(parts), batch * len(parts),
                args.rounds)
    finally:
        if reader is not None:
            reader.close()
        _stop_all(nodes)
        master.stop()
    return out


def hit_ratios(args: argparse.Namespace, keys: list[Any], model: dict[str, Any], unique: int,
               page_bytes: int, tmp: Path) -> dict[str, Any]:
    """The three replays: one sidecar, two without the tier, two with it (the sidecars
    without the tier start together, and so do those with it)."""
    out: dict[str, Any] = {}
    plain = [Sidecar(tmp, name, model, None) for name in ("one", "plain0", "plain1")]
    try:
        out["single_hit_ratio"] = replay(plain[:1], keys, args.page_size, False)
        out["two_nodes_no_tier_hit_ratio"] = replay(plain[1:], keys, args.page_size, False)
    finally:
        _stop_all(plain)
    master = Master(tmp)
    tier = {"master": master.address, "timeout": 5.0,
            "segment_bytes": max(64 << 20, 2 * unique * page_bytes)}
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
        _stop_all(pair)
        master.stop()
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--synthetic", action="store_true",
                        help="a synthetic conversation trace instead of the file")
    parser.add_argument("--limit", type=int, default=200, help="requests replayed")
    parser.add_argument("--page-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--fetch-requests", type=int, default=8,
                        help="requests the fetch measurement replays (0: none)")
    parser.add_argument("--fetch-page-size", type=int, default=64)
    parser.add_argument("--fetch-layers", type=int, default=2)
    parser.add_argument("--fetch-heads", type=int, default=4)
    parser.add_argument("--fetch-head-dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of the fetch measurements (the best counts)")
    parser.add_argument("--fetch-only", action="store_true",
                        help="only the fetch measurement (no hit-ratio runs)")
    parser.add_argument("--no-split", dest="split", action="store_false",
                        help="skip Mooncake's reads of an object per page and buffer")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    path = None if args.synthetic or not args.trace.exists() else args.trace
    trace = load_expanded(path, args.page_size, args.limit)
    keys = [k for k in trace.keys if len(k)]
    unique = _unique_pages(keys, args.page_size)
    pool_tokens = (unique + 2 * args.page_size) * args.page_size + max(map(len, keys))
    model = _model(args, pool_tokens)
    row_bytes = args.heads * args.head_dim * 2
    parts = [args.page_size * row_bytes] * (2 * args.layers)
    page_bytes = sum(parts)
    out: dict[str, Any] = {"trace": str(path or "synthetic"), "requests": len(keys),
                           "tokens": sum(map(len, keys)), "page_size": args.page_size,
                           "page_bytes": page_bytes, "pool_tokens": pool_tokens}
    with tempfile.TemporaryDirectory(prefix="tier-bench-") as tmp_name:
        tmp = Path(tmp_name)
        if not args.fetch_only:
            out.update(hit_ratios(args, keys, model, unique, page_bytes, tmp))
        if args.fetch_requests:
            out.update(fetch_phase(args, trace_keys(args, args.fetch_page_size,
                                                    args.fetch_requests), tmp))
    single = out.get("single_hit_ratio")
    if single is not None:
        out["tier_vs_single"] = out["two_nodes_tier_hit_ratio"] / single if single else None
    if out.get("mooncake_get_gbps"):
        out["fetch_vs_mooncake"] = out["fetch_gbps"] / out["mooncake_get_gbps"]
        out["fetch_vs_mooncake_median"] = float(np.median(out["fetch_vs_mooncake_rounds"]))
    _print(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return out


def _print(out: dict[str, Any]) -> None:
    print(f"trace {out['trace']}: {out['requests']} requests, {out['tokens']} tokens, "
          f"pages of {out['page_size']} tokens ({out['page_bytes']} bytes)")
    if "single_hit_ratio" in out:
        print("| run | token hit ratio |")
        print("|---|---|")
        print(f"| one sidecar, whole trace | {out['single_hit_ratio']:.4f} |")
        print(f"| two nodes, no tier | {out['two_nodes_no_tier_hit_ratio']:.4f} |")
        print(f"| two nodes, tier | {out['two_nodes_tier_hit_ratio']:.4f} |")
    if out.get("tier_vs_single") is not None:
        print(f"two nodes with the tier / one sidecar: {out['tier_vs_single']:.3f} "
              "(target >= 0.95)")
    if out.get("mooncake_get_gbps"):
        print(f"fetches of {out['fetch_requests']} requests' pages, "
              f"{out['fetch_page_bytes']} bytes each:")
        print("| fetch | GB/s |")
        print("|---|---|")
        print(f"| ours (Match's fetch, {out['fetch_pages_per_lookup']} pages a lookup) | "
              f"{out['fetch_gbps']:.3f} |")
        if "replay_fetch_gbps" in out:
            print(f"| ours, during the two-node replay ({out['page_bytes']}-byte pages) | "
                  f"{out['replay_fetch_gbps']:.3f} |")
        print(f"| Mooncake batch_get_into, same pages and batches | "
              f"{out['mooncake_get_gbps']:.3f} |")
        print(f"| memcpy, same bytes | {out['memcpy_gbps']:.3f} |")
        if out.get("mooncake_get_gbps_object_per_buffer"):
            print("| Mooncake batch_get_into, an object per page and K/V buffer | "
                  f"{out['mooncake_get_gbps_object_per_buffer']:.3f} |")
        rounds = ", ".join(f"{r:.2f}" for r in out["fetch_vs_mooncake_rounds"])
        print(f"ours / Mooncake's: {out['fetch_vs_mooncake']:.3f} best over best, "
              f"{out['fetch_vs_mooncake_median']:.3f} median of the rounds ({rounds}); "
              "target >= 0.8")


if __name__ == "__main__":
    main()
