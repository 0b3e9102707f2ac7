"""Shared helpers of the deployment tests: the files under deploy/, the Dockerfile, tools."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
CHART = DEPLOY / "helm" / "prefixcache"
DASHBOARD = DEPLOY / "grafana" / "prefixcache.json"
DOCKERFILE = REPO / "Dockerfile"

# The plain manifests, by what a reader applies together.
CPU_FILES = ("configmap.yaml", "deployment.yaml", "service.yaml")
GPU_FILES = (
    "gpu/configmap.yaml",
    "gpu/deployment.yaml",
    "gpu/resourceclaimtemplate.yaml",
    "service.yaml",
)
MONITORING_FILES = ("monitoring/servicemonitor.yaml", "monitoring/prometheusrule.yaml")
# The shared tier: its mooncake_master, and the CPU pod with server.tier on.
TIER_MASTER_FILE = "tier/mooncake-master.yaml"
TIER_POD_FILES = ("configmap.yaml", "tier/deployment.yaml", "service.yaml")
TIER_FILES = (*TIER_POD_FILES, TIER_MASTER_FILE)
# Native sidecars are on by default from 1.29; DRA's resource.k8s.io/v1 is GA in 1.34.
MIN_KUBERNETES = "1.29.0"
MIN_KUBERNETES_GPU = "1.34.0"
# Labels Prometheus adds to every series it scrapes from a target (job and instance
# always; the rest with Kubernetes service discovery).
TARGET_LABELS = frozenset(
    {"job", "instance", "namespace", "pod", "service", "container", "endpoint"}
)


def need(module: str, *, in_ci: bool = True) -> ModuleType:
    """Import ``module``, or skip; CI installs the dev extra, so there it must be there."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if in_ci and os.environ.get("CI"):
            pytest.fail(f"{module} is missing in CI (the dev extra installs it): {exc}")
        pytest.skip(f"{module} is not installed (pip install -e '.[dev]'): {exc}")


def tool(name: str, *, in_ci: bool = True) -> str:
    """The path of a command from the venv or PATH, or skip (fail in CI)."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        if in_ci and os.environ.get("CI"):
            pytest.fail(f"{name} is missing in CI (the dev extra installs it)")
        pytest.skip(f"{name} is not installed (pip install -e '.[dev]')")
    return found


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def docs_of(*names: str) -> list[dict[str, Any]]:
    return [doc for name in names for doc in load_docs(KUBERNETES / name)]


def all_manifest_files() -> list[Path]:
    return sorted(KUBERNETES.rglob("*.yaml"))


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def pod_spec(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "Deployment")["spec"]["template"]["spec"]


def sidecar(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = [c for c in pod_spec(docs)["initContainers"] if c["name"] == "prefixcache"]
    return container


def env_of(container: dict[str, Any]) -> dict[str, str]:
    """The container's literal environment (valueFrom entries left out)."""
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


# ------------------------------------------------------------------ Dockerfile


def dockerfile_instructions(text: str | None = None) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    text = DOCKERFILE.read_text() if text is None else text
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


def stages() -> list[list[tuple[str, str]]]:
    """The Dockerfile's instructions, split at each FROM (which starts its stage)."""
    result: list[list[tuple[str, str]]] = []
    for instruction in dockerfile_instructions():
        if instruction[0] == "FROM":
            result.append([])
        assert result, "the Dockerfile must start with FROM (after global ARGs, none here)"
        result[-1].append(instruction)
    return result


def exec_form(arguments: str) -> list[str]:
    value = json.loads(arguments)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), arguments
    return value


def healthcheck_command() -> list[str]:
    """The Dockerfile HEALTHCHECK's exec-form command: the reference probe."""
    (args,) = [a for i, a in dockerfile_instructions() if i == "HEALTHCHECK"]
    _options, _, command = args.partition("CMD ")
    assert command, f"HEALTHCHECK needs CMD: {args}"
    return exec_form(command)


def mounted_tier_secret(docs: list[dict[str, Any]], tmp: Path) -> dict[str, str]:
    """The sidecar's PREFIXCACHE_* environment with the tier secret's mount moved under
    ``tmp``, where a secret file stands in for the Secret's key (the pod's IP filled in).
    Checks that PREFIXCACHE_TIER's secret_file lies in a read-only mount of a Secret
    volume, under the path the volume gives its key."""
    container, spec = sidecar(docs), pod_spec(docs)
    env = {
        k: v.replace("$(POD_IP)", "10.1.2.3")
        for k, v in env_of(container).items()
        if k.startswith("PREFIXCACHE_")
    }
    secret_file = json.loads(env["PREFIXCACHE_TIER"])["secret_file"]
    directory, _, name = secret_file.rpartition("/")
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == directory]
    assert mount.get("readOnly") is True
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"]
    assert {i["path"] for i in volume["secret"]["items"]} == {name}
    assert volume["secret"]["defaultMode"] & 0o077 == 0o040  # the pod's group only
    (tmp / "tier-secret").mkdir()
    (tmp / "tier-secret" / name).write_bytes(os.urandom(32))
    env["PREFIXCACHE_TIER"] = env["PREFIXCACHE_TIER"].replace(directory, str(tmp / "tier-secret"))
    return env
