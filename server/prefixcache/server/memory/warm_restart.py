"""Warm restart (``server.warm_restart``): the cache outlives a clean restart.

A clean stop (SIGTERM, SIGINT: app.py's drain) ends every session, then keeps the CPU
pools' shared-memory files under ``shm_dir`` and writes a snapshot of every model's
tree beside them (warm_snapshot.py, tree_snapshot.py). The next start with the same
models takes the files over (renamed to its own owner name, mapped as they are) and
rebuilds the trees: cached prompts hit again, on byte-identical KV. It is a new start
all the same: a new epoch, no sessions, no locks; every restored node is unlocked and
evictable, and every handle from before is refused as stale.

Anything that does not add up starts cold, with one log line saying why, counted in
``prefixcache_warm_restarts_total{outcome}``:

- ``no_snapshot``: none was written by a clean stop since the pool was last written.
- ``corrupt``: torn, damaged, or a tree that does not rebuild.
- ``config_changed``: another model list, kind, page size or pool geometry or dtype.
- ``foreign``: another user's files, or an owner that is still alive.
- ``stale``: pool files gone, replaced or written since the snapshot.
- ``unsupported``: a model whose kind is not restored (radix is; chunk models hold
  nothing to restore, and their pools are taken over all the same).

After a SIGKILL (or an OOM kill, a node crash) the start is cold. A start consumes
the snapshot it reads (removes it first thing), and only a clean stop writes one, after
the last call is done and every session has ended. So a snapshot exists only if no
pool write can have happened after it: a killed run never leaves one, and what a
killed run's workers may have half-written is never served. Recovering the tree after
a kill (a journal, per-page checksums) would save the cache at the cost of trusting
pages nobody can vouch for; the cold start is the safe choice.

Workers. A clean stop ends every session, and with them their write fences
(write_fence.py): every fence record reads 0, so a worker that follows the fence
protocol copies nothing more into the pool. A worker that is inside a copy at the
stop holds its record; then no snapshot is written (the next start is cold, and the
old pool files are swept), since its copy could land in slots the next run hands out.
A worker that survives the restart still maps the old files, which are the new pool
now: its epoch is stale, so its slots, locks and fence are refused, and it must
DescribePool and open a new session (the files have new names, the same memory)
before it writes again. A worker that writes through the mapped pool without a fence
is on its own, with or without a warm restart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixcache.cache import CacheError
from prefixcache.cache.radix.tree_snapshot import decode, encode, restore, take

from ..config import Config
from . import warm_snapshot
from .shared_pool import LOCK_SUFFIX, PREFIX, describe_buffers
from .sizing import Budget, measure
from .warm_snapshot import Refused

log = logging.getLogger("prefixcache.server")

OUTCOMES = ("restored", "no_snapshot", "corrupt", "config_changed", "foreign", "stale",
            "unsupported")
# Chunk models keep nothing between requests: their pool is taken over, with no tree.
SUPPORTED_KINDS = ("radix", "chunk")


def snapshot_path(shm_dir: str, listen: str) -> Path:
    """One snapshot per service: named after its listen address, which no two
    services on a host share (a shm_dir may serve several)."""
    digest = hashlib.sha256(listen.encode()).hexdigest()[:16]
    return Path(shm_dir) / f"{PREFIX}warm-{digest}.snapshot"


@dataclass
class Takeover:
    """A snapshot accepted at start: the old owner's lock (held, so that no other
    start's sweep removes its files meanwhile), the files to adopt and the trees."""

    owner: str
    lock_fd: int
    directory: Path
    files: dict[str, tuple[Path, int]]
    trees: dict[str, bytes]
    written_ns: int

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.files.values())

    def budget(self) -> Budget:
        """The host's budget (sizing.check_fits) with the adopted files counted as
        free: they are in shm_dir, and in host memory, already."""
        budget, nbytes = measure(), self.nbytes
        free = budget.shm_free
        return dataclasses.replace(
            budget, shm_free=lambda directory: free(directory) + nbytes,
            memory=None if budget.memory is None else budget.memory + nbytes)

    def release(self) -> None:
        """Remove what is left of the old owner (its fence file, its lock file), then
        let go of its lock; a second call does nothing."""
        if self.lock_fd < 0:
            return
        for path in self.directory.glob(f"{self.owner}-*"):
            with contextlib.suppress(OSError):
                path.unlink()
        with contextlib.suppress(OSError):
            (self.directory / f"{self.owner}{LOCK_SUFFIX}").unlink()
        if self.lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.lock_fd)
            self.lock_fd = -1


