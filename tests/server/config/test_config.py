"""Configuration: the embedded default, YAML, env and CLI precedence, errors by field."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixcache.server.config import ConfigError, load_config


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_the_embedded_default_is_one_small_cpu_model() -> None:
    cfg = load_config(env={})
    assert [(m.name, m.kind, m.pool.device) for m in cfg.models] == [("default", "radix", "cpu")]
    assert cfg.server.listen.startswith("unix:") and cfg.server.socket_mode == 0o600
    assert cfg.server.token is None and not cfg.server.insecure


def test_cli_beats_env_beats_yaml(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "server: {listen: 'unix:/y.sock', metrics_port: 1, log_level: error}\n"
        "models: [{name: a, kind: swa, sliding_window_size: 8,"
        " pool: {size: 64, dtype: bfloat16, v_head_dim: null}}]\n",
    )
    env = {"PREFIXCACHE_LISTEN": "unix:/e.sock", "PREFIXCACHE_METRICS_PORT": "2"}
    cfg = load_config(path, env=env, overrides={"listen": "unix:/c.sock", "metrics_port": None})
    assert (cfg.server.listen, cfg.server.metrics_port, cfg.server.log_level) == (
        "unix:/c.sock",
        2,
        "error",
    )
    (model,) = cfg.models
    assert (model.kind, model.sliding_window_size, model.pool.size, model.pool.dtype) == (
        "swa",
        8,
        64,
        "bfloat16",
    )
    assert load_config(env={"PREFIXCACHE_CONFIG": str(path)}).models[0].name == "a"


def test_tokens_come_from_env_or_files(tmp_path: Path) -> None:
    (tmp_path / "tok").write_text("s3cret\n")
    cfg = load_config(
        env={"PREFIXCACHE_ADMIN_TOKEN": "adm"}, overrides={"token_file": str(tmp_path / "tok")}
    )
    assert (cfg.server.token, cfg.server.admin_token) == ("s3cret", "adm")


@pytest.mark.parametrize(
    ("yaml_text", "field"),
    [
        ("models: [{name: a, page_size: 0}]", "models[0].page_size"),
        ("models: [{name: a, kind: tree}]", "models[0].kind"),
        ("models: [{name: a, kind: swa}]", "models[0].sliding_window_size"),
        ("models: [{name: a, sliding_window_size: 4}]", "models[0].sliding_window_size"),
        ("models: [{name: a, pool: {dtype: float64}}]", "models[0].pool.dtype"),
        ("models: [{name: a, pool: {size: 0}}]", "models[0].pool.size"),
        ("models: [{name: a, pool: {device: tpu}}]", "models[0].pool.device"),
        ("models: [{name: a, pool: {heads: 2}}]", "models[0].pool.heads"),
        ("models: [{name: a, eviction_policy: random}]", "models[0].eviction_policy"),
        ("models: [{name: a}, {name: a}]", "models[1].name"),
        ("models: [{page_size: 1}]", "models[0].name"),
        ("models: []", "models"),
        ("models: [{name: a, page_size: two}]", "models[0].page_size"),
        ("server: {listen: nowhere}", "server.listen"),
        ("server: {metrics_port: 70000}", "server.metrics_port"),
        ("server: {tls_cert: a.pem}", "server.tls_cert"),
        ("server: {session_ttl: 0}", "server.session_ttl"),
        ("server: {log_format: xml}", "server.log_format"),
        ("server: {colour: blue}", "server.colour"),
        ("extra: 1", "extra"),
        ("models: [{name: a, kind: slot}]", "models[0].max_seq_len"),
        ("models: [{name: a, kind: slot, max_seq_len: 8, page_size: 4}]", "models[0].page_size"),
        ("models: [{name: a, max_seq_len: 8}]", "models[0].max_seq_len"),
        ("models: [{name: a, mamba: {state_slots: 2}}]", "models[0].mamba"),
        (
            "models: [{name: a, kind: mamba, mamba: {state_slots: 0}}]",
            "models[0].mamba.state_slots",
        ),
        (
            "models: [{name: a, kind: mamba, mamba: {conv_state_shape: [0]}}]",
            "models[0].mamba.conv_state_shape",
        ),
        ("models: [{name: a, kind: mamba, mamba: {dtype: int4}}]", "models[0].mamba.dtype"),
        ("models: [{name: a, kind: mamba, eviction_policy: lfu}]", "models[0].eviction_policy"),
        # Values a looser check would accept, or that would crash the start later.
        ("server: {grace_period: .nan}", "server.grace_period"),
        ("server: {grace_period: 1e12}", "server.grace_period"),
        ("server: {grace_period: -1}", "server.grace_period"),
        ("server: {session_ttl_max: .inf}", "server.session_ttl_max"),
        ("server: {session_ttl_max: .nan}", "server.session_ttl_max"),
        ("server: {session_ttl_max: 1e300}", "server.session_ttl_max"),
        ("server: {session_ttl: .nan}", "server.session_ttl"),
        ("server: {socket_mode: 0}", "server.socket_mode"),
        ("server: {socket_mode: 0o060}", "server.socket_mode"),
        ("server: {max_message_bytes: 3221225472}", "server.max_message_bytes"),
        ("server: {change_log_capacity: -1}", "server.change_log_capacity"),
        ("models: [{name: a, pool: {device: cudax}}]", "models[0].pool.device"),
        ("models: [{name: a, pool: {device: 'cuda:'}}]", "models[0].pool.device"),
        ("server: {retention: {tenant_share: -0.1}}", "server.retention.tenant_share"),
        ("server: {retention: {tenant_share: 1.5}}", "server.retention.tenant_share"),
        ("server: {retention: {max_seconds: .inf}}", "server.retention.max_seconds"),
        ("server: {retention: {max_seconds: 0}}", "server.retention.max_seconds"),
        ("server: {retention: {pin: true}}", "server.retention.pin"),
        ("server: {retention: [1]}", "server.retention"),
    ],
)
def test_errors_name_the_field(tmp_path: Path, yaml_text: str, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, yaml_text + "\n"), env={})
    assert str(err.value).startswith(field), str(err.value)


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file"):
        load_config(tmp_path / "missing.yaml", env={})
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "models: [\n"), env={})
    with pytest.raises(ConfigError, match=r"server\.metrics_port"):
        load_config(env={"PREFIXCACHE_METRICS_PORT": "many"})


def test_mamba_and_slot_models(tmp_path: Path) -> None:
    cfg = load_config(
        write(
            tmp_path,
            """
