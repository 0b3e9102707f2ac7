"""Warm restart (``server.warm_restart``): the cache outlives a restart, clean or not.

The CPU pools live in shared-memory files under ``shm_dir``, which outlive the
process. What a restart needs besides is the tree, and a way to know that the bytes it
points at are still the ones it cached. So this service writes a snapshot of every
model's tree beside the pool files (warm_snapshot.py, tree_snapshot.py), with a seal
over every run of pages it holds (tree_seals.py):

- while serving, every ``warm_checkpoint_interval`` seconds (checkpoints.py), and
- at a clean stop (SIGTERM, SIGINT: app.py's drain), after the last call is done and
  every session has ended.

The next start with the same models takes the files over (renamed to its own owner
name, mapped as they are), checks every seal against the bytes in the pool, and
rebuilds the trees from what verifies: cached prompts hit again, on byte-identical
KV. A run of pages whose bytes changed since (a write into the pool after the stop,
or, after a crash, slots that were given to other KV after the last checkpoint) is
cut off with everything below it: a shorter hit, never a wrong one, counted in
``prefixcache_integrity_failures_total{source="snapshot"}`` (reason ``seal_mismatch`` after a
clean stop, where nothing may change; ``changed_after_checkpoint`` after a crash, where
it is expected). It is a new start all the same: a new epoch, no sessions, no locks;
every restored node is unlocked and evictable, and every handle from before is refused
as stale.

The outcome is logged and counted in ``prefixcache_warm_restarts_total{outcome}``:
``restored`` (from a clean stop's snapshot), ``restored_from_checkpoint`` (after a
crash: what changed since the checkpoint misses), or cold, with one log line saying
why:

- ``no_snapshot``: none there (the first start, checkpoints off, or a crash before
  the first checkpoint).
- ``corrupt``: torn, damaged, not a regular file, or a tree that does not rebuild.
- ``config_changed``: another model list, kind, page size or pool geometry or dtype.
- ``foreign``: another user's files, or an owner that is still alive.
- ``stale``: pool files gone or replaced, or a worker of a killed run still inside a
  copy into the pool (it holds its write fence).
- ``unsupported``: a model whose kind is not restored (radix is; chunk models hold
  nothing to restore, and their pools are taken over all the same).

Workers. A clean stop ends every session, and with them their write fences
(write_fence.py): every record reads 0, so a worker that follows the fence protocol
copies nothing more into the pool. A worker that is inside a copy at the stop holds
its record; then no snapshot is written (the next start is cold, and the old pool files
are swept), since its copy could land in slots the next run hands out. After a crash
the fences were never ended: the next start ends them (write_fence.quiesce) before it
checks a seal, and starts cold if a worker still holds one. A worker that survives the
restart still maps the old files, which are the new pool now: its epoch is stale, so
its slots, locks and fence are refused, and it must DescribePool and open a new
session (the files have new names, the same memory) before it writes again. A worker
that writes through the mapped pool without a fence is on its own; what it changed in
a cached page before the next start's check is caught there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixcache.cache import CacheError
from prefixcache.cache.node import TreeNode
from prefixcache.cache.radix.tree_snapshot import (
    TreeParts,
    decode,
    encode_parts,
    prune,
    restore,
    take,
)

from ..config import Config
from . import warm_snapshot
from .page_seal import CHANGED_AFTER_CHECKPOINT, SEAL_MISMATCH
from .shared_pool import (
    LOCK_SUFFIX,
    PREFIX,
    describe_buffers,
    file_tag,
    mark_kept,
    service_tag,
)
from .sizing import Budget, measure
from .tree_seals import TreeSeals, kv_rows
from .warm_snapshot import Refused, Snapshot
from .write_fence import FENCE_FILE, quiesce

log = logging.getLogger("prefixcache.server")

OUTCOMES = (
    "restored",
    "restored_from_checkpoint",
    "no_snapshot",
    "corrupt",
    "config_changed",
    "foreign",
    "stale",
    "unsupported",
)
CHECKPOINT_OUTCOMES = ("written", "no_room", "failed")
# Chunk models keep nothing between requests: their pool is taken over, with no tree.
SUPPORTED_KINDS = ("radix", "chunk")
# A snapshot's body before it is encoded: the manifest, and each tree with its seals.
Body = tuple[dict[str, Any], list[tuple[TreeParts, bytes]]]
# How long a start waits for a killed run's worker to finish a copy it is inside.
_FENCE_WAIT = 1.0


def snapshot_path(shm_dir: str, listen: str) -> Path:
    """One snapshot per service: named after its listen address, which no two
    services on a host share (a shm_dir may serve several)."""
    return Path(shm_dir) / f"{PREFIX}warm-{service_tag(listen)}.snapshot"


@dataclass
class Takeover:
    """A snapshot accepted at start: the old owner's lock (held, so that no other
    start's sweep removes its files meanwhile), the files to adopt and the trees."""

    owner: str
    lock_fd: int
    directory: Path
    files: dict[str, tuple[Path, int]]
    snapshot: Snapshot
    names: list[str]
    per_unit: dict[str, int]
    clean: bool
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
            budget,
            shm_free=lambda directory: free(directory) + nbytes,
            memory=None if budget.memory is None else budget.memory + nbytes,
        )

    def release(self) -> None:
        """Remove what is left of the old owner (its fence file, its mark, its lock
        file), then let go of its lock; a second call does nothing."""
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
class Capture:
    """A snapshot in the making: every tree model's nodes as taken, the units still to
    seal, and the roots they were taken under (a Reset replaces a root)."""

    trees: dict[str, TreeParts]
    plans: dict[str, list[tuple[int, int, int, tuple[int, int, int]]]]
    todo: dict[str, list[int]]
    roots: dict[str, TreeNode]

    @property
    def sealing(self) -> int:
        return sum(len(t) for t in self.todo.values())


