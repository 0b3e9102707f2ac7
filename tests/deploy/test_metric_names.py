"""The pod's sidecar, started as the manifest says, serves what the probes, the inference
container, the alert rules and the dashboard expect.

One real `prefixcache serve` subprocess runs with the command, arguments, environment and
ConfigMap of deploy/kubernetes/ (the mount paths moved under a temporary directory, the
metrics port made free). The probes' own commands decide when it is up, and every PromQL
expression of the dashboard and the PrometheusRule is checked against its /metrics:
each metric exists, each label matched or grouped by exists on it, and each label value
the server enumerates (state, reason, operation) is one it exports.
"""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from deploy.promql import parse
from deploy.support import (
    CPU_FILES,
    DASHBOARD,
    REPO,
    TARGET_LABELS,
    docs_of,
    env_of,
    healthcheck_command,
    one,
    pod_spec,
    sidecar,
)
from prometheus_client.parser import text_string_to_metric_families

from prefixcache.v1 import prefix_cache_pb2 as pb
from prefixcache.v1 import prefix_cache_pb2_grpc as pb_grpc

# `prefixcache` as the console script runs it, whether or not the project is installed.
CLI = [sys.executable, "-c", "from prefixcache.server.cli import main; raise SystemExit(main())"]
START_TIMEOUT = 60.0
# Labels whose every value the server exports from the start (outcome: lookups.py).
ENUMERATED = ("state", "reason", "operation", "outcome")
STATUS_CODES = frozenset(code.name for code in grpc.StatusCode)


@dataclass
class Pod:
    """The sidecar of deployment.yaml, running here."""

    proc: subprocess.Popen[str]
    env: dict[str, str]  # the sidecar container's environment, paths moved
    inference_env: dict[str, str]  # the inference container's
    socket: Path
    stderr: Path
    metrics_port: int = 0


