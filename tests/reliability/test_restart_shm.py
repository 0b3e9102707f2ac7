"""Restart after SIGKILL when the pool fills much of ``shm_dir``.

A killed server leaves its pool files behind. The next start removes them, but it used
to check that its pools fit first, counting the dead server's files as taken: with the
pool over half of ``shm_dir`` every restart exited 2, and with a worker still mapping an
old pool, a third was enough. The service must come up, counting only what it adds, and
log the memory a still-mapped dead pool pins.

``shm_dir`` is a real tmpfs of a few MiB, mounted in a mount namespace of its own
(``unshare -rm``: no root needed); the servers and the worker that maps the old pool run
inside it (``nsenter``), the test talks to them over the socket outside it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from harness import SOURCE_PATH, wait_serving

pytestmark = pytest.mark.slow  # restarts beside large dead pools: 8-31 s a test at load 10

MiB = 1 << 20
# 13 MiB of KV: (size + page_size) rows of K and V, 64 float16 each (256 bytes a row).
POOL_ROWS = 13 * MiB // 256 - 1
CONFIG = f"""\
models:
  - name: m
    page_size: 1
    pool: {{size: {POOL_ROWS}, layers: 1, k_heads: 1, k_head_dim: 64}}
"""
ENV = {
    **os.environ,
    "PYTHONPATH": SOURCE_PATH,
    "OMP_NUM_THREADS": "1",
    "PREFIXCACHE_LOG_FORMAT": "json",
}
# Maps every pool file of the directory, as an attached worker does, and holds them.
MAPPER = """\
import mmap, os, sys
maps = []
for name in sorted(os.listdir(sys.argv[1])):
    if name.startswith("prefixcache-") and not name.endswith(".lock"):
        with open(os.path.join(sys.argv[1], name), "r+b") as f:
            maps.append(mmap.mmap(f.fileno(), 0))
