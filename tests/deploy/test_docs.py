"""The "Deploy" section of docs/operations.md (once the README's) and deploy/README.md
name what really exists."""

from __future__ import annotations

import re
import tomllib

import yaml
from deploy.support import (
    CHART,
    CPU_FILES,
    DEPLOY,
    GPU_FILES,
    REPO,
    docs_of,
    one,
    pod_spec,
    sidecar,
)

OPERATIONS = REPO / "docs" / "operations.md"
DEPLOY_README = (DEPLOY / "README.md").read_text()


def _deploy_section() -> str:
    match = re.search(r"^## Deploy\n(.*?)^## ", OPERATIONS.read_text(), re.MULTILINE | re.DOTALL)
    assert match, 'docs/operations.md has no "## Deploy" section followed by another'
    return match[1]


def test_every_path_named_exists() -> None:
    section = _deploy_section()
    named = set(re.findall(r"(deploy/[\w./-]*[\w/])", section))
    named |= {
        f"deploy/{p}"
        for p in re.findall(r"`((?:kubernetes|helm|grafana)/[\w./-]*)`", DEPLOY_README)
    }
    assert len(named) >= 8
    for path in named:
        assert (REPO / path).exists(), path


def test_image_tags_match_the_manifests_and_the_chart() -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == version
    section = _deploy_section()
    assert f"docker build -t prefixcache:{version} ." in section
    assert f"prefixcache:{version}-cuda" in section
    assert sidecar(docs_of(*CPU_FILES))["image"] == f"prefixcache:{version}"
    assert sidecar(docs_of(*GPU_FILES))["image"] == f"prefixcache:{version}-cuda"
    gpu_values = yaml.safe_load((CHART / "values-gpu.yaml").read_text())
    assert gpu_values["image"]["tag"] == f"{version}-cuda"


def test_commands_name_the_objects_the_manifests_create() -> None:
    section = _deploy_section()
    docs = docs_of(*CPU_FILES)
    name = one(docs, "Deployment")["metadata"]["name"]
    assert f"kubectl rollout status deployment/{name}" in section
    assert f"kubectl logs deployment/{name} -c {pod_spec(docs)['containers'][0]['name']}" in section
    refs = [
        e["valueFrom"]["secretKeyRef"]
        for e in sidecar(docs)["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    ]
    (secret,) = {ref["name"] for ref in refs}
    assert f"kubectl create secret generic {secret}" in section
    keys = {ref["key"] for ref in refs}
    for key in keys:
        assert f"--from-literal={key}=" in section
    # docker run shares the socket directory the image listens in.
    assert "-v prefixcache-run:/run/prefixcache" in section
    assert "job_name: prefixcache" in section
