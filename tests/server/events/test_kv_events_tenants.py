"""KV events and tenants: events go to any ZMQ subscriber, unauthenticated,
so with ``server.tenants`` set nothing is published unless ``kv_events.tenants`` says
what: ``refuse`` (the default) fails the start, ``hashed`` publishes no token ids and
keyed namespace names and block hashes, ``all`` publishes everything. Each policy goes
through real config loading (YAML and environment) and a real server with a real SUB.

Keyed: a subscriber who guesses a namespace and a prompt can compute the unkeyed names
and chains; with ``hashed`` it confirms none of them, and a router given
``kv_events.hash_key_file`` recomputes every hash from the tokens, by the formula
docs/across-nodes.md gives (done here from hmac and hashlib alone).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
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

TOKENS = [11, 12, 13, 14, 15, 16]


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.term()


def config_yaml(
    tmp: Path,
    policy: str | None,
    *,
    tenants: bool = True,
    publisher: str = "zmq",
    key_file: Path | None = None,
) -> Path:
    lines = [
        "server:",
        f"  listen: unix:{tmp / 'pc.sock'}",
        "  metrics_port: -1",
        "  token: op-token",
        "  kv_events:",
        "    enable_kv_cache_events: true",
        f"    publisher: '{publisher}'",
        f"    endpoint: ipc://{tmp}/ev",
        f"    replay_endpoint: ipc://{tmp}/replay",
        "    buffer_steps: 1",
    ]
    if policy is not None:
        lines.append(f"    tenants: {policy}")
    if key_file is not None:
        lines.append(f"    hash_key_file: {key_file}")
    if tenants:
        lines += [
            "  tenants:",
            "    - name: acme",
            "      token: tok-acme",
            "      namespaces: [acme/]",
        ]
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
        load_config(config_yaml(tmp_path, None), env={"PREFIXCACHE_KV_EVENTS_TENANTS": "some"})
    assert (
        load_config(
            config_yaml(tmp_path, None), env={"PREFIXCACHE_KV_EVENTS_TENANTS": "hashed"}
        ).server.kv_events.tenants
        == "hashed"
    )
    # Nothing to refuse: no tenants, or events that publish nothing.
    assert load_config(config_yaml(tmp_path, None, tenants=False), env={})
    assert load_config(config_yaml(tmp_path, None, publisher="null"), env={})
    # A config built without load_config is refused at start, before anything binds.
    from prefixcache.server.app import PrefixCacheServer

    built = make_config(
        tmp_path,
        MODELS[:1],
        token="op-token",
        tenants=(TenantConfig("acme", "tok-acme", namespaces=("acme/",)),),
        kv_events=KvEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/ev2"),
    )
    with pytest.raises(ConfigError, match=r"server\.kv_events\.tenants"):
        asyncio.run(PrefixCacheServer(built).start())
    assert not (tmp_path / "ev2").exists()


@pytest.mark.parametrize("policy", ["hashed", "all"])
def test_each_policy_publishes_what_it_says(tmp_path: Path, ctx: zmq.Context, policy: str) -> None:
    cfg = load_config(config_yaml(tmp_path, policy), env={})
    srv = ServerThread(replace(cfg, models=MODELS[:1]))
    publisher = srv.server.kv_events.publishers["r"]
    try:
        sub = Subscriber(ctx, publisher.endpoint, publisher.replay_endpoint)
        time.sleep(0.3)
        with (
            PrefixCacheClient(srv.address, token="tok-acme", timeout=10) as acme,
            acme.session(10) as s,
        ):
            hit = s.match("r", TOKENS, extra_key="acme/secret", allocate=True)
            s.insert("r", TOKENS, hit.all_slots(), extra_key="acme/secret")
        with (
            PrefixCacheClient(srv.address, token="op-token", timeout=10) as op,
            op.session(10) as s,
        ):
            hit = s.match("r", TOKENS, allocate=True)  # the default namespace
            s.insert("r", TOKENS, hit.all_slots())
        batches = sub.until(quiet_seq(srv, "r"))
        stored = [
            e.fields
            for _, _, p in batches
            for e in decode_batch(p, "map", "vllm")[1]
            if e.kind == "BlockStored"
        ]
        raw = b"".join(p for _, _, p in batches)
        # A router behind the buffer gets the state by replay, under the same policy.
        ((_, snapshot),) = Subscriber(ctx, publisher.endpoint, publisher.replay_endpoint).replay(0)[
            :1
        ]
        from_replay = [
            e.fields for e in decode_batch(snapshot, "map", "vllm")[1] if e.kind == "BlockStored"
        ]
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
        hidden = {n for n in names if n != "None"}
        assert len(hidden) == 1 and names.count("None") == 2
        assert hidden.pop().startswith("h:")
        assert b"acme" not in raw and b"acme" not in snapshot
        assert all(f["block_hashes"] and f["block_size"] == 2 for f in stored)


# What a subscriber without the key computes for a guess (the unkeyed formulas): the
# namespace's name, and the block hashes of a prompt in it, as published in vllm format.
def unkeyed_guess(extra_key: str, tokens: list[int], page: int) -> tuple[str, list[int]]:
    name = (
        "h:"
        + hashlib.sha256(b"prefixcache-kv-events-ns-v1\0" + extra_key.encode()).hexdigest()[:32]
    )
    prior = hashlib.sha256(b"sglang-cache-salt-v1\0" + extra_key.encode()).digest()
    return name, _chain(prior, tokens, page)


def router_side(
    key: bytes, extra_key: str | None, tokens: list[int], page: int
) -> tuple[str | None, list[int]]:
    """docs/across-nodes.md's recomputation of hashed events, with the key."""
    name = (
        None
        if extra_key is None
        else "h:"
        + hmac.new(
            key, b"prefixcache-kv-events-ns-v1\0" + extra_key.encode(), hashlib.sha256
        ).hexdigest()[:32]
    )
    ns = b"\0" if extra_key is None else b"\1" + extra_key.encode()
    seed = hmac.new(
        key, b"prefixcache-kv-events-seed-v1\0" + (1).to_bytes(4, "little") + ns, hashlib.sha256
    ).digest()
    return name, _chain(seed, tokens, page)


