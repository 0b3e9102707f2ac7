"""The installed `prefixcache` console script, run as a real subprocess."""

from __future__ import annotations

import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest


def _prefixcache_script() -> str:
    # The script installed next to this interpreter, not whatever is first on PATH.
    script = shutil.which("prefixcache", path=sysconfig.get_path("scripts"))
    if script is None:
        pytest.fail("no `prefixcache` script: install the project first (pip install -e .)")
    return script


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_prefixcache_script(), *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_help_lists_commands(tmp_path: Path) -> None:
    """`prefixcache --help` exits 0 and names the demo command."""
    result = _run("--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "demo" in result.stdout


def test_no_command_is_a_usage_error(tmp_path: Path) -> None:
    """A bare `prefixcache` prints usage and exits 2, as argparse does."""
    result = _run(cwd=tmp_path)
    assert result.returncode == 2
    assert "usage: prefixcache" in result.stderr


def test_demo_reports_shared_prefix_hit(tmp_path: Path) -> None:
    """The demo's query shares 10 leading tokens with a cached prompt, and hits all 10."""
    result = _run("demo", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^match query: hit 10 of 12 tokens$", result.stdout, re.MULTILINE), (
        result.stdout
    )