@dataclass
class WarmRestart:
    """This start's side of warm restarts: ``prepare`` and ``restore`` at start,
    checkpoints while serving (``capture``, ``seal``, ``body``, ``write``), ``save``
    at a clean stop; what happened, for /metrics."""

    config: Config
    outcome: str | None = None
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    # (model, reason) -> pages that failed their seal at this start
    integrity: dict[tuple[str, str], int] = field(default_factory=dict)
    checkpoints: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(CHECKPOINT_OUTCOMES, 0)
    )
    checkpoint_bytes: int = 0
    checkpoint_seconds: float = 0.0  # on the event loop, the last one
    _seals: dict[str, TreeSeals] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        cfg = self.config.server
        return snapshot_path(cfg.shm_dir, cfg.listen)

    @property
    def service(self) -> str:
        return service_tag(self.config.server.listen)

    def cold(self, outcome: str, reason: str) -> None:
        self.outcome = outcome
        self.counts[outcome] += 1
        log.warning("warm restart: starting cold", extra={"outcome": outcome, "reason": reason})

    # ------------------------------------------------------------------ start

    def prepare(self) -> Takeover | None:
        """Read and check the snapshot (it is removed whatever it holds); None, logged
        and counted, when the start must be cold."""
        leftovers = warm_snapshot.remove_leftovers(self.path)
        if leftovers:
            log.warning(
                "warm restart: removed a snapshot's temporary files that a killed writer left",
                extra={"files": leftovers},
            )
        try:
            return self._prepare()
        except Refused as exc:
            self.cold(exc.outcome, exc.reason)
            return None

    def _prepare(self) -> Takeover:
        read = warm_snapshot.consume(self.path, warm_snapshot.max_bytes(self.config.models))
        why = _unsupported(self.config)
        if why is not None:
            raise Refused("unsupported", why)
        if read is None:
            raise Refused(
                "no_snapshot",
                f"no snapshot at {self.path}: the first start, "
                "or the last run stopped before it wrote one",
            )
        manifest = read.manifest
        if manifest.get("version") != warm_snapshot.VERSION:
            raise Refused(
                "config_changed",
                f"snapshot format {manifest.get('version')!r}, "
                f"this version reads {warm_snapshot.VERSION}",
            )
        why = warm_snapshot.changed(
            manifest.get("models"), warm_snapshot.fingerprint(self.config.models)
        )
        if why is not None:
            raise Refused("config_changed", why)
        try:
            owner, names = str(manifest["owner"]), [str(n) for n in manifest["trees"]]
            files = [
                (str(f["suffix"]), str(f["name"]), int(f["size"]), int(f["ino"]))
                for f in manifest["files"]
            ]
            per_unit = {str(k): int(v) for k, v in manifest["unit_tokens"].items()}
            written, clean = int(manifest["written_ns"]), manifest["clean"] is True
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise Refused("corrupt", f"the snapshot's manifest lacks {exc}") from exc
        if (
            names != _tree_models(self.config)
            or len(read.trees) != len(names)
            or sorted(per_unit) != sorted(names)
            or min(per_unit.values(), default=1) < 1
        ):
            raise Refused("corrupt", "the snapshot's trees are not its models'")
        directory = Path(self.config.server.shm_dir)
        lock_fd = _hold_lock(directory, owner)
        try:
            adopt = _check_files(directory, owner, files)
            if not clean:
                _end_fences(directory, owner)
        except BaseException:
            os.close(lock_fd)
            raise
        return Takeover(owner, lock_fd, directory, adopt, read, names, per_unit, clean, written)

    def restore(self, service: Any, takeover: Takeover) -> None:
        """Check every seal and rebuild every model's tree from what verifies over the
        adopted pools; on any failure every model is emptied (cold, logged, counted)."""
        started = time.monotonic()
        takeover.release()
        if len(service.shared.adopted) != len(takeover.files):
            self._empty(service)
            self.cold(
                "stale",
                f"{len(service.shared.adopted)} of the "
                f"{len(takeover.files)} pool files were taken over",
            )
            return
        reason = SEAL_MISMATCH if takeover.clean else CHANGED_AFTER_CHECKPOINT
        tokens = nodes = dropped = checked = 0
        failures: dict[str, int] = {}
        try:
            for name, (tree, seals) in zip(takeover.names, takeover.snapshot.trees, strict=True):
                engine = service.engines[name]
                sealer = self._sealer(name, engine)
                if takeover.per_unit[name] != sealer.per_unit:
                    raise ValueError(
                        f"model {name}'s seals cover {takeover.per_unit[name]} "
                        f"tokens each, this version's {sealer.per_unit}"
                    )
                image = decode(tree)
                keep, good, failed = sealer.verify(image, sealer.per_unit, seals)
                checked += image.tokens * sealer.row_bytes
                kept = prune(image, keep)
                built = restore(engine.cache, engine.allocator, kept, check=False)
                sealer.adopt(kept, [n.id for n in built], good)
                tokens, nodes = tokens + kept.tokens, nodes + kept.nodes
                dropped += image.tokens - kept.tokens
                if failed:
                    failures[name] = failed
            service.check_integrity()
        except (CacheError, KeyError, ValueError) as exc:  # SnapshotError, IntegrityError
            self._empty(service)
            self.cold("corrupt", f"a tree does not rebuild: {exc}")
            return
        finally:
            takeover.snapshot.trees.clear()  # the mapped file goes with its last view
        for name, failed in failures.items():
            self.integrity[(name, reason)] = self.integrity.get((name, reason), 0) + failed
        outcome = "restored" if takeover.clean else "restored_from_checkpoint"
        self.outcome = outcome
        self.counts[outcome] += 1
        log.info(
            "warm restart: cache restored",
            extra={
                "outcome": outcome,
                "models": ",".join(takeover.names),
                "tokens": tokens,
                "nodes": nodes,
                "pool_bytes": takeover.nbytes,
                "checked_bytes": checked,
                "seconds": round(time.monotonic() - started, 3),
                "snapshot_age_s": round((time.time_ns() - takeover.written_ns) / 1e9, 1),
            },
        )
        if failures:
            log.warning(
                "warm restart: pages whose bytes changed since the snapshot were dropped",
                extra={
                    "reason": reason,
                    "tokens": dropped,
                    "units": sum(failures.values()),
                    "models": ",".join(failures),
                },
            )

    def _sealer(self, name: str, engine: Any) -> TreeSeals:
        sealer = self._seals.get(name)
        if sealer is None:
            model = next(
                m for m in warm_snapshot.fingerprint(self.config.models) if m["name"] == name
            )
            sealer = self._seals[name] = TreeSeals(model, kv_rows(engine), engine.page_size)
        return sealer

    @staticmethod
    def _empty(service: Any) -> None:
        for engine in service.engines.values():
            engine.cache.reset()
            engine.allocator.clear()

    # ------------------------------------------------------------ snapshots

    def capture(self, service: Any) -> Capture:
        """Every tree model's nodes, as they are now (one pass over the nodes, no copy
        of their tokens or slots), and the units that have no seal yet."""
        trees, plans, todo, roots = {}, {}, {}, {}
        for name in _tree_models(self.config):
            engine = service.engines[name]
            sealer = self._sealer(name, engine)
            trees[name] = take(engine.cache)
            plans[name] = sealer.plan(trees[name])
            todo[name] = sealer.missing(plans[name])
            roots[name] = engine.cache.root_node
        return Capture(trees, plans, todo, roots)

    def seal(self, service: Any, capture: Capture, seconds: float | None = None) -> bool:
        """Seal the capture's units for about ``seconds`` (None: all); True once all are.
        Raises CacheError when a tree was reset since the capture (it is void)."""
        deadline = None if seconds is None else time.perf_counter() + seconds
        for name, todo in capture.todo.items():
            if service.engines[name].cache.root_node is not capture.roots[name]:
                raise CacheError(f"model {name}'s cache was reset during the checkpoint")
            left = 1e9 if deadline is None else deadline - time.perf_counter()
            if left <= 0:
                return False
            self._seals[name].seal_some(capture.trees[name], capture.plans[name], todo, left)
            if todo:
                return False
        return True

    def body(self, service: Any, capture: Capture, clean: bool) -> Body:
        """What the snapshot's body holds, for a sealed capture: the manifest (this
        owner's pool files as they are now), each tree without the nodes that left it
        before they were sealed, and their seals. Encoded by ``write`` (off the loop:
        it reads nothing that changes)."""
        names = _tree_models(self.config)
        owner = service.shared.owner
        files = []
        paths = sorted(
            {
                h.shm_path
                for e in service.engines.values()
                for h in describe_buffers(e, service.shared)
            }
        )
        for p in paths:
            st = os.stat(p)
            files.append(
                {
                    "suffix": Path(p).name.removeprefix(f"{owner}-"),
                    "name": Path(p).name,
                    "size": st.st_size,
                    "ino": st.st_ino,
                }
            )
        manifest = {
            "version": warm_snapshot.VERSION,
            "owner": owner,
            "uid": os.geteuid(),
            "written_ns": time.time_ns(),
            "trees": names,
            "files": files,
            "clean": clean,
            "service": self.service,
            "unit_tokens": {n: self._seals[n].per_unit for n in names},
            "models": warm_snapshot.fingerprint(self.config.models),
        }
        trees = []
        for name in names:
            sealer, tree, plan = self._seals[name], capture.trees[name], capture.plans[name]
            drop = set(sealer.dropped(plan))
            if drop:
                tree = _without(tree, drop)
                plan = sealer.plan(tree)
            trees.append((tree, sealer.seals(plan)))
        return manifest, trees

    def write(self, service: Any, body: Body) -> int:
        """Encode and write a snapshot body (safe off the event loop: it reads only
        what ``body`` holds), and mark the pool files as kept for ``server.warm_keep``
        seconds. ``warm_checkpoint_max_bytes`` caps checkpoints, not a clean stop's
        snapshot (the free space of shm_dir caps both)."""
        cfg = self.config.server
        manifest, trees = body
        parts = warm_snapshot.encode_body(
            manifest, [(encode_parts(tree), seals) for tree, seals in trees]
        )
        cap = None if manifest["clean"] else cfg.warm_checkpoint_max_bytes or None
        size = warm_snapshot.write(self.path, parts, service.shared.mode, cap)
        owner = service.shared.owner
        if owner is not None:
            mark_kept(Path(cfg.shm_dir), owner, cfg.warm_keep, self.service)
        return size

    def writable(self, service: Any) -> str | None:
        """Why no snapshot can be written now (the kinds, or pools not in shared
        memory), or None."""
        why = _unsupported(self.config)
        if why is not None:
            return why
        if service.shared.owner is None:
            return "the pools are not in shared memory"
        for engine in service.engines.values():
            handles = describe_buffers(engine, service.shared)
            if not handles or not all(h.shm_path for h in handles):
                return f"model {engine.config.name}'s pool is not in shared memory files"
        return None

    # ------------------------------------------------------------------- stop

    def save(self, service: Any) -> frozenset[str]:
        """At a clean stop, after the last call (and the last checkpoint): end every
        session and write the snapshot; returns the pool files to keep (none when no
        snapshot is written, with the reason logged)."""
        started = time.monotonic()
        for session in service.sessions:
            service.close_session(session)
        service.settle_fences()
        why = self._unsafe(service)
        if why is not None:
            self._discard()
            log.warning(
                "warm restart: no snapshot written; the next start is cold", extra={"reason": why}
            )
            return frozenset()
        capture = self.capture(service)
        try:
            self.seal(service, capture)
            size = self.write(service, self.body(service, capture, clean=True))
        except (OSError, CacheError) as exc:
            self._discard()
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            log.warning(
                "warm restart: the snapshot could not be written; the next start is cold",
                extra={"reason": f"{self.path}: {why}"},
            )
            return frozenset()
        log.info(
            "warm restart: snapshot written",
            extra={
                "path": str(self.path),
                "bytes": size,
                "tokens": sum(t.tokens for t in capture.trees.values()),
                "seconds": round(time.monotonic() - started, 3),
            },
        )
        return frozenset(
            h.shm_path
            for e in service.engines.values()
            for h in describe_buffers(e, service.shared)
        )

    def _discard(self) -> None:
        """No snapshot, nor a checkpoint, outlives a stop that cannot vouch for one."""
        with contextlib.suppress(OSError):
            self.path.unlink()

    def _unsafe(self, service: Any) -> str | None:
        why = self.writable(service)
        if why is not None:
            return why
        if service.fences.waiting():
            return (
                f"{len(service.fences.waiting())} ended sessions' workers were still "
                "copying into the mapped pool"
            )
        try:
            service.check_integrity()
        except Exception as exc:  # never persist a cache that fails its own check
            return f"the integrity check failed: {exc}"
        return None