def _base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXCACHE_")}
    paths = [str(REPO / "server"), str(REPO / "client")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _exec(
    command: list[str], env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run a probe's exec command as the kubelet would, in the container's environment."""
    assert command[0] == "prefixcache", command
    return subprocess.run(
        [*CLI, *command[1:]], env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    docs = docs_of(*CPU_FILES)
    container = sidecar(docs)
    spec = pod_spec(docs)
    config_map = one(docs, "ConfigMap")
    tmp = tmp_path_factory.mktemp("pod")
    # Each mount path of the sidecar becomes a directory here.
    moved: dict[str, str] = {}
    volumes = {v["name"]: v for v in spec["volumes"]}
    for i, mount in enumerate(container["volumeMounts"]):
        here = tmp / f"m{i}"
        here.mkdir()
        moved[mount["mountPath"]] = str(here)
        if "configMap" in volumes[mount["name"]]:
            for key, text in config_map["data"].items():
                (here / key).write_text(text)

    paths = "|".join(map(re.escape, sorted(moved, key=len, reverse=True)))

    def move(value: str) -> str:  # one pass: a moved path may contain another (/tmp)
        # A path ends where the value or a JSON string (PREFIXCACHE_DISK's) does.
        return re.sub(rf"(?<![\w/])({paths})(?=[/\"]|$)", lambda m: moved[m[1]], value)

    env = {**_base_env(), **{k: move(v) for k, v in env_of(container).items()}}
    env["PREFIXCACHE_METRICS_PORT"] = "0"
    # The kubelet expands $(POD_IP) (a fieldRef, left out of env_of); this host's "pod
    # IP" is loopback, where the scrapes below go.
    env = {k: v.replace("$(POD_IP)", "127.0.0.1") for k, v in env.items()}
    inference = spec["containers"][0]
    inference_env = {**_base_env(), **{k: move(v) for k, v in env_of(inference).items()}}
    assert container["command"][0] == "prefixcache"
    argv = [*CLI, *container["command"][1:], *map(move, container.get("args", []))]
    stderr = tmp / "stderr"
    with open(stderr, "w") as err:
        proc = subprocess.Popen(
            argv,
            cwd=tmp,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            text=True,
        )
    socket = Path(env["PREFIXCACHE_LISTEN"].removeprefix("unix:"))
    running = Pod(proc, env, inference_env, socket, stderr)
    try:
        _wait_started(running, container["startupProbe"])
        yield running
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = None
    assert code == 0, f"serve exited with {code} after SIGTERM:\n{stderr.read_text()}"


def _wait_started(pod: Pod, startup: dict[str, Any]) -> None:
    """The kubelet's loop: run the startup probe until it passes."""
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        if pod.proc.poll() is not None:
            pytest.fail(f"serve exited with {pod.proc.returncode}:\n{pod.stderr.read_text()}")
        result = _exec(startup["exec"]["command"], pod.env, startup["timeoutSeconds"])
        if result.returncode == 0:
            break
        if time.monotonic() > deadline:
            pytest.fail(
                f"startup probe still failing after {START_TIMEOUT} s:\n"
                f"{result.stderr}\n{pod.stderr.read_text()}"
            )
        time.sleep(0.3)
    for line in pod.stderr.read_text().splitlines():
        record = json.loads(line)  # PREFIXCACHE_LOG_FORMAT=json
        if record["event"] == "serving":
            pod.metrics_port = int(record["metrics_port"])
    assert pod.metrics_port > 0


@pytest.fixture(scope="module")
def exported(pod: Pod) -> dict[str, dict[str, set[str]]]:
    """Sample name -> label -> values seen, from /metrics after a few calls."""
    with grpc.insecure_channel(pod.env["PREFIXCACHE_LISTEN"]) as channel:
        stub = pb_grpc.PrefixCacheStub(channel)
        (model,) = stub.ListModels(pb.ListModelsRequest(), timeout=10).models
        tokens = struct.pack("<64I", *range(64))
        stub.Match(pb.MatchRequest(model=model.name, token_ids=tokens), timeout=10)
        stub.Stats(pb.StatsRequest(), timeout=10)
    url = f"http://127.0.0.1:{pod.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    samples: dict[str, dict[str, set[str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = samples.setdefault(sample.name, {})
            for key, value in sample.labels.items():
                labels.setdefault(key, set()).add(value)
    return samples


# ---------------------------------------------------------------- the probes


def test_liveness_readiness_and_docker_healthcheck_pass(pod: Pod) -> None:
    container = sidecar(docs_of(*CPU_FILES))
    for name in ("livenessProbe", "readinessProbe"):
        probe = container[name]
        result = _exec(probe["exec"]["command"], pod.env, probe["timeoutSeconds"])
        assert result.returncode == 0, (name, result.stderr)
        assert result.stdout.endswith(": SERVING\n"), result.stdout
    result = _exec(healthcheck_command(), pod.env, 5)
    assert result.returncode == 0, result.stderr


def test_the_sidecar_knows_every_variable_the_manifest_sets(pod: Pod) -> None:
    # An unknown PREFIXCACHE_* variable (a typo) is logged as a warning at start.
    assert "unknown environment variables" not in pod.stderr.read_text()


def test_probe_fails_fast_without_a_server(tmp_path: Path) -> None:
    probe = sidecar(docs_of(*CPU_FILES))["livenessProbe"]
    env = {**_base_env(), "PREFIXCACHE_LISTEN": f"unix:{tmp_path / 'none.sock'}"}
    # Within the probe's timeoutSeconds (_exec raises past it), and UNAVAILABLE: the
    # missing socket failed the call at once, no wait for a server until a deadline.
    result = _exec(probe["exec"]["command"], env, probe["timeoutSeconds"])
    assert result.returncode != 0
    # One line saying why, for the kubelet's event.
    (line,) = result.stderr.splitlines()
    assert "UNAVAILABLE" in line and "none.sock" in line, line


def test_readiness_fails_for_a_service_the_server_does_not_have(pod: Pod) -> None:
    command = sidecar(docs_of(*CPU_FILES))["readinessProbe"]["exec"]["command"]
    result = _exec([*command[:-1], "prefixcache.v1.PrefixCache/nope"], pod.env, 5)
    assert result.returncode != 0
    (line,) = result.stderr.splitlines()
    assert "NOT_FOUND" in line and "prefixcache.v1.PrefixCache/nope" in line, line


def test_the_socket_is_shared_with_the_pods_group(pod: Pod) -> None:
    assert pod.socket.is_socket()
    assert pod.socket.stat().st_mode & 0o777 == 0o660


def test_the_inference_container_reaches_the_sidecar(pod: Pod, tmp_path: Path) -> None:
    target = pod.inference_env["PREFIXCACHE_TARGET"]
    assert target == pod.env["PREFIXCACHE_LISTEN"]
    # The stand-in's own command, which finds the sidecar through PREFIXCACHE_TARGET.
    command = pod_spec(docs_of(*CPU_FILES))["containers"][0]["command"]
    assert "prefixcache stats;" in command[-1], command
    result = subprocess.run(
        [*CLI, "stats"],
        env=pod.inference_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert re.search(r"^demo\s", result.stdout, re.MULTILINE), result.stdout


# ----------------------------------------------------- metric names in PromQL


def _check(text: str, exported: dict[str, dict[str, set[str]]], legend: str | None = None) -> None:
    expr = parse(text)
    assert expr.selectors, f"no metric in {text!r}"
    available: set[str] = set(TARGET_LABELS)
    for selector in expr.selectors:
        if selector.metric == "up":  # Prometheus' own, per scrape target
            labels: dict[str, set[str]] = {}
        else:
            assert selector.metric in exported, (
                f"{selector.metric} is not exported by the server (in {text!r})"
            )
            labels = exported[selector.metric]
        available |= set(labels)
        for m in selector.matchers:
            assert m.label in TARGET_LABELS or m.label in labels, (
                f"{selector.metric} has no label {m.label!r} (in {text!r})"
            )
            if "$" in m.value:
                continue
            values = m.value.split("|") if m.op in ("=~", "!~") else [m.value]
            if m.label in ENUMERATED:
                assert set(values) <= labels[m.label], (
                    f"{selector.metric}{{{m.label}}} is never {values} (in {text!r})"
                )
            if m.label == "code":
                assert set(values) <= STATUS_CODES, f"not a gRPC status in {text!r}"
    assert expr.grouping <= available, (
        f"grouping by labels none of its metrics has: {expr.grouping - available} in {text!r}"
    )
    if legend:
        shown = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
        kept = expr.grouping if expr.grouping else available
        assert shown <= kept, f"legend {legend!r} names labels the query drops: {text!r}"


def test_dashboard_queries_use_exported_metrics(exported: dict[str, dict[str, set[str]]]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    count = 0
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            _check(target["expr"], exported, target.get("legendFormat"))
            count += 1
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["query"]["query"])
        assert match, variable["query"]
        selector, label = match.groups()
        _check(selector, exported)
        assert label in TARGET_LABELS or label in exported[parse(selector).selectors[0].metric]
    assert count >= 10


def test_alert_rules_use_exported_metrics(exported: dict[str, dict[str, set[str]]]) -> None:
    rule = one(docs_of("monitoring/prometheusrule.yaml"), "PrometheusRule")
    exprs = [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert exprs
    for expr in exprs:
        _check(expr, exported)
    # The alerts' annotations name only labels their expression keeps.
    for r in (r for g in rule["spec"]["groups"] for r in g["rules"]):
        parsed = parse(r["expr"])
        used = {
            label
            for text in r["annotations"].values()
            for label in re.findall(r"\$labels\.(\w+)", text)
        }
        if parsed.grouping:
            assert used <= parsed.grouping, (r["alert"], used - parsed.grouping)


def test_the_checker_catches_mistakes(exported: dict[str, dict[str, set[str]]]) -> None:
    """Each kind of mistake the two tests above look for is really caught."""
    mistakes = [
        "rate(prefixcache_hit_token_total[5m])",  # a typo
        'prefixcache_pool_slots{state="taken"}',  # no such state
        'prefixcache_rpc_requests_total{model="m"}',  # no model label
        "sum by (reason) (prefixcache_cached_tokens)",  # label of another
        "rat(prefixcache_hit_tokens_total[5m])",  # unknown function
        'prefixcache_rpc_requests_total{code="EXHAUSTED"}',  # not a status code
    ]
    for text in mistakes:
        with pytest.raises((AssertionError, ValueError)):
            _check(text, exported)
    with pytest.raises(AssertionError):
        _check("sum by (model) (prefixcache_locks)", exported, legend="{{state}}")


# ------------------------------------------------------------ the dashboard


def test_the_dashboard_has_the_panels_operators_need() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    titles = {p["title"] for p in panels}
    assert {
        "Hit ratio",
        "Cached tokens by state",
        "Evicted tokens by reason",
        "Pool usage",
        "RPC latency p50 / p99 by method",
        "Sessions and locks",
    } <= titles
    defined = {v["name"] for v in dashboard["templating"]["list"]}
    builtin = {"__rate_interval", "__range", "__interval"}
    for p in panels:
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]), p["title"]
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert p["targets"], p["title"]
        for target in p["targets"]:
            used = set(re.findall(r"\$(\w+)", target["expr"]))
            assert used <= defined | builtin, (p["title"], used - defined - builtin)
    latency = next(p for p in panels if p["title"].startswith("RPC latency"))
    quantiles = {
        re.match(r"histogram_quantile\(([\d.]+),", t["expr"])[1] for t in latency["targets"]
    }
    assert quantiles == {"0.5", "0.99"}
