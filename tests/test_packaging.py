"""The wheel, built from a clone-like copy, ships both source roots and the generated code.

Building runs the real isolated build (hatchling + the codegen hook) and
installs into a clean venv, so this needs the package index and takes about a minute.
"""

from __future__ import annotations

import csv
import io
import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]

_SMOKE = """
import importlib.util, sys
import prefixcache, prefixcache.client
from prefixcache.v1 import prefix_cache_pb2 as pb

assert prefixcache.__file__ is None, "prefixcache must stay a namespace package"
assert 'torch' not in sys.modules and importlib.util.find_spec('torch') is None
assert prefixcache.client.__file__.startswith(sys.prefix), prefixcache.client.__file__
request = pb.MatchRequest(model="m", token_ids=(7).to_bytes(4, "little"), token_width=1)
assert not request.HasField("extra_key")
print(prefixcache.client.__version__)
"""


def _clone_like_copy(dest: Path) -> Path:
    """Copy what a fresh clone would hold: tracked plus untracked-but-not-ignored files."""
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    for name in filter(None, listing.decode().split("\0")):
        source = REPO / name
        if source.is_file():  # a tracked file may be deleted in the working tree
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = _clone_like_copy(tmp_path_factory.mktemp("src"))
    assert not (source / "client/prefixcache/v1").exists(), "generated code must not be in git"
    dist = tmp_path_factory.mktemp("dist")
    _run_ok(sys.executable, "-m", "build", "--wheel", "--outdir", dist, source)
    (built,) = dist.glob("prefixcache-*.whl")
    return built


def _record(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        (record,) = (n for n in archive.namelist() if n.endswith(".dist-info/RECORD"))
        return [row[0] for row in csv.reader(io.StringIO(archive.read(record).decode()))]


def test_wheel_holds_both_roots_and_generated_code(wheel: Path) -> None:
    """Server and client roots merge into one `prefixcache/` with no __init__.py of its own."""
    files = _record(wheel)
    assert any(f.startswith("prefixcache/cache/") for f in files), files
    for expected in (
        "prefixcache/server/cli.py",
        "prefixcache/client/__init__.py",
        "prefixcache/wire/kv_chunk.py",  # shared by client and server
        "prefixcache/v1/__init__.py",
        "prefixcache/v1/prefix_cache_pb2.py",
        "prefixcache/v1/prefix_cache_pb2.pyi",
        "prefixcache/v1/prefix_cache_pb2_grpc.py",
    ):
        assert expected in files
    assert "prefixcache/__init__.py" not in files
    assert not [f for f in files if "__pycache__" in f]


def test_wheel_carries_its_licence(wheel: Path) -> None:
    """The wheel says its licence as an SPDX expression and ships the licence's text."""
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = (n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        assert "License-Expression: Apache-2.0" in archive.read(metadata).decode().splitlines()
        (text,) = (n for n in archive.namelist() if n.endswith(".dist-info/licenses/LICENSE"))
        assert archive.read(text) == (REPO / "LICENSE").read_bytes()


def test_wheel_installs_client_without_torch(wheel: Path, tmp_path: Path) -> None:
    """A clean venv gets grpcio and protobuf only, and the client imports from the wheel."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)  # deliberately no system site-packages
    python = env_dir / "bin" / "python"
    _run_ok(python, "-m", "pip", "install", "--quiet", wheel)
    assert _run_ok(python, "-c", _SMOKE, cwd=tmp_path).strip() == VERSION


def test_installed_project_spans_both_roots(tmp_path: Path) -> None:
    """The install under test (editable in CI) resolves subpackages from both roots."""
    code = "import prefixcache.client, prefixcache.server.cli, prefixcache.v1.prefix_cache_pb2_grpc"
    _run_ok(sys.executable, "-c", code, cwd=tmp_path)


def _run_ok(*cmd: str | Path, cwd: Path | None = None) -> str:
    result = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout
