"""Real parts for the tier's tests: a ``mooncake_master`` on free loopback ports,
``prefixcache serve`` subprocesses with ``server.tier`` pointing at it, and another
client of the master in the test process (``RawStore``: what anything else on the
cluster's network can run), with the keys of a prompt's pages (``prompt_keys``).

Tests that use these skip (with the reason) only when the Mooncake wheel of the
``tier`` extra cannot be imported (not installed, or libibverbs1 missing).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import pytest
import yaml
from harness import SOURCE_PATH

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-c", "from prefixcache.server.cli import main; raise SystemExit(main())"]


def mooncake_master() -> str | None:
    """The ``mooncake_master`` of this interpreter's environment (a venv's bin, which
    need not be on PATH: CI's e2e stage runs its venv's python directly), else PATH's."""
    return shutil.which("mooncake_master", path=sysconfig.get_path("scripts")) or shutil.which(
        "mooncake_master"
    )


def mooncake_missing() -> str | None:
    """Why the Mooncake client cannot run here, or None."""
    if mooncake_master() is None:
        return "mooncake_master is not installed (pip install '.[tier]')"
    probe = subprocess.run(
        [sys.executable, "-c", "import mooncake.store"], capture_output=True, text=True, timeout=60
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return f"mooncake.store does not import ({last}); needs libibverbs1"
    return None


def needs_mooncake() -> None:
    reason = mooncake_missing()
    if reason is not None:
        pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[Any], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"mooncake_master did not listen on {port}")


class Master:
    """A ``mooncake_master`` on loopback; ``kill`` and ``start`` again on the same port."""

    def __init__(self, tmp: Path, client_ttl: int = 2) -> None:
        # Seconds the master keeps a client that stopped heartbeating (and its objects).
        self.client_ttl = client_ttl
        self.port = free_port()
        self.metrics_port = free_port()
        self.log_path = tmp / "master.log"
        self.proc: subprocess.Popen[Any] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {**os.environ, "GLOG_minloglevel": "1"}
        binary = mooncake_master()
        if binary is None:
            raise RuntimeError("mooncake_master is not installed (pip install '.[tier]')")
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                [
                    binary,
                    f"--rpc_port={self.port}",
                    "--rpc_address=127.0.0.1",
                    f"--metrics_port={self.metrics_port}",
                    "--metrics_host=127.0.0.1",
                    "--enable_metric_reporting=false",
                    f"--client_ttl={self.client_ttl}",
                ],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        _wait_port(self.port, self.proc)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def tier_config(
    master: str,
    *,
    timeout: float = 0.5,
    models: list[dict[str, Any]] | None = None,
    tier: dict[str, Any] | None = None,
    **server: Any,
) -> dict[str, Any]:
    """A small config with the tier on: private pools, tiny segments; ``tier``: more
    ``server.tier`` keys."""
    return {
        "server": {
            "shm_dir": "off",
            "check_integrity": True,
            "tier": {
                "master": master,
                "segment_bytes": 32 << 20,
                "timeout": timeout,
                **(tier or {}),
            },
            **server,
        },
        "models": models
        or [
            {
                "name": "m",
                "kind": "radix",
                "page_size": 4,
                "pool": {
                    "size": 256,
                    "layers": 2,
                    "k_heads": 2,
                    "k_head_dim": 8,
                    "dtype": "float16",
                },
            }
        ],
    }


class Node:
    """One ``prefixcache serve`` with the tier on: a "node" of the cluster."""

    def __init__(self, tmp: Path, name: str, config: dict[str, Any]) -> None:
        self.dir = tmp / name
        self.dir.mkdir()
        (self.dir / "pc.yaml").write_text(yaml.safe_dump(config))
        self.address = f"unix:{self.dir / 'pc.sock'}"
        self.metrics_port = free_port()
        self.stderr_path = self.dir / "stderr"
        self._stderr: IO[str] = open(self.stderr_path, "w")  # noqa: SIM115 (closed in stop)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXCACHE_")}
        env.update(PYTHONPATH=SOURCE_PATH, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [
                *CLI,
                "serve",
                "--config",
                str(self.dir / "pc.yaml"),
                "--listen",
                self.address,
                "--metrics-port",
                str(self.metrics_port),
                "--metrics-host",
                "127.0.0.1",
                "--grace-period",
                "1",
            ],
            cwd=self.dir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
        )

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def metrics(self) -> dict[str, float]:
        """The scrape, as ``{"name{labels}": value}``."""
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5
        ) as reply:
            text = reply.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def metric(self, pattern: str) -> float:
        """The sum of the samples whose ``name{labels}`` matches ``pattern``."""
        return sum(v for k, v in self.metrics().items() if re.fullmatch(pattern, k))

    def wait(self, pattern: str, minimum: float, timeout: float = 30.0) -> float:
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.metric(pattern)
            except OSError:
                value = float("nan")
            if value >= minimum:
                return value
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.stderr}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{pattern} stayed at {value} (< {minimum}):\n{self.stderr[-3000:]}"
                )
            time.sleep(0.1)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(10)
        self._stderr.close()
        return code


