"""The Helm chart renders the plain manifests, and its options render valid objects.

Rendering uses Helm's own Go engine through helm-python-sdk (a ctypes binding of the
Helm SDK, no cluster needed), which the dev extra installs on Linux x86-64. With release
name `prefixcache`, the defaults render deploy/kubernetes/, values-gpu.yaml renders
deploy/kubernetes/gpu/ and values-tier.yaml deploy/kubernetes/tier/ (beside the default
ConfigMap and Service), up to the labels only Helm adds and the config checksum.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy.support import (
    CHART,
    CPU_FILES,
    GPU_FILES,
    MIN_KUBERNETES,
    MONITORING_FILES,
    TIER_FILES,
    docs_of,
    env_of,
    need,
    one,
    pod_spec,
    sidecar,
)

from prefixcache.server.config import load_config

RELEASE = "prefixcache"
HELM_ONLY_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by")
MONITORING = {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}
# The dev extra installs helm-python-sdk only where it has a wheel.
HELM_IN_CI = sys.platform == "linux" and platform.machine() == "x86_64"


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def render(*values: dict[str, Any], values_file: str | None = None) -> dict[str, str]:
    """Template path -> rendered text, as `helm template prefixcache CHART` prints it."""
    helm = need("helm_python", in_ci=HELM_IN_CI)
    merged: dict[str, Any] = {}
    if values_file:
        merged = yaml.safe_load((CHART / values_file).read_text())
    for extra in values:
        merged = _merge(merged, extra)
    with helm.Chart.load(str(CHART)) as chart:
        return chart.render(merged, name=RELEASE, namespace="default")


def objects(rendered: dict[str, str]) -> list[dict[str, Any]]:
    return [
        doc
        for path, text in sorted(rendered.items())
        if path.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def _normalise(doc: dict[str, Any]) -> dict[str, Any]:
    """Without what only Helm adds; a ConfigMap's config compared as data, not text."""

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: walk(v) for k, v in node.items()}
            meta = out.get("metadata")
            if isinstance(meta, dict):
                labels = {
                    k: v for k, v in meta.get("labels", {}).items() if k not in HELM_ONLY_LABELS
                }
                if "labels" in meta:
                    meta["labels"] = labels
                annotations = {
                    k: v for k, v in meta.get("annotations", {}).items() if k != "checksum/config"
                }
                if "annotations" in meta:
                    meta["annotations"] = annotations
            return out
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    out = walk(doc)
    if out["kind"] == "ConfigMap":
        out["data"] = {k: yaml.safe_load(v) for k, v in out["data"].items()}
    return out


def _by_name(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    keyed = {(d["kind"], d["metadata"]["name"]): _normalise(d) for d in docs}
    assert len(keyed) == len(docs), "two objects of one kind share a name"
    return keyed


def _assert_same(rendered: list[dict[str, Any]], plain: list[dict[str, Any]]) -> None:
    got, want = _by_name(rendered), _by_name(plain)
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key] == want[key], f"{key}: the chart renders something else"


def test_defaults_render_the_plain_manifests() -> None:
    rendered = objects(render())
    assert {d["kind"] for d in rendered} == {"ConfigMap", "Deployment", "Service"}
    _assert_same(rendered, docs_of(*CPU_FILES))


def test_monitoring_on_renders_the_service_monitor_and_rules() -> None:
    _assert_same(objects(render(MONITORING)), docs_of(*CPU_FILES, *MONITORING_FILES))


def test_gpu_values_render_the_gpu_manifests() -> None:
    rendered = objects(render(MONITORING, values_file="values-gpu.yaml"))
    _assert_same(rendered, docs_of(*GPU_FILES, *MONITORING_FILES))


def test_tier_values_render_the_tier_manifests() -> None:
    rendered = objects(render(MONITORING, values_file="values-tier.yaml"))
    assert sum(d["kind"] == "Deployment" for d in rendered) == 2  # sidecar pod, master
    _assert_same(rendered, docs_of(*TIER_FILES, *MONITORING_FILES))


