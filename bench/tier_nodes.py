"""What both tier benches (tier_fetch.py, tier_replay.py; run by tier.py) start and
drive: a ``mooncake_master``, ``prefixcache serve`` sidecars with their metrics scraped
over HTTP, the model they serve, and a replay of the trace's prompts over them."""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from bench.trace import load_expanded
from prefixcache.client import PrefixCacheClient

_REPO = Path(__file__).resolve().parents[1]
MODEL = "m"
_CLI = [sys.executable, "-c", "from prefixcache.server.cli import main; raise SystemExit(main())"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env() -> dict[str, str]:
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
            [
                "mooncake_master",
                f"--rpc_port={self.port}",
                "--rpc_address=127.0.0.1",
                f"--metrics_port={_free_port()}",
                "--metrics_host=127.0.0.1",
                "--enable_metric_reporting=false",
            ],
            env={**os.environ, "GLOG_minloglevel": "1"},
            stdout=log,
            stderr=log,
        )
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

    def __init__(
        self, tmp: Path, name: str, model: dict[str, Any], tier: dict[str, Any] | None
    ) -> None:
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
            [
                *_CLI,
                "serve",
                "--config",
                str(folder / "pc.yaml"),
                "--listen",
                self.address,
                "--metrics-port",
                str(self.metrics_port),
                "--metrics-host",
                "127.0.0.1",
            ],
            env=child_env(),
            stdout=subprocess.DEVNULL,
            stderr=self.stderr,
        )
        self.client: PrefixCacheClient | None = None
        self.pages_out = 0.0
        pool = model["pool"]
        self.page_bytes = (
            model["page_size"] * pool["k_heads"] * pool["k_head_dim"] * 2 * 2 * pool["layers"]
        )

    def metric(self, pattern: str) -> float:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10
        ) as reply:
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
                raise RuntimeError(
                    f"{pattern} stayed at {value} (< {minimum}); see {self.stderr.name}"
                )
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
                    raise RuntimeError(
                        f"the sidecar did not start; see {self.stderr.name}"
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


def stop_all(nodes: list[Sidecar]) -> None:
    """Stop sidecars together (each takes a second or more to leave the store)."""
    for node in nodes:
        node.signal()
    for node in nodes:
        node.join()


def model_config(args: argparse.Namespace, pool_tokens: int) -> dict[str, Any]:
    return {
        "name": MODEL,
        "page_size": args.page_size,
        "pool": {
            "size": pool_tokens,
            "layers": args.layers,
            "k_heads": args.heads,
            "k_head_dim": args.head_dim,
            "dtype": "float16",
        },
    }


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


def unique_pages(keys: list[Any], page_size: int) -> int:
    """Distinct pages of the trace, each named by its chained hash (a page is the same
    page only after the same prefix): what one sidecar must hold to evict nothing."""
    seen: set[bytes] = set()
    step = 4 * page_size
    for key in keys:
        data, prior = memoryview(key).cast("B"), b""
        for at in range(0, len(data) - step + 1, step):
            prior = hashlib.sha256(prior + data[at : at + step]).digest()
            seen.add(prior)
    return len(seen)


def trace_keys(args: argparse.Namespace, page_size: int, limit: int) -> list[Any]:
    path = None if args.synthetic or not args.trace.exists() else args.trace
    return [k for k in load_expanded(path, page_size, limit).keys if len(k)]
