"""Server settings from PREFIXCACHE_* variables: octal modes, and unknown names."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixcache.server.config import ConfigError, load_config, unknown_env_warning


@pytest.mark.parametrize("text", ["0660", "0o660", "0O660", " 0660 ", "432"])
def test_socket_mode_from_env_is_octal_as_operators_write_it(text: str) -> None:
    """0660 is read as octal, as deploy/README.md writes it, not refused as no integer."""
    config = load_config(env={"PREFIXCACHE_SOCKET_MODE": text})
    assert config.server.socket_mode == 0o660


@pytest.mark.parametrize(
    ("yaml_value", "mode"),
    [
        ("0660", 0o660),  # YAML 1.1 reads an unquoted leading 0 as octal itself
        ("'0660'", 0o660),  # quoted: a string, read as the environment's is
        ("0o640", 0o640),  # a string to YAML 1.1, an octal literal to us
        ("432", 0o660),  # a plain number is a number
    ],
)
def test_socket_mode_in_yaml_reads_the_same(tmp_path: Path, yaml_value: str, mode: int) -> None:
    path = tmp_path / "pc.yaml"
    path.write_text(f"server:\n  socket_mode: {yaml_value}\n")
    assert load_config(path, env={}).server.socket_mode == mode


@pytest.mark.parametrize("text", ["0680", "660", "0o1777", "rw-rw----"])
def test_a_socket_mode_that_is_no_mode_names_the_field(text: str) -> None:
    # "660" is decimal 660 (as YAML reads it unquoted), beyond 0o777: refused, not guessed.
    with pytest.raises(ConfigError, match=r"^server\.socket_mode: "):
        load_config(env={"PREFIXCACHE_SOCKET_MODE": text})


def test_known_variables_draw_no_warning() -> None:
    env = {
        "PREFIXCACHE_LISTEN": "unix:/x",
        "PREFIXCACHE_SOCKET_MODE": "0660",
        "PREFIXCACHE_CONFIG": "/c.yaml",
        "PREFIXCACHE_TARGET": "unix:/x",
        "PREFIXCACHE_TOKEN": "t",
        "PREFIXCACHE_ADMIN_TOKEN": "a",
        "HOME": "/root",
        "PREFIXCACHE": "not ours: no underscore",
    }
    assert unknown_env_warning(env) is None


def test_unknown_variables_are_named_in_one_line_with_the_closest_key() -> None:
    """A misspelt setting is named, not ignored in silence."""
    env = {
        "PREFIXCACHE_LISTN": "unix:/x",
        "PREFIXCACHE_GRACE_PERIODS": "5",
        "PREFIXCACHE_ZZZ": "s3cret",
        "PREFIXCACHE_LISTEN": "unix:/y",
    }
    warning = unknown_env_warning(env)
    assert warning is not None and "\n" not in warning
    assert "PREFIXCACHE_LISTN (did you mean PREFIXCACHE_LISTEN?)" in warning
    assert "PREFIXCACHE_GRACE_PERIODS (did you mean PREFIXCACHE_GRACE_PERIOD?)" in warning
    assert "PREFIXCACHE_ZZZ" in warning
    assert "s3cret" not in warning and "unix:" not in warning  # names only, never values
    # ... and load_config still ignores them (a warning, not an error).
    assert load_config(env=env).server.listen == "unix:/y"