models:
  - {name: h, kind: mamba, page_size: 16,
     mamba: {state_slots: 64, working_slots: 8, layers: 3, conv_state_shape: [8, 3],
             temporal_state_shape: [2, 4, 4], chunk_size: 64}}
  - {name: s, kind: slot, max_seq_len: 4096, pool: {size: 32}}
  - {name: d, kind: mamba}
""",
        ),
        env={},
    )
    h, s, d = cfg.models
    assert h.mamba is not None and h.mamba.conv_state_shape == (8, 3) and h.mamba.chunk_size == 64
    assert (s.max_seq_len, s.pool.size, s.mamba) == (4096, 32, None)
    assert d.mamba is not None and d.mamba.state_slots == 256  # the defaults


def test_limits_at_their_bounds_are_accepted(tmp_path: Path) -> None:
    cfg = load_config(
        write(
            tmp_path,
            "server: {grace_period: 3600, session_ttl_max: 86400, "
            "max_message_bytes: 2147483647, socket_mode: 0o600}\n"
            "models: [{name: a, pool: {device: 'cuda:1'}}]\n",
        ),
        env={},
    )
    assert (cfg.server.grace_period, cfg.server.session_ttl_max, cfg.server.max_message_bytes) == (
        3600,
        86400,
        2**31 - 1,
    )


def test_retention_from_yaml_and_env(tmp_path: Path) -> None:
    """On by default; the section from YAML, or PREFIXCACHE_RETENTION as JSON or off."""
    from prefixcache.server.config import RetentionConfig

    assert load_config(env={}).server.retention == RetentionConfig()
    cfg = load_config(
        write(tmp_path, "server: {retention: {max_seconds: 60, tenant_share: 0.1}}\n"), env={}
    )
    assert cfg.server.retention == RetentionConfig(True, 60.0, 0.1)
    env = load_config(env={"PREFIXCACHE_RETENTION": '{"enabled": false}'}).server.retention
    assert env.enabled is False
    assert load_config(env={"PREFIXCACHE_RETENTION": "off"}).server.retention.enabled is False


def test_the_default_retention_share_divides_the_pool_among_the_tenants() -> None:
    from prefixcache.server.config import RetentionConfig
    from prefixcache.server.config.retention import retention_share

    assert retention_share(RetentionConfig(), 0) == 1.0
    assert retention_share(RetentionConfig(), 1) == 0.5
    assert retention_share(RetentionConfig(), 3) == 0.25
    assert retention_share(RetentionConfig(tenant_share=0.3), 3) == 0.3
