"""KV events and tenants: events go to any ZMQ subscriber, unauthenticated,
so with ``server.tenants`` set nothing is published unless ``kv_events.tenants`` says
what: ``refuse`` (the default) fails the start, ``hashed`` publishes no token ids and
hashed namespace names, ``all`` publishes everything. Each policy goes through real
config loading (YAML and environment) and a real server with a real SUB.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import zmq
from harness import ServerThread, make_config
from kv_events_harness import MODELS, Subscriber, decode_batch, quiet_seq

from prefixcache.client import PrefixCacheClient
from prefixcache.server.config import ConfigError, KvEventsConfig, TenantConfig, load_config
from prefixcache.server.events.wire import hidden_namespace

TOKENS = [11, 12, 13, 14, 15, 16]


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.term()


def config_yaml(tmp: Path, policy: str | None, *, tenants: bool = True,
                publisher: str = "zmq") -> Path:
    lines = ["server:", f"  listen: unix:{tmp / 'pc.sock'}", "  metrics_port: -1",
             "  token: op-token", "  kv_events:", "    enable_kv_cache_events: true",
             f"    publisher: '{publisher}'", f"    endpoint: ipc://{tmp}/ev",
             f"    replay_endpoint: ipc://{tmp}/replay", "    buffer_steps: 1"]
    if policy is not None:
        lines.append(f"    tenants: {policy}")
    if tenants:
        lines += ["  tenants:", "    - name: acme", "      token: tok-acme",
                  "      namespaces: [acme/]"]
    path = tmp / "c.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_tenants_without_a_policy_refuse_to_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"server\.kv_events\.tenants: server\.tenants is set"):
        load_config(config_yaml(tmp_path, None), env={})
    with pytest.raises(ConfigError, match=r"server\.kv_events\.tenants"):
        load_config(config_yaml(tmp_path, "refuse"), env={})
    # The same through the environment, and a policy that is not one names its key.
    with pytest.raises(ConfigError, match=r"server\.kv_events\.tenants: one of refuse"):
        load_config(config_yaml(tmp_path, None),
                    env={"PREFIXCACHE_KV_EVENTS_TENANTS": "some"})
    assert load_config(config_yaml(tmp_path, None),
                       env={"PREFIXCACHE_KV_EVENTS_TENANTS": "hashed"}
                       ).server.kv_events.tenants == "hashed"
    # Nothing to refuse: no tenants, or events that publish nothing.
    assert load_config(config_yaml(tmp_path, None, tenants=False), env={})
    assert load_config(config_yaml(tmp_path, None, publisher="null"), env={})
    # A config built without load_config is refused at start, before anything binds.
    from prefixcache.server.app import PrefixCacheServer

    built = make_config(tmp_path, MODELS[:1], token="op-token",
                        tenants=(TenantConfig("acme", "tok-acme", namespaces=("acme/",)),),
                        kv_events=KvEventsConfig(enable_kv_cache_events=True,
                                                 endpoint=f"ipc://{tmp_path}/ev2"))
    with pytest.raises(ConfigError, match=r"server\.kv_events\.tenants"):
        asyncio.run(PrefixCacheServer(built).start())
    assert not (tmp_path / "ev2").exists()


@pytest.mark.parametrize("policy", ["hashed", "all"])
def test_each_policy_publishes_what_it_says(tmp_path: Path, ctx: zmq.Context,
                                            policy: str) -> None:
    cfg = load_config(config_yaml(tmp_path, policy), env={})
    srv = ServerThread(replace(cfg, models=MODELS[:1]))
    publisher = srv.server.kv_events.publishers["r"]
    try:
        sub = Subscriber(ctx, publisher.endpoint, publisher.replay_endpoint)
        time.sleep(0.3)
        with PrefixCacheClient(srv.address, token="tok-acme", timeout=10) as acme, \
                acme.session(10) as s:
            hit = s.match("r", TOKENS, extra_key="acme/secret", allocate=True)
            s.insert("r", TOKENS, hit.all_slots(), extra_key="acme/secret")
        with PrefixCacheClient(srv.address, token="op-token", timeout=10) as op, \
                op.session(10) as s:
            hit = s.match("r", TOKENS, allocate=True)  # the default namespace
            s.insert("r", TOKENS, hit.all_slots())
        batches = sub.until(quiet_seq(srv, "r"))
        stored = [e.fields for _, _, p in batches for e in decode_batch(p, "map", "vllm")[1]
                  if e.kind == "BlockStored"]
        raw = b"".join(p for _, _, p in batches)
        # A router behind the buffer gets the state by replay, under the same policy.
        (_, snapshot), = Subscriber(ctx, publisher.endpoint, publisher.replay_endpoint
                                    ).replay(0)[:1]
        from_replay = [e.fields for e in decode_batch(snapshot, "map", "vllm")[1]
                       if e.kind == "BlockStored"]
        sub.close()
    finally:
        srv.stop()
    assert len(stored) == 2 and len(from_replay) == 2
    names = sorted(str(f["lora_name"]) for f in stored + from_replay)
    if policy == "all":
        assert all(f["token_ids"] == TOKENS for f in stored + from_replay)
        assert names == ["None", "None", "acme/secret", "acme/secret"]
    else:
        assert all(f["token_ids"] == [] for f in stored + from_replay)
        hidden = hidden_namespace("acme/secret")
        assert names == ["None", "None", hidden, hidden]
        assert hidden.startswith("h:") and "acme" not in hidden
        assert b"acme" not in raw and b"acme" not in snapshot
        assert all(f["block_hashes"] and f["block_size"] == 2 for f in stored)
