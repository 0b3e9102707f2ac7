"""Memory sizing: what a config's pools take, checked before any of them is allocated.

A pool larger than the host does not fail cleanly on its own: a private CPU pool is
mapped lazily and the OOM killer picks a victim later, and a shared-memory pool fills
the tmpfs one buffer at a time, taking memory from every process on the host. So the
service adds up every pool of every model first (KV, SWA, Mamba state, slot rows, and
the host-side bookkeeping that grows with them) and refuses, naming the field, a config
that does not fit:

* CPU pools, private or shared, against the memory available: ``MemAvailable`` of
  ``/proc/meminfo``, or what the process's memory cgroup still allows when that is less;
* CPU pools in shared memory, also against the free space of ``shm_dir``'s filesystem;
* CUDA pools against the free memory of their device (which must exist).

The check is deliberately a sum of exact buffer shapes rather than a probe allocation:
it allocates nothing, so a refused config leaves no files and no memory behind.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ConfigError, ModelConfig

# Host bytes per row that the service keeps next to the buffers: the session owner tag
# (int64) and the allocator's liveness byte and free list, for KV rows; Python lists and
# dicts for Mamba and slot bookkeeping. Over-estimates, so that a refusal is never late.
_KV_ROW_BYTES = 32
_STATE_SLOT_BYTES = 96
_SEQ_SLOT_BYTES = 256

_CUDA = re.compile(r"cuda(?::(\d+))?")


@dataclass(frozen=True, slots=True)
class Need:
    """One pool's bytes: on ``device``, plus ``host_bytes`` of bookkeeping on the host."""

    field: str  # the config field that sizes it, e.g. "models[0].pool.size"
    what: str  # e.g. "KV pool of model 'llama'"
    device: str  # "cpu" or "cuda:N"
    nbytes: int
    host_bytes: int


@dataclass(frozen=True, slots=True)
class Budget:
    """What the host offers; ``None`` where it cannot be measured (no check then)."""

    memory: int | None
    memory_source: str
    shm_free: Callable[[str], int]
    cuda_free: Callable[[int], int]
    cuda_devices: int  # visible CUDA devices; 0 on a CPU build of torch


def pool_needs(models: Sequence[ModelConfig]) -> list[Need]:
    """Every pool the models allocate, with exactly the shapes the engines use."""
    needs = []
    for i, m in enumerate(models):
        where, pool, name = f"models[{i}]", m.pool, repr(m.name)
        size = _itemsize(pool.dtype)
        k_row = pool.k_heads * pool.k_head_dim
        v_row = (
            0 if pool.mla else (pool.v_heads or pool.k_heads) * (pool.v_head_dim or pool.k_head_dim)
        )
        row = (k_row + v_row) * size * pool.layers
        if m.kind == "slot":
            # [slot, position, layer, heads, dim] for K and for V.
            slots = pool.size
            needs.append(
                Need(
                    f"{where}.max_seq_len",
                    f"slot rows of model {name} (pool.size x max_seq_len)",
                    pool.device,
                    slots * m.max_seq_len * row,
                    slots * _SEQ_SLOT_BYTES,
                )
            )
            continue
        rows = pool.size + m.page_size  # KVPool keeps page_size spare rows
        needs.append(
            Need(
                f"{where}.pool.size",
                f"KV pool of model {name}",
                pool.device,
                rows * row,
                rows * _KV_ROW_BYTES,
            )
        )
        if m.kind == "swa":
            swa_rows = (pool.swa_size or pool.size) + m.page_size
            field = f"{where}.pool.swa_size" if pool.swa_size else f"{where}.pool.size"
            needs.append(
                Need(
                    field,
                    f"SWA pool of model {name}",
                    pool.device,
                    swa_rows * row,
                    swa_rows * _KV_ROW_BYTES,
                )
            )
        if m.kind == "mamba" and m.mamba is not None:
            mc = m.mamba
            slots = 1 + mc.working_slots + mc.state_slots  # slot 0 is the padding
            per_slot = math.prod(mc.conv_state_shape) * _itemsize(mc.dtype) + math.prod(
                mc.temporal_state_shape
            ) * _itemsize(mc.temporal_dtype)
            needs.append(
                Need(
                    f"{where}.mamba",
                    f"Mamba state of model {name}",
                    pool.device,
                    mc.layers * slots * per_slot,
                    slots * _STATE_SLOT_BYTES,
                )
            )
    return needs


