"""The chart with ``kvEvents.enabled``: the event ports on the pod and the Service, the
pod label llm-d's pod discovery selects, and settings the server accepts. (Off, the
default, renders the plain manifests: test_helm.py.)"""

from __future__ import annotations

from deploy.support import MIN_KUBERNETES, env_of, need, one, sidecar
from deploy.test_helm import objects, render

from prefixcache.server.config import load_config


def test_kv_events_on_render_ports_labels_and_settings() -> None:
    kv = need("kubernetes_validate")
    rendered = objects(
        render({"kvEvents": {"enabled": True, "enginePort": 8080, "hashFormat": "sglang"}})
    )
    for doc in rendered:
        kv.validate(doc, MIN_KUBERNETES, strict=True)
    container = sidecar(rendered)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["kv-events"], ports["kv-replay"]) == (5557, 5558)
    service = one(rendered, "Service")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "metrics": 9470,
        "kv-events": 5557,
        "kv-replay": 5558,
    }
    labels = one(rendered, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert labels["llm-d.ai/inferenceServing"] == "true"
    env = env_of(container)
    names = [e["name"] for e in container["env"]]
    assert names.index("POD_IP") < names.index("PREFIXCACHE_KV_EVENTS_TOPIC")  # $(POD_IP)
    assert env["PREFIXCACHE_KV_EVENTS_TOPIC"] == "kv@$(POD_IP):8080@{model}"
    env = {k: v.replace("$(POD_IP)", "10.1.2.3") for k, v in env.items()}
    config = load_config(env=env)
    events = config.server.kv_events
    assert events.enable_kv_cache_events and events.hash_format == "sglang"
    assert (events.endpoint, events.replay_endpoint) == ("tcp://*:5557", "tcp://*:5558")
    assert events.topic == "kv@10.1.2.3:8080@{model}"
    assert (events.buffer_steps, events.hwm) == (1000, 1000)