@dataclass
class WarmRestart:
    """This start's side of warm restarts: ``prepare`` and ``restore`` at start,
    ``save`` at a clean stop; ``outcome`` is what the start did (for /metrics)."""

    config: Config
    outcome: str | None = None
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))

    @property
    def path(self) -> Path:
        cfg = self.config.server
        return snapshot_path(cfg.shm_dir, cfg.listen)

    def cold(self, outcome: str, reason: str) -> None:
        self.outcome = outcome
        self.counts[outcome] += 1
        log.warning("warm restart: starting cold", extra={"outcome": outcome,
                                                          "reason": reason})

    # ------------------------------------------------------------------ start

    def prepare(self) -> Takeover | None:
        """Read and check the snapshot (it is removed whatever it holds); None, logged
        and counted, when the start must be cold."""
        try:
            return self._prepare()
        except Refused as exc:
            self.cold(exc.outcome, exc.reason)
            return None

    def _prepare(self) -> Takeover:
        read = warm_snapshot.consume(self.path)
        why = _unsupported(self.config)
        if why is not None:
            raise Refused("unsupported", why)
        if read is None:
            raise Refused("no_snapshot", f"no snapshot at {self.path}: the last run did "
                          "not stop cleanly (or this is the first start)")
        manifest, blobs = read
        if manifest.get("version") != warm_snapshot.VERSION:
            raise Refused("config_changed", f"snapshot format {manifest.get('version')!r}, "
                          f"this version reads {warm_snapshot.VERSION}")
        why = warm_snapshot.changed(manifest.get("models"),
                                    warm_snapshot.fingerprint(self.config.models))
        if why is not None:
            raise Refused("config_changed", why)
        try:
            owner, names = str(manifest["owner"]), list(manifest["trees"])
            files = [(str(f["suffix"]), str(f["name"]), int(f["size"]), int(f["ino"]),
                      int(f["mtime_ns"])) for f in manifest["files"]]
            written = int(manifest["written_ns"])
        except (KeyError, TypeError, ValueError) as exc:
            raise Refused("corrupt", f"the snapshot's manifest lacks {exc}") from exc
        if names != _tree_models(self.config) or len(blobs) != len(names):
            raise Refused("corrupt", "the snapshot's trees are not its models'")
        directory = Path(self.config.server.shm_dir)
        lock_fd = _hold_lock(directory, owner)
        try:
            adopt = _check_files(directory, owner, files)
        except BaseException:
            os.close(lock_fd)
            raise
        return Takeover(owner, lock_fd, directory, adopt, dict(zip(names, blobs,
                                                                  strict=True)), written)

    def restore(self, service: Any, takeover: Takeover) -> None:
        """Rebuild every model's tree over the adopted pools; on any failure every
        model is emptied (cold, logged, counted)."""
        started = time.monotonic()
        takeover.release()
        if len(service.shared.adopted) != len(takeover.files):
            self._empty(service)
            self.cold("stale", f"{len(service.shared.adopted)} of the "
                               f"{len(takeover.files)} pool files were taken over")
            return
        tokens = nodes = 0
        try:
            for name, blob in takeover.trees.items():
                engine = service.engines[name]
                image = decode(blob)
                tokens += restore(engine.cache, engine.allocator, image)
                nodes += image.nodes
            service.check_integrity()
        except (CacheError, KeyError) as exc:  # SnapshotError, IntegrityError
            self._empty(service)
            self.cold("corrupt", f"a tree does not rebuild: {exc}")
            return
        self.outcome = "restored"
        self.counts["restored"] += 1
        log.info("warm restart: cache restored", extra={
            "models": ",".join(takeover.trees), "tokens": tokens, "nodes": nodes,
            "pool_bytes": takeover.nbytes, "seconds": round(time.monotonic() - started, 3),
            "snapshot_age_s": round((time.time_ns() - takeover.written_ns) / 1e9, 1)})

    @staticmethod
    def _empty(service: Any) -> None:
        for engine in service.engines.values():
            engine.cache.reset()
            engine.allocator.clear()

    # ------------------------------------------------------------------- stop

    def save(self, service: Any) -> frozenset[str]:
        """At a clean stop, after the last call: end every session and write the
        snapshot; returns the pool files to keep (none when no snapshot is written,
        with the reason logged)."""
        with contextlib.suppress(FileNotFoundError):  # never leave an older one behind
            self.path.unlink()
        for session in service.sessions:
            service.close_session(session)
        service.settle_fences()
        why = self._unsafe(service)
        if why is not None:
            log.warning("warm restart: no snapshot written; the next start is cold",
                        extra={"reason": why})
            return frozenset()
        names = _tree_models(self.config)
        images = [take(service.engines[name].cache) for name in names]
        paths = sorted({h.shm_path for e in service.engines.values()
                        for h in describe_buffers(e, service.shared)})
        owner = service.shared.owner
        files = []
        for p in paths:
            st = os.stat(p)
            files.append({"suffix": Path(p).name.removeprefix(f"{owner}-"),
                          "name": Path(p).name, "size": st.st_size, "ino": st.st_ino,
                          "mtime_ns": st.st_mtime_ns})
        manifest = {"version": warm_snapshot.VERSION, "owner": owner, "uid": os.geteuid(),
                    "written_ns": time.time_ns(), "trees": names, "files": files,
                    "models": warm_snapshot.fingerprint(self.config.models)}
        try:
            size = warm_snapshot.write(self.path, manifest, [encode(i) for i in images],
                                       service.shared.mode)
        except OSError as exc:
            log.warning("warm restart: the snapshot could not be written; the next start "
                        "is cold", extra={"reason": f"{self.path}: {exc.strerror or exc}"})
            return frozenset()
        log.info("warm restart: snapshot written", extra={
            "path": str(self.path), "bytes": size, "tokens": sum(i.tokens for i in images),
            "pool_files": len(files)})
        return frozenset(paths)

    def _unsafe(self, service: Any) -> str | None:
        why = _unsupported(self.config)
        if why is not None:
            return why
        if service.fences.waiting():
            return (f"{len(service.fences.waiting())} ended sessions' workers were still "
                    "copying into the mapped pool")
        if service.shared.owner is None:
            return "the pools are not in shared memory"
        for engine in service.engines.values():
            handles = describe_buffers(engine, service.shared)
            if not handles or not all(h.shm_path for h in handles):
                return f"model {engine.config.name}'s pool is not in shared memory files"
        try:
            service.check_integrity()
        except Exception as exc:  # never persist a cache that fails its own check
            return f"the integrity check failed: {exc}"
        return None