def test_tls_and_auth_values_render_valid_objects(tmp_path: Path) -> None:
    kv = need("kubernetes_validate")
    rendered = objects(
        render(
            {
                "tls": {"enabled": True, "secretName": "pc-tls", "clientCA": True},
                "auth": {"secretName": "pc-tokens", "optional": False},
                "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
                "extraEnv": [{"name": "PREFIXCACHE_SESSION_TTL", "value": "60"}],
            }
        )
    )
    for doc in rendered:
        if doc["kind"] != "ServiceMonitor":
            kv.validate(doc, MIN_KUBERNETES, strict=True)
    container = sidecar(rendered)
    env = env_of(container)
    assert env["PREFIXCACHE_LISTEN"] == "0.0.0.0:50051"
    (tls_mount,) = [m for m in container["volumeMounts"] if m["name"] == "tls"]
    for name in ("PREFIXCACHE_TLS_CERT", "PREFIXCACHE_TLS_KEY", "PREFIXCACHE_TLS_CLIENT_CA"):
        assert env[name].startswith(tls_mount["mountPath"] + "/"), name
    spec = pod_spec(rendered)
    (tls_volume,) = [v for v in spec["volumes"] if v["name"] == "tls"]
    assert tls_volume["secret"]["secretName"] == "pc-tls"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["tcpSocket"] == {"port": "grpc"}, probe
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["grpc"] == 50051
    service = one(rendered, "Service")
    assert {p["name"] for p in service["spec"]["ports"]} == {"metrics", "grpc"}
    secrets = {
        e["valueFrom"]["secretKeyRef"]["name"]
        for c in [container, *spec["containers"]]
        for e in c["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert secrets == {"pc-tokens"}
    assert env_of(spec["containers"][0])["PREFIXCACHE_TARGET"] == "localhost:50051"
    assert (
        one(rendered, "ServiceMonitor")["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    )
    # The server accepts these settings (the certificate files are read at bind time).
    config_map = one(rendered, "ConfigMap")
    (tmp_path / "config.yaml").write_text(config_map["data"]["config.yaml"])
    config = load_config(tmp_path / "config.yaml", env=env)
    assert config.server.tls_client_ca and config.server.session_ttl == 60


def test_tls_without_a_secret_name_fails_to_render() -> None:
    helm = need("helm_python", in_ci=HELM_IN_CI)
    with pytest.raises(helm.HelmError, match=r"tls\.secretName"):
        render({"tls": {"enabled": True}})


def test_helm_lint_is_clean() -> None:
    helm = need("helm_python", in_ci=HELM_IN_CI)
    tier = yaml.safe_load((CHART / "values-tier.yaml").read_text())
    for values in ({}, MONITORING, tier):
        report = helm.lint(str(CHART), values, strict=True, kube_version="v1.34.0")
        assert report["errors"] == [], report
        problems = [m for m in report["messages"] if m["severity"] >= 2]
        assert problems == [], problems


def test_notes_tell_how_to_check_the_sidecar() -> None:
    notes = render()[f"{RELEASE}/templates/NOTES.txt"]
    assert "prefixcache stats --target unix:/run/prefixcache/prefixcache.sock" in notes
    assert "http://prefixcache.default.svc:9470/metrics" in notes


def test_metrics_bind_the_pod_ip_with_an_optional_token() -> None:
    """The server binds /metrics to 127.0.0.1 by default; the chart sets the pod's IP
    (Prometheus scrapes it there), and with auth.metricsTokenKey a token from the auth
    Secret that the ServiceMonitor sends."""
    container = sidecar(objects(render()))
    names = [e["name"] for e in container["env"]]
    assert names.index("POD_IP") < names.index("PREFIXCACHE_METRICS_HOST")  # $(POD_IP)
    (pod_ip,) = [e for e in container["env"] if e["name"] == "POD_IP"]
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    env = env_of(container)
    assert env["PREFIXCACHE_METRICS_HOST"] == "$(POD_IP)"
    assert "PREFIXCACHE_METRICS_TOKEN" not in names
    pod_env = {k: v.replace("$(POD_IP)", "10.1.2.3") for k, v in env.items()}
    assert load_config(env=pod_env).server.metrics_host == "10.1.2.3"

    rendered = objects(
        render(MONITORING, {"metricsHost": "0.0.0.0", "auth": {"metricsTokenKey": "metrics-token"}})
    )
    container = sidecar(rendered)
    assert env_of(container)["PREFIXCACHE_METRICS_HOST"] == "0.0.0.0"
    (token,) = [e for e in container["env"] if e["name"] == "PREFIXCACHE_METRICS_TOKEN"]
    ref = token["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == ("prefixcache-auth", "metrics-token")
    (endpoint,) = one(rendered, "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": "prefixcache-auth", "key": "metrics-token"},
    }
