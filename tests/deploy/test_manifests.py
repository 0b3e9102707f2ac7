"""The plain manifests in deploy/kubernetes/: valid objects that fit together.

Core objects are validated against the Kubernetes OpenAPI schemas that
kubernetes-validate bundles (strict: an unknown field is an error), at the oldest
version each example needs and at the newest one bundled. The Prometheus Operator's
ServiceMonitor and PrometheusRule are custom resources those schemas lack, so they are
checked field by field here; their PromQL is checked against a real server's metrics in
test_metric_names.py.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy.support import (
    CPU_FILES,
    GPU_FILES,
    KUBERNETES,
    MIN_KUBERNETES,
    MIN_KUBERNETES_GPU,
    MONITORING_FILES,
    TIER_FILES,
    TIER_MASTER_FILE,
    TIER_POD_FILES,
    all_manifest_files,
    docs_of,
    env_of,
    load_docs,
    mounted_tier_secret,
    need,
    one,
    pod_spec,
    sidecar,
)

from prefixcache.server.config import load_config

CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule"}
# The sidecar's pod, in each variant.
PODS = pytest.mark.parametrize(
    "files", [CPU_FILES, GPU_FILES, TIER_POD_FILES], ids=["cpu", "gpu", "tier"]
)
DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")


def _core_docs(names: tuple[str, ...]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (name, doc)
        for name in names
        for doc in load_docs(KUBERNETES / name)
        if doc["kind"] not in CUSTOM_KINDS
    ]


def test_every_manifest_file_is_listed() -> None:
    """A new file under deploy/kubernetes/ must join one of the lists the tests check."""
    listed = {*CPU_FILES, *GPU_FILES, *TIER_FILES, *MONITORING_FILES}
    found = {str(p.relative_to(KUBERNETES)) for p in all_manifest_files()}
    assert found == listed


@pytest.mark.parametrize(
    ("names", "minimum"),
    [(CPU_FILES, MIN_KUBERNETES), (GPU_FILES, MIN_KUBERNETES_GPU), (TIER_FILES, MIN_KUBERNETES)],
    ids=["cpu", "gpu", "tier"],
)
def test_core_objects_match_the_kubernetes_schemas(names: tuple[str, ...], minimum: str) -> None:
    kv = need("kubernetes_validate")
    docs = _core_docs(names)
    assert docs
    for version in (minimum, kv.latest_version()):
        for name, doc in docs:
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as exc:
                pytest.fail(
                    f"{name}: {doc['kind']} is not valid for Kubernetes {version}: "
                    f"{exc.message} at {'.'.join(map(str, exc.path))}"
                )


def test_the_validator_rejects_a_broken_deployment() -> None:
    """The check above would catch a typo: the schemas are strict and really loaded."""
    kv = need("kubernetes_validate")
    deployment = copy.deepcopy(one(docs_of("deployment.yaml"), "Deployment"))
    sidecar_spec = deployment["spec"]["template"]["spec"]["initContainers"][0]
    sidecar_spec["restartPolicyy"] = sidecar_spec.pop("restartPolicy")
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, MIN_KUBERNETES, strict=True)
    # Native sidecars do not exist before 1.28: the schema must know restartPolicy.
    good = one(docs_of("deployment.yaml"), "Deployment")
    with pytest.raises(kv.ValidationError):
        kv.validate(good, "1.27.0", strict=True)


@PODS
def test_the_pod_runs_prefixcache_as_a_native_sidecar(files: tuple[str, ...]) -> None:
    docs = docs_of(*files)
    spec = pod_spec(docs)
    container = sidecar(docs)
    assert container["restartPolicy"] == "Always"
    assert [c["name"] for c in spec["containers"]] == ["inference"]
    inference = spec["containers"][0]
    # Both mount the socket's emptyDir where PREFIXCACHE_LISTEN puts the socket.
    listen = env_of(container)["PREFIXCACHE_LISTEN"]
    assert listen.startswith("unix:/")
    socket_dir = listen.removeprefix("unix:").rpartition("/")[0]
    volumes = {v["name"]: v for v in spec["volumes"]}
    for c in (container, inference):
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert "emptyDir" in volumes[mounts[socket_dir]], c["name"]
    assert env_of(inference)["PREFIXCACHE_TARGET"] == listen
    # Every container of the pod gets the socket's group, and the socket is group-writable.
    assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsGroup"]
    # Written 0660, as operators write modes; the server reads it as octal.
    mode = env_of(container)["PREFIXCACHE_SOCKET_MODE"]
    assert mode == "0660"
    assert load_config(env={"PREFIXCACHE_SOCKET_MODE": mode}).server.socket_mode == 0o660
    # PREFIXCACHE_* Service links would land in the server's settings.
    assert spec["enableServiceLinks"] is False
    # Long enough for the server's own drain after the inference container stopped.
    assert (
        spec["terminationGracePeriodSeconds"]
        > float(env_of(container)["PREFIXCACHE_GRACE_PERIOD"]) + 5
    )


@PODS
def test_containers_are_locked_down_and_sized(files: tuple[str, ...]) -> None:
    spec = pod_spec(docs_of(*files))
    pod = spec["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0
    assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
    for c in [*spec["initContainers"], *spec["containers"]]:
        security = c["securityContext"]
        assert security["allowPrivilegeEscalation"] is False, c["name"]
        assert security["readOnlyRootFilesystem"] is True, c["name"]
        assert security["capabilities"] == {"drop": ["ALL"]}, c["name"]
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]), c["name"]
        assert "memory" in c["resources"]["limits"], c["name"]
    # A read-only root: the sidecar's /tmp is an emptyDir.
    mounts = {m["mountPath"] for m in sidecar(docs_of(*files))["volumeMounts"]}
    assert "/tmp" in mounts


@PODS
def test_probes_check_grpc_health_over_the_socket(files: tuple[str, ...]) -> None:
    container = sidecar(docs_of(*files))
    for name in ("startupProbe", "livenessProbe", "readinessProbe"):
        probe = container[name]
        command = probe["exec"]["command"]
        # `prefixcache health`, not an inline script; its default deadline is 3 s.
        assert command[:2] == ["prefixcache", "health"], name
        assert "--timeout" not in command and probe["timeoutSeconds"] >= 4, name
    assert container["readinessProbe"]["exec"]["command"][2:] == [
        "--service",
        "prefixcache.v1.PrefixCache",
    ]
    # The probes ask PREFIXCACHE_LISTEN; a PREFIXCACHE_TARGET would win over it.
    env = {e["name"] for e in container["env"]}
    assert "PREFIXCACHE_LISTEN" in env and "PREFIXCACHE_TARGET" not in env
    # Room for a big pool to be allocated before liveness takes over.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120


@PODS
def test_the_config_map_is_mounted_and_loads(files: tuple[str, ...], tmp_path: Path) -> None:
    docs = docs_of(*files)
    config_map = one(docs, "ConfigMap")
    container = sidecar(docs)
    spec = pod_spec(docs)
    (volume,) = [v for v in spec["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert mount.get("readOnly") is True
    config_arg = container["args"][container["args"].index("--config") + 1]
    directory, _, key = config_arg.rpartition("/")
    assert directory == mount["mountPath"] and key in config_map["data"]
    path = tmp_path / key
    path.write_text(config_map["data"][key])
    env = {
        k: v.replace("$(POD_IP)", "10.1.2.3")
        for k, v in env_of(container).items()
        if k.startswith("PREFIXCACHE_")
    }
    if "tier/deployment.yaml" in files:  # its secret, from the Secret's mount
        env = mounted_tier_secret(docs, tmp_path)
    config = load_config(path, env=env)  # raises ConfigError naming a bad field
    assert config.server.listen == env["PREFIXCACHE_LISTEN"]
    assert config.server.metrics_port == int(env["PREFIXCACHE_METRICS_PORT"])
    assert config.models
    devices = {m.pool.device for m in config.models}
    assert devices == ({"cuda:0"} if "gpu/deployment.yaml" in files else {"cpu"})
    # Only the tier variant turns server.tier on.
    assert (config.server.tier is not None) == ("tier/deployment.yaml" in files)


def test_the_gpu_pod_shares_one_claimed_gpu() -> None:
    docs = docs_of(*GPU_FILES)
    template = one(docs, "ResourceClaimTemplate")
    spec = pod_spec(docs)
    (claim,) = spec["resourceClaims"]
    assert claim["resourceClaimTemplateName"] == template["metadata"]["name"]
    for c in [*spec["initContainers"], *spec["containers"]]:
        assert c["resources"]["claims"] == [{"name": claim["name"]}], c["name"]
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"]
    assert sidecar(docs)["image"].endswith("-cuda")


def _master() -> tuple[dict[str, Any], dict[str, Any]]:
    docs = docs_of(TIER_MASTER_FILE)
    return one(docs, "Deployment"), one(docs, "Service")


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_the_tier_master_is_apart_from_the_sidecar_and_its_service_selects_it() -> None:
    master, master_service = _master()
    pod = docs_of(*TIER_POD_FILES)
    sidecar_deployment, sidecar_service = one(pod, "Deployment"), one(pod, "Service")
    master_labels = master["spec"]["template"]["metadata"]["labels"]
    sidecar_labels = sidecar_deployment["spec"]["template"]["metadata"]["labels"]
    assert master_labels["app.kubernetes.io/component"] == "mooncake-master"
    # Each Deployment and Service selects its own pods and never the other's: the
    # sidecar's metrics Service (and ServiceMonitor) must not scrape the master, and a
    # Deployment adopting the other's pods would fight over them.
    for selector, own, other in (
        (master["spec"]["selector"]["matchLabels"], master_labels, sidecar_labels),
        (master_service["spec"]["selector"], master_labels, sidecar_labels),
        (sidecar_deployment["spec"]["selector"]["matchLabels"], sidecar_labels, master_labels),
        (sidecar_service["spec"]["selector"], sidecar_labels, master_labels),
    ):
        assert _selects(selector, own) and not _selects(selector, other), selector
    (container,) = master["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["mooncake_master"]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    for port in master_service["spec"]["ports"]:
        assert named[port["targetPort"]] == port["port"], port
    args = dict(a.removeprefix("--").split("=", 1) for a in container["args"])
    assert int(args["rpc_port"]) == named["mooncake-rpc"]
    assert int(args["metrics_port"]) == named["mooncake-http"]
    assert args["rpc_address"] == "0.0.0.0"  # reached through the Service, not localhost
    # Its metadata lives in memory: one replica, never two at once during a rollout.
    assert master["spec"]["replicas"] == 1
    assert master["spec"]["strategy"] == {"type": "Recreate"}
    # mooncake_master comes with the tier extra, in the sidecar's image.
    assert container["image"] == sidecar(pod)["image"]


def test_the_tier_sidecar_names_the_master_service(tmp_path: Path) -> None:
    _, master_service = _master()
    docs = docs_of(*TIER_POD_FILES)
    container = sidecar(docs)
    names = [e["name"] for e in container["env"]]
    # $(POD_IP) expands only when POD_IP is defined earlier in the list.
    assert names.index("POD_IP") < names.index("PREFIXCACHE_TIER")
    assert "$(POD_IP)" in env_of(container)["PREFIXCACHE_TIER"]
    # The secret_file it names is the Secret prefixcache-tier, mounted read-only.
    env = mounted_tier_secret(docs, tmp_path)
    tier = load_config(env={"PREFIXCACHE_TIER": env["PREFIXCACHE_TIER"]}).server.tier
    assert tier is not None and tier.secret_file is not None
    (volume,) = [v for v in pod_spec(docs)["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == "prefixcache-tier"
    (rpc,) = [p for p in master_service["spec"]["ports"] if p["name"] == "mooncake-rpc"]
    assert tier.master == f"{master_service['metadata']['name']}:{rpc['port']}"
    assert tier.local_hostname == "10.1.2.3"
    assert (tier.backend, tier.protocol) == ("mooncake", "tcp")
    # The segment it lends is its own memory: its limit is the CPU pod's plus that.
    cpu_limit = sidecar(docs_of(*CPU_FILES))["resources"]["limits"]["memory"]
    limit = container["resources"]["limits"]["memory"]
    assert _bytes(limit) >= _bytes(cpu_limit) + tier.segment_bytes


def _bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    return int(quantity[:-2]) * units[quantity[-2:]] if quantity[-2:] in units else int(quantity)


def test_the_tier_master_is_locked_down_and_sized() -> None:
    master, _ = _master()
    spec = master["spec"]["template"]["spec"]
    pod = spec["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0
    assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = spec["containers"]
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert "memory" in container["resources"]["limits"]
    # A read-only root: glog must not try to write its files there.
    assert env_of(container)["GLOG_logtostderr"] == "1"
    assert {"readinessProbe", "livenessProbe"} <= set(container)


def test_the_metrics_service_reaches_the_sidecar() -> None:
    docs = docs_of(*CPU_FILES)
    service = one(docs, "Service")
    deployment = one(docs, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    container = sidecar(docs)
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named[port["targetPort"]] == int(env_of(container)["PREFIXCACHE_METRICS_PORT"])
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(named["metrics"])
    assert annotations["prometheus.io/path"] == "/metrics"


def test_the_service_monitor_selects_the_service() -> None:
    service = one(docs_of("service.yaml"), "Service")
    monitor = one(docs_of("monitoring/servicemonitor.yaml"), "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    port_names = {p["name"] for p in service["spec"]["ports"]}
    assert monitor["spec"]["endpoints"]
    for endpoint in monitor["spec"]["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme"}
        assert endpoint["port"] in port_names
        assert endpoint["path"] == "/metrics"
        assert DURATION.match(endpoint["interval"])


def test_the_prometheus_rule_is_well_formed() -> None:
    rule = one(docs_of("monitoring/prometheusrule.yaml"), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(rule) == {"apiVersion", "kind", "metadata", "spec"}
    alerts = {}
    for group in rule["spec"]["groups"]:
        assert set(group) <= {"name", "interval", "rules"} and group["name"]
        for r in group["rules"]:
            assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}, r
            assert isinstance(r["expr"], str) and r["expr"].strip()
            if "for" in r:
                assert DURATION.match(r["for"]), r["for"]
            assert r["labels"]["severity"] in ("critical", "warning")
            assert {"summary", "description"} <= set(r["annotations"])
            for text in r["annotations"].values():
                for ref in re.findall(r"\{\{(.*?)\}\}", text):
                    assert re.fullmatch(
                        r"\s*\$(labels\.\w+|value)(\s*\|\s*humanize\w*)?\s*", ref
                    ), ref
            alerts[r["alert"]] = r
    # The ones the issue asks for: server down, hit ratio collapse, pool exhaustion,
    # lease expiries spiking.
    assert {
        "PrefixcacheDown",
        "PrefixcacheHitRatioCollapse",
        "PrefixcachePoolExhausted",
        "PrefixcacheLeaseExpiriesSpiking",
    } <= set(alerts)
    # The scrape job is named after the metrics Service.
    service = one(docs_of("service.yaml"), "Service")
    assert f'up{{job="{service["metadata"]["name"]}"}}' in alerts["PrefixcacheDown"]["expr"]


def test_the_pool_exhausted_alert_keys_on_the_reason_not_the_status_code() -> None:
    """Over-long prompts are RESOURCE_EXHAUSTED too, with free slots left: the
    alert reads the refusals of a pinned pool only. The chart renders this same rule
    (test_helm.py::test_monitoring_on_renders_the_service_monitor_and_rules)."""
    from deploy.promql import parse

    rule = one(docs_of("monitoring/prometheusrule.yaml"), "PrometheusRule")
    (alert,) = [
        r
        for g in rule["spec"]["groups"]
        for r in g["rules"]
        if r.get("alert") == "PrefixcachePoolExhausted"
    ]
    selectors = parse(alert["expr"]).selectors
    assert [s.metric for s in selectors] == ["prefixcache_allocation_refusals_total"]
    assert [(m.label, m.op, m.value) for m in selectors[0].matchers] == [
        ("reason", "=", "pool_exhausted")
    ]


def test_every_object_carries_the_common_labels() -> None:
    for path in all_manifest_files():
        # The master's objects are named apart from the sidecar's (see above).
        master = path == KUBERNETES / TIER_MASTER_FILE
        for doc in load_docs(path):
            labels = doc["metadata"]["labels"]
            assert labels["app.kubernetes.io/name"] == (
                "prefixcache-mooncake-master" if master else "prefixcache"
            ), path
            assert labels["app.kubernetes.io/instance"] == "prefixcache", path
            assert "namespace" not in doc["metadata"], "kubectl -n picks the namespace"


def test_manifests_are_plain_yaml() -> None:
    """No templating left in the plain files (only Prometheus' own in annotations)."""
    for path in all_manifest_files():
        text = path.read_text()
        assert "{{ ." not in text and "{{-" not in text, path
        yaml.safe_load_all(text)