def _chain(prior: bytes, tokens: list[int], page: int) -> list[int]:
    out = []
    for i in range(0, len(tokens) - len(tokens) % page, page):
        data = b"".join(t.to_bytes(4, "little") for t in tokens[i : i + page])
        prior = hashlib.sha256(prior + data).digest()
        out.append(int.from_bytes(prior[-8:], "big"))  # vllm: the last 8 bytes
    return out


PROMPT = [101, 102, 103, 104, 105, 106, 107, 108]  # four pages of two tokens


def _published(
    tmp: Path,
    ctx: zmq.Context,
    key_file: Path | None,
    namespaces: tuple[str | None, ...] = ("acme/app",),
) -> list[dict]:
    """The BlockStored fields a subscriber sees once PROMPT is cached in each namespace
    (by acme's token; None: the default namespace, by the operator's)."""
    tmp.mkdir(exist_ok=True)
    cfg = load_config(config_yaml(tmp, "hashed", key_file=key_file), env={})
    srv = ServerThread(replace(cfg, models=MODELS[:1]))
    publisher = srv.server.kv_events.publishers["r"]
    try:
        sub = Subscriber(ctx, publisher.endpoint, publisher.replay_endpoint)
        time.sleep(0.3)
        for extra_key in namespaces:
            token = "op-token" if extra_key is None else "tok-acme"
            with (
                PrefixCacheClient(srv.address, token=token, timeout=10) as client,
                client.session(10) as s,
            ):
                hit = s.match("r", PROMPT, extra_key=extra_key, allocate=True)
                s.insert("r", PROMPT, hit.all_slots(), extra_key=extra_key)
        batches = sub.until(quiet_seq(srv, "r"))
        sub.close()
    finally:
        srv.stop()
    return [
        e.fields
        for _, _, p in batches
        for e in decode_batch(p, "map", "vllm")[1]
        if e.kind == "BlockStored"
    ]