def _unsupported(config: Config) -> str | None:
    """Why these models cannot restart warm, or None."""
    kinds = [f"{m.name} ({m.kind})" for m in config.models if m.kind not in SUPPORTED_KINDS]
    if kinds:
        return f"only radix (and chunk) models are restored warm, not {', '.join(kinds)}"
    devices = [f"{m.name} ({m.pool.device})" for m in config.models
               if m.pool.device != "cpu"]
    if devices:  # device memory does not outlive the process
        return f"only CPU pools outlive a restart, not {', '.join(devices)}"
    return None


def _tree_models(config: Config) -> list[str]:
    return [m.name for m in config.models if m.kind == "radix"]


def _hold_lock(directory: Path, owner: str) -> int:
    """Lock the old owner's lock file (it must be dead); the descriptor holds it."""
    if not owner.startswith(PREFIX) or "/" in owner:
        raise Refused("corrupt", f"the snapshot names a bad owner {owner!r}")
    path = directory / f"{owner}{LOCK_SUFFIX}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise Refused("stale", f"the pool's owner {owner} left no lock file: its files "
                               "were removed since the snapshot") from None
    except OSError as exc:
        raise Refused("foreign", f"{path}: {exc.strerror or exc}") from exc
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            raise Refused("foreign", f"{path} belongs to another user")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise Refused("foreign", f"the pool's owner {owner} is alive (it holds "
                                 f"{path.name})") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_files(directory: Path, owner: str,
                 files: list[tuple[str, str, int, int, int]]) -> dict[str, tuple[Path, int]]:
    """The files to adopt, each checked against the snapshot: there, ours, the same
    file (inode), the same size, not written since (mtime)."""
    adopt = {}
    for suffix, name, size, ino, mtime in files:
        if name != f"{owner}-{suffix}" or "/" in name:
            raise Refused("corrupt", f"the snapshot names a file {name!r} not of {owner}")
        path = directory / name
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise Refused("stale", f"pool file {name} is gone") from None
        if st.st_uid != os.geteuid():
            raise Refused("foreign", f"pool file {name} belongs to another user")
        if st.st_ino != ino or st.st_size != size:
            raise Refused("stale", f"pool file {name} was replaced since the snapshot")
        if st.st_mtime_ns != mtime:
            raise Refused("stale", f"pool file {name} was written after the snapshot")
        adopt[suffix] = (path, size)
    return adopt


class WarmRestartCollector(Collector):
    """``prefixcache_warm_restarts_total{outcome}``: this start's outcome (every
    outcome exported, at 0 until it happens; all 0 with warm_restart off)."""

    def __init__(self, warm: WarmRestart | None) -> None:
        self.warm = warm

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "prefixcache_warm_restarts", "Starts with server.warm_restart on, by outcome "
            "(restored, or why the cache started cold).", labels=["outcome"])
        counts = self.warm.counts if self.warm is not None else dict.fromkeys(OUTCOMES, 0)
        for outcome in OUTCOMES:
            family.add_metric([outcome], counts[outcome])
        yield family