def _without(tree: TreeParts, drop: set[int]) -> TreeParts:
    """``tree`` without the nodes in ``drop`` and everything below them."""
    gone = [False] * len(tree.nodes)
    parents = tree.parent.tolist()
    for i in range(len(tree.nodes)):
        gone[i] = i in drop or (parents[i] >= 0 and gone[parents[i]])
    kept = [i for i in range(len(tree.nodes)) if not gone[i]]
    index = {old: new for new, old in enumerate(kept)}
    parent = [index[parents[i]] if parents[i] >= 0 else -1 for i in kept]
    spaces = sorted({int(tree.namespace[i]) for i in kept})
    space = {old: new for new, old in enumerate(spaces)}
    return TreeParts(
        tree.page_size,
        [tree.namespaces[s] for s in spaces],
        np.asarray(parent, dtype=np.int64),
        np.asarray([space[int(tree.namespace[i])] for i in kept], dtype=np.int64),
        tree.key_lens[kept],
        tree.ticks[kept],
        tree.node_ids[kept],
        [tree.keys[i] for i in kept],
        [tree.slots[i] for i in kept],
        [tree.nodes[i] for i in kept],
    )


def _unsupported(config: Config) -> str | None:
    """Why these models cannot restart warm, or None."""
    kinds = [f"{m.name} ({m.kind})" for m in config.models if m.kind not in SUPPORTED_KINDS]
    if kinds:
        return f"only radix (and chunk) models are restored warm, not {', '.join(kinds)}"
    devices = [f"{m.name} ({m.pool.device})" for m in config.models if m.pool.device != "cpu"]
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
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise Refused(
            "stale",
            f"the pool's owner {owner} left no lock file: its files "
            "were removed since the snapshot",
        ) from None
    except OSError as exc:
        raise Refused("foreign", f"{path}: {exc.strerror or exc}") from exc
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            raise Refused("foreign", f"{path} belongs to another user")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise Refused(
            "foreign", f"the pool's owner {owner} is alive (it holds {path.name})"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_files(
    directory: Path, owner: str, files: list[tuple[str, str, int, int]]
) -> dict[str, tuple[Path, int]]:
    """The files to adopt, each checked against the snapshot: there, ours, the same
    file (inode), the same size. Their bytes are checked by the seals."""
    adopt = {}
    for suffix, name, size, ino in files:
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
        adopt[suffix] = (path, size)
    return adopt


def _end_fences(directory: Path, owner: str) -> None:
    """After a crash: end the killed run's write fences, so that no worker of it
    copies into the pool from now on; Refused (stale) if one is inside a copy."""
    for path in directory.glob(f"{owner}-{file_tag(FENCE_FILE)}-*"):
        try:
            quiet = quiesce(str(path), _FENCE_WAIT)
        except OSError as exc:
            raise Refused(
                "stale",
                f"the killed run's write fences {path.name} cannot be ended: {exc.strerror or exc}",
            ) from exc
        if not quiet:
            raise Refused(
                "stale",
                "a worker of the killed run is still copying into the "
                f"pool (it holds a record of {path.name})",
            )


class WarmRestartCollector(Collector):
    """``prefixcache_warm_restarts_total{outcome}`` (this start's outcome; every one
    exported, at 0 until it happens; all 0 with warm_restart off) and the checkpoints
    written while serving."""

    def __init__(self, warm: WarmRestart | None) -> None:
        self.warm = warm

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "prefixcache_warm_restarts",
            "Starts with server.warm_restart on, by outcome "
            "(restored, restored_from_checkpoint, or why the cache started cold).",
            labels=["outcome"],
        )
        counts = self.warm.counts if self.warm is not None else dict.fromkeys(OUTCOMES, 0)
        for outcome in OUTCOMES:
            family.add_metric([outcome], counts[outcome])
        yield family
        written = CounterMetricFamily(
            "prefixcache_warm_checkpoints",
            "Checkpoints of the trees while serving, by "
            "outcome (written; no_room: over warm_checkpoint_max_bytes or shm_dir's free "
            "space; failed).",
            labels=["outcome"],
        )
        done = (
            self.warm.checkpoints
            if self.warm is not None
            else dict.fromkeys(CHECKPOINT_OUTCOMES, 0)
        )
        for outcome in CHECKPOINT_OUTCOMES:
            written.add_metric([outcome], done[outcome])
        yield written
        size = GaugeMetricFamily(
            "prefixcache_warm_checkpoint_bytes", "Bytes of the last snapshot or checkpoint written."
        )
        size.add_metric([], self.warm.checkpoint_bytes if self.warm is not None else 0)
        yield size