def test_hashed_events_confirm_no_guess_without_the_key(tmp_path: Path, ctx: zmq.Context) -> None:
    key_file = tmp_path / "kv-events.key"
    key_file.write_bytes(os.urandom(32))
    key = key_file.read_bytes()
    stored = _published(tmp_path, ctx, key_file, ("acme/app", None))
    assert len(stored) == 2
    acme = next(f for f in stored if f["lora_name"] is not None)
    default = next(f for f in stored if f["lora_name"] is None)
    # The guess of the namespace and the prompt: 0 of 4 block hashes, nor the name.
    guessed_name, guessed = unkeyed_guess("acme/app", PROMPT, 2)
    assert len(guessed) == len(acme["block_hashes"]) == 4
    assert sum(h in acme["block_hashes"] for h in guessed) == 0
    assert acme["lora_name"] != guessed_name
    # Nor a prompt of the default namespace, published as SGLang hashes it unkeyed.
    plain = [int(h[-16:], 16) for h in _plain_chain(PROMPT, 2)]
    assert sum(h in default["block_hashes"] for h in plain) == 0
    # A router with the key recomputes both, name and hashes, from the tokens.
    assert router_side(key, "acme/app", PROMPT, 2) == (acme["lora_name"], acme["block_hashes"])
    assert router_side(key, None, PROMPT, 2) == (None, default["block_hashes"])
    # Another start (another node) with the same key publishes the same hashes.
    again = _published(tmp_path / "again", ctx, key_file)
    assert again[0]["block_hashes"] == acme["block_hashes"]


def _plain_chain(tokens: list[int], page: int) -> list[str]:
    from prefixcache.cache import hash_token_ids

    out, prior = [], None
    for i in range(0, len(tokens), page):
        prior = hash_token_ids(tokens[i : i + page], prior)
        out.append(prior)
    return out


def test_without_a_key_file_a_random_key_hides_them_too(tmp_path: Path, ctx: zmq.Context) -> None:
    first = _published(tmp_path, ctx, None)
    name, guessed = unkeyed_guess("acme/app", PROMPT, 2)
    assert sum(h in first[0]["block_hashes"] for h in guessed) == 0
    assert first[0]["lora_name"] != name
    second = _published(tmp_path / "again", ctx, None)
    assert second[0]["block_hashes"] != first[0]["block_hashes"]  # a key per start


def test_the_key_file_is_checked(tmp_path: Path) -> None:
    short = tmp_path / "short.key"
    short.write_bytes(b"x" * 31)
    with pytest.raises(ConfigError, match=r"hash_key_file: .* holds 31 bytes"):
        load_config(config_yaml(tmp_path, "hashed", key_file=short), env={})
    with pytest.raises(ConfigError, match=r"hash_key_file: .*missing"):
        load_config(config_yaml(tmp_path, "hashed", key_file=tmp_path / "missing"), env={})
    good = tmp_path / "good.key"
    good.write_bytes(os.urandom(32))
    with pytest.raises(ConfigError, match=r"hash_key_file: keys hashed events only"):
        load_config(config_yaml(tmp_path, "all", key_file=good), env={})
    assert load_config(
        config_yaml(tmp_path, "hashed", key_file=good), env={}
    ).server.kv_events.hash_key_file == str(good)


def test_the_tier_secret_keys_hashed_events_when_no_key_file_is_set(tmp_path: Path) -> None:
    # Every sidecar of a cluster holds the tier's secret: with it, they all publish the
    # same keyed hashes, and a router given the derived key recomputes them.
    from prefixcache.server.events.publisher import hash_key
    from prefixcache.server.memory.page_seal import derive_key

    secret = tmp_path / "tier.secret"
    secret.write_bytes(os.urandom(32))
    hashed = KvEventsConfig(enable_kv_cache_events=True, tenants="hashed")
    derived = derive_key(secret.read_bytes(), "kv-events", None)
    assert hash_key(hashed, str(secret)) == hash_key(hashed, str(secret)) == derived
    assert hash_key(hashed) != derived  # no secret: a random key of this start
    key_file = tmp_path / "events.key"
    key_file.write_bytes(os.urandom(32))
    assert (
        hash_key(replace(hashed, hash_key_file=str(key_file)), str(secret)) == key_file.read_bytes()
    )  # the events' own key comes first
    assert hash_key(replace(hashed, tenants="all"), str(secret)) is None
    secret.write_bytes(b"short")
    with pytest.raises(ConfigError, match="secret"):
        hash_key(hashed, str(secret))
