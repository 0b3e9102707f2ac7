"""The chart's disk values: the disk tier on by default on an emptyDir mounted at
``disk.path`` (server.disk as PREFIXCACHE_DISK, which the server reads back), a
PersistentVolumeClaim instead with ``disk.claimName``, and nothing with it off (the GPU
values)."""

from __future__ import annotations

from typing import Any

from deploy.support import MIN_KUBERNETES, env_of, need, pod_spec, sidecar
from deploy.test_helm import objects, render

from prefixcache.server.config import load_config


def _disk(docs: list[dict[str, Any]]) -> tuple[Any, dict[str, Any] | None, dict | None]:
    """The sidecar's server.disk as the server reads it, its mount and its volume."""
    container = sidecar(docs)
    env = env_of(container)
    cfg = (
        load_config(None, env={"PREFIXCACHE_DISK": env["PREFIXCACHE_DISK"]}).server.disk
        if "PREFIXCACHE_DISK" in env
        else None
    )
    mount = next((m for m in container["volumeMounts"] if m["name"] == "disk"), None)
    volume = next((v for v in pod_spec(docs)["volumes"] if v["name"] == "disk"), None)
    return cfg, mount, volume


def test_the_disk_tier_is_on_by_default_on_an_emptydir() -> None:
    docs = objects(render())
    cfg, mount, volume = _disk(docs)
    assert cfg is not None and cfg.path == "/var/cache/prefixcache"
    assert cfg.bytes == 1 << 30
    assert mount is not None and mount["mountPath"] == cfg.path
    assert volume is not None and volume["emptyDir"] == {"sizeLimit": "1536Mi"}


def test_a_claim_keeps_the_pages_across_pods_and_settings_pass_through() -> None:
    docs = objects(
        render(
            {
                "disk": {
                    "claimName": "prefixcache-pages",
                    "path": "/pages",
                    "bytes": 1 << 40,
                    "settings": {"min_hits": 1},
                }
            }
        )
    )
    kv = need("kubernetes_validate")
    for doc in docs:
        kv.validate(doc, MIN_KUBERNETES, strict=True)
    cfg, mount, volume = _disk(docs)
    assert cfg is not None and (cfg.path, cfg.bytes, cfg.min_hits) == ("/pages", 1 << 40, 1)
    assert mount is not None and mount["mountPath"] == "/pages"
    assert volume == {"name": "disk", "persistentVolumeClaim": {"claimName": "prefixcache-pages"}}


def test_the_gpu_values_leave_the_disk_tier_out() -> None:
    docs = objects(render(values_file="values-gpu.yaml"))
    assert _disk(docs) == (None, None, None)