def check_fits(
    models: Sequence[ModelConfig], shm_dir: str | None, budget: Budget | None = None
) -> None:
    """Refuse, before anything is allocated, pools that the host cannot hold.

    Args:
        models: The models to host.
        shm_dir: Where CPU pools go as shared memory; None or "" keeps them private.
        budget: What the host offers (default: measured now).

    Raises:
        ConfigError: naming the field of the largest pool where they do not fit, or a
            CUDA device that this torch cannot use.
    """
    budget = budget or measure()
    needs = pool_needs(models)
    for i, m in enumerate(models):
        _check_device(m.pool.device, f"models[{i}].pool.device", budget.cuda_devices)
    # Host memory: CPU buffers, and every pool's bookkeeping, whatever its device.
    host = [(n.host_bytes + (n.nbytes if n.device == "cpu" else 0), n) for n in needs]
    total = sum(b for b, _ in host)
    if budget.memory is not None and total > budget.memory:
        most, worst = max(host, key=lambda item: item[0])
        raise ConfigError(
            f"{worst.field}: the pools need {_fmt(total)} of host memory ({worst.what}: "
            f"{_fmt(most)}), but {_fmt(budget.memory)} is available "
            f"({budget.memory_source}); make the pools smaller, or put them on a GPU "
            "(pool.device)"
        )
    cpu = [n for n in needs if n.device == "cpu"]
    shared = sum(n.nbytes for n in cpu)
    if shm_dir and shared:
        free = budget.shm_free(shm_dir)
        if shared > free:
            worst = max(cpu, key=lambda n: n.nbytes)
            raise ConfigError(
                f"server.shm_dir: the CPU pools need {_fmt(shared)} of shared memory "
                f"(largest: {worst.field}, {_fmt(worst.nbytes)}), but {shm_dir} has "
                f"{_fmt(free)} free; make it larger (e.g. docker --shm-size), make the "
                "pools smaller, or set shm_dir to 'off' to keep the pools private"
            )
    on_cuda: dict[int, list[Need]] = {}
    for n in needs:
        match = _CUDA.fullmatch(n.device)
        if match is not None:
            on_cuda.setdefault(int(match.group(1) or 0), []).append(n)
    for index, device_needs in sorted(on_cuda.items()):
        total = sum(n.nbytes for n in device_needs)
        free = budget.cuda_free(index)
        if total > free:
            worst = max(device_needs, key=lambda n: n.nbytes)
            raise ConfigError(
                f"{worst.field}: the pools on cuda:{index} need {_fmt(total)} ({worst.what}: "
                f"{_fmt(worst.nbytes)}), but the device has {_fmt(free)} free; make the "
                "pools smaller or spread them over devices"
            )


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation that the host refused (the check's backstop)."""
    return isinstance(exc, MemoryError | torch.cuda.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)
    )


def measure() -> Budget:
    """The host's memory, shared-memory and CUDA budgets, as of now."""
    memory, source = available_memory()
    # is_available() first: on a CPU build it answers False without touching a driver.
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return Budget(memory, source, shm_free, _cuda_free, devices)


def available_memory() -> tuple[int | None, str]:
    """Bytes this process may still allocate, and where the figure comes from."""
    best: tuple[int | None, str] = (_meminfo_available(), "MemAvailable in /proc/meminfo")
    cgroup = _cgroup_available()
    if cgroup is not None and (best[0] is None or cgroup < best[0]):
        best = (cgroup, "the memory cgroup's limit")
    return best


def shm_free(directory: str) -> int:
    """Free bytes of ``directory``'s filesystem (for an unprivileged process)."""
    try:
        st = os.statvfs(directory)
    except OSError as exc:
        raise ConfigError(f"server.shm_dir: {directory}: {exc.strerror or exc}") from exc
    return st.f_bavail * st.f_frsize


def _cuda_free(index: int) -> int:
    return int(torch.cuda.mem_get_info(index)[0])


def _check_device(device: str, where: str, visible: int) -> None:
    """Refuse a CUDA device that does not exist, before anything touches it (on a CPU
    build, torch's first CUDA call raises an AssertionError from deep in the allocator)."""
    match = _CUDA.fullmatch(device)
    if match is None:
        return
    if not visible:
        why = "a CPU build" if torch.version.cuda is None else "no GPU visible"
        raise ConfigError(
            f"{where}: {device} asked for, but this torch has no CUDA ({why}); "
            "use device: cpu, or a CUDA build of torch on a GPU host"
        )
    if int(match.group(1) or 0) >= visible:
        raise ConfigError(
            f"{where}: {device} asked for, but only {visible} CUDA device(s) are visible"
        )


def _itemsize(dtype: str) -> int:
    return int(getattr(torch, dtype).itemsize)


def _fmt(nbytes: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _meminfo_available() -> int | None:
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:  # not Linux: nothing to measure against
        return None
    match = re.search(r"^MemAvailable:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def _cgroup_available(
    root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> int | None:
    """The least headroom of the process's memory cgroup and its ancestors, if limited.

    Headroom is the limit less the usage, plus the inactive file cache that the kernel
    reclaims before it would OOM-kill (tmpfs pages are not file cache: they count).
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    best: int | None = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            base, files = root, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # cgroup v1
            base, files = (
                root / "memory",
                ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
            )
        else:
            continue
        for directory in _up_to(base, path):
            room = _headroom(directory, *files)
            if room is not None and (best is None or room < best):
                best = room
    return best


def _up_to(base: Path, path: str) -> list[Path]:
    # Inside a container the mount shows the container's own cgroup at its root, and the
    # path in /proc/self/cgroup may not exist under it: then the root is all we can see.
    here = base / path.lstrip("/")
    if not here.is_dir():
        return [base]
    out = [here]
    while here != base and base in here.parents:
        here = here.parent
        out.append(here)
    return out


def _headroom(directory: Path, limit_file: str, usage_file: str, inactive: str) -> int | None:
    try:
        limit_text = (directory / limit_file).read_text().strip()
        usage = int((directory / usage_file).read_text().strip())
    except (OSError, ValueError):
        return None
    if limit_text == "max" or not limit_text.isdigit() or int(limit_text) >= 1 << 60:
        return None  # no limit (v1 writes "unlimited" as a huge page-aligned number)
    reclaimable = 0
    try:
        stat = (directory / "memory.stat").read_text()
        match = re.search(rf"^{inactive} (\d+)$", stat, re.MULTILINE)
        reclaimable = int(match.group(1)) if match else 0
    except OSError:
        pass
    return max(0, int(limit_text) - usage + reclaimable)
