"""`prefixcache serve --check-config`, a real subprocess: the config blocks of the README
and docs/*.md are valid as written, and every `server:` key works on the command line."""

from __future__ import annotations

import re
import textwrap
from dataclasses import fields
from pathlib import Path

import pytest
from doc_pages import code_blocks
from test_cli import _env, _run

from prefixcache.server.cli import _NO_FLAG, build_parser
from prefixcache.server.config.types import ServerConfig


def _config_blocks() -> list[str]:
    """The documents' YAML blocks that are prefixcache configs (dedented fragments too)."""
    blocks = [textwrap.dedent(b) for _, b in code_blocks("yaml")]
    return [b for b in blocks if re.search(r"^(server|models):", b, re.MULTILINE)]


def test_the_readme_has_config_blocks() -> None:
    assert len(_config_blocks()) >= 3


@pytest.mark.parametrize("index", range(len(_config_blocks())))
def test_every_readme_config_block_is_valid_as_written(tmp_path: Path, index: int) -> None:
    (tmp_path / "c.yaml").write_text(_config_blocks()[index])
    done = _run(
        "serve", "--check-config", "--config", str(tmp_path / "c.yaml"), cwd=tmp_path, env=_env()
    )
    # 1: valid, but names files or devices this machine lacks (/etc/..., cuda:0).
    assert done.returncode in (0, 1), done.stderr
    assert "config error" not in done.stderr and "config OK" in done.stdout, done.stdout


def test_check_config_tells_invalid_from_not_for_this_host(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("server: {session_tll: 3}\n")
    bad = _run(
        "serve", "--check-config", "--config", str(tmp_path / "bad.yaml"), cwd=tmp_path, env=_env()
    )
    assert bad.returncode == 2 and "session_tll" in bad.stderr, bad.stderr
    missing = tmp_path / "no-such-token"
    elsewhere = _run(
        "serve", "--check-config", "--token-file", str(missing), cwd=tmp_path, env=_env()
    )
    assert elsewhere.returncode == 1, elsewhere.stderr
    assert f"server.token_file: cannot read {missing}" in elsewhere.stdout
    good = _run("serve", "--check-config", cwd=tmp_path, env=_env())
    assert (good.returncode, good.stdout.splitlines()[-1]) == (0, "config OK")


def test_every_scalar_server_key_has_a_flag() -> None:
    serve = next(
        a
        for a in build_parser()._subparsers._group_actions[0].choices.values()
        if a.prog.endswith("serve")
    )
    dests = {a.dest for a in serve._actions}
    missing = [
        f.name for f in fields(ServerConfig) if f.name not in _NO_FLAG and f.name not in dests
    ]
    assert missing == []


def test_flags_reach_the_config_and_are_checked(tmp_path: Path) -> None:
    """`--session-ttl` was refused before; now it is read, and checked like the file's."""
    ok = _run(
        "serve",
        "--check-config",
        "--session-ttl",
        "5",
        "--max-sessions",
        "3",
        cwd=tmp_path,
        env=_env(),
    )
    assert ok.returncode == 0, ok.stderr
    bad = _run("serve", "--check-config", "--session-ttl", "abc", cwd=tmp_path, env=_env())
    assert bad.returncode == 2 and "server.session_ttl" in bad.stderr, bad.stderr
    bad = _run("serve", "--check-config", "--max-sessions", "0", cwd=tmp_path, env=_env())
    assert bad.returncode == 2 and "server.max_sessions" in bad.stderr, bad.stderr
