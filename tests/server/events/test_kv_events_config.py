"""KV events settings: off by default, configured like the other keys, bad values
named by key, one endpoint per model (none for the slot kind), and endpoints that
collide or cannot bind fail the start.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from harness import ServerThread, make_config
from kv_events_harness import MODELS, start

from prefixcache.server.config import KvEventsConfig, ModelConfig, PoolConfig, load_config
from prefixcache.server.events.publisher import endpoint_for


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.term()


def test_models_get_their_own_ports_and_the_slot_kind_publishes_nothing(tmp_path: Path) -> None:
    assert endpoint_for("tcp://*:5557", 0) == "tcp://*:5557"
    assert endpoint_for("tcp://*:5557", 2) == "tcp://*:5559"
    assert endpoint_for("tcp://10.0.0.1:6000", 1) == "tcp://10.0.0.1:6001"
    assert endpoint_for("ipc:///run/ev", 1) == "ipc:///run/ev_1"
    assert endpoint_for("tcp://127.0.0.1:*", 3) == "tcp://127.0.0.1:*"
    models = (
        *MODELS,
        ModelConfig(
            name="s", kind="slot", max_seq_len=8, pool=PoolConfig(size=2, k_heads=1, k_head_dim=2)
        ),
    )
    srv = start(
        tmp_path,
        models=models,
        endpoint=f"ipc://{tmp_path}/ev",
        replay_endpoint=None,
        topic="kv@{host}@{model}-x",
    )
    try:
        publishers = srv.server.kv_events.publishers
        assert sorted(publishers) == ["r", "w"]
        assert publishers["r"].endpoint == f"ipc://{tmp_path}/ev"
        assert publishers["w"].endpoint == f"ipc://{tmp_path}/ev_1"
        assert publishers["w"].topic.endswith("@w-x") and publishers["w"].replay_endpoint is None
    finally:
        srv.stop()


def test_off_by_default_and_configured_like_the_other_keys(tmp_path: Path) -> None:
    cfg = load_config(env={})
    assert not cfg.server.kv_events.enable_kv_cache_events
    assert cfg.server.kv_events.endpoint == "tcp://*:5557"
    (tmp_path / "c.yaml").write_text(
        "server:\n  kv_events:\n    enable_kv_cache_events: true\n    hwm: 7\n    encoding: array\n"
    )
    cfg = load_config(
        tmp_path / "c.yaml",
        env={"PREFIXCACHE_KV_EVENTS_HASH_FORMAT": "sglang", "PREFIXCACHE_KV_EVENTS_HWM": "8"},
        overrides={"kv_events": '{"topic": "kv@pod:8000@m", "hwm": 9}'},
    )
    kv = cfg.server.kv_events
    assert (kv.enable_kv_cache_events, kv.encoding, kv.hash_format, kv.topic, kv.hwm) == (
        True,
        "array",
        "sglang",
        "kv@pod:8000@m",
        9,
    )
    srv = ServerThread(make_config(tmp_path, MODELS[:1]))
    try:
        assert srv.server.kv_events is None
    finally:
        srv.stop()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PREFIXCACHE_KV_EVENTS_ENCODING": "json"}, "encoding"),
        ({"PREFIXCACHE_KV_EVENTS_ENDPOINT": "http://x:1"}, "endpoint"),
        ({"PREFIXCACHE_KV_EVENTS_BUFFER_STEPS": "0"}, "buffer_steps"),
        ({"PREFIXCACHE_KV_EVENTS": "{nope"}, "PREFIXCACHE_KV_EVENTS"),
        ({"PREFIXCACHE_KV_EVENTS": '{"enable": true}'}, "enable"),
        ({"PREFIXCACHE_KV_EVENTS_HWM": "0"}, "hwm"),  # 0 is unbounded in ZMQ
        ({"PREFIXCACHE_KV_EVENTS_MAX_REPLAYS": "0"}, "max_replays"),
        ({"PREFIXCACHE_KV_EVENTS_MAX_REPLAYS_PER_PEER": "0"}, "max_replays_per_peer"),
        ({"PREFIXCACHE_KV_EVENTS_REPLAY_TIMEOUT": "nan"}, "replay_timeout"),
        ({"PREFIXCACHE_KV_EVENTS_REPLAY_TIMEOUT": "0"}, "replay_timeout"),
    ],
)
def test_bad_settings_name_their_key(env: dict[str, str], message: str) -> None:
    from prefixcache.server.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config(env=env)


def test_endpoints_that_collide_or_cannot_bind_fail_the_start(
    tmp_path: Path, ctx: zmq.Context
) -> None:
    from prefixcache.server.app import PrefixCacheServer
    from prefixcache.server.config import ConfigError

    # Two models: model 1's events port would be model 0's replay port.
    overlap = make_config(
        tmp_path,
        MODELS,
        kv_events=KvEventsConfig(
            enable_kv_cache_events=True, endpoint="tcp://*:47001", replay_endpoint="tcp://*:47002"
        ),
    )
    with pytest.raises(ConfigError, match="more ports apart than there are models"):
        asyncio.run(PrefixCacheServer(overlap).start())
    busy = ctx.socket(zmq.PUB)
    port = busy.bind_to_random_port("tcp://*")
    try:
        taken = make_config(
            tmp_path,
            MODELS[:1],
            kv_events=KvEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}"),
        )
        with pytest.raises(ConfigError, match=r"server\.kv_events\.endpoint"):
            asyncio.run(PrefixCacheServer(taken).start())
        assert not (tmp_path / "pc.sock").exists()  # the failed start left nothing
    finally:
        busy.close()


def test_the_bind_or_connect_rule_is_logged_at_start(
    tmp_path: Path, ctx: zmq.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """A concrete address is connected to (vLLM's rule): the start says so, with the way
    to bind instead; a wildcard is bound, and says that."""
    relay = ctx.socket(zmq.SUB)  # what a concrete endpoint connects to
    port = relay.bind_to_random_port("tcp://127.0.0.1")
    relay.setsockopt(zmq.SUBSCRIBE, b"")
    caplog.set_level(logging.INFO, logger="prefixcache.server")
    for endpoint, said in ((f"tcp://127.0.0.1:{port}", "connecting to"), ("tcp://*:0", "bound to")):
        caplog.clear()
        cfg = KvEventsConfig(enable_kv_cache_events=True, endpoint=endpoint)
        thread = ServerThread(make_config(tmp_path, MODELS[:1], kv_events=cfg))
        try:
            lines = [
                r.getMessage()
                for r in caplog.records
                if r.getMessage().startswith("publishing KV events")
            ]
            assert len(lines) == 1 and said in lines[0], lines
            if said == "connecting to":
                assert "bind with tcp://*:PORT" in lines[0]
        finally:
            thread.stop()
    relay.close(linger=0)
