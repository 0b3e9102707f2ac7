"""Memory sizing: every pool is added up before any is allocated.

The sums are checked against the buffers real engines allocate, and the refusals with
budgets given by the test (so nothing here depends on, or takes, the host's memory).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml
from server.harness import EVERY_KIND

from prefixcache.server.config import ConfigError, MambaConfig, ModelConfig, PoolConfig, load_config
from prefixcache.server.memory.sizing import (
    Budget,
    _cgroup_available,
    check_fits,
    is_out_of_memory,
    pool_needs,
)
from prefixcache.server.service import CacheService

GiB = 1 << 30
# The sample config of docs/configuration.md (it was the README's).
SAMPLE_PAGE = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def budget(
    memory: int | None = 64 * GiB, shm: int = 32 * GiB, cuda: int = 0, cuda_free: int = 80 * GiB
) -> Budget:
    return Budget(memory, "test", lambda _: shm, lambda _: cuda_free, cuda)


def _buffers(engine) -> list:
    if engine.kind == "slot":
        return [engine.k_cache, engine.v_cache]
    out = [*engine.kv_pool.k_buffer, *engine.kv_pool.v_buffer]
    if engine.swa_kv_pool is not None:
        out += [*engine.swa_kv_pool.k_buffer, *engine.swa_kv_pool.v_buffer]
    if engine.mamba_pool is not None:
        out += [engine.mamba_pool.conv_state, engine.mamba_pool.temporal_state]
    return out


def test_the_sum_is_what_real_engines_allocate() -> None:
    models = [
        *EVERY_KIND,
        ModelConfig(
            name="v",
            kind="swa",
            page_size=4,
            sliding_window_size=8,
            pool=PoolConfig(
                size=32,
                swa_size=12,
                layers=3,
                k_heads=2,
                k_head_dim=4,
                v_heads=1,
                v_head_dim=6,
                dtype="float32",
            ),
        ),
        ModelConfig(
            name="b",
            kind="mamba",
            page_size=2,
            pool=PoolConfig(size=16, k_heads=1, k_head_dim=2, dtype="bfloat16"),
            mamba=MambaConfig(
                state_slots=3,
                working_slots=0,
                layers=3,
                conv_state_shape=(5,),
                dtype="float8_e4m3fn",
                temporal_state_shape=(2, 3),
            ),
        ),
    ]
    service = CacheService(models)
    try:
        allocated = sum(
            t.numel() * t.element_size() for e in service.engines.values() for t in _buffers(e)
        )
    finally:
        service.close()
    assert sum(n.nbytes for n in pool_needs(models)) == allocated


def test_a_config_that_fits_passes() -> None:
    check_fits(EVERY_KIND, "/dev/shm", budget())


@pytest.mark.parametrize(
    ("model", "field"),
    [
        (ModelConfig(name="a", pool=PoolConfig(size=10**9)), "models[1].pool.size"),
        (
            ModelConfig(
                name="a",
                kind="swa",
                sliding_window_size=4,
                pool=PoolConfig(size=64, swa_size=10**9),
            ),
            "models[1].pool.swa_size",
        ),
        (
            ModelConfig(name="a", kind="slot", max_seq_len=10**8, pool=PoolConfig(size=64)),
            "models[1].max_seq_len",
        ),
        (
            ModelConfig(
                name="a", kind="mamba", mamba=MambaConfig(temporal_state_shape=(1024, 1024, 1024))
            ),
            "models[1].mamba",
        ),
    ],
    ids=["kv", "swa", "slot", "mamba"],
)
def test_more_than_memory_is_refused_naming_the_largest_pool(
    model: ModelConfig, field: str
) -> None:
    models = [ModelConfig(name="small", pool=PoolConfig(size=64)), model]
    with pytest.raises(ConfigError) as err:
        check_fits(models, None, budget())
    message = str(err.value)
    assert message.startswith(f"{field}: the pools need "), message
    assert "64.0 GiB is available (test)" in message and "\n" not in message


def test_shared_memory_is_checked_against_the_filesystem_too() -> None:
    models = [ModelConfig(name="a", pool=PoolConfig(size=1 << 20, layers=8))]  # 4 GiB
    check_fits(models, None, budget(shm=GiB))  # private: the shm size does not matter
    with pytest.raises(
        ConfigError,
        match=r"^server\.shm_dir: the CPU pools need 4\.0 GiB .*"
        r"models\[0\]\.pool\.size.* has 1\.0 GiB free",
    ):
        check_fits(models, "/dev/shm", budget(shm=GiB))


def test_gpu_pools_take_no_host_memory_but_must_fit_their_device() -> None:
    gpu = [ModelConfig(name="a", pool=PoolConfig(size=1 << 20, layers=8, device="cuda:1"))]
    check_fits(gpu, "/dev/shm", budget(memory=GiB, shm=0, cuda=2))
    with pytest.raises(
        ConfigError,
        match=r"^models\[0\]\.pool\.size: the pools on cuda:1 "
        r"need 4\.0 GiB .* has 1\.0 GiB free",
    ):
        check_fits(gpu, None, budget(cuda=2, cuda_free=GiB))


@pytest.mark.parametrize(
    ("device", "visible", "expected"),
    [
        ("cuda:0", 0, "has no CUDA"),
        ("cuda", 0, "has no CUDA"),
        ("cuda:2", 2, "only 2 CUDA"),
    ],
)
def test_a_cuda_device_that_is_not_there_is_refused(
    device: str, visible: int, expected: str
) -> None:
    models = [
        ModelConfig(name="a", pool=PoolConfig(size=64)),
        ModelConfig(name="b", pool=PoolConfig(size=64, device=device)),
    ]
    with pytest.raises(ConfigError, match=rf"^models\[1\]\.pool\.device: .*{expected}"):
        check_fits(models, None, budget(cuda=visible))


def test_unmeasurable_memory_is_not_checked() -> None:
    check_fits([ModelConfig(name="a", pool=PoolConfig(size=10**9))], None, budget(memory=None))


def _readme_models(tmp: Path) -> tuple[ModelConfig, ...]:
    block = re.search(r"```yaml\n(server:\n.*?)```", SAMPLE_PAGE.read_text(), re.DOTALL)
    assert block, "docs/configuration.md has no sample config"
    data = yaml.safe_load(block[1])
    data.pop("server")  # its token files do not exist here
    (tmp / "readme.yaml").write_text(yaml.safe_dump(data))
    return load_config(tmp / "readme.yaml", env={}).models


def test_the_readme_sample_fits_the_gpu_it_claims(tmp_path: Path) -> None:
    """The sample once asked 131 GB on a CPU host; it is GPU-only and fits 80 GB now."""
    models = _readme_models(tmp_path)
    assert {m.pool.device for m in models} == {"cuda:0"}
    total = sum(n.nbytes for n in pool_needs(models))
    assert total <= 60 * GiB, total / GiB  # with room for the CUDA context on 80 GB
    check_fits(models, "/dev/shm", budget(memory=4 * GiB, shm=0, cuda=1, cuda_free=79 * GiB))
    assert round(total / GiB) == 55  # what the sample's comment says it takes
    assert "take 55 GiB of one 80 GB GPU" in SAMPLE_PAGE.read_text()


# ---------------------------------------------------------------------------- cgroups


def _tree(tmp: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(text)
    return tmp


def test_cgroup_v2_headroom_is_the_least_of_the_ancestors(tmp_path: Path) -> None:
    root = _tree(
        tmp_path / "cg",
        {
            "memory.max": "max\n",
            "memory.current": "5\n",
            "pod/memory.max": "1000\n",
            "pod/memory.current": "600\n",
            "pod/memory.stat": "anon 500\ninactive_file 50\n",
            "pod/c/memory.max": "max\n",
            "pod/c/memory.current": "300\n",
        },
    )
    proc = _tree(tmp_path, {"self": "0::/pod/c\n"}) / "self"
    assert _cgroup_available(root, proc) == 1000 - 600 + 50


def test_cgroup_v1_and_no_limit(tmp_path: Path) -> None:
    root = _tree(
        tmp_path / "cg",
        {
            "memory/memory.limit_in_bytes": "9223372036854771712\n",
            "memory/memory.usage_in_bytes": "1\n",
            "memory/box/memory.limit_in_bytes": "4096\n",
            "memory/box/memory.usage_in_bytes": "1024\n",
            "memory/box/memory.stat": "inactive_file 7\ntotal_inactive_file 24\n",
        },
    )
    proc = _tree(tmp_path, {"v1": "5:cpu:/\n4:memory:/box\n", "none": "4:memory:/\n"})
    assert _cgroup_available(root, proc / "v1") == 4096 - 1024 + 24
    assert _cgroup_available(root, proc / "none") is None  # the root has no limit
    # The cgroup's path is not under the mount (a container's own view): the root only.
    assert _cgroup_available(root, _tree(tmp_path, {"x": "4:memory:/elsewhere\n"}) / "x") is None


def test_allocation_failures_are_told_from_other_errors() -> None:
    """The backstop for memory taken between the check and the allocation (exit 2, not a
    traceback); a real failed allocation is not provoked here, as it could OOM a host."""
    refused = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
        "can't allocate memory: you tried to allocate 10 bytes."
    )
    assert is_out_of_memory(refused) and is_out_of_memory(MemoryError())
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("can't allocate memory"))
