"""The chart's tier values: a mooncake_master Deployment and Service, and the sidecar's
server.tier (PREFIXCACHE_TIER) pointing at it from the pod's IP."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from deploy.support import (
    MIN_KUBERNETES,
    env_of,
    mounted_tier_secret,
    need,
    pod_spec,
    sidecar,
)
from deploy.test_helm import objects, render

from prefixcache.server.config import load_config

MASTER = "prefixcache-mooncake-master"


def _named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any] | None:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found[0] if found else None


def _sidecars(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``docs`` but the master's Deployment."""
    return [d for d in docs if d["kind"] != "Deployment" or d["metadata"]["name"] != MASTER]


def _tier(docs: list[dict[str, Any]], tmp: Path) -> Any:
    """The sidecar's server.tier, as the server reads it in a pod at 10.1.2.3 (its
    secret, if any, from the Secret's mount)."""
    sidecars = _sidecars(docs)
    value = env_of(sidecar(sidecars))["PREFIXCACHE_TIER"].replace("$(POD_IP)", "10.1.2.3")
    if "secret_file" in json.loads(value):
        value = mounted_tier_secret(sidecars, tmp)["PREFIXCACHE_TIER"]
    return load_config(None, env={"PREFIXCACHE_TIER": value}).server.tier


def test_tier_on_runs_a_master_and_points_every_sidecar_at_it(tmp_path: Path) -> None:
    docs = objects(render({"tier": {"enabled": True, "settings": {"timeout": 0.25}}}))
    kv = need("kubernetes_validate")
    for doc in docs:
        kv.validate(doc, MIN_KUBERNETES, strict=True)
    master, service = _named(docs, "Deployment", MASTER), _named(docs, "Service", MASTER)
    assert master is not None and service is not None
    (container,) = master["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["mooncake_master"]
    assert "--rpc_port=50051" in container["args"]
    assert {p["port"] for p in service["spec"]["ports"]} == {50051, 9003}
    # Neither Service selects the other's pods.
    labels = master["spec"]["template"]["metadata"]["labels"]
    sidecar_service = _named(docs, "Service", "prefixcache")
    assert sidecar_service is not None
    assert not set(sidecar_service["spec"]["selector"].items()) <= set(labels.items())
    tier = _tier(docs, tmp_path)
    assert (tier.master, tier.local_hostname, tier.timeout) == (f"{MASTER}:50051", "10.1.2.3", 0.25)
    assert tier.secret_file == str(tmp_path / "tier-secret" / "secret")


def test_the_tier_secret_comes_from_the_secret_named_or_is_left_out(tmp_path: Path) -> None:
    docs = objects(render({"tier": {"enabled": True, "secretName": "pc-tier", "secretKey": "key"}}))
    (volume,) = [v for v in pod_spec(_sidecars(docs))["volumes"] if v["name"] == "tier-secret"]
    assert volume["secret"]["secretName"] == "pc-tier"
    assert _tier(docs, tmp_path).secret_file.endswith("/key")
    off = objects(render({"tier": {"enabled": True, "secretName": ""}}))
    assert "tier-secret" not in json.dumps(pod_spec(_sidecars(off))["volumes"])
    assert _tier(off, tmp_path).secret_file is None


def test_an_existing_master_is_used_as_given(tmp_path: Path) -> None:
    docs = objects(
        render({"tier": {"enabled": True, "address": "mc.infra:7000", "master": {"deploy": False}}})
    )
    assert _named(docs, "Deployment", MASTER) is None
    assert _named(docs, "Service", MASTER) is None
    assert _tier(docs, tmp_path).master == "mc.infra:7000"


def test_tier_off_by_default() -> None:
    rendered = render()
    assert not any("mooncake" in text for text in rendered.values())
    assert "PREFIXCACHE_TIER" not in json.dumps(objects(rendered))
    assert not re.search(r"tier", rendered.get("prefixcache/templates/deployment.yaml", ""))
