"""Nothing a client sends is unpickled or evaluated: no pickle, eval or exec on any path.

gRPC messages are protobuf and KV bytes are raw buffers; this keeps it that way by
scanning every module of the server and client packages for the calls that would turn
wire bytes into code or arbitrary objects.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = [REPO / "server" / "prefixcache", REPO / "client" / "prefixcache" / "client"]
FORBIDDEN_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve"}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}
# torch.load unpickles; multiprocessing's reductions pickle too.
FORBIDDEN_ATTRIBUTES = {("torch", "load"), ("multiprocessing", "reduction")}


def modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in pkg.rglob("*.py") if "_pb2" not in p.name)


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_deserialisation_of_code_or_objects(path: Path) -> None:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.split(".")[0] in FORBIDDEN_MODULES
        ):
            found.append(node.module)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in FORBIDDEN_CALLS
        ):
            found.append(f"{node.func.id}() at line {node.lineno}")
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and (node.value.id, node.attr) in FORBIDDEN_ATTRIBUTES
        ):
            found.append(f"{node.value.id}.{node.attr} at line {node.lineno}")
    assert not found, found


def test_the_scan_sees_every_module() -> None:
    names = {p.name for p in modules()}
    assert {"servicer.py", "kv_transfer.py", "shared_pool.py", "attach.py", "kv.py"} <= names