print(len(maps), flush=True)
sys.stdin.read()
"""


class Namespace:
    """A tmpfs of ``mib`` MiB at ``tmp/shm``, seen only by commands run through ``run``."""

    def __init__(self, tmp: Path, mib: int) -> None:
        for tool in ("unshare", "nsenter", "mount"):
            if shutil.which(tool) is None:
                pytest.skip(f"needs {tool} (util-linux) to mount a small tmpfs")
        self.shm = tmp / "shm"
        self.shm.mkdir()
        self.holder = subprocess.Popen(
            [
                "unshare",
                "-rm",
                "--propagation",
                "private",
                "sh",
                "-c",
                f'mount -t tmpfs -o size={mib}m pcshm "$0" && echo ready && exec sleep 600',
                str(self.shm),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.holder.stdout is not None
        if self.holder.stdout.readline().strip() != "ready":
            self.holder.kill()
            _, err = self.holder.communicate()
            pytest.skip(f"cannot mount a tmpfs in a user namespace here: {err.strip()}")

    def argv(self, *command: str) -> list[str]:
        return [
            "nsenter",
            "-t",
            str(self.holder.pid),
            "-U",
            "-m",
            "--preserve-credentials",
            *command,
        ]

    def run(self, *command: str) -> str:
        return subprocess.run(
            self.argv(*command), check=True, capture_output=True, text=True, timeout=30
        ).stdout

    def files(self) -> list[str]:
        return sorted(self.run("ls", "-A", str(self.shm)).split())

    def used_mib(self) -> float:
        used = self.run("df", "-B1", "--output=used", str(self.shm)).split()[-1]
        return int(used) / MiB

    def close(self) -> None:
        self.holder.kill()
        self.holder.wait(30)


class Server:
    """One start of ``prefixcache serve`` inside the namespace, its log in a file."""

    def __init__(self, ns: Namespace, tmp: Path, n: int, wait: bool = True) -> None:
        (tmp / "pc.yaml").write_text(CONFIG)
        self.address = f"unix:{tmp / 'pc.sock'}"
        self.log = tmp / f"serve-{n}.log"
        with self.log.open("wb") as err:
            self.proc = subprocess.Popen(
                ns.argv(
                    sys.executable,
                    "-m",
                    "prefixcache.server.cli",
                    "serve",
                    "--config",
                    str(tmp / "pc.yaml"),
                    "--listen",
                    self.address,
                    "--metrics-port",
                    "-1",
                    "--shm-dir",
                    str(ns.shm),
                ),
                env=ENV,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        if not wait:
            return
        try:
            wait_serving(self.proc, self.address, timeout=60)
        except RuntimeError as exc:
            raise AssertionError(f"{exc}\n{self.log.read_text()}") from None

    def records(self, message: str) -> list[dict[str, Any]]:
        lines = [
            json.loads(line) for line in self.log.read_text().splitlines() if line.startswith("{")
        ]
        return [r for r in lines if r.get("event") == message]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)


@contextmanager
def namespace(tmp: Path, mib: int) -> Iterator[tuple[Namespace, list[Server]]]:
    ns = Namespace(tmp, mib)
    servers: list[Server] = []
    try:
        yield ns, servers
    finally:
        for server in servers:
            server.stop()
        ns.close()


REMOVED = "removed shared-memory files of dead services"


def test_restart_after_sigkill_with_the_pool_over_half_of_shm_dir(tmp_path: Path) -> None:
    with namespace(tmp_path, 24) as (ns, servers):
        servers.append(Server(ns, tmp_path, 0))
        assert ns.used_mib() > 12  # the pool really is in the tmpfs, over half of it
        servers[0].kill()
        # Counting the dead pool's files as used would refuse this start ("13.0 MiB
        # needed, 11.0 MiB free", exit 2), and every restart after it.
        servers.append(Server(ns, tmp_path, 1))
        removed = servers[1].records(REMOVED)
        assert len(removed) == 1 and removed[0]["pinned_bytes"] == 0
        assert removed[0]["bytes"] >= 13 * MiB
        servers[1].stop()
        assert servers[1].proc.returncode == 0
        assert ns.files() == [] and ns.used_mib() < 1  # nothing left behind


def test_restart_while_a_worker_still_maps_a_dead_pool(tmp_path: Path) -> None:
    """The dead pool a worker maps stays pinned (unlinking frees only its name); the log
    says so, and the start after the next kill still fits beside it."""
    with namespace(tmp_path, 36) as (ns, servers):
        servers.append(Server(ns, tmp_path, 0))
        servers[0].kill()
        worker = subprocess.Popen(
            ns.argv(sys.executable, "-c", MAPPER, str(ns.shm)),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert worker.stdout is not None and int(worker.stdout.readline()) == 2
            servers.append(Server(ns, tmp_path, 1))
            assert ns.used_mib() > 26  # the worker's dead pool and the new one
            servers[1].kill()
            # Only the server's own stale files count as free: counting server 1's too
            # (10 MiB free) would refuse the start, exit 2.
            servers.append(Server(ns, tmp_path, 2))
            # Server 1 removed the mapped pool's names, but its memory stayed pinned;
            # server 2's removal of server 1's unmapped pool freed it all.
            pinned = servers[1].records(REMOVED)
            assert len(pinned) == 1 and pinned[0]["pinned_bytes"] >= 12 * MiB
            freed = servers[2].records(REMOVED)
            assert len(freed) == 1 and freed[0]["pinned_bytes"] < MiB
        finally:
            worker.communicate("", timeout=30)  # the worker unmaps and exits
        servers[2].stop()
        assert servers[2].proc.returncode == 0
        assert ns.files() == [] and ns.used_mib() < 1


def test_a_restart_that_cannot_fit_beside_a_mapped_dead_pool_says_so(tmp_path: Path) -> None:
    """Over half of shm_dir, with the dead pool still mapped: the memory really is
    taken, so the start is refused (exit 2), naming what holds it."""
    with namespace(tmp_path, 24) as (ns, servers):
        servers.append(Server(ns, tmp_path, 0))
        servers[0].kill()
        worker = subprocess.Popen(
            ns.argv(sys.executable, "-c", MAPPER, str(ns.shm)),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert worker.stdout is not None and int(worker.stdout.readline()) == 2
            refused = Server(ns, tmp_path, 1, wait=False)
            assert refused.proc.wait(60) == 2
            log = refused.log.read_text()
            assert "server.shm_dir: the CPU pools need 13.0 MiB" in log, log
            assert "still maps" in log, log
            assert ns.files() == []  # the dead pool's names are gone all the same
        finally:
            worker.communicate("", timeout=30)
        assert ns.used_mib() < 1  # and its memory once the worker let go