@contextmanager
def two_nodes(
    tmp: Path, config_for: Callable[[str], dict[str, Any]]
) -> Iterator[tuple[Master, Node, Node]]:
    """A master and nodes ``a`` and ``b`` with the config ``config_for`` gives for the
    master's address, once both are connected to the store; both must stop cleanly."""
    needs_mooncake()
    master = Master(tmp)
    master.start()
    nodes: list[Node] = []
    try:
        for name in ("a", "b"):
            nodes.append(Node(tmp, name, config_for(master.address)))
        for node in nodes:
            node.wait(r"prefixcache_tier_connected", 1)
        yield master, nodes[0], nodes[1]
    finally:
        codes = [node.stop() for node in nodes]
        master.stop()
    assert codes == [0] * len(nodes), [n.stderr[-2000:] for n in nodes]


@contextmanager
def frozen_master_node(tmp: Path, model: dict[str, Any]) -> Iterator[tuple[Master, Node]]:
    """Node ``a`` with ``model``, connected to a master that is then frozen (SIGSTOP);
    the master is thawed before both stop, and the node must stop cleanly."""
    needs_mooncake()
    master = Master(tmp)
    master.start()
    node = Node(tmp, "a", tier_config(master.address, models=[model]))
    try:
        node.wait(r"prefixcache_tier_connected", 1)
        if master.proc is None:
            raise RuntimeError("the master did not start")
        master.proc.send_signal(signal.SIGSTOP)
        yield master, node
    finally:
        if master.proc is not None and master.proc.poll() is None:
            master.proc.send_signal(signal.SIGCONT)
        code = node.stop()
        master.stop()
    assert code == 0, node.stderr[-2000:]


class RawStore:
    """Another client of the master, in the test process: Mooncake's own Python client
    with raw bytes in and out, as any process that reaches the master can run it. Its
    objects live in its own segment, so they last as long as it does."""

    def __init__(self, master: Master) -> None:
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        self.store: Any = MooncakeDistributedStore()
        if self.store.setup(
            "127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", master.address
        ):
            raise RuntimeError(f"a raw Mooncake client could not set up at {master.address}")
        self.config = ReplicateConfig()
        self.config.replica_num = 1
        self.config.preferred_segment = self.store.get_hostname()

    def get(self, key: str) -> bytes:
        return bytes(self.store.get(key))

    def put(self, key: str, data: bytes) -> int:
        """Mooncake's put: a key held already is left as it is (and answers 0)."""
        return int(self.store.put(key, data, self.config))

    def upsert(self, key: str, data: bytes) -> int:
        return int(self.store.upsert(key, data, self.config))

    def remove(self, key: str) -> int:
        return int(self.store.remove(key, True))

    def exists(self, key: str) -> bool:
        return int(self.store.is_exist(key)) == 1

    def close(self) -> None:
        self.store.close()


def node_models(config: dict[str, Any]) -> tuple[Any, Any]:
    """A node config's (first model, tenants), as the server reads them."""
    from prefixcache.server.config import load_config

    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as fh:
        yaml.safe_dump(
            {
                "server": {"tenants": config["server"].get("tenants", [])},
                "models": config["models"],
            },
            fh,
        )
        fh.flush()
        cfg = load_config(fh.name, env={})
    return cfg.models[0], cfg.server.tenants


def prompt_keys(
    config: dict[str, Any],
    tokens: list[int],
    extra_key: str | None = None,
    secret: bytes | None = None,
) -> list[str]:
    """The store keys of ``tokens``' whole pages as a node with ``config`` names them
    (with ``secret``: as a node holding it does)."""
    import numpy as np

    from prefixcache.cache.hashing import hash_pages
    from prefixcache.server.tier.keys import KeyMaker

    model, tenants = node_models(config)
    whole = len(tokens) - len(tokens) % model.page_size
    hashes = hash_pages(
        np.asarray(tokens[:whole], dtype="<u4").tobytes(), 4 * model.page_size, None
    )
    return KeyMaker(model, tenants, secret).keys(extra_key, 1, hashes)
